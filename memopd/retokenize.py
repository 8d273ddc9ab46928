"""A teacher with another tokenizer: each recorded call as the teacher sees it, and the teacher's
log-probs mapped back to the student's action tokens by text spans.

The rule, deterministic from the record and the two tokenizers (no model involved):

1. **The view.** A call's prompt is cut at its shared prefix (``prefix_len``); each part is
   decoded by the student's tokenizer (special tokens kept as their text) and encoded by the
   teacher's as text that stands inside a document (:func:`encode`: the teacher's own normaliser
   and pre-tokenizer, without the prefix space or ``▁`` they insert at a document's start; its
   special tokens recognised by their text; nothing else is added). The
   response is decoded and encoded on its own, so the teacher's state ends where the student's
   did. With identical tokenizers (the same vocabulary, token for id) the view is the record
   itself, so this path equals the same-tokenizer one exactly.
2. **The chunks.** A token of a response *ends* at the length of the decoded text up to and
   including it, when that text is a prefix of the whole response text; a token whose prefix
   ends inside a character (a byte-level token holding part of a UTF-8 character) has no end.
   A chunk boundary is an offset where a student token and a teacher token both end; a chunk is
   the text between two boundaries, with the student tokens and the teacher tokens that end in
   it. Chunks are the smallest spans both tokenizations agree on.
3. **The scores.** A chunk's teacher log-prob is the sum of its teacher tokens' log-probs: the
   teacher's log-probability of that text, in the call's state, after the text before it. Each
   student token of the chunk gets an equal share, so the shares of a response sum to the
   teacher's log-prob of the whole response text, and a one-token chunk (every chunk, with
   identical tokenizers) gets its own log-prob unchanged.

What the sampled-token estimator then sees at a student token ``a`` is ``log s(a) - share``: the
log-ratio at one-token chunks, and, summed over a longer chunk, the chunk's log-ratio.

Bias, and what happens at span boundaries:

- The teacher's probability of a text is taken under its own (canonical) tokenization of it; a
  model also puts some mass on other tokenizations of the same text, which this leaves out, so
  the teacher's log-prob is a lower bound of the text's.
- Within a chunk of several student tokens the split is equal, not per token: the per-token
  log-ratios there are the chunk's mean, and only their sum is the chunk's. A token's own
  log-ratio exists only where both tokenizations have a boundary on each side of it.
- Where the teacher's text differs from the student's (a normaliser that changes text: the
  preset tokenizers insert a space after a line break, which a sampled ``"\nfoo"`` lacks), the
  teacher's token ends are carried onto the student's text through the longest matching
  character blocks of the two (:func:`map_offsets`); an end in text only the teacher has is no
  boundary, so the chunk around a changed character grows to the nearest ends both still share.
  Such calls are counted (``teacher/text_mismatch_calls``).
- The prompt is the student's text in the teacher's tokens: a teacher of another chat template
  sees the student's template markers as text.

4. **The top-k** (``--opd-estimator topk``; two vocabularies have no token-for-token map). Each
   student token ``v`` belongs to the teacher token its text starts with: the first of the
   teacher's tokens of ``decode(v)`` read inside a document, as :func:`encode` reads it
   (:func:`first_pieces`; identical tokenizers: ``v`` itself). Read alone under
   ``add_prefix_space``, ``pen`` would start with the teacher's ``" pen"`` and ``!`` with a lone
   space: pieces that do not start the token's text.
   At the first student token of a chunk the teacher's state is the student's text exactly (the
   chunk starts where both tokenizations end), so there the teacher's next-token distribution
   over its own vocabulary is compared with the student's summed onto the teacher's tokens
   (:func:`memopd.estimators.project_student`): the teacher's ``k`` most likely tokens and the
   tail, the student's mass of ``" Zane"`` in the teacher's ``" Z"`` bucket. The target at a
   state does not depend on which token the student sampled there. :func:`chunk_starts` names
   the supervised positions and the teacher token whose state each reads.

   Bias, besides the top-k's tail bucket (a lower bound): the buckets are events of the text's
   beginning, "the next text starts with the teacher's token ``u``", taken under each model's own
   tokenization of its next token. They agree where the teacher's tokens are no longer than the
   student's; where a student token is shorter than the teacher's next token (the teacher writes
   ``" Zane"`` whole, the student ``" Z" + "ane"``), the student's ``" Z"`` is compared with the
   teacher's ``" Z"``, which has little mass, and the student is drawn to the teacher's longer
   token. A student token after the first in its chunk is not supervised: the teacher's state at
   its start would end inside one of the teacher's tokens.
"""

from __future__ import annotations

import bisect
import json
import weakref
from dataclasses import dataclass, replace
from typing import Any, Sequence

