"""The Visits task: documents of filler sentences; some say where a person is; the question asks
where one of them is. Lazy and seeded: sample ``i`` of a split is the same on every machine."""

from __future__ import annotations

import random

from memgym import Document, Sample
from memgym.generators.longqa import CITIES, FILLER_ADJ, FILLER_ADV, FILLER_NOUN, FILLER_VERB, PERSONS, TITLES

QUESTION = "in which city is {person} ?"


class VisitsSource:
    """``make_source``'s result: any object with ``__len__``, ``__getitem__`` and ``index_of``."""

    def __init__(self, split: str, seed: int, size: int, num_documents: int, num_people: int):
        self.split, self.seed, self.size = split, seed, size
        self.num_documents, self.num_people = num_documents, num_people

    def __len__(self) -> int:
        return self.size

    def index_of(self, sample_id: str) -> int:
        prefix = f"visits-{self.split}-"
        tail = sample_id[len(prefix):] if sample_id.startswith(prefix) else ""
        if not tail.isdigit() or int(tail) >= self.size:
            raise KeyError(f"no sample {sample_id!r} in Visits split {self.split!r}")
        return int(tail)

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < self.size:
            raise IndexError(f"Visits split {self.split!r} has {self.size} samples; got index {index}")
        rng = random.Random(f"visits/{self.split}/{self.seed}/{index}")
        people = rng.sample(PERSONS, self.num_people)
        cities = rng.sample(CITIES, self.num_people)
        facts = [f"{p} {c} ." for p, c in zip(people, cities)]
        docs = [[_filler(rng) for _ in range(rng.randint(2, 3))] for _ in range(self.num_documents)]
        for fact in facts:  # each fact in its own document, at a random place in it
            doc = docs[rng.randrange(self.num_documents)]
            doc.insert(rng.randrange(len(doc) + 1), fact)
        return Sample(id=f"visits-{self.split}-{index}", question=QUESTION.format(person=people[0]),
                      answers=[cities[0]],
                      documents=[Document(rng.choice(TITLES), " ".join(d)) for d in docs],
                      supporting_facts=[{"text": facts[0]}])  # the oracle keeps this sentence


def _filler(rng: random.Random) -> str:
    words = [rng.choice(FILLER_ADJ), rng.choice(FILLER_NOUN), rng.choice(FILLER_VERB), rng.choice(FILLER_ADV)]
    return f"the {' '.join(words)} ."


def make_source(split: str, seed: int, num_documents: int = 6, num_people: int = 1) -> VisitsSource:
    if num_documents < 1 or not 1 <= num_people <= len(CITIES):
        raise ValueError(f"Visits: num_documents must be >= 1 and num_people in 1..{len(CITIES)}; "
                         f"got {num_documents}, {num_people}")
    size = 100_000 if split == "train" else 1_000  # train and test draw from disjoint seeds (split in the key)
    return VisitsSource(split, seed, size, num_documents, num_people)
