"""BM25 retrieval in front of MemAgent: the same model, prompts and memory budget, only fewer chunks.

:class:`RAGMemAgent` (registered as ``rag-memagent``) ranks the episode's chunks against the question
with Okapi BM25 (:func:`agents.baselines.bm25_rank`, as the ``rag`` reader baseline), keeps the top
``top_k`` (default 1) and runs the ordinary MemAgent calls over only those chunks, in document
order: one memory call per retrieved chunk (the first from the empty memory, each later one from
the memory the previous one wrote), then the answer call from the memory alone. Prompts, sampling
(memory calls capped at the memory budget) and records are MemAgent's; it just skips the chunks
retrieval ranks low.

Design: retrieval at the end, over every chunk. The env streams the input, one chunk per step,
and the agent must step it through every chunk. It does so without a model call: it keeps each
chunk's text (the retrieval index, outside the model's memory, as any RAG system keeps its corpus)
and returns the empty memory, so the env's memory stays empty. At the answer step it has the whole
corpus, so BM25 is exact: the document frequencies and average length are those of all the
episode's chunks, as in a two-pass retriever, with no approximation from a partly read stream.
It then makes its ``min(top_k, num_chunks)`` memory calls and the answer call in that one step
(a generator step can yield several calls in sequence; they are batched across environments like
every call). An episode therefore makes exactly ``min(top_k, num_chunks) + 1`` model calls,
whatever the context length.

A streaming alternative (score each chunk as it arrives, call the model whenever a chunk beats
every earlier one, from the empty memory) needs no stored text but ranks with the statistics of
the chunks read so far, so its final choice can differ from BM25 over the whole input, and it
makes a random number of calls (one per new running maximum); it handles only ``top_k = 1``.

The memory budget: the memory calls happen after the env's memory phase, so the env cannot cut
them. The agent applies the env's own rule instead: it cuts each memory the way the env would cut
that action (:mod:`memgym.chunking`'s counter for the env's ``budget_unit`` and
``memory_budget``, read from ``info``) and keeps the sampled ids the env would have kept
(:meth:`MemoryPolicy.sync_memory`). With a token budget and capped sampling (the default) nothing
is ever cut. The next call's memory is exactly those ids, so records are token-exact as MemAgent's:
every call's prompt ids, position ids, sampled ids and log-probs are recorded by the backend, the
memory span is in ``Invocation.spans``, and ``Invocation.meta`` adds ``chunk_index`` (memory calls),
``retrieved`` (the chunk indices, in document order).

It differs from the ``rag`` baseline (:class:`agents.baselines.RAGAgent`) only in how the retrieved
text reaches the model: ``rag`` puts the chunks straight into one answer prompt, a prompt a model
trained as a memory agent has never seen; this agent feeds them through the memory calls it was
trained on.

With ``python -m memopd.eval``, ``--top-k`` (default 3 there, for the ``rag`` reader baseline)
reaches this agent too: pass ``--top-k 1`` for top-1 retrieval.
"""

from __future__ import annotations

from typing import Any

from agents.baselines import bm25_rank
from agents.memagent import MemAgent
from agents.policy import EpisodeState, strip_stop


class RAGMemAgent(MemAgent):
    """MemAgent over the ``top_k`` chunks BM25 ranks best for the question (see the module doc).

    ``backend``, ``sampling``, ``answer_sampling``, ``answer_max_new_tokens``, ``template``,
    ``tokenizer`` and ``cap_memory_sampling`` are as :class:`agents.memagent.MemAgent`'s.

    Args:
        top_k: chunks retrieved (default 1); an episode makes ``min(top_k, num_chunks)`` memory
            calls and one answer call.
    """

    name = "rag-memagent"

    def __init__(self, backend: Any = None, sampling: Any = None, top_k: int = 1, **kwargs: Any) -> None:
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"top_k must be an int >= 1 (got {top_k!r})")
        super().__init__(backend, sampling, **kwargs)
        self.top_k = top_k
        self._counters: dict[str, Any] = {}

    def step(self, state: EpisodeState, obs: str, info: dict[str, Any]):
        if state.prefix_ids is None:
            state.prefix_ids = self.prompts.prefix(info["question"])
            state.extra["chunks"] = []
        phase = info.get("phase")
        if phase == "memory":  # index the chunk; the env's memory stays empty, no model call
            state.extra["chunks"].append(str(info["chunk"]))
            return ""
        if phase != "answer":
            raise ValueError(f"RAGMemAgent got an observation in phase {phase!r}; expected 'memory' or 'answer' "
                             "(reset the env after an episode ends)")
        chunks = state.extra["chunks"]
        question = str(info.get("question", state.question))
        chosen = sorted(bm25_rank(question, chunks)[: self.top_k])
        state.extra["retrieved"] = chosen
        for k in chosen:
            chunk = self.prompts.encode_text(chunks[k])
            prompt = self.prompts.build("memory", state.prefix_ids, memory=state.memory_ids, chunk=chunk)
            inv = yield self.request(state, prompt, "memory", chunk_index=k, retrieved=chosen), \
                self.memory_sampling(info)
            state.pending_memory = strip_stop(inv)
            self.cut_memory(state, info)
        prompt = self.prompts.build("answer", state.prefix_ids, memory=state.memory_ids)
        inv = yield self.request(state, prompt, "answer", retrieved=chosen), self.answer_sampling
        return self.decode(strip_stop(inv)).strip()

    def cut_memory(self, state: EpisodeState, info: dict[str, Any]) -> None:
        """Adopt the pending memory write as the env would have cut it (its counter, its budget)."""
        budget = info.get("memory_budget")
        if budget is None:
            state.memory_ids, state.pending_memory = list(state.pending_memory or []), None
            return
        unit = str(info.get("budget_unit", "words"))
        text = self.decode(state.pending_memory or [])
        kept, size, cut = self._counter(unit).cut(text, int(budget))
        self.sync_memory(state, {"memory_truncated": cut > 0, "budget_unit": unit, "memory_size": size,
                                 "memory": kept})

    def _counter(self, unit: str) -> Any:
        if unit not in self._counters:
            from memgym.chunking import TokenCounter, WordCounter

            self._counters[unit] = TokenCounter(self.tokenizer) if unit == "tokens" else WordCounter()
        return self._counters[unit]


__all__ = ["RAGMemAgent"]
