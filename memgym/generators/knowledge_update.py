"""KnowledgeUpdate: a person's city is stated, then changed in later chunks; the answer is the latest.

Conflict resolution: the memory must overwrite. ``alice paris .`` in one chunk, ``alice rome .``
in a later one; the question ``where does alice live now ?`` asks for ``rome``. The statements sit
in distinct chunks, in reading order (``updates`` changes after the first statement), so the latest
is the one read last. The oracle keeps one fact, the latest read, and answers its city. Distractor
facts (``distractor_similarity``) state other people's cities. Knobs: ``updates`` (default 1;
harder: more), the shared ones of :class:`memgym.generators.memory_tasks.MemoryTaskConfig`.
"""

from __future__ import annotations

import random
import re
from typing import Any

from memgym.generators.longqa import CITIES, PERSONS
from memgym.generators.memory_tasks import Drawn, MemoryTaskConfig, make_source_for, need, someone_else
from memgym.generators.planning import PlacedFact
from memgym.oracle import contains

QUESTION = "where does {person} live now ?"
WORDS = ("where", "does", "live", "now")


class LatestScript:
    """Keep the latest fact about the person (overwrite), answer its city."""

    def __init__(self, person: str, final: str):
        self.pattern = re.compile(r"(?<!\w)" + re.escape(person) + r" (\w+) \.")
        self.final = final

    def update(self, memory: str, chunk: str) -> list[str]:
        read = [m.group(0) for m in self.pattern.finditer(chunk)]
        if read:
            return [read[-1]]
        held = self.pattern.search(memory)
        return [held.group(0)] if held else []

    def answer(self, memory: str) -> str:
        held = self.pattern.search(memory)
        return held.group(1) if held else ""

    def missing(self, memory: str) -> list[str]:
        return [] if contains(memory, self.final) else [self.final]


class KnowledgeUpdate:
    name = "KnowledgeUpdate"
    defaults: dict[str, Any] = {"updates": 1}

    def check(self, cfg: MemoryTaskConfig) -> None:
        updates = cfg.options["updates"]
        need(isinstance(updates, int) and not isinstance(updates, bool) and 1 <= updates < cfg.num_chunks,
             self.name, "updates", updates, f"an int in 1..num_chunks - 1 ({cfg.num_chunks - 1}): each statement "
             "sits in a chunk of its own")

    def draw(self, rng: random.Random, cfg: MemoryTaskConfig, slots: int) -> Drawn:
        person = rng.choice(PERSONS)
        n = cfg.options["updates"] + 1
        cities = rng.sample(CITIES, n)
        chunks = sorted(rng.sample(range(cfg.num_chunks), n))
        texts = [f"{person} {city} ." for city in cities]
        facts = [PlacedFact(chunk=c, slot=rng.randrange(slots), order=float(k), text=t)
                 for k, (c, t) in enumerate(zip(chunks, texts))]

        return Drawn(question=QUESTION.format(person=person), answers=[cities[-1]], facts=facts,
                     supporting_facts=[{"update": k, "chunk": c, "text": t}
                                       for k, (c, t) in enumerate(zip(chunks, texts))],
                     oracle=LatestScript(person, texts[-1]), distractor=someone_else(person),
                     metadata={"person": person, "values": cities, "updates": n - 1})


TASK = KnowledgeUpdate()


make_source = make_source_for(TASK)
