"""BM25 retrieval in front of MemAgent: the same model, prompts and memory budget, only fewer chunks.

:class:`RAGAgent` (registered as ``rag-bm25``) ranks the episode's chunks against the question with
Okapi BM25 (:func:`bm25_scores`, written out here: ``k1 = 1.5``, ``b = 0.75``), keeps the top
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
``retrieved`` (the chunk indices, in document order) and ``bm25`` (their scores).

With ``python -m memopd.eval``, ``--top-k`` (default 3 there, for the ``rag`` reader baseline)
reaches this agent too: pass ``--top-k 1`` for the default top-1 retrieval.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any, Sequence

from agents.memagent import MemAgent
from agents.policy import EpisodeState, strip_stop

K1 = 1.5
B = 0.75

_TERM = re.compile(r"[^\W_]+")


def bm25_tokens(text: str) -> list[str]:
    """Lowercased terms: ``text`` split at whitespace and punctuation (underscores included)."""
    return _TERM.findall(text.lower())


def bm25_idf(n_docs: int, doc_freq: int) -> float:
    """Okapi BM25's inverse document frequency in its non-negative form,
    ``ln(1 + (N - n + 0.5) / (n + 0.5))`` (the classic ``ln((N - n + 0.5) / (n + 0.5))`` turns
    negative for a term in more than half the documents, which would make matching it count
    against a document)."""
    return math.log(1.0 + (n_docs - doc_freq + 0.5) / (doc_freq + 0.5))


def bm25_scores(query: str, documents: Sequence[str], k1: float = K1, b: float = B) -> list[float]:
    """Okapi BM25 score of every document against ``query``:

        score(D) = sum over query terms q of  idf(q) * f(q, D) * (k1 + 1) / (f(q, D) + k1 * (1 - b + b * |D| / avgdl))

    with ``f(q, D)`` the count of ``q`` in ``D``, ``|D|`` its length in terms, ``avgdl`` the mean
    length over ``documents`` and ``idf`` :func:`bm25_idf` over ``documents``. A query term that
    occurs twice counts twice. Terms come from :func:`bm25_tokens`."""
    docs = [bm25_tokens(d) for d in documents]
    if not docs:
        return []
    avgdl = sum(len(d) for d in docs) / len(docs)
    if avgdl == 0:
        return [0.0] * len(docs)
    df: Counter[str] = Counter()
    for d in docs:
        df.update(set(d))
    terms = bm25_tokens(query)
    idf = {q: bm25_idf(len(docs), df[q]) for q in set(terms)}
    scores = []
    for d in docs:
        tf = Counter(d)
        norm = k1 * (1.0 - b + b * len(d) / avgdl)
        scores.append(sum(idf[q] * tf[q] * (k1 + 1.0) / (tf[q] + norm) for q in terms if tf[q]))
    return scores


def bm25_top_k(query: str, documents: Sequence[str], k: int, k1: float = K1, b: float = B) -> list[int]:
    """Indices of the ``k`` best documents by :func:`bm25_scores` (ties: the earlier document), in
    document order."""
    scores = bm25_scores(query, documents, k1, b)
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return sorted(ranked[:k])


class RAGAgent(MemAgent):
    """MemAgent over the ``top_k`` chunks BM25 ranks best for the question (see the module doc).

    Args:
        backend, sampling, answer_sampling, answer_max_new_tokens, template, tokenizer,
        cap_memory_sampling: as :class:`agents.memagent.MemAgent`.
        top_k: chunks retrieved (default 1); an episode makes ``min(top_k, num_chunks)`` memory
            calls and one answer call.
        k1, b: BM25's term-frequency saturation and length normalisation.
    """

    name = "rag-bm25"

    def __init__(self, backend: Any = None, sampling: Any = None, top_k: int = 1, k1: float = K1, b: float = B,
                 **kwargs: Any) -> None:
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"top_k must be an int >= 1 (got {top_k!r})")
        super().__init__(backend, sampling, **kwargs)
        self.top_k = top_k
        self.k1, self.b = float(k1), float(b)
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
            raise ValueError(f"RAGAgent got an observation in phase {phase!r}; expected 'memory' or 'answer' "
                             "(reset the env after an episode ends)")
        chunks = state.extra["chunks"]
        question = str(info.get("question", state.question))
        scores = bm25_scores(question, chunks, self.k1, self.b)
        chosen = sorted(sorted(range(len(chunks)), key=lambda i: (-scores[i], i))[: self.top_k])
        state.extra["retrieved"] = chosen
        found = {"retrieved": chosen, "bm25": [scores[i] for i in chosen]}
        for k in chosen:
            chunk = self.prompts.encode_text(chunks[k])
            prompt = self.prompts.build("memory", state.prefix_ids, memory=state.memory_ids, chunk=chunk)
            inv = yield self.request(state, prompt, "memory", chunk_index=k, **found), self.memory_sampling(info)
            state.pending_memory = strip_stop(inv)
            self.cut_memory(state, info)
        prompt = self.prompts.build("answer", state.prefix_ids, memory=state.memory_ids)
        inv = yield self.request(state, prompt, "answer", **found), self.answer_sampling
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


__all__ = ["B", "K1", "RAGAgent", "bm25_idf", "bm25_scores", "bm25_tokens", "bm25_top_k"]