from agents.records import Episode, Invocation


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers map the same tokens to the same ids (one vocabulary)."""
    return a is b or a.get_vocab() == b.get_vocab()


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def encode(tokenizer: Any, text: str) -> list[int]:
    """The tokens of ``text`` as it stands inside a document, after other text: the tokenizer's own
    normaliser and pre-tokenizer, without what they insert at a document's start (a ByteLevel
    ``add_prefix_space``, a Metaspace prepend, a ``Prepend`` normaliser). Encoded alone, a preset
    tokenizer reads ``pen`` as ``" pen"``; a piece of a text must keep the text (module rule 1)."""
    if not text:
        return []
    inner = continuation_tokenizer(tokenizer)
    if inner is None:  # a tokenizer without a ``tokenizers`` backend: its own encode
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(inner.encode(text, add_special_tokens=False).ids)


_CONTINUATION: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _no_document_start(node: Any) -> Any:
    """A normaliser or pre-tokenizer (its JSON) with what it adds at a document's start taken out."""
    if isinstance(node, list):
        return [n for n in (_no_document_start(x) for x in node) if n is not None]
    if not isinstance(node, dict):
        return node
    kind = node.get("type")
    if kind == "Prepend":  # SentencePiece-style "▁" before the text: only a document's start has it
        return None
    node = {k: _no_document_start(v) for k, v in node.items()}
    if kind == "ByteLevel":
        node["add_prefix_space"] = False
    elif kind == "Metaspace":
        node["prepend_scheme"] = "never"
        node.pop("add_prefix_space", None)
    elif kind == "Sequence":
        for key in ("normalizers", "pretokenizers"):
            if key in node and not node[key]:
                return None
    return node


def continuation_tokenizer(tokenizer: Any) -> Any | None:
    """A copy of ``tokenizer``'s ``tokenizers`` backend that encodes text as a continuation (see
    :func:`encode`), made once per tokenizer; None where there is no such backend."""
    if tokenizer in _CONTINUATION:
        return _CONTINUATION[tokenizer]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    inner = None
    if backend is not None:
        from tokenizers import Tokenizer

        spec = json.loads(backend.to_str())
        for key in ("normalizer", "pre_tokenizer"):
            if spec.get(key) is not None:
                spec[key] = _no_document_start(spec[key])
        inner = Tokenizer.from_str(json.dumps(spec))
        inner.no_padding()
        inner.no_truncation()
    _CONTINUATION[tokenizer] = inner
    return inner


def token_ends(tokenizer: Any, ids: Sequence[int]) -> tuple[str, list[int | None]]:
    """The decoded text of ``ids`` and, for each token, the offset in it where the token ends:
    the length of the decoded text through the token, or None where that is not a prefix of the
    whole (it ends inside a character)."""
    text = decode(tokenizer, ids)
    ends: list[int | None] = []
    for i in range(1, len(ids) + 1):
        head = text if i == len(ids) else decode(tokenizer, ids[:i])
        ends.append(len(head) if text.startswith(head) and not head.endswith("\ufffd") else None)
    return text, ends


def chunk_of(ends: Sequence[int | None], boundaries: Sequence[int]) -> list[int]:
    """The chunk of each token: the first boundary at or after its end (a token with no end: the
    first boundary after the last end before it)."""
    out, last = [], 0
    for e in ends:
        if e is None:
            out.append(min(bisect.bisect_right(boundaries, last), len(boundaries) - 1))
        else:
            out.append(min(bisect.bisect_left(boundaries, e), len(boundaries) - 1))
            last = e
    return out


def map_offsets(ends: Sequence[int | None], text: str, onto: str) -> list[int | None]:
    """Offsets in ``text`` as offsets in ``onto``, through the longest matching blocks of the two
    (:class:`difflib.SequenceMatcher`): an offset at or inside a matched block maps to the same
    place in its copy; one in text that only ``text`` has maps to None."""
    from difflib import SequenceMatcher

    blocks = SequenceMatcher(None, text, onto, autojunk=False).get_matching_blocks()
    out: list[int | None] = []
    for e in ends:
        hit = None if e is None else next((b.b + e - b.a for b in blocks if b.size and b.a <= e <= b.a + b.size),
                                          None)
        out.append(hit)
    return out


@dataclass(frozen=True)
class Alignment:
    """The chunks of one response in both tokenizations: the chunk index of each student token
    and of each teacher token; ``text_match`` is False when the teacher's text differs from the
    student's (aligned through :func:`map_offsets`)."""

    student_chunk: tuple[int, ...]
    teacher_chunk: tuple[int, ...]
    num_chunks: int
    text_match: bool = True


