"""Length units, document rendering, streaming chunking and the memory cut.

Everything here is measured in *units*. An environment always counts **tokens**: of the
tokenizer it is made with (the agent's), else of memgym's default tokenizer
(:func:`default_tokenizer`, the tiny presets' byte-level BPE, shipped as
``memgym/default_tokenizer.json`` and read without torch). The memory budget, the chunk size and
every agent's memory cap are counted in that one unit. :class:`WordCounter` (whitespace words)
remains for generators called on their own. A :class:`Counter` hides which; the chunker, the
memory cut and the generators that size their input (LongQA plans chunks exactly) share one.

Chunking rules (the environment contract):
- documents are rendered as ``"Document i: <title>\\n<text>"``; ``i`` counts the stream from a
  first label (:func:`first_label`): 1 (``numbering="sequential"``), a random offset drawn per
  sample (``"random"``: training sees the labels long inputs have) or no label at all (``"none"``:
  ``"Document: <title>"``);
- a chunk holds whole documents, packed greedily in order, while they fit;
- a document longer than a chunk is split at word boundaries, preferring sentence ends; its
  continuation pieces repeat the header with ``(continued)``;
- a word is never split; pieces are joined with a blank line.
Documents are consumed lazily, so a million-token episode streams in flat memory.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol

from memgym.data import Document

PIECE_SEPARATOR = "\n\n"
_WORD_RE = re.compile(r"\S+")
_SENTENCE_END = (".", "!", "?")
DEFAULT_TOKENIZER_FILE = Path(__file__).resolve().parent / "default_tokenizer.json"
"""memgym's default tokenizer: the tiny presets' (``agents.presets``), the tokenizer of the default
student, so that an env made without a tokenizer counts exactly what training and evaluation count
(tests/test_budget_unit.py checks the file against the preset)."""


class Counter(Protocol):
    """Measures text in budget units ("words" or "tokens")."""

    unit: str

    def count(self, text: str) -> int: ...

    def word_units(self, text: str) -> list[tuple[int, int, int]]:
        """``(start, end, units)`` for every whitespace-separated word of ``text``."""
        ...

    def cut(self, text: str, budget: int) -> tuple[str, int, int]:
        """Keep the first ``budget`` units: returns ``(kept_text, kept_units, removed_units)``."""
        ...


class WordCounter:
    """Whitespace-separated words; one unit per word."""

    unit = "words"

    def count(self, text: str) -> int:
        return len(text.split())

    def word_units(self, text: str) -> list[tuple[int, int, int]]:
        return [(m.start(), m.end(), 1) for m in _WORD_RE.finditer(text)]

    def cut(self, text: str, budget: int) -> tuple[str, int, int]:
        # Keep the text up to the end of the budget-th word (leading whitespace kept as is).
        total = 0
        for total, m in enumerate(_WORD_RE.finditer(text), start=1):
            if total == budget:
                end = m.end()
                rest = self.count(text[end:])
                return (text[:end], budget, rest) if rest else (text, budget, 0)
        return (text, total, 0) if budget > 0 or total == 0 else ("", 0, total)


class TokenCounter:
    """Tokens of a Hugging Face *fast* tokenizer, without special tokens.

    Chunk lengths are the sums of their pieces' token counts; for tokenizers that split on
    whitespace before tokenizing (word-level, byte-level BPE, SentencePiece with whitespace
    splitting) this equals the token count of the joined chunk text.
    """

    unit = "tokens"

    def __init__(self, tokenizer: Any):
        from tokenizers import Tokenizer

        # A bare ``tokenizers.Tokenizer`` (the default one) needs no transformers, hence no torch.
        self._raw = tokenizer if isinstance(tokenizer, Tokenizer) else None
        if self._raw is None and not getattr(tokenizer, "is_fast", False):
            raise TypeError(
                f"memgym needs a fast (Rust-backed) Hugging Face tokenizer for token offsets; "
                f"got {type(tokenizer).__name__}. Load it with AutoTokenizer.from_pretrained(..., use_fast=True)."
            )
        self.tokenizer = tokenizer
        self.fingerprint = tokenizer_fingerprint(tokenizer)

    def _encode(self, text: str, offsets: bool = False) -> dict:
        if self._raw is not None:
            enc = self._raw.encode(text, add_special_tokens=False)
            return {"input_ids": enc.ids, "offset_mapping": enc.offsets}
        fast = backend_encode(self.tokenizer, text)
        if fast is not None:
            return {"input_ids": fast.ids, "offset_mapping": fast.offsets}
        return self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=offsets,
                              return_attention_mask=False)

    def count(self, text: str) -> int:
        return len(self._encode(text)["input_ids"]) if text else 0

    def word_units(self, text: str) -> list[tuple[int, int, int]]:
        words = [(m.start(), m.end()) for m in _WORD_RE.finditer(text)]
        if not words:
            return []
        counts = [0] * len(words)
        w = 0
        for start, end in self._encode(text, offsets=True)["offset_mapping"]:
            # A token belongs to the word its last character lies in; a whitespace-only token
            # belongs to the word after it.
            pos = end if text[start:end].isspace() else max(start, end - 1)
            while w + 1 < len(words) and pos >= words[w + 1][0]:
                w += 1
            counts[w] += 1
        return [(s, e, c) for (s, e), c in zip(words, counts)]

    def cut(self, text: str, budget: int) -> tuple[str, int, int]:
        # Contract: keep the first `budget` tokens and cut the text at the end offset of the
        # last kept token.
        offsets = self._encode(text, offsets=True)["offset_mapping"]
        if len(offsets) <= budget:
            return text, len(offsets), 0
        if budget <= 0:
            return "", 0, len(offsets)
        return text[: offsets[budget - 1][1]], budget, len(offsets) - budget


def backend_encode(tokenizer: Any, text: str, split_special_tokens: bool = False) -> Any:
    """``tokenizer(text, add_special_tokens=False)`` straight from a fast tokenizer's Rust
    backend: a ``tokenizers.Encoding`` (``ids``, ``offsets``), the same ids and offsets without
    transformers' per-call work, which was 60% of the tokenizing time of an environment step
    (measured: 65 of 170 µs per call in the Rust encoder). None when the tokenizer has no backend
    or has truncation or padding set (the transformers call then says what they do). Like that
    call, it sets whether special-token text is split (``split_special_tokens``) on the backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    if backend.encode_special_tokens != split_special_tokens:
        backend.encode_special_tokens = split_special_tokens
    return backend.encode(text, add_special_tokens=False)


