"""Generate documents that fill an exact number of chunks, with facts placed in chosen chunks.

A generator gives a ``make_document(seed_index, facts)`` callback; the planner calls it for
document after document, packs them with the environment's own :class:`~memgym.chunking.Packer`
and stops when ``num_chunks`` chunks are full. Because the packing is the environment's, the
chunker later cuts the stream exactly where the plan did, so a fact planned for chunk ``c`` is
read in chunk ``c``. Only one chunk's documents are buffered at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from memgym.chunking import Counter, Packer, label, render_document
from memgym.data import Document


@dataclass(frozen=True)
class PlacedFact:
    """A sentence that must appear in chunk ``chunk``, around document position ``slot``."""

    chunk: int
    slot: int  # target document position in the chunk (moved earlier when the chunk is fuller)
    order: float  # tie-break between facts of one chunk and slot
    text: str


PLAIN_DOC_TRIES = 20
"""Draws of a plain document before one longer than half a chunk is accepted anyway."""

MakeDocument = Callable[[int, Sequence[PlacedFact]], Document]


class PlannedDocuments:
    """A re-iterable document stream planned to fill ``num_chunks`` chunks exactly.

    Iterating regenerates every document from its seed, so nothing beyond one chunk is held.
    """

    def __init__(self, make_document: MakeDocument, facts: Sequence[PlacedFact], chunk_size: int,
                 num_chunks: int, counter: Counter, name: str = "generator", first: int | None = 1):
        self.make_document = make_document
        self.facts = list(facts)
        self.chunk_size = chunk_size
        self.num_chunks = num_chunks
        self.counter = counter
        self.name = name
        self.first = first  # the first document's label (memgym.chunking.first_label): labels take room

    def num_chunks_for(self, chunk_size: int, counter: Counter, first: int | None = 1) -> int | None:
        """The chunk count under these chunking settings when the plan used them, else None."""
        same = chunk_size == self.chunk_size and counter is self.counter and first == self.first
        return self.num_chunks if same else None

    def __iter__(self) -> Iterator[Document]:
        packer = Packer(self.chunk_size, self.counter)
        by_chunk: dict[int, list[PlacedFact]] = {}
        for f in self.facts:
            by_chunk.setdefault(f.chunk, []).append(f)
        state = {"seed": 0, "start": 1}
        carry: Document | None = None
        for c in range(self.num_chunks):
            pending = sorted(by_chunk.get(c, []), key=lambda f: (f.slot, f.order))
            buf, carry = self._fill_chunk(c, packer, pending, carry, state)
            yield from buf
            state["start"] += len(buf)

    def _fill_chunk(self, c: int, packer: Packer, pending: list[PlacedFact], carry: Document | None,
                    state: dict) -> tuple[list[Document], Document | None]:
        """Fill chunk ``c``; returns its documents and the first one that did not fit."""
        buf: list[Document] = []
        units: list[int] = []
        has_fact: list[bool] = []

        def measure(doc: Document) -> int:
            return self.counter.count(render_document(label(self.first, state["start"] + len(buf)), doc))

        def push(doc: Document, u: int, fact: bool) -> None:
            if u > self.chunk_size:  # the chunker would split it, and the plan would no longer hold
                raise ValueError(self._too_small(u, "one document"))
            buf.append(doc), units.append(u), has_fact.append(fact)
            packer.add(u)

        def new_document(facts: Sequence[PlacedFact]) -> Document:
            # A plain document may become the next chunk's first one (the carry), so keep it at
            # most half a chunk: then a fact document of up to half a chunk always fits beside it.
            for _ in range(PLAIN_DOC_TRIES):
                state["seed"] += 1
                doc = self.make_document(state["seed"] - 1, facts)
                if facts or measure(doc) <= self.chunk_size // 2:
                    break
            return doc

        # What the previous chunk could still take: a document that would not fit there may open this
        # chunk in place of the carry.
        previous = Packer(self.chunk_size, self.counter)
        previous.used, previous.pieces = packer.used, packer.pieces
        packer.close()
        if carry is not None:  # it did not fit the previous chunk, so it opens this one
            push(carry, measure(carry), False)
        nxt: Document | None = None
        closing = False
        while True:
            if pending and (closing or pending[0].slot <= len(buf)):
                group = [f for f in pending if closing or f.slot <= len(buf)]
                pending = [f for f in pending if f not in group]
                doc = new_document(group)
                while not packer.fits(u := measure(doc)):
                    # Make room by dropping the latest plain documents. A chunk's first document
                    # (the one that did not fit the previous chunk) stays, unless the fact document
                    # does not fit the previous chunk either: then it opens this chunk instead.
                    opening = self.counter.count(render_document(label(self.first, state["start"]), doc))
                    if carry is not None and len(buf) == 1 and not previous.fits(opening):
                        carry = None
                    elif len(buf) <= (1 if c > 0 else 0) or has_fact[-1]:
                        raise ValueError(self._too_small(u))
                    buf.pop(), units.pop(), has_fact.pop()
                    packer.close()
                    for v in units:
                        packer.add(v)
                push(doc, u, True)
                closing = False
                continue
            if nxt is None:
                nxt = new_document(())
            u = measure(nxt)
            if packer.fits(u):
                push(nxt, u, False)
                nxt = None
                continue
            if not buf:
                raise ValueError(self._too_small(u, "one document"))
            if pending:
                closing = True  # the chunk is full: place the remaining facts now
                continue
            return buf, nxt

    def _too_small(self, units: int, what: str = "a fact document next to another document") -> str:
        """Why a document cannot be placed, with a chunk_size that leaves room for it."""
        unit = self.counter.unit
        size = max(2 * units, self.chunk_size + units)
        return (f"{self.name}: chunk_size={self.chunk_size} {unit} is too small to hold {what} "
                f"({units} {unit}); pass chunk_size={size} or more (e.g. --env-kwarg chunk_size={size})")
