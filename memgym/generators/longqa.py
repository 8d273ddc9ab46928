"""LongQA: synthetic, seeded, offline multi-hop questions over a long stream of documents.

A question asks for the end of a chain of facts (``person -> company -> city -> country``,
``hops`` links long). Each chain fact sits in one document somewhere in the input; every other
sentence is a distractor: a fact of the same kind about other entities (with probability
``distractor_similarity``) or a filler sentence. Sample ``i`` is derived from
``(seed, split, i)`` in O(1); its documents are regenerated lazily from per-document seeds on
every iteration, so an episode of millions of tokens streams in flat memory.

The input is planned to fill exactly ``num_chunks`` chunks of ``chunk_size`` units under the
environment's chunking rules (:class:`memgym.chunking.Packer`), and each supporting fact is
placed in a chosen chunk, so ``supporting_facts`` says where each fact is before any document
is generated. The easy default (one hop, compact facts, causal order) is learnable by a tiny
model in minutes; ``hops``, ``fact_order="random"``, ``fact_style="natural"``, a higher
``distractor_similarity`` and a longer context make it harder.

Fact styles: ``"compact"`` puts subject and object side by side (``alice acme .``), which a
tiny model learns to recall quickly; ``"natural"`` writes English (``Alice works at Acme.``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from memgym.chunking import Counter, WordCounter, first_label, iter_chunks, render_document
from memgym.generators.planning import PlacedFact, PlannedDocuments
from memgym.data import Document, Sample

# A closed vocabulary (about 300 words) so a tokenizer trained on the task text gives one token
# per entity. Every entry is a single lowercase word.
PERSONS = (
    "alice bob carol dave erin frank grace heidi ivan judy karl laura mallory nina oscar peggy "
    "quinn rupert sybil trent ursula victor wendy xavier yara zane aaron bella caleb diana ethan "
    "fiona george hannah isaac jasmine kevin lily marcus nora owen paula rafael sara tobias uma "
    "vera walter ximena yusuf zoe adrian bianca cyrus delia elias flora gideon helena igor jonah "
    "kira leon mila nadia otto petra ronan selma theo ulric vivian wyatt yvonne zelda arjun "
    "brenda colin dora emil freya gustav hazel ines jude kemal lena miro nell orla pavel rhea"
).split()
COMPANIES = (
    "acme globex initech umbrella hooli stark wayne tyrell cyberdyne soylent vandelay wonka "
    "gringotts oscorp massive aperture blackmesa monarch nakatomi octan pendant quartzo rekall "
    "sirius tessier vought weyland yoyodyne zorin abstergo buynlarge chozo dinoco ecorp "
    "frobozz gekko hanso ingen jupiter kruger lexcorp momcorp nexus omnicorp planetex "
    "roxxon sterling tricell ubik veidt wolfram xeno yutani zenith altair borealis cobalt"
).split()
CITIES = (
    "paris rome berlin madrid lisbon vienna prague warsaw oslo dublin athens cairo lagos nairobi "
    "accra tunis tokyo osaka seoul beijing delhi mumbai dhaka lima quito bogota santiago havana "
    "toronto boston denver austin seattle chicago miami dallas sydney perth auckland manila "
    "jakarta hanoi bangkok riyadh doha tehran ankara kyiv minsk riga vilnius tallinn helsinki "
    "stockholm zurich geneva milan naples porto seville"
).split()
COUNTRIES = (
    "france italy germany spain portugal austria poland norway ireland greece egypt nigeria "
    "kenya ghana japan korea china india peru ecuador colombia chile cuba canada australia "
    "vietnam thailand qatar iran turkey ukraine latvia finland sweden switzerland brazil mexico"
).split()
TITLES = (
    "notes records report log memo bulletin letter archive digest ledger journal minutes "
    "briefing summary diary register file dossier roster gazette"
).split()
FILLER_ADJ = "quiet old small bright green cold warm busy empty tall dark calm wide long young".split()
FILLER_NOUN = "river garden bridge market tower forest valley harbor village meadow road lake station museum library".split()
FILLER_VERB = "rests waits shines grows stands sleeps glows fades opens changes".split()
FILLER_ADV = "today often slowly again quietly early later softly".split()

ENTITY_TYPES = ("person", "company", "city", "country")
POOLS = {"person": PERSONS, "company": COMPANIES, "city": CITIES, "country": COUNTRIES}
# Relation h links ENTITY_TYPES[h] to ENTITY_TYPES[h + 1].
NATURAL_FACTS = ("{s} works at {o}.", "{s} is located in {o}.", "{s} is in {o}.")
QUESTIONS = {
    1: "which company does {p} work at ?",
    2: "in which city is the company that {p} works at ?",
    3: "in which country is the company that {p} works at ?",
}
MAX_HOPS = len(NATURAL_FACTS)
FACT_ORDERS = ("causal", "random")
FACT_STYLES = ("compact", "natural")


@dataclass
class LongQAConfig:
    """Knobs of the LongQA generator (all are `make_source` / `gymnasium.make` kwargs)."""

    hops: int = 1
    """Links in the fact chain: 1 (person -> company), 2 (-> city, a bridge question), 3 (-> country)."""
    num_chunks: int = 5
    """Chunks the input fills exactly (under the environment's chunking rules)."""
    chunk_size: int = 64
    """Chunk size in units of `counter` (words by default)."""
    context_length: int | None = None
    """Total input length in units; when set, num_chunks = ceil(context_length / chunk_size)."""
    distractor_similarity: float = 0.5
    """Probability that a distractor sentence is a fact of the question's relation kinds about
    other entities (1.0: all distractors look like facts; 0.0: all are filler sentences)."""
    fact_order: str = "causal"
    """"causal": hop h's fact comes no later than hop h+1's (relevance is known when a fact is
    read); "random": facts are placed independently (harder: a fact may only become relevant
    after a later chunk)."""
    fact_window: int | None = None
    """When set, every fact sits in one of the first `fact_window` chunks (the rest is filler): an
    episode whose answer is decided early, with a long tail of turns that only carry the memory."""
    fact_style: str = "compact"
    """"compact": `alice acme .` (subject and object adjacent, lowercase); "natural": English."""
    fact_repeats: int = 1
    """Times each chain fact is stated, in different chunks where there are enough (2: the fact
    comes again, so an agent that missed or lost it can still recover it; ``supporting_facts`` lists
    every statement). Under the causal order a repeat of hop h+1 never comes before hop h's first
    statement. Repeats are drawn after everything else, so ``fact_repeats=1`` samples are unchanged."""
    sentences_per_document: tuple[int, int] = (2, 3)
    """Inclusive range of sentences per document."""
    num_samples: int | None = None
    """Samples in the source (default: 1,000,000 for train, 1,000 for other splits)."""
    counter: Counter = field(default_factory=WordCounter)
    """Measures units; the environment passes its own (words or tokenizer tokens)."""

    def __post_init__(self) -> None:
        if isinstance(self.sentences_per_document, list):
            self.sentences_per_document = tuple(self.sentences_per_document)
        _check(isinstance(self.hops, int) and 1 <= self.hops <= MAX_HOPS, "hops", self.hops, f"an int in 1..{MAX_HOPS}")
        _check(isinstance(self.chunk_size, int) and self.chunk_size >= 16, "chunk_size", self.chunk_size, "an int >= 16")
        if self.context_length is not None:
            _check(isinstance(self.context_length, int) and self.context_length >= 1, "context_length",
                   self.context_length, "a positive int or None")
            self.num_chunks = max(1, math.ceil(self.context_length / self.chunk_size))
        _check(isinstance(self.num_chunks, int) and self.num_chunks >= 1, "num_chunks", self.num_chunks, "an int >= 1")
        _check(isinstance(self.distractor_similarity, (int, float)) and 0.0 <= self.distractor_similarity <= 1.0,
               "distractor_similarity", self.distractor_similarity, "a number in [0, 1]")
        if self.fact_window is not None:
            _check(isinstance(self.fact_window, int) and 1 <= self.fact_window <= self.num_chunks, "fact_window",
                   self.fact_window, f"an int in 1..num_chunks ({self.num_chunks}) or None")
        _check(self.fact_order in FACT_ORDERS, "fact_order", self.fact_order, f"one of {FACT_ORDERS}")
        _check(self.fact_style in FACT_STYLES, "fact_style", self.fact_style, f"one of {FACT_STYLES}")
        _check(isinstance(self.fact_repeats, int) and not isinstance(self.fact_repeats, bool)
               and 1 <= self.fact_repeats <= 8, "fact_repeats", self.fact_repeats, "an int in 1..8")
        lo_hi = self.sentences_per_document
        _check(isinstance(lo_hi, tuple) and len(lo_hi) == 2 and 1 <= lo_hi[0] <= lo_hi[1] <= 8,
               "sentences_per_document", lo_hi, "a pair (lo, hi) with 1 <= lo <= hi <= 8")
        if self.num_samples is not None:
            _check(isinstance(self.num_samples, int) and self.num_samples >= 1, "num_samples", self.num_samples,
                   "a positive int")


def _check(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"LongQA: {name}={value!r} is invalid; expected {expected}")


@dataclass(frozen=True)
class _Fact(PlacedFact):
    hop: int = 0


class LongQADocuments(PlannedDocuments):
    """The lazily generated documents of one sample; iterating regenerates them identically."""

    def __init__(self, config: LongQAConfig, key: str, chain: list[str], facts: list[_Fact], first: int | None = 1):
        super().__init__(self._document, facts, config.chunk_size, config.num_chunks, config.counter, "LongQA",
                         first)
        self.config = config
        self.key = key
        # Distractor facts never have a chain entity as subject, so the answer is unique.
        self.excluded = set(chain[:-1])

    def _document(self, seed_index: int, facts: Sequence[PlacedFact]) -> Document:
        cfg = self.config
        rng = random.Random(f"{self.key}/{seed_index}")
        lo, hi = cfg.sentences_per_document
        n = max(rng.randint(lo, hi), len(facts))
        sentences = [self._distractor(rng) for _ in range(n - len(facts))]
        # Facts keep their given order (causal within a document when the order is causal).
        slots = sorted(rng.sample(range(n), len(facts)))
        for pos, f in zip(slots, facts):
            sentences.insert(pos, f.text)
        title = rng.choice(TITLES)
        return Document(title=title if cfg.fact_style == "compact" else title.capitalize(), text=" ".join(sentences))

    def _distractor(self, rng: random.Random) -> str:
        cfg = self.config
        if rng.random() < cfg.distractor_similarity:
            h = rng.randrange(cfg.hops)
            subjects = POOLS[ENTITY_TYPES[h]]
            s = rng.choice(subjects)
            while s in self.excluded:
                s = rng.choice(subjects)
            return fact_sentence(h, s, rng.choice(POOLS[ENTITY_TYPES[h + 1]]), cfg.fact_style)
        adj, noun, verb = rng.choice(FILLER_ADJ), rng.choice(FILLER_NOUN), rng.choice(FILLER_VERB)
        if cfg.fact_style == "compact":
            return f"the {adj} {noun} {verb} ."
        return f"The {adj} {noun} {verb} {rng.choice(FILLER_ADV)}."


def fact_sentence(hop: int, subject: str, obj: str, style: str) -> str:
    """The sentence stating relation ``hop`` between two entity words."""
    if style == "compact":
        return f"{subject} {obj} ."
    return NATURAL_FACTS[hop].format(s=subject.capitalize(), o=obj.capitalize())


def question_text(hops: int, person: str, style: str) -> str:
    q = QUESTIONS[hops].format(p=person)
    if style == "compact":
        return q
    return (q[0].upper() + q[1:-2] + "?").replace(f" {person} ", f" {person.capitalize()} ")


class LongQASource:
    """A deterministic, O(1)-indexable stream of LongQA samples (a ``SampleSource``)."""

    def __init__(self, split: str, seed: int, config: LongQAConfig, numbering: str = "sequential"):
        if not isinstance(split, str) or not split:
            raise ValueError(f"LongQA: split must be a non-empty string, got {split!r}")
        self.split, self.seed, self.config, self.numbering = split, seed, config, numbering
        self._len = config.num_samples or (1_000_000 if split == "train" else 1_000)
        self._prefix = f"longqa-{split}-{seed}-"
        # Target slots of facts spread over the documents a chunk typically holds.
        probe = LongQADocuments(config, f"longqa-probe/{seed}", [""] * (config.hops + 1), [])
        mean_units = sum(config.counter.count(render_document(9, probe._document(i, []))) for i in range(16)) / 16
        self._documents_per_chunk = max(1, int(config.chunk_size // mean_units))

    def __len__(self) -> int:
        return self._len

    def index_of(self, sample_id: str) -> int:
        if isinstance(sample_id, str) and sample_id.startswith(self._prefix):
            tail = sample_id[len(self._prefix):]
            if tail.isdigit() and int(tail) < self._len and str(int(tail)) == tail:
                return int(tail)
        raise KeyError(f"no sample {sample_id!r} in LongQA split {self.split!r} (ids look like "
                       f"'{self._prefix}<index>' with index < {self._len})")

    def __getitem__(self, index: int) -> Sample:
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"sample index must be an int, got {type(index).__name__}")
        if not 0 <= index < self._len:
            raise IndexError(f"sample index {index} out of range for {self._len} samples")
        cfg = self.config
        key = f"longqa/{self.seed}/{self.split}/{index}"
        rng = random.Random(key)
        chain = [rng.choice(POOLS[ENTITY_TYPES[h]]) for h in range(cfg.hops + 1)]
        chunks = [rng.randrange(cfg.fact_window or cfg.num_chunks) for _ in range(cfg.hops)]
        if cfg.fact_order == "causal":
            chunks.sort()
        facts = []
        per_chunk = self._documents_per_chunk
        for h, c in enumerate(chunks):
            order = float(h) if cfg.fact_order == "causal" else rng.random()
            text = fact_sentence(h, chain[h], chain[h + 1], cfg.fact_style)
            facts.append(_Fact(chunk=c, slot=rng.randrange(per_chunk), order=order, text=text, hop=h))
        if cfg.fact_order == "causal":  # within a chunk, a later hop never sits in an earlier slot
            facts = _causal_slots(facts)
        facts += _repeats(cfg, rng, facts, per_chunk)
        answer = chain[-1] if cfg.fact_style == "compact" else chain[-1].capitalize()
        sample_id = f"{self._prefix}{index}"
        return Sample(
            id=sample_id,
            question=question_text(cfg.hops, chain[0], cfg.fact_style),
            answers=[answer],
            documents=LongQADocuments(cfg, key, chain, facts, first_label(self.numbering, sample_id)),
            supporting_facts=[{"hop": f.hop, "chunk": f.chunk, "text": f.text} for f in facts],
            metadata={"task": "LongQA", "hops": cfg.hops, "chain": chain, "fact_order": cfg.fact_order,
                      "fact_style": cfg.fact_style, "distractor_similarity": cfg.distractor_similarity,
                      "fact_repeats": cfg.fact_repeats,
                      "num_chunks": cfg.num_chunks, "chunk_size": cfg.chunk_size, "unit": cfg.counter.unit},
        )


def _repeats(cfg: LongQAConfig, rng: random.Random, firsts: list[_Fact], per_chunk: int) -> list[_Fact]:
    """The further statements of each chain fact (``fact_repeats - 1`` each): in chunks that do not
    hold it yet where there are any, and under the causal order never before the previous hop's first
    statement, placed after it in its chunk (so reading order keeps hop h before hop h + 1)."""
    out: list[_Fact] = []
    span = cfg.fact_window or cfg.num_chunks
    for f in firsts:
        used = {f.chunk}
        causal = cfg.fact_order == "causal" and f.hop > 0
        lo = firsts[f.hop - 1].chunk if causal else 0
        for _ in range(cfg.fact_repeats - 1):
            free = [c for c in range(lo, span) if c not in used] or list(range(lo, span))
            chunk = rng.choice(free)
            used.add(chunk)
            slot = rng.randrange(per_chunk)
            if causal and chunk == lo:
                slot = max(slot, firsts[f.hop - 1].slot)
            order = f.order if cfg.fact_order == "causal" else rng.random()
            out.append(_Fact(chunk=chunk, slot=slot, order=order, text=f.text, hop=f.hop))
    return out


def _causal_slots(facts: list[_Fact]) -> list[_Fact]:
    """Make slots non-decreasing along hops for facts that share a chunk."""
    out, last = [], {}
    for f in facts:
        slot = max(f.slot, last.get(f.chunk, 0))
        last[f.chunk] = slot
        out.append(_Fact(chunk=f.chunk, slot=slot, order=f.order, text=f.text, hop=f.hop))
    return out


def make_source(split: str = "train", seed: int = 0, *, chunk_size: int = 64, num_chunks: int = 5,
                context_length: int | None = None, counter: Counter | None = None, numbering: str = "sequential",
                **options: Any) -> LongQASource:
    """The LongQA sample source for ``split``.

    ``chunk_size``, ``num_chunks``, ``context_length``, ``counter`` and ``numbering`` (the document
    labels the env renders, :func:`memgym.chunking.first_label`) size the input (the environment
    passes its own); ``options`` are the other :class:`LongQAConfig` fields.
    """
    known = set(LongQAConfig.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"LongQA: unknown option(s) {unknown}; known: {sorted(known)}")
    config = LongQAConfig(chunk_size=chunk_size, num_chunks=num_chunks, context_length=context_length,
                          counter=counter or WordCounter(), **options)
    return LongQASource(split, seed, config, numbering)


def tokenizer_corpus(n_samples: int = 2000, seed: int = 0) -> Iterator[str]:
    """Representative LongQA text (vocabulary, questions, chunks, answers) to train a tokenizer.

    Covers both fact styles and every hop count, and starts with every vocabulary word, so a
    word-level or BPE tokenizer trained on it gives one token per entity. Split digits and
    punctuation in the pre-tokenizer (e.g. ``Sequence([Whitespace(), Digits(True)])``) so that
    document numbers (``Document 27:``) of long inputs stay inside the vocabulary.
    """
    words = PERSONS + COMPANIES + CITIES + COUNTRIES + TITLES + FILLER_ADJ + FILLER_NOUN + FILLER_VERB + FILLER_ADV
    yield " ".join(words)
    yield " ".join(w.capitalize() for w in words)
    for hops in range(1, MAX_HOPS + 1):
        for style in FACT_STYLES:
            yield question_text(hops, "alice", style)
    settings = [(h, style) for h in range(1, MAX_HOPS + 1) for style in FACT_STYLES]
    for i in range(n_samples):
        hops, style = settings[i % len(settings)]
        source = make_source("corpus", seed, hops=hops, fact_style=style, num_chunks=2, chunk_size=128,
                             num_samples=n_samples)
        sample = source[i]
        yield sample.question
        for chunk in iter_chunks(sample.documents, 128):
            yield chunk.text
        yield " ".join(sample.answers)
