"""MultiValue: every city a person visits, stated one fact at a time anywhere in the input (a set).

``alice paris .``, later ``alice oslo .``, ...: the question ``which cities does alice visit ?``
asks for all of them, scored by token F1 (order-free: for distinct one-word values it is set F1).
The memory must hold every value at once: ``values`` facts of 3 tokens each bind a memory budget
below ``3 * values`` tokens. The oracle keeps the facts verbatim in reading order, as many as the
budget holds, and answers their cities. Distractor facts state other people's cities. Knobs:
``values`` (default 3 here, which the digit presets' tokenizer corpus reads; the task's own default,
in its task.toml, is 2 facts in chunks of 32 tokens: the size the embedded teacher recipe learns),
the shared ones of :class:`memgym.generators.memory_tasks.MemoryTaskConfig`.
"""

from __future__ import annotations

import random
import re
from typing import Any

from memgym.generators.longqa import CITIES, PERSONS
from memgym.generators.memory_tasks import Drawn, MemoryTaskConfig, causal, make_source_for, need, someone_else, spread
from memgym.generators.planning import PlacedFact
from memgym.oracle import contains

QUESTION = "which cities does {person} visit ?"
WORDS = ("which", "cities", "does", "visit")
MAX_VALUES = 12


class AllValuesScript:
    """Keep every fact about the person, in reading order; answer their cities."""

    def __init__(self, person: str, facts: list[str]):
        self.pattern = re.compile(r"(?<!\w)" + re.escape(person) + r" (\w+) \.")
        self.facts = facts

    def update(self, memory: str, chunk: str) -> list[str]:
        held = [m.group(0) for m in self.pattern.finditer(memory)]
        return held + [m.group(0) for m in self.pattern.finditer(chunk) if m.group(0) not in held]

    def answer(self, memory: str) -> str:
        return " ".join(m.group(1) for m in self.pattern.finditer(memory))

    def missing(self, memory: str) -> list[str]:
        return [f for f in self.facts if not contains(memory, f)]


class MultiValue:
    name = "MultiValue"
    defaults: dict[str, Any] = {"values": 3}  # the digit presets' tokenizer corpus uses it

    def check(self, cfg: MemoryTaskConfig) -> None:
        values = cfg.options["values"]
        need(isinstance(values, int) and not isinstance(values, bool) and 1 <= values <= MAX_VALUES, self.name,
             "values", values, f"an int in 1..{MAX_VALUES}")

    def draw(self, rng: random.Random, cfg: MemoryTaskConfig, slots: int) -> Drawn:
        person = rng.choice(PERSONS)
        cities = rng.sample(CITIES, cfg.options["values"])
        chunks = spread(rng, len(cities), cfg.num_chunks)
        placed = causal([PlacedFact(chunk=c, slot=rng.randrange(slots), order=float(k), text=f"{person} {city} .")
                         for k, (c, city) in enumerate(zip(chunks, cities))])
        values = [f.text.split()[1] for f in placed]  # in reading order

        return Drawn(question=QUESTION.format(person=person), answers=[" ".join(values)], facts=placed,
                     supporting_facts=[{"value": v, "chunk": f.chunk, "text": f.text} for v, f in zip(values, placed)],
                     oracle=AllValuesScript(person, [f.text for f in placed]), distractor=someone_else(person),
                     metadata={"person": person, "values": values})


TASK = MultiValue()


make_source = make_source_for(TASK)
