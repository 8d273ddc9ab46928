"""Baselines that keep the input outside the env's memory and answer once at the end.

- :class:`FullContextAgent`: the persistent-history baseline. It keeps one growing transcript of
  every chunk read and answers once from it, truncated to the model's context limit (the most
  recent text is kept).
- :class:`FullContextOracle`: the full-context agent's records with the gold answer, no model (SFT
  data for a full-context reader).
- :class:`RAGAgent`: retrieval. It keeps the chunks, ranks them with BM25 against the question and
  answers once from the top-k chunks (in reading order).

Both write an empty memory at every chunk (the env's memory is unused) and record their single
answer call as an :class:`agents.records.Invocation`, like every agent.
"""

from __future__ import annotations

import re
import time
from dataclasses import replace
from typing import Any, Sequence

from agents.memagent import default_sampling
from agents.policy import AgentError, EpisodeState, MemoryPolicy, strip_stop
from agents.records import Invocation
from agents.prompts import READER_TEMPLATE, PromptBuilder, PromptTemplate


class _ReaderAgent(MemoryPolicy):
    """Shared part: collect chunk ids during the memory phase, one answer call at the end."""

    def __init__(self, backend: Any = None, sampling: Any = None, answer_max_new_tokens: int = 32,
                 context_length: int | None = None, template: PromptTemplate = READER_TEMPLATE,
                 tokenizer: Any = None) -> None:
        super().__init__(backend, tokenizer)
        base = sampling if sampling is not None else default_sampling()
        self.answer_sampling = replace(base, max_new_tokens=answer_max_new_tokens)
        self.prompts = PromptBuilder(self.tokenizer, template)
        self.context_length = context_length if context_length is not None else _model_context(backend, self.tokenizer)

    def step(self, state: EpisodeState, obs: str, info: dict[str, Any]):
        if state.prefix_ids is None:
            state.prefix_ids = self.prompts.prefix(info["question"])
            state.extra["chunks"], state.extra["chunk_ids"] = [], []
        phase = info.get("phase")
        if phase == "memory":
            state.extra["chunks"].append(info["chunk"])
            state.extra["chunk_ids"].append(self.prompts.encode_text(info["chunk"]))
            return ""
        if phase != "answer":
            raise ValueError(f"{type(self).__name__} got phase {phase!r}; expected 'memory' or 'answer'")
        context, meta = self.context(state)
        prompt = self.prompts.build("answer", state.prefix_ids, context=context)
        inv = yield self.request(state, prompt, "answer", **meta), self.answer_sampling
        return self.decode(strip_stop(inv)).strip()

    def context(self, state: EpisodeState) -> tuple[list[int], dict[str, Any]]:
        raise NotImplementedError

    def context_room(self, state: EpisodeState) -> int | None:
        """Context tokens that fit: the limit minus prefix, template and the answer's new tokens."""
        if self.context_length is None:
            return None
        room = (self.context_length - len(state.prefix_ids or []) - self.prompts.overhead("answer")
                - self.answer_sampling.max_new_tokens)
        if room <= 0:
            raise ValueError(f"{type(self).__name__}: the prompt without any context already fills the "
                             f"context length {self.context_length}; use a model with a longer context")
        return room


class FullContextAgent(_ReaderAgent):
    """Persistent history: every chunk in one transcript, one answer call at the end.

    Args:
        backend: the model backend.
        sampling: base sampling params (the answer call uses them with ``answer_max_new_tokens``).
        answer_max_new_tokens: new-token limit of the answer call.
        context_length: the model's context limit in tokens (default: the backend's
            ``max_context``, else the tokenizer's ``model_max_length``); the transcript is cut
            from the front to fit, keeping the most recent text.
    """

    name = "fullcontext"

    def context(self, state: EpisodeState) -> tuple[list[int], dict[str, Any]]:
        ids = self.prompts.join(state.extra["chunk_ids"])
        room = self.context_room(state)
        cut = max(0, len(ids) - room) if room is not None else 0
        return ids[cut:], {"context_tokens": len(ids), "context_cut": cut}