def make_counter(tokenizer: Any = None) -> TokenCounter:
    """The :class:`TokenCounter` an environment counts with: of ``tokenizer``, else of
    :func:`default_tokenizer`.

    ``tokenizer`` may be a transformers tokenizer object, a ``tokenizers.Tokenizer`` or a string
    (hub id or local directory), loaded lazily here with ``AutoTokenizer`` so that importing
    memgym stays light.
    """
    if tokenizer is None:
        return TokenCounter(default_tokenizer())
    if isinstance(tokenizer, str):
        tokenizer = _load_tokenizer(tokenizer)
    return TokenCounter(tokenizer)


@lru_cache(maxsize=1)
def default_tokenizer() -> Any:
    """memgym's default tokenizer (:data:`DEFAULT_TOKENIZER_FILE`), a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(DEFAULT_TOKENIZER_FILE))


_FINGERPRINTS: dict[int, tuple[Any, str]] = {}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of what decides how a tokenizer counts (normaliser, pre-tokeniser, model,
    added tokens), equal for a transformers fast tokenizer and the ``tokenizers.Tokenizer`` it
    wraps. An env puts it in ``info["budget_tokenizer"]`` so that an agent counting with another
    tokenizer (another unit) is told at once."""
    known = _FINGERPRINTS.get(id(tokenizer))
    if known is not None and known[0] is tokenizer:
        return known[1]
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    spec = json.loads(backend.to_str())
    keep = {k: spec.get(k) for k in ("added_tokens", "normalizer", "pre_tokenizer", "model")}
    digest = hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]
    _FINGERPRINTS[id(tokenizer)] = (tokenizer, digest)
    return digest


