"""Counting: how many times a fact is stated over the input (a running count, bAbI-style counting).

``alice paris .`` is stated ``k`` times, in ``k`` distinct chunks, among filler; the question
``how many times does alice visit paris ?`` asks for ``k`` (1..``max_count``, written in digits).
The memory must carry an aggregate, not the facts: the oracle keeps ``alice paris n``, the count
so far, and answers ``n``. Distractor facts (``distractor_similarity``) state other visits of the
same person or place, which do not count. Knobs: ``max_count`` (default 3; the count is drawn from
1..max_count), the shared ones of :class:`memgym.generators.memory_tasks.MemoryTaskConfig`.
"""

from __future__ import annotations

import random
import re
from typing import Any

from memgym.generators.longqa import CITIES, PERSONS
from memgym.generators.memory_tasks import Drawn, MemoryTaskConfig, make_source_for, need
from memgym.generators.planning import PlacedFact

QUESTION = "how many times does {person} visit {city} ?"
WORDS = ("how", "many", "times", "does", "visit")


class CountScript:
    """Keep ``person city n``, the count so far; answer ``n``."""

    def __init__(self, person: str, city: str, count: int):
        self.head = f"{person} {city}"
        self.fact = re.compile(r"(?<!\w)" + re.escape(self.head) + r" \.")
        self.kept = re.compile(r"(?<!\w)" + re.escape(self.head) + r" (\d+)")
        self.count = count

    def held(self, memory: str) -> int:
        m = self.kept.search(memory)
        return int(m.group(1)) if m else 0

    def update(self, memory: str, chunk: str) -> list[str]:
        n = self.held(memory) + len(self.fact.findall(chunk))
        return [f"{self.head} {n}"] if n else []

    def answer(self, memory: str) -> str:
        return str(self.held(memory))

    def missing(self, memory: str) -> list[str]:
        return [] if self.held(memory) == self.count else [f"{self.head} {self.count}"]


class Counting:
    name = "Counting"
    defaults: dict[str, Any] = {"max_count": 3}

    def check(self, cfg: MemoryTaskConfig) -> None:
        most = cfg.options["max_count"]
        need(isinstance(most, int) and not isinstance(most, bool) and 1 <= most <= cfg.num_chunks, self.name,
             "max_count", most, f"an int in 1..num_chunks ({cfg.num_chunks}): each statement sits in a chunk of "
             "its own")

    def draw(self, rng: random.Random, cfg: MemoryTaskConfig, slots: int) -> Drawn:
        person, city = rng.choice(PERSONS), rng.choice(CITIES)
        count = rng.randint(1, cfg.options["max_count"])
        chunks = sorted(rng.sample(range(cfg.num_chunks), count))
        text = f"{person} {city} ."
        facts = [PlacedFact(chunk=c, slot=rng.randrange(slots), order=float(k), text=text)
                 for k, c in enumerate(chunks)]

        def distractor(r: random.Random) -> str:  # the person elsewhere, or someone else in the city
            if r.random() < 0.5:
                return f"{person} {r.choice([c for c in CITIES if c != city])} ."
            return f"{r.choice([p for p in PERSONS if p != person])} {city} ."

        return Drawn(question=QUESTION.format(person=person, city=city), answers=[str(count)], facts=facts,
                     supporting_facts=[{"occurrence": k, "chunk": c, "text": text} for k, c in enumerate(chunks)],
                     oracle=CountScript(person, city, count), distractor=distractor,
                     metadata={"person": person, "city": city, "count": count})


TASK = Counting()


make_source = make_source_for(TASK)
