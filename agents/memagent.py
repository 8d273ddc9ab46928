"""MemAgent: overwrite a bounded memory after every chunk, then answer from the memory alone.

In the spirit of MemAgent (Yu et al., 2025): each memory call sees the problem, the previous
memory and one section, and writes the updated memory; the final call sees the problem and the
memory and writes the answer. Prompts are token-exact (see :mod:`agents.prompts`): the memory in
call t+1 is exactly the ids sampled in call t.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from agents.policy import EpisodeState, MemoryPolicy, strip_stop
from agents.prompts import MEMAGENT_TEMPLATE, PromptBuilder, PromptTemplate, template as resolve_template


def default_sampling(max_new_tokens: int = 256) -> Any:
    from agents.backends.base import SamplingParams

    return SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)


class MemAgent(MemoryPolicy):
    """Memory-overwrite agent.

    Args:
        backend: the model backend (its tokenizer builds the prompts; make the env with
            ``tokenizer=backend.tokenizer`` so the memory budget is counted in the same tokens).
        sampling: sampling of memory calls (default: temperature 1, 256 new tokens). With a token
            budget, memory calls sample at most ``memory_budget`` tokens.
        answer_sampling: sampling of the answer call (default: ``sampling`` with
            ``answer_max_new_tokens``).
        answer_max_new_tokens: new-token limit of the answer call when ``answer_sampling`` is not given.
        template: prompt texts, or a built-in template's name (default: MemAgent-style;
            ``"memagent-chunk-first"`` puts the section before the memory, which lets packing
            store a turn's chunk once for a question's samples).
        tokenizer: override the backend's tokenizer (the oracle builds prompts without a backend).
        cap_memory_sampling: cap memory calls at the memory budget (token budgets). ``False``
            lets the model write past the budget and the env cut it.
    """

    name = "memagent"

    def __init__(self, backend: Any = None, sampling: Any = None, answer_sampling: Any = None,
                 answer_max_new_tokens: int = 32, template: PromptTemplate | str = MEMAGENT_TEMPLATE,
                 tokenizer: Any = None, cap_memory_sampling: bool = True) -> None:
        super().__init__(backend, tokenizer)
        self.cap_memory_sampling = cap_memory_sampling
        self.sampling = sampling if sampling is not None else default_sampling()
        self.answer_sampling = (answer_sampling if answer_sampling is not None
                                else replace(self.sampling, max_new_tokens=answer_max_new_tokens))
        self.prompts = PromptBuilder(self.tokenizer, resolve_template(template))

    def memory_sampling(self, info: dict[str, Any]) -> Any:
        """Memory calls never sample more tokens than the memory budget holds."""
        if self.cap_memory_sampling and info.get("budget_unit") == "tokens" \
                and info.get("memory_budget") is not None:
            budget = int(info["memory_budget"])
            if budget < self.sampling.max_new_tokens:
                return replace(self.sampling, max_new_tokens=max(1, budget))
        return self.sampling

    def step(self, state: EpisodeState, obs: str, info: dict[str, Any]):
        self.sync_memory(state, info)
        if state.prefix_ids is None:
            state.prefix_ids = self.prompts.prefix(info["question"])
        phase = info.get("phase")
        if phase == "memory":
            chunk = self.prompts.encode_text(info["chunk"])
            prompt = self.prompts.build("memory", state.prefix_ids, memory=state.memory_ids, chunk=chunk)
            inv = yield self.request(state, prompt, "memory", chunk_index=int(info["chunk_index"])), \
                self.memory_sampling(info)
            state.pending_memory = strip_stop(inv)
            return self.decode(state.pending_memory)
        if phase == "answer":
            prompt = self.prompts.build("answer", state.prefix_ids, memory=state.memory_ids)
            inv = yield self.request(state, prompt, "answer"), self.answer_sampling
            return self.decode(strip_stop(inv)).strip()
        raise ValueError(f"MemAgent got an observation in phase {phase!r}; expected 'memory' or 'answer' "
                         "(reset the env after an episode ends)")


class TranscriptMemAgent(MemAgent):
    """MemAgent acting in the persistent-history context, for evaluating a model there.

    Each call sees the flattened transcript ``q, o_1, a_1, ..., o_t`` (the context that
    ``memopd.contexts``' persistent mode scores an action in): the shared prefix, then every
    earlier call's private prompt without the memory it received, followed by that call's sampled
    response (stop token included), then this call's private prompt without its memory. It writes
    the same memories and answer as MemAgent, so the env and the scorer are unchanged; only what
    the model conditions on differs. Use it as ``--agent agents.memagent:TranscriptMemAgent``.
    Its records hold the whole transcript as the prompt: score them in aligned mode, which restores
    exactly what was sampled.
    """

    name = "memagent-transcript"

    def step(self, state: EpisodeState, obs: str, info: dict[str, Any]):
        inner = MemAgent.step(self, state, obs, info)
        sent = None
        while True:  # MemAgent's calls, with each sampled response appended to the transcript
            try:
                request = inner.send(sent)
            except StopIteration as stop:
                return stop.value
            sent = yield request
            state.extra["transcript"] = state.extra.get("transcript", []) + list(sent.response_ids)

    def request(self, state: EpisodeState, prompt: Any, role: str, **meta: Any) -> Any:
        from agents.backends.base import GenerationRequest

        p = prompt.prefix_len
        s, t = prompt.spans.get("memory", (0, 0))
        observation = [tok for i, tok in enumerate(prompt.ids) if i >= p and not s <= i < t]
        history = state.extra.get("transcript", []) + observation
        state.extra["transcript"] = history
        return GenerationRequest(prompt_ids=list(prompt.ids[:p]) + history, prefix_len=p, role=role,
                                 turn=len(state.invocations), spans={},
                                 meta={"episode_id": state.episode_id, "context": "transcript", **meta})