def _load_tokenizer(spec: str) -> Any:
    """``AutoTokenizer.from_pretrained(spec)``; a failure is a ``ValueError`` naming the
    ``tokenizer`` setting and what to give instead (a local path that does not exist is said so,
    not sent to the hub as a malformed repo id)."""
    import os

    expanded = os.path.expanduser(spec)
    looks_local = os.path.isabs(expanded) or spec.startswith((".", "~")) or os.path.exists(expanded)
    if looks_local and not os.path.exists(expanded):
        raise ValueError(f"tokenizer={spec!r}: no such directory; give a directory holding a saved tokenizer "
                         "(tokenizer.json), a hub id such as 'gpt2', or leave tokenizer unset (memgym's default)")
    files = ("tokenizer.json", "tokenizer_config.json")
    if os.path.isdir(expanded) and not any(os.path.isfile(os.path.join(expanded, f)) for f in files):
        raise ValueError(f"tokenizer={spec!r}: the directory holds no tokenizer files ({', '.join(files)}); give a "
                         "directory a tokenizer was saved to (save_pretrained), or leave tokenizer unset (memgym's "
                         "default)")
    from transformers import AutoTokenizer  # lazy: heavy import

    try:
        return AutoTokenizer.from_pretrained(expanded if looks_local else spec)
    except Exception as exc:  # noqa: BLE001 - transformers fails in many ways, each with a multi-line text
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        what = "a directory holding a saved tokenizer (tokenizer.json)" if looks_local else "a hub id such as 'gpt2'"
        raise ValueError(f"tokenizer={spec!r}: could not load a tokenizer from it ({first[:200]}); give {what}, "
                         "or leave tokenizer unset (memgym's default)") from None


NUMBERINGS = ("sequential", "random", "none")
"""How documents are labelled (the env's ``numbering`` setting; see :func:`first_label`)."""
RANDOM_LABELS = 10_000
"""``numbering="random"``: the first label of a sample is drawn from 1..RANDOM_LABELS."""


def first_label(numbering: str, sample_id: str) -> int | None:
    """The label of a sample's first document: 1 (``"sequential"``), a number drawn from the sample
    id in 1..:data:`RANDOM_LABELS` (``"random"``: the same sample is always labelled alike, and a
    training run sees labels up to RANDOM_LABELS + its documents), or None (``"none"``: no labels)."""
    if numbering == "sequential":
        return 1
    if numbering == "none":
        return None
    if numbering == "random":
        digest = hashlib.sha256(f"memgym-numbering/{sample_id}".encode()).digest()
        return 1 + int.from_bytes(digest[:8], "big") % RANDOM_LABELS
    raise ValueError(f"numbering must be one of {NUMBERINGS}, got {numbering!r}")


def label(first: int | None, position: int) -> int | None:
    """The label of the document at 1-based ``position`` when the first is labelled ``first``."""
    return None if first is None else first + position - 1


def document_header(index: int | None, title: str, continued: bool = False) -> str:
    header = (f"Document {index}: {title}" if index is not None else f"Document: {title}").rstrip()
    return header + " (continued)" if continued else header


def render_document(index: int | None, doc: Document) -> str:
    """How a document appears in a chunk; ``index`` is its label (None: unlabelled)."""
    return f"{document_header(index, doc.title)}\n{doc.text}"


def separator_units(counter: Counter) -> int:
    """Units the blank line between two pieces adds, measured in context (tokenizers may
    split whitespace differently between words than at the end of a text); measured once per
    counter (every chunk's packer asks)."""
    cached = getattr(counter, "_separator_units", None)
    if cached is None:
        a, b = render_document(1, Document("a", "x .")), render_document(2, Document("b", "y ."))
        cached = counter.count(a + PIECE_SEPARATOR + b) - counter.count(a) - counter.count(b)
        try:
            counter._separator_units = cached  # type: ignore[attr-defined]
        except AttributeError:  # a counter with __slots__: measure each time
            pass
    return cached


