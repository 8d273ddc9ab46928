"""KnowledgeUpdate: a person's city is stated, then changed in later chunks; the answer is the latest.

Conflict resolution: the memory must overwrite. ``alice paris .`` in one chunk, ``alice rome .``
in a later one; the question ``where does alice live now ?`` asks for ``rome``. The statements sit
in distinct chunks, in reading order (``updates`` changes after the first statement), so the latest
is the one read last. The oracle keeps one fact, the latest read, and answers its city. Distractor
facts (``distractor_similarity``) state other people's cities.

With ``people`` = P > 1 the question asks where P people live now (``where do alice and bob live
now ?``), each with its own statement and updates drawn and placed as above (facts of one chunk sit
in one document), and the answer is their latest cities in the question's order (``rome oslo``;
token F1 does not score the order). The memory must hold P facts and overwrite each: the oracle
keeps the latest fact of each person (``alice rome . bob oslo .``), as many as the budget holds,
and answers the cities it holds, so a budget of one fact's tokens holds one person of P.

Knobs: ``updates`` (default 1; harder: more), ``people`` (default 1 here, which the digit presets'
tokenizer corpus reads; the task's own default, in its task.toml, is 2: one fact fits any budget
that holds a fact at all, so one person never makes the memory bind), the shared ones of
:class:`memgym.generators.memory_tasks.MemoryTaskConfig`.
"""

from __future__ import annotations

import random
import re
from typing import Any

from memgym.generators.longqa import CITIES, PERSONS
from memgym.generators.memory_tasks import Drawn, MemoryTaskConfig, make_source_for, need, someone_else
from memgym.generators.planning import PlacedFact
from memgym.oracle import EachOf, contains

QUESTION = "where does {person} live now ?"
QUESTION_SEVERAL = "where do {people} live now ?"
WORDS = ("where", "does", "live", "now")
MAX_PEOPLE = 6


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
    defaults: dict[str, Any] = {"updates": 1, "people": 1}

    def check(self, cfg: MemoryTaskConfig) -> None:
        updates, people = cfg.options["updates"], cfg.options["people"]
        need(isinstance(updates, int) and not isinstance(updates, bool) and 1 <= updates < cfg.num_chunks,
             self.name, "updates", updates, f"an int in 1..num_chunks - 1 ({cfg.num_chunks - 1}): each statement "
             "sits in a chunk of its own")
        need(isinstance(people, int) and not isinstance(people, bool) and 1 <= people <= MAX_PEOPLE, self.name,
             "people", people, f"an int in 1..{MAX_PEOPLE}")

    def draw(self, rng: random.Random, cfg: MemoryTaskConfig, slots: int) -> Drawn:
        # One person draws exactly what this task drew before it had people: its samples are unchanged.
        n = cfg.options["updates"] + 1
        drawn: list[tuple[str, list[str], list[int]]] = []  # (person, cities in order, their chunks)
        for _ in range(cfg.options["people"]):
            person = rng.choice([p for p in PERSONS if p not in {d[0] for d in drawn}])
            drawn.append((person, rng.sample(CITIES, n), sorted(rng.sample(range(cfg.num_chunks), n))))
        slot_of: dict[int, int] = {}  # one slot per chunk: a chunk's facts share a document
        for _, _, chunks in drawn:
            for c in chunks:
                if c not in slot_of:
                    slot_of[c] = rng.randrange(slots)
        # A person's statements sit in distinct chunks; a chunk with several people's has them in the question's order.
        facts = [PlacedFact(chunk=c, slot=slot_of[c], order=float(k), text=f"{person} {city} .")
                 for k, (person, cities, chunks) in enumerate(drawn) for c, city in zip(chunks, cities)]
        people = [d[0] for d in drawn]
        several = len(drawn) > 1
        support = [fact for _, fact in sorted(
            ((c, k), {"update": j, "chunk": c, "text": f"{person} {city} ."} | ({"person": person} if several else {}))
            for k, (person, cities, chunks) in enumerate(drawn)
            for j, (c, city) in enumerate(zip(chunks, cities)))]  # reading order
        scripts = [LatestScript(person, f"{person} {cities[-1]} .") for person, cities, _ in drawn]
        if several:
            question = QUESTION_SEVERAL.format(people=" and ".join(people))
            metadata: dict[str, Any] = {"people": [{"person": p, "values": v} for p, v, _ in drawn], "updates": n - 1}
        else:
            question = QUESTION.format(person=people[0])
            metadata = {"person": people[0], "values": drawn[0][1], "updates": n - 1}
        return Drawn(question=question, answers=[" ".join(cities[-1] for _, cities, _ in drawn)], facts=facts,
                     supporting_facts=support, oracle=EachOf(scripts, LatestScript.answer) if several else scripts[0],
                     distractor=someone_else(*people), metadata=metadata)


TASK = KnowledgeUpdate()


make_source = make_source_for(TASK)
