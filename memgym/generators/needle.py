"""NeedleQA: RULER-style single-needle retrieval in a long haystack (synthetic, seeded, lazy).

One sentence, ``One of the special magic numbers for <key> is: <number>.``, hides in filler
text; the question asks for the number. ``needle_depth`` places it (0 = first chunk,
1 = last chunk; None = anywhere), ``num_distractor_needles`` adds needles with other keys
(RULER's multi-key variant), ``haystack`` picks the filler: RULER's repeated ``"noise"``
sentences or varied ``"sentences"``. Sizes and laziness work as in LongQA: the input fills
exactly ``num_chunks`` chunks (or ``ceil(context_length / chunk_size)``), streamed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Sequence

from memgym.chunking import Counter, WordCounter, first_label
from memgym.data import Document, Sample
from memgym.generators.longqa import FILLER_ADJ, FILLER_ADV, FILLER_NOUN, FILLER_VERB
from memgym.generators.planning import PlacedFact, PlannedDocuments

NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
KEY_ADJ = ("amber brave calm dusty eager fancy gentle hollow icy jolly keen lively misty noble "
           "odd proud quick rusty silent tidy").split()
KEY_NOUN = ("anchor badger candle dragon engine falcon garnet harbor island jacket kettle lantern "
            "marble needle orchid pepper quartz rocket saddle tunnel").split()
HAYSTACKS = ("noise", "sentences")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"


@dataclass
class NeedleConfig:
    """Knobs of the NeedleQA generator (all are `make_source` / `gymnasium.make` kwargs)."""

    chunk_size: int = 128
    """Chunk size in units of `counter` (words by default)."""
    num_chunks: int = 8
    """Chunks the input fills exactly."""
    context_length: int | None = None
    """Total input length in units; when set, num_chunks = ceil(context_length / chunk_size)."""
    needle_depth: float | None = None
    """Where the needle goes, 0.0 (first chunk) to 1.0 (last chunk); None: uniformly anywhere."""
    num_distractor_needles: int = 0
    """Extra needles with other keys and numbers, placed anywhere."""
    haystack: str = "noise"
    """"noise": RULER's five repeated sentences; "sentences": varied filler sentences."""
    num_samples: int | None = None
    """Samples in the source (default: 1,000,000 for train, 1,000 for other splits)."""

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, expected: str) -> None:
            if not ok:
                raise ValueError(f"NeedleQA: {name}={getattr(self, name)!r} is invalid; expected {expected}")

        check(isinstance(self.chunk_size, int) and self.chunk_size >= 24, "chunk_size", "an int >= 24")
        if self.context_length is not None:
            check(isinstance(self.context_length, int) and self.context_length >= 1, "context_length", "a positive int")
            self.num_chunks = max(1, math.ceil(self.context_length / self.chunk_size))
        check(isinstance(self.num_chunks, int) and self.num_chunks >= 1, "num_chunks", "an int >= 1")
        check(self.needle_depth is None or (isinstance(self.needle_depth, (int, float)) and 0 <= self.needle_depth <= 1),
              "needle_depth", "None or a number in [0, 1]")
        check(isinstance(self.num_distractor_needles, int) and 0 <= self.num_distractor_needles < len(KEY_ADJ) * len(KEY_NOUN),
              "num_distractor_needles", "an int >= 0")
        check(self.haystack in HAYSTACKS, "haystack", f"one of {HAYSTACKS}")
        check(self.num_samples is None or (isinstance(self.num_samples, int) and self.num_samples >= 1),
              "num_samples", "a positive int or None")


