"""Token-exact prompts, assembled from token-id segments.

A prompt is a concatenation of *literal* template pieces (instructions, tags, the chat template's
role markers) and *data* segments (question, memory, chunk, context), each already token ids.
Nothing is ever decoded and re-encoded: the memory segment of call t+1 is the token ids the model
sampled in call t. The episode's shared prefix (instructions + question) comes first and is the
same token ids in every call of the episode, so a learner can store it once.

How the template pieces are found: the user message of each call kind is written with marker
characters in place of the data slots, rendered once through the tokenizer's chat template (when it
has one), and split at the markers. Each literal piece is encoded on its own with
``add_special_tokens=False`` (its special tokens, e.g. ``<|im_start|>``, become their ids); data
text is encoded with ``split_special_tokens=True`` so that a chunk containing ``<|im_end|>``
cannot inject a control token.

This module imports no torch: it only needs a transformers tokenizer object.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

SLOTS = ("question", "memory", "chunk", "context")
"""Data slots a template may use. ``question`` must be in the shared prefix, the others in calls."""

# Private-use characters never appear in chat templates; they only mark where data goes.
_MARK = {name: f"\ue000{name}\ue001" for name in SLOTS}
_PREFIX_END = "\ue000/prefix\ue001"
_SPLIT = re.compile("(\ue000[^\ue001]*\ue001)")


@dataclass(frozen=True)
class PromptTemplate:
    """The texts of one agent's prompts (before the chat template is applied).

    ``prefix`` is shared by every call of an episode and must hold ``{question}``; each entry of
    ``calls`` is the rest of the user message for one kind of call and may use ``{memory}``,
    ``{chunk}`` and ``{context}``.
    """

    name: str
    prefix: str
    """Instructions + ``{question}``: the episode's shared prefix."""
    calls: dict[str, str]
    """Call kind (``"memory"``, ``"answer"``) -> the call-specific text after the prefix."""
    context_separator: str = "\n\n"
    """Literal text put between chunks when several are joined into ``{context}``."""

    def __post_init__(self) -> None:
        if self.prefix.count("{question}") != 1:
            raise ValueError(f"template {self.name!r}: prefix must contain {{question}} exactly once")
        for kind, text in self.calls.items():
            if "{question}" in text:
                raise ValueError(f"template {self.name!r}: call {kind!r} must not repeat {{question}} "
                                 "(the question belongs to the shared prefix)")
            for slot in re.findall(r"\{(\w+)\}", text):
                if slot not in SLOTS:
                    raise ValueError(f"template {self.name!r}: call {kind!r} uses unknown slot {{{slot}}}; "
                                     f"known slots: {SLOTS}")

    def user_message(self, kind: str, marked: bool = True) -> str:
        """The user message of a call kind, with slot markers (``marked``) or ``{slot}`` names."""
        text = self.prefix + (_PREFIX_END if marked else "") + self.calls[kind]
        if marked:
            for name, mark in _MARK.items():
                text = text.replace("{" + name + "}", mark)
        return text

    def literal_pieces(self) -> list[str]:
        """All literal text of this template (without the chat template), split at the slots."""
        pieces = re.split(r"\{(?:%s)\}" % "|".join(SLOTS), self.prefix)
        for text in self.calls.values():
            pieces += re.split(r"\{(?:%s)\}" % "|".join(SLOTS), text)
        return [p for p in pieces + [self.context_separator] if p]


MEMAGENT_TEMPLATE = PromptTemplate(
    name="memagent",
    prefix=(
        "You read a long text one section at a time to solve a problem. You keep a short memory: "
        "after each section you rewrite it, keeping every detail from the previous memory that "
        "helps solve the problem and adding any new useful information from the section. "
        "At the end you answer the problem from the memory alone.\n\n"
        "<problem>\n{question}\n</problem>\n\n"
    ),
    calls={
        "memory": (
            "<memory>\n{memory}\n</memory>\n\n<section>\n{chunk}\n</section>\n\n"
            "Write the updated memory, and nothing else."
        ),
        "answer": (
            "<memory>\n{memory}\n</memory>\n\n"
            "Answer the problem from the memory. Write only the answer, as a short phrase."
        ),
    },
)
"""MemAgent-style prompts: problem + previous memory + section -> updated memory; problem +
memory -> answer. Both share the prefix (instructions + problem)."""