class Packer:
    """Greedy packing of pieces into chunks of at most ``chunk_size`` units.

    Shared by the chunker and by generators that plan their documents to fill an exact
    number of chunks, so both agree on where chunks end.
    """

    def __init__(self, chunk_size: int, counter: Counter):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = chunk_size
        self.counter = counter
        self.separator_units = separator_units(counter)
        self.used = 0
        self.pieces = 0

    def cost(self, units: int) -> int:
        """Units a piece of ``units`` adds to the current chunk (separator included)."""
        return units + (self.separator_units if self.pieces else 0)

    def fits(self, units: int) -> bool:
        return self.used + self.cost(units) <= self.chunk_size

    def add(self, units: int) -> None:
        self.used += self.cost(units)
        self.pieces += 1

    def close(self) -> None:
        self.used = 0
        self.pieces = 0


@dataclass(frozen=True)
class Chunk:
    """One chunk of the input: its text, its size in units, and the documents it touches."""

    text: str
    size: int
    first_document: int  # 1-based position of the first document (piece) in the chunk
    last_document: int


def _split_long(index: int | None, doc: Document, chunk_size: int, counter: Counter) -> Iterator[tuple[str, int]]:
    """Split one over-long document into pieces of at most ``chunk_size`` units.

    Words are packed greedily; a piece ends at the last sentence end that fits when there is
    one, else at the last word that fits. A single word longer than a chunk is kept whole
    (a word is never split) and reported at its real size.
    """
    words = counter.word_units(doc.text)
    text = doc.text
    w, continued = 0, False
    while w < len(words):
        header = document_header(index, doc.title, continued)
        room = chunk_size - counter.count(header + "\n")
        used, end, last_sentence = 0, w, -1
        while end < len(words) and (used + words[end][2] <= room or end == w):
            used += words[end][2]
            if text[words[end][0]:words[end][1]].endswith(_SENTENCE_END):
                last_sentence = end
            end += 1
        if end < len(words) and last_sentence >= w:
            end = last_sentence + 1
        while True:
            piece = f"{header}\n{text[words[w][0]:words[end - 1][1]]}"
            units = counter.count(piece)
            # Per-word counts can differ slightly from the piece's own tokenisation: shrink.
            if units <= chunk_size or end == w + 1:
                break
            end -= 1
        yield piece, units
        w, continued = end, True


def iter_pieces(documents: Iterable[Document], chunk_size: int, counter: Counter,
                first: int | None = 1) -> Iterator[tuple[int, str, int]]:
    """Rendered pieces ``(document_position, text, units)``: whole documents, or parts of long
    ones; positions are 1-based, labels start at ``first`` (None: unlabelled)."""
    for position, doc in enumerate(documents, start=1):
        text = render_document(label(first, position), doc)
        units = counter.count(text)
        if units <= chunk_size:
            yield position, text, units
        else:
            for piece, piece_units in _split_long(label(first, position), doc, chunk_size, counter):
                yield position, piece, piece_units


def iter_chunks(documents: Iterable[Document], chunk_size: int, counter: Counter | None = None,
                first: int | None = 1) -> Iterator[Chunk]:
    """Stream the chunks of a document sequence (lazily; nothing is materialised beyond a chunk);
    documents are labelled from ``first`` (:func:`first_label`)."""
    counter = counter or WordCounter()
    packer = Packer(chunk_size, counter)
    parts: list[str] = []
    first_doc = last = 0
    for index, text, units in iter_pieces(documents, chunk_size, counter, first):
        if parts and not packer.fits(units):
            yield Chunk(PIECE_SEPARATOR.join(parts), packer.used, first_doc, last)
            packer.close()
            parts = []
        if not parts:
            first_doc = index
        packer.add(units)
        parts.append(text)
        last = index
    if parts:
        yield Chunk(PIECE_SEPARATOR.join(parts), packer.used, first_doc, last)


def count_chunks(documents: Iterable[Document], chunk_size: int, counter: Counter | None = None,
                 first: int | None = 1) -> int:
    """Number of chunks :func:`iter_chunks` would give, without joining any chunk text."""
    counter = counter or WordCounter()
    packer = Packer(chunk_size, counter)
    n = 0
    for _, _, units in iter_pieces(documents, chunk_size, counter, first):
        if packer.pieces and not packer.fits(units):
            packer.close()
        if not packer.pieces:
            n += 1
        packer.add(units)
    return n
