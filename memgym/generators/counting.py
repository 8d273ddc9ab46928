"""Counting: how many times a fact is stated over the input (a running count, bAbI-style counting).

``alice paris .`` is stated ``k`` times, in ``k`` distinct chunks, among filler; the question
``how many times does alice visit paris ?`` asks for ``k`` (1..``max_count``, written in digits).
The memory must carry an aggregate, not the facts: the oracle keeps ``alice paris n``, the count
so far, and answers ``n``. Distractor facts (``distractor_similarity``) state other visits of the
same person or place, which do not count.

With ``keys`` = K > 1 the question asks for K counts at once (``how many times does alice visit
paris and bob visit rome ?``, K distinct people and cities, each count drawn and placed as above;
facts of one chunk sit in one document) and the answer is the counts in the question's order
(``2 3``; token F1 does not score the order). The memory must hold K running counts: the oracle
keeps ``alice paris n bob rome m`` (one item per key, as many as the budget holds) and answers the
counts it holds, so a budget of one item's tokens holds one count of K (F1 2/3 at K = 2).

Knobs: ``max_count`` (default 3; each count is drawn from 1..max_count), ``keys`` (default 1 here,
which the digit presets' tokenizer corpus reads; the task's own default, in its task.toml, is 2: one
count fits any budget that holds a count at all, so one key never makes the memory bind), the shared
ones of :class:`memgym.generators.memory_tasks.MemoryTaskConfig`.
"""

from __future__ import annotations

import random
import re
from typing import Any

from memgym.generators.longqa import CITIES, PERSONS
from memgym.generators.memory_tasks import Drawn, MemoryTaskConfig, make_source_for, need
from memgym.generators.planning import PlacedFact
from memgym.oracle import EachOf

QUESTION = "how many times does {keys} ?"
KEY = "{person} visit {city}"
WORDS = ("how", "many", "times", "does", "visit")
MAX_KEYS = 6


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
    defaults: dict[str, Any] = {"max_count": 3, "keys": 1}  # keys=1: the digit presets' tokenizer corpus uses it

    def check(self, cfg: MemoryTaskConfig) -> None:
        most, keys = cfg.options["max_count"], cfg.options["keys"]
        need(isinstance(most, int) and not isinstance(most, bool) and 1 <= most <= cfg.num_chunks, self.name,
             "max_count", most, f"an int in 1..num_chunks ({cfg.num_chunks}): each statement sits in a chunk of "
             "its own")
        need(isinstance(keys, int) and not isinstance(keys, bool) and 1 <= keys <= MAX_KEYS, self.name, "keys", keys,
             f"an int in 1..{MAX_KEYS}")

    def draw(self, rng: random.Random, cfg: MemoryTaskConfig, slots: int) -> Drawn:
        # One key draws exactly what this task drew before it had keys: its samples are unchanged.
        keys: list[tuple[str, str, int, list[int]]] = []
        for _ in range(cfg.options["keys"]):
            person = rng.choice([p for p in PERSONS if p not in {k[0] for k in keys}])
            city = rng.choice([c for c in CITIES if c not in {k[1] for k in keys}])
            count = rng.randint(1, cfg.options["max_count"])
            keys.append((person, city, count, sorted(rng.sample(range(cfg.num_chunks), count))))
        slot_of: dict[int, int] = {}  # one slot per chunk: a chunk's facts share a document
        for _, _, _, chunks in keys:
            for c in chunks:
                if c not in slot_of:
                    slot_of[c] = rng.randrange(slots)
        # A key's facts sit in distinct chunks; a chunk with several keys' facts has them in the question's order.
        facts = [PlacedFact(chunk=c, slot=slot_of[c], order=float(k), text=f"{person} {city} .")
                 for k, (person, city, _, chunks) in enumerate(keys) for c in chunks]
        people, cities = [k[0] for k in keys], [k[1] for k in keys]

        def distractor(r: random.Random) -> str:  # an asked person elsewhere, or someone else in an asked city
            i = r.randrange(len(keys)) if len(keys) > 1 else 0
            if r.random() < 0.5:
                return f"{people[i]} {r.choice([c for c in CITIES if c != cities[i]])} ."
            return f"{r.choice([p for p in PERSONS if p not in people])} {cities[i]} ."

        support = [fact for _, fact in sorted(
            ((c, k), {"occurrence": j, "chunk": c, "text": f"{person} {city} ."}
             | ({"person": person, "city": city} if len(keys) > 1 else {}))
            for k, (person, city, _, chunks) in enumerate(keys) for j, c in enumerate(chunks))]  # reading order
        question = QUESTION.format(keys=" and ".join(KEY.format(person=p, city=c) for p, c, _, _ in keys))
        scripts = [CountScript(person, city, count) for person, city, count, _ in keys]
        metadata: dict[str, Any] = ({"person": people[0], "city": cities[0], "count": keys[0][2]} if len(keys) == 1
                                    else {"keys": [{"person": p, "city": c, "count": n} for p, c, n, _ in keys]})
        return Drawn(question=question, answers=[" ".join(str(k[2]) for k in keys)], facts=facts,
                     supporting_facts=support, oracle=scripts[0] if len(keys) == 1 else EachOf(scripts, _count_known),
                     distractor=distractor, metadata=metadata)


def _count_known(script: CountScript, memory: str) -> str:
    n = script.held(memory)
    return str(n) if n else ""


TASK = Counting()


make_source = make_source_for(TASK)