READER_TEMPLATE = PromptTemplate(
    name="reader",
    prefix=(
        "You answer a problem about a long text. Read the text and answer the problem.\n\n"
        "<problem>\n{question}\n</problem>\n\n"
    ),
    calls={
        "answer": (
            "<text>\n{context}\n</text>\n\n"
            "Answer the problem from the text. Write only the answer, as a short phrase."
        ),
    },
)
"""Prompts of the baselines that answer once from a context (full transcript or retrieved chunks)."""

MEMAGENT_CHUNK_FIRST_TEMPLATE = PromptTemplate(
    name="memagent-chunk-first",
    prefix=MEMAGENT_TEMPLATE.prefix,
    calls={
        "memory": (
            "<section>\n{chunk}\n</section>\n\n<memory>\n{memory}\n</memory>\n\n"
            "Write the updated memory, and nothing else."
        ),
        "answer": MEMAGENT_TEMPLATE.calls["answer"],
    },
)
"""MemAgent's prompts with the section before the memory. Everything before the memory is then
the same for every sample of a question at a turn, so packing stores a turn's chunk once for all
of them (MemAgent's order shares only the prefix and the first call). Same words as MemAgent's."""

TEMPLATES = {t.name: t for t in (MEMAGENT_TEMPLATE, READER_TEMPLATE, MEMAGENT_CHUNK_FIRST_TEMPLATE)}
CORPUS_TEMPLATES = (MEMAGENT_TEMPLATE, READER_TEMPLATE)
"""The templates whose text the preset tokenizers are trained on (the chunk-first template reuses
MemAgent's words, so adding it changed no tokenizer)."""


def template(spec: "PromptTemplate | str") -> "PromptTemplate":
    """A template, or a built-in one by name (``memagent``, ``memagent-chunk-first``, ``reader``)."""
    if isinstance(spec, PromptTemplate):
        return spec
    if spec not in TEMPLATES:
        raise ValueError(f"unknown prompt template {spec!r}; built-in templates: {sorted(TEMPLATES)}")
    return TEMPLATES[spec]


def template_corpus() -> list[str]:
    """Every literal text the built-in templates put into prompts (the chat template aside).

    Used to train small tokenizers so that the instructions and tags compress well.
    """
    out: list[str] = []
    for tpl in CORPUS_TEMPLATES:
        for piece in tpl.literal_pieces():
            if piece not in out:
                out.append(piece)
    return out