class NeedleSource:
    """A deterministic, O(1)-indexable stream of NeedleQA samples (a ``SampleSource``)."""

    def __init__(self, split: str, seed: int, config: NeedleConfig, counter: Counter, numbering: str = "sequential"):
        self.split, self.seed, self.config, self.counter = split, seed, config, counter
        self.numbering = numbering
        self._len = config.num_samples or (1_000_000 if split == "train" else 1_000)
        self._prefix = f"needle-{split}-{seed}-"

    def __len__(self) -> int:
        return self._len

    def index_of(self, sample_id: str) -> int:
        if isinstance(sample_id, str) and sample_id.startswith(self._prefix):
            tail = sample_id[len(self._prefix):]
            if tail.isdigit() and str(int(tail)) == tail and int(tail) < self._len:
                return int(tail)
        raise KeyError(f"no sample {sample_id!r} in NeedleQA split {self.split!r} (ids look like "
                       f"'{self._prefix}<index>' with index < {self._len})")

    def __getitem__(self, index: int) -> Sample:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < self._len:
            raise IndexError(f"sample index must be an int in [0, {self._len}), got {index!r}")
        cfg = self.config
        key = f"needle/{self.seed}/{self.split}/{index}"
        rng = random.Random(key)
        keys = rng.sample([f"{a}-{n}" for a in KEY_ADJ for n in KEY_NOUN], 1 + cfg.num_distractor_needles)
        values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in keys]
        if cfg.needle_depth is None:
            chunk = rng.randrange(cfg.num_chunks)
        else:
            chunk = min(int(cfg.needle_depth * cfg.num_chunks), cfg.num_chunks - 1)
        chunks = [chunk] + [rng.randrange(cfg.num_chunks) for _ in keys[1:]]
        facts = [PlacedFact(chunk=c, slot=rng.randrange(3), order=rng.random(), text=NEEDLE.format(key=k, value=v))
                 for c, k, v in zip(chunks, keys, values)]
        docs = PlannedDocuments(_Haystack(cfg.haystack, key).document, facts, cfg.chunk_size, cfg.num_chunks,
                                self.counter, "NeedleQA", first_label(self.numbering, f"{self._prefix}{index}"))
        return Sample(
            id=f"{self._prefix}{index}",
            question=QUESTION.format(key=keys[0]),
            answers=[values[0]],
            documents=docs,
            supporting_facts=[{"chunk": facts[0].chunk, "text": facts[0].text}],
            metadata={"task": "NeedleQA", "key": keys[0], "num_chunks": cfg.num_chunks, "chunk_size": cfg.chunk_size,
                      "unit": self.counter.unit, "haystack": cfg.haystack},
        )


class _Haystack:
    """Makes the filler documents of one sample from per-document seeds."""

    def __init__(self, kind: str, key: str):
        self.kind, self.key = kind, key

    def document(self, seed_index: int, facts: Sequence[PlacedFact]) -> Document:
        rng = random.Random(f"{self.key}/{seed_index}")
        if self.kind == "noise":
            sentences = list(NOISE)
        else:
            sentences = [f"The {rng.choice(FILLER_ADJ)} {rng.choice(FILLER_NOUN)} {rng.choice(FILLER_VERB)} "
                         f"{rng.choice(FILLER_ADV)}." for _ in range(rng.randint(3, 5))]
        for f in facts:
            sentences.insert(rng.randrange(len(sentences) + 1), f.text)
        return Document(title="Text", text=" ".join(sentences))


def make_source(split: str = "train", seed: int = 0, *, chunk_size: int = 128, num_chunks: int = 8,
                context_length: int | None = None, counter: Counter | None = None, numbering: str = "sequential",
                **options: Any) -> NeedleSource:
    """The NeedleQA sample source for ``split``; ``options`` are :class:`NeedleConfig` fields."""
    known = set(NeedleConfig.__dataclass_fields__) - {"chunk_size", "num_chunks", "context_length"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"NeedleQA: unknown option(s) {unknown}; known: {sorted(known)}")
    config = NeedleConfig(chunk_size=chunk_size, num_chunks=num_chunks, context_length=context_length, **options)
    return NeedleSource(split, seed, config, counter or WordCounter(), numbering)