class FullContextOracle(FullContextAgent):
    """:class:`FullContextAgent`'s records with the gold answer as the response, and no model:
    the data that fine-tunes a model into a full-context reader (``memopd.sft --episodes``), the
    baseline of the length axis (docs/agents.md). Like :class:`agents.oracle.OracleAgent`, the
    response is the answer's ids and EOS with log-probs 0.0 and ``meta["oracle"] = True``.

    Args:
        samples: the env's sample source (``index_of`` + ``__getitem__``) or a function
            ``(task_id, sample_id) -> Sample`` (``memopd.eval`` passes the env's).
        tokenizer: the tokenizer of the records (default: the ``tiny`` preset's).
        context_length: as :class:`FullContextAgent` (default: the tokenizer's
            ``model_max_length``).
    """

    name = "fullcontext-oracle"
    calls_model = False

    def __init__(self, samples: Any, tokenizer: Any = None, context_length: int | None = None,
                 answer_max_new_tokens: int = 32) -> None:
        from agents.oracle import _as_lookup, default_tokenizer

        tokenizer = tokenizer if tokenizer is not None else default_tokenizer()
        if tokenizer.eos_token_id is None:
            raise ValueError("FullContextOracle needs a tokenizer with an EOS token (responses end with it)")
        super().__init__(backend=None, tokenizer=tokenizer, answer_max_new_tokens=answer_max_new_tokens,
                         context_length=context_length)
        self.lookup = _as_lookup(samples)

    def step(self, state: EpisodeState, obs: str, info: dict[str, Any]) -> str:
        calls = super().step(state, obs, info)  # FullContextAgent's: a chunk kept, or the answer call
        try:
            request, _ = next(calls)
        except StopIteration as done:
            return done.value
        sample = self.lookup(str(info.get("task_id", "")), str(info["sample_id"]))
        text = str(sample.answers[0])
        response = self.prompts.encode_text(text) + [int(self.tokenizer.eos_token_id)]
        inv = Invocation(prompt_ids=request.prompt_ids, response_ids=response, logprobs=[0.0] * len(response),
                         position_ids=list(range(len(request.prompt_ids) + len(response))),
                         prefix_len=request.prefix_len, role="answer", turn=request.turn, finish_reason="eos",
                         sampling={}, timing={"start": time.time(), "latency_s": 0.0}, response_text=text,
                         spans=request.spans, meta={"oracle": True, **request.meta})
        state.invocations.append(inv)
        try:
            calls.send(inv)
        except StopIteration as done:
            return done.value
        raise AgentError("FullContextAgent made a second call")  # pragma: no cover - it makes one


class RAGAgent(_ReaderAgent):
    """BM25 retrieval over the chunks read, the top-k chunks (in reading order) into one answer call.

    The other arguments are as :class:`FullContextAgent`'s; retrieved chunks that do not fit the
    context length are dropped, lowest score first.

    Args:
        top_k: chunks retrieved.
    """

    name = "rag"

    def __init__(self, backend: Any = None, top_k: int = 3, **kwargs: Any) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1 (got {top_k})")
        super().__init__(backend, **kwargs)
        self.top_k = top_k

    def context(self, state: EpisodeState) -> tuple[list[int], dict[str, Any]]:
        chunks, chunk_ids = state.extra["chunks"], state.extra["chunk_ids"]
        ranked = bm25_rank(state.question, chunks)[: self.top_k]
        room = self.context_room(state)
        while room is not None and len(ranked) > 1 and len(self.prompts.join([chunk_ids[i] for i in ranked])) > room:
            ranked = ranked[:-1]
        chosen = sorted(ranked)
        ids = self.prompts.join([chunk_ids[i] for i in chosen])
        if room is not None and len(ids) > room:
            ids = ids[:room]  # a single chunk longer than the context: keep its start
        return ids, {"retrieved": chosen}


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def bm25_rank(query: str, documents: Sequence[str]) -> list[int]:
    """Indices of ``documents`` by BM25 (Okapi) score against ``query``, best first; ties keep
    reading order."""
    if not documents:
        return []
    from rank_bm25 import BM25Okapi

    bm25 = BM25Okapi([_words(d) or [""] for d in documents])
    scores = bm25.get_scores(_words(query))
    return sorted(range(len(documents)), key=lambda i: (-float(scores[i]), i))


def _model_context(backend: Any, tokenizer: Any) -> int | None:
    """The backend's position limit (``Backend.max_context``), else the tokenizer's
    ``model_max_length`` (a tokenizer shared by models of other lengths can say less than the model)."""
    limit = getattr(backend, "max_context", None)
    if isinstance(limit, int) and limit > 0:
        return limit
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**8 else None