@dataclass
class Prompt:
    """A prompt as token ids, with the span of each segment."""

    ids: list[int]
    prefix_len: int
    """``ids[:prefix_len]`` is the episode's shared prefix."""
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Data slot -> ``(start, end)`` of its ids within ``ids``."""

    def segment(self, name: str) -> list[int]:
        start, end = self.spans[name]
        return self.ids[start:end]


@dataclass(frozen=True)
class _CompiledCall:
    pieces: tuple[tuple[int, ...], ...]  # literal ids between slots: len(slots) + 1 entries
    slots: tuple[str, ...]


class PromptBuilder:
    """Builds token-id prompts of one :class:`PromptTemplate` for one tokenizer.

    Args:
        tokenizer: a transformers tokenizer.
        template: the prompt texts (default: MemAgent-style).
        use_chat_template: render through the tokenizer's chat template; ``None`` (default) uses
            it when the tokenizer has one. Without one, the user message is prefixed with the BOS
            token (when the tokenizer adds one) and followed by a newline.
    """

    def __init__(self, tokenizer: Any, template: PromptTemplate = MEMAGENT_TEMPLATE,
                 use_chat_template: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template
        has_chat = bool(getattr(tokenizer, "chat_template", None))
        if use_chat_template and not has_chat:
            raise ValueError("use_chat_template=True but the tokenizer has no chat_template")
        self.use_chat_template = has_chat if use_chat_template is None else use_chat_template
        self._prefix_pieces: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._calls = {kind: self._compile(kind) for kind in template.calls}
        sep = self._encode_literal(template.context_separator)
        self.separator_ids: list[int] = list(sep)

    # ------------------------------------------------------------------ rendering
    def render(self, kind: str, marked: bool = True) -> str:
        """The full prompt text of a call kind, chat template applied (with slot markers)."""
        content = self.template.user_message(kind, marked=marked)
        if self.use_chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
            if not isinstance(text, str):
                raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
            return text
        return self._bos_text() + content + "\n"

    def _bos_text(self) -> str:
        bos = getattr(self.tokenizer, "bos_token", None)
        if bos and self.tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [self.tokenizer.bos_token_id]:
            return bos
        return ""

    def _encode_literal(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else ()

    def _compile(self, kind: str) -> _CompiledCall:
        parts = _SPLIT.split(self.render(kind))
        literals, marks = parts[0::2], parts[1::2]
        names = [m[1:-1] for m in marks]
        if names[:2] != ["question", "/prefix"]:
            raise ValueError(f"template {self.template.name!r}, call {kind!r}: the chat template reordered "
                             f"the prompt (markers {names}); expected the question then the prefix end")
        prefix = (self._encode_literal(literals[0]), self._encode_literal(literals[1]))
        if self._prefix_pieces is None:
            self._prefix_pieces = prefix
        elif prefix != self._prefix_pieces:
            raise ValueError(f"template {self.template.name!r}: call {kind!r} renders a different shared "
                             "prefix than the other calls; the text before the prefix end must not depend "
                             "on the call kind")
        # literals[2] is the text between the prefix end and the first call slot, and so on.
        pieces = tuple(self._encode_literal(lit) for lit in literals[2:])
        return _CompiledCall(pieces=pieces, slots=tuple(names[2:]))

    # ------------------------------------------------------------------ building
    def encode_text(self, text: str) -> list[int]:
        """Token ids of data text (question, chunk): no special tokens added or parsed."""
        if not text:
            return []
        from memgym.chunking import backend_encode

        fast = backend_encode(self.tokenizer, text, split_special_tokens=True)  # the same ids, sooner
        if fast is not None:
            return list(fast.ids)
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def prefix(self, question: str | Sequence[int]) -> list[int]:
        """The shared prefix ids: literal instructions + the question (text or ids)."""
        q = self.encode_text(question) if isinstance(question, str) else list(question)
        head, tail = self._prefix_pieces  # type: ignore[misc]
        return list(head) + q + list(tail)

    def build(self, kind: str, prefix_ids: Sequence[int], **segments: Sequence[int]) -> Prompt:
        """A prompt of call ``kind``: the prefix ids, then the call's pieces and data segments."""
        if kind not in self._calls:
            raise KeyError(f"template {self.template.name!r} has no call {kind!r}; it has {sorted(self._calls)}")
        call = self._calls[kind]
        missing = set(call.slots) - segments.keys()
        extra = segments.keys() - set(call.slots)
        if missing or extra:
            raise ValueError(f"call {kind!r} takes segments {list(call.slots)}; missing {sorted(missing)}, "
                             f"unexpected {sorted(extra)}")
        ids = list(prefix_ids)
        spans: dict[str, tuple[int, int]] = {}
        for piece, slot in zip(call.pieces, call.slots):
            ids += piece
            start = len(ids)
            ids += list(segments[slot])
            spans[slot] = (start, len(ids))
        ids += call.pieces[-1]
        return Prompt(ids=ids, prefix_len=len(prefix_ids), spans=spans)

    def overhead(self, kind: str) -> int:
        """Tokens a call adds besides the prefix and its data segments."""
        return sum(len(p) for p in self._calls[kind].pieces)

    def join(self, chunks: Sequence[Sequence[int]]) -> list[int]:
        """Several chunks' ids joined by the template's context separator."""
        out: list[int] = []
        for i, chunk in enumerate(chunks):
            if i:
                out += self.separator_ids
            out += list(chunk)
        return out
