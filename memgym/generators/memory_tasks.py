"""Tasks that make the memory bind: what KnowledgeUpdate, MultiValue, VariableTracking and Counting share.

Each task draws, per sample, a few fact sentences placed in chosen chunks, a question over them,
its answer and an oracle script (:mod:`memgym.oracle`) that solves the sample from its own memory;
this module streams the rest of the input around them: filler sentences (``the old river rests
.``), or with probability ``distractor_similarity`` a distractor fact of the task's kind that
never changes the answer. Documents are planned to fill exactly ``num_chunks`` chunks under the
environment's chunking (:class:`memgym.generators.planning.PlannedDocuments`, with the env's
document ``numbering``) and regenerated lazily from per-document seeds, so any length streams in
flat memory. Sample ``i`` is derived from ``(task, seed, split, i)`` in O(1).

Facts are compact (subject and object side by side, as LongQA's default) so that a tiny model
learns to copy them; the question states the memory budget (``state_budget``), in the env's unit.
The tasks, each a module here with its task folder in ``tasks/``:

- :mod:`~memgym.generators.knowledge_update`: a fact, then updates in later chunks; the latest wins;
- :mod:`~memgym.generators.multi_value`: every value of a key, spread over the input (a set);
- :mod:`~memgym.generators.variable_tracking`: assignment chains; every variable holding a value;
- :mod:`~memgym.generators.counting`: how many times a fact is stated (a running count).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from memgym.chunking import NUMBERINGS, Counter, WordCounter, first_label, render_document
from memgym.data import Document, Sample
from memgym.generators.longqa import FILLER_ADJ, FILLER_NOUN, FILLER_VERB, TITLES
from memgym.generators.planning import PlacedFact, PlannedDocuments
from memgym.oracle import OracleScript

BUDGET_NOTE = " ( memory : {budget} tokens )"
"""Appended to the question when ``state_budget``: the prompt states the memory budget."""


@dataclass
class MemoryTaskConfig:
    """The knobs every memory task shares (all are ``make_source`` / ``gymnasium.make`` kwargs)."""

    chunk_size: int = 64
    """Chunk size in units of `counter` (the env's tokens)."""
    num_chunks: int = 4
    """Chunks the input fills exactly."""
    context_length: int | None = None
    """Total input length in units; when set, num_chunks = ceil(context_length / chunk_size)."""
    memory_budget: int = 16
    """The env's memory budget (tokens), stated in the question when `state_budget`."""
    state_budget: bool = True
    """Append ``( memory : N tokens )`` to the question."""
    distractor_similarity: float = 0.0
    """Probability that a non-fact sentence is a distractor fact of the task's kind (0: filler only)."""
    sentences_per_document: tuple[int, int] = (2, 3)
    """Inclusive range of sentences per document."""
    num_samples: int | None = None
    """Samples in the source (default: 1,000,000 for train, 1,000 for other splits)."""
    counter: Counter = field(default_factory=WordCounter)
    """Measures units; the environment passes its own."""
    numbering: str = "sequential"
    """Document labels (the env's `numbering`); the plan makes room for them."""
    options: dict[str, Any] = field(default_factory=dict)
    """The task's own knobs, checked by the task."""

    def check(self, name: str) -> None:
        def need(ok: bool, key: str, value: Any, expected: str) -> None:
            if not ok:
                raise ValueError(f"{name}: {key}={value!r} is invalid; expected {expected}")

        if isinstance(self.sentences_per_document, list):
            self.sentences_per_document = tuple(self.sentences_per_document)
        need(isinstance(self.chunk_size, int) and self.chunk_size >= 16, "chunk_size", self.chunk_size, "an int >= 16")
        if self.context_length is not None:
            need(isinstance(self.context_length, int) and self.context_length >= 1, "context_length",
                 self.context_length, "a positive int or None")
            self.num_chunks = max(1, math.ceil(self.context_length / self.chunk_size))
        need(isinstance(self.num_chunks, int) and self.num_chunks >= 1, "num_chunks", self.num_chunks, "an int >= 1")
        need(isinstance(self.memory_budget, int) and self.memory_budget >= 1, "memory_budget", self.memory_budget,
             "an int >= 1")
        need(isinstance(self.distractor_similarity, (int, float)) and 0 <= self.distractor_similarity <= 1,
             "distractor_similarity", self.distractor_similarity, "a number in [0, 1]")
        lo_hi = self.sentences_per_document
        need(isinstance(lo_hi, tuple) and len(lo_hi) == 2 and 1 <= lo_hi[0] <= lo_hi[1] <= 8,
             "sentences_per_document", lo_hi, "a pair (lo, hi) with 1 <= lo <= hi <= 8")
        need(self.num_samples is None or (isinstance(self.num_samples, int) and self.num_samples >= 1),
             "num_samples", self.num_samples, "a positive int or None")
        need(self.numbering in NUMBERINGS, "numbering", self.numbering, f"one of {NUMBERINGS}")


@dataclass
class Drawn:
    """What a task draws for one sample; the source adds the documents around ``facts``."""

    question: str
    answers: list[str]
    facts: list[PlacedFact]
    supporting_facts: list[dict[str, Any]]
    oracle: OracleScript
    distractor: Callable[[random.Random], str]
    metadata: dict[str, Any] = field(default_factory=dict)


class MemoryTask(Protocol):
    """One memory task: its name, its knobs and how it draws a sample."""

    name: str
    defaults: dict[str, Any]
    """The task's own knobs and their defaults."""

    def check(self, cfg: MemoryTaskConfig) -> None:
        """Refuse knobs that cannot work (a ``ValueError`` naming the knob)."""
        ...

    def draw(self, rng: random.Random, cfg: MemoryTaskConfig, slots: int) -> Drawn:
        """The sample's facts (each in a chunk, at a document slot below ``slots``), question,
        answers and oracle script."""
        ...


def need(ok: bool, task: str, key: str, value: Any, expected: str) -> None:
    """A task knob check: a ``ValueError`` naming the task, the knob and what it takes."""
    if not ok:
        raise ValueError(f"{task}: {key}={value!r} is invalid; expected {expected}")


def filler(rng: random.Random) -> str:
    return f"the {rng.choice(FILLER_ADJ)} {rng.choice(FILLER_NOUN)} {rng.choice(FILLER_VERB)} ."


def spread(rng: random.Random, n: int, num_chunks: int) -> list[int]:
    """Chunks for ``n`` facts in reading order: distinct while there are enough chunks (a chunk then
    never has to hold many facts at once), else as evenly as possible."""
    if n <= num_chunks:
        return sorted(rng.sample(range(num_chunks), n))
    return sorted(k % num_chunks for k in range(n))


def causal(facts: Sequence[PlacedFact]) -> list[PlacedFact]:
    """Facts given in reading order keep it: chunks non-decreasing, and within a chunk slots too."""
    out: list[PlacedFact] = []
    for f in sorted(facts, key=lambda f: (f.chunk, f.order)):
        if out and out[-1].chunk == f.chunk and f.slot < out[-1].slot:
            f = PlacedFact(chunk=f.chunk, slot=out[-1].slot, order=f.order, text=f.text)
        out.append(f)
    return out


class _Documents:
    """Makes one sample's documents from per-document seeds: filler or distractors, and its facts."""

    def __init__(self, cfg: MemoryTaskConfig, key: str, distractor: Callable[[random.Random], str]):
        self.cfg, self.key, self.distractor = cfg, key, distractor

    def document(self, seed_index: int, facts: Sequence[PlacedFact]) -> Document:
        rng = random.Random(f"{self.key}/{seed_index}")
        lo, hi = self.cfg.sentences_per_document
        n = max(rng.randint(lo, hi), len(facts))
        sentences = [self.distractor(rng) if rng.random() < self.cfg.distractor_similarity else filler(rng)
                     for _ in range(n - len(facts))]
        for pos, f in zip(sorted(rng.sample(range(n), len(facts))), facts):  # facts keep their order
            sentences.insert(pos, f.text)
        return Document(title=rng.choice(TITLES), text=" ".join(sentences))


class MemoryTaskSource:
    """A deterministic, O(1)-indexable stream of one memory task's samples (a ``SampleSource``)."""

    def __init__(self, task: MemoryTask, split: str, seed: int, cfg: MemoryTaskConfig):
        if not isinstance(split, str) or not split:
            raise ValueError(f"{task.name}: split must be a non-empty string, got {split!r}")
        self.task, self.split, self.seed, self.config = task, split, seed, cfg
        self._len = cfg.num_samples or (1_000_000 if split == "train" else 1_000)
        self._prefix = f"{task.name.lower()}-{split}-{seed}-"
        # Fact slots spread over the documents a chunk typically holds.
        probe = _Documents(cfg, f"{task.name}-probe/{seed}", filler)
        mean = sum(cfg.counter.count(render_document(9, probe.document(i, []))) for i in range(16)) / 16
        self._slots = max(1, int(cfg.chunk_size // mean))

    def __len__(self) -> int:
        return self._len

    def index_of(self, sample_id: str) -> int:
        if isinstance(sample_id, str) and sample_id.startswith(self._prefix):
            tail = sample_id[len(self._prefix):]
            if tail.isdigit() and str(int(tail)) == tail and int(tail) < self._len:
                return int(tail)
        raise KeyError(f"no sample {sample_id!r} in {self.task.name} split {self.split!r} (ids look like "
                       f"'{self._prefix}<index>' with index < {self._len})")

    def __getitem__(self, index: int) -> Sample:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < self._len:
            raise IndexError(f"sample index must be an int in [0, {self._len}), got {index!r}")
        cfg = self.config
        key = f"{self.task.name}/{self.seed}/{self.split}/{index}"
        drawn = self.task.draw(random.Random(key), cfg, self._slots)
        sample_id = f"{self._prefix}{index}"
        documents = PlannedDocuments(_Documents(cfg, key, drawn.distractor).document, drawn.facts, cfg.chunk_size,
                                     cfg.num_chunks, cfg.counter, self.task.name, first_label(cfg.numbering, sample_id))
        question = drawn.question + (BUDGET_NOTE.format(budget=cfg.memory_budget) if cfg.state_budget else "")
        metadata = {"task": self.task.name, **drawn.metadata, "num_chunks": cfg.num_chunks,
                    "chunk_size": cfg.chunk_size, "memory_budget": cfg.memory_budget, "unit": cfg.counter.unit}
        return Sample(id=sample_id, question=question, answers=drawn.answers, documents=documents,
                      supporting_facts=drawn.supporting_facts, metadata=metadata, oracle=drawn.oracle)


def someone_else(*people: str) -> Callable[[random.Random], str]:
    """A distractor: another person's city (never an asked person's)."""
    from memgym.generators.longqa import CITIES, PERSONS

    others = [p for p in PERSONS if p not in people]
    return lambda rng: f"{rng.choice(others)} {rng.choice(CITIES)} ."


def make_source_for(task: MemoryTask) -> Callable[..., MemoryTaskSource]:
    """The ``make_source`` of ``task``: the sizing kwargs by name (the env passes its own), the
    rest as :func:`build_source`'s ``options``."""

    def make_source(split: str = "train", seed: int = 0, *, chunk_size: int = 64, num_chunks: int = 4,
                    context_length: int | None = None, counter: Counter | None = None, numbering: str = "sequential",
                    memory_budget: int = 16, **options: Any) -> MemoryTaskSource:
        return build_source(task, split, seed, chunk_size=chunk_size, num_chunks=num_chunks,
                            context_length=context_length, counter=counter, numbering=numbering,
                            memory_budget=memory_budget, options=options)

    make_source.__doc__ = f"The {task.name} sample source (its module doc says what it asks; sizing kwargs come " \
                          "from the env, the rest are its knobs and MemoryTaskConfig's)."
    return make_source


def build_source(task: MemoryTask, split: str, seed: int, *, chunk_size: int, num_chunks: int,
                 context_length: int | None, counter: Counter | None, numbering: str, memory_budget: int,
                 options: dict[str, Any]) -> MemoryTaskSource:
    """``make_source`` of a memory task: ``options`` are the shared knobs of :class:`MemoryTaskConfig`
    (``state_budget``, ``distractor_similarity``, ``sentences_per_document``, ``num_samples``) and the
    task's own (``task.defaults``)."""
    shared = {"state_budget", "distractor_similarity", "sentences_per_document", "num_samples"}
    unknown = sorted(set(options) - shared - set(task.defaults))
    if unknown:
        raise TypeError(f"{task.name}: unknown option(s) {unknown}; known: {sorted(shared | set(task.defaults))}")
    cfg = MemoryTaskConfig(chunk_size=chunk_size, num_chunks=num_chunks, context_length=context_length,
                           memory_budget=memory_budget, counter=counter or WordCounter(), numbering=numbering,
                           options={**task.defaults, **{k: v for k, v in options.items() if k in task.defaults}},
                           **{k: v for k, v in options.items() if k in shared})
    cfg.check(task.name)
    task.check(cfg)
    return MemoryTaskSource(task, split, seed, cfg)