def align(student_ids: Sequence[int], teacher_ids: Sequence[int], student_tok: Any, teacher_tok: Any) -> Alignment:
    """Chunks of a response that the student wrote as ``student_ids`` and the teacher reads as
    ``teacher_ids`` (see the module's rule 2)."""
    s_text, s_ends = token_ends(student_tok, student_ids)
    t_text, t_ends = token_ends(teacher_tok, teacher_ids)
    if not student_ids:
        return Alignment((), (0,) * len(teacher_ids), 1, s_text == t_text)
    if s_text != t_text:  # the teacher's normaliser changed the text: its ends in the student's offsets
        t_ends = map_offsets(t_ends, t_text, s_text)
    bounds = sorted({e for e in s_ends if e is not None} & {e for e in t_ends if e is not None} | {len(s_text)})
    # a chunk with no student token (teacher text before the student's first end) cannot happen:
    # every boundary is a student end, and the last is the text's end
    return Alignment(tuple(chunk_of(s_ends, bounds)), tuple(chunk_of(t_ends, bounds)), len(bounds), s_text == t_text)


@dataclass(frozen=True)
class TeacherView:
    """One call as the teacher sees it: the record in the teacher's tokens (its ``logprobs`` are
    zeros: the teacher scores, it did not sample) and the response's chunks."""

    invocation: Invocation
    alignment: Alignment


def view_call(inv: Invocation, student_tok: Any, teacher_tok: Any) -> TeacherView:
    """The teacher's view of ``inv`` (rule 1), for tokenizers that differ."""
    p = inv.prefix_len
    prefix = encode(teacher_tok, decode(student_tok, inv.prompt_ids[:p]))
    prompt = prefix + encode(teacher_tok, decode(student_tok, inv.prompt_ids[p:]))
    response = encode(teacher_tok, decode(student_tok, inv.response_ids))
    t_inv = replace(inv, prompt_ids=prompt, response_ids=response, logprobs=[0.0] * len(response),
                    position_ids=list(range(len(prompt) + len(response))), prefix_len=len(prefix), spans=None)
    return TeacherView(t_inv, align(inv.response_ids, response, student_tok, teacher_tok))


def identity_view(inv: Invocation) -> TeacherView:
    """The view of ``inv`` for a teacher with the student's tokenizer: the record itself, every
    token its own chunk."""
    n = len(inv.response_ids)
    return TeacherView(inv, Alignment(tuple(range(n)), tuple(range(n)), n))


def view_episodes(episodes: Sequence[Episode], student_tok: Any, teacher_tok: Any) -> list[list[TeacherView]]:
    """Every call of ``episodes`` as the teacher sees it, episode by episode."""
    if same_tokenizer(student_tok, teacher_tok):
        return [[identity_view(inv) for inv in ep.invocations] for ep in episodes]
    return [[view_call(inv, student_tok, teacher_tok) for inv in ep.invocations] for ep in episodes]


def spread(teacher_logp: Sequence[float], alignment: Alignment) -> list[float]:
    """Per student token: an equal share of its chunk's teacher log-prob, the chunk's being the
    sum of its teacher tokens' ``teacher_logp`` (rule 3)."""
    total = [0.0] * alignment.num_chunks
    for c, lp in zip(alignment.teacher_chunk, teacher_logp):
        total[c] += float(lp)
    size = [0] * alignment.num_chunks
    for c in alignment.student_chunk:
        size[c] += 1
    return [total[c] / size[c] for c in alignment.student_chunk]


def first_pieces(student_tok: Any, teacher_tok: Any) -> list[int]:
    """For each student token id, the teacher's first token of its text inside a document
    (``encode(teacher, decode(student, [v]))[0]``, :func:`encode` inserting no prefix space), or
    -1 (an empty text, a byte-level token holding part of a character, or a text the teacher's
    normaliser drops). Identical tokenizers: the identity (module rule 4)."""
    if same_tokenizer(student_tok, teacher_tok):
        return list(range(len(student_tok)))
    out = []
    for v in range(len(student_tok)):
        text = decode(student_tok, [v])
        ids = encode(teacher_tok, text) if "\ufffd" not in text else []
        out.append(ids[0] if ids else -1)
    return out


def chunk_starts(alignment: Alignment) -> list[int | None]:
    """Per student token of a response: the index of the first teacher token of its chunk when
    the student token is the first of its chunk and the chunk has a teacher token, else None
    (module rule 4)."""
    first: dict[int, int] = {}
    for u, c in enumerate(alignment.teacher_chunk):
        first.setdefault(c, u)
    out: list[int | None] = []
    for j, c in enumerate(alignment.student_chunk):
        out.append(first.get(c) if j == 0 or alignment.student_chunk[j - 1] != c else None)
    return out


__all__ = ["Alignment", "TeacherView", "align", "chunk_of", "decode", "encode", "identity_view", "map_offsets",
           "chunk_starts", "first_pieces", "same_tokenizer", "spread", "token_ends", "view_call",
           "view_episodes"]
