"""The model-backend interface every agent talks to.

A backend turns a batch of token-id prompts into fully filled :class:`agents.records.Invocation`
records: prompt ids, the position ids used at sampling time, the sampled ids and the log-probs of
the distribution actually sampled from. Agents never tokenise model output back into input;
they reuse ``response_ids`` directly (token in, token out). Any engine (transformers, vLLM, ...)
that implements :meth:`Backend.generate` with these semantics drops in unchanged.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, ContextManager

from agents.records import ROLES, Invocation

FINISH_REASONS = ("eos", "length", "stop")


@dataclass
class SamplingParams:
    """How to sample one response per request."""

    temperature: float = 1.0
    """Softmax temperature. Log-probs are recorded under ``softmax(logits / temperature)``.
    Must be > 0 unless ``greedy`` (greedy ignores it and records log-probs at temperature 1)."""
    top_p: float = 1.0
    """Nucleus sampling: sample only from the smallest set of tokens whose probability mass
    reaches ``top_p``. 1.0 disables it. Recorded log-probs stay full-vocabulary (untruncated)."""
    top_k: int = 0
    """Sample only from the ``top_k`` most likely tokens; 0 disables it. Recorded log-probs stay
    full-vocabulary (untruncated)."""
    max_new_tokens: int = 64
    """Most tokens sampled per request (the stop token counts). Hitting it ends the response
    with ``finish_reason="length"``."""
    greedy: bool = False
    """Take the arg-max token at every step (deterministic); temperature/top-p/top-k unused."""
    stop_token_ids: list[int] | None = None
    """Token ids that end a response (they are kept in ``response_ids``: they were sampled and
    have a log-prob). ``None``: the tokenizer's EOS and chat end tokens (see
    :func:`default_stop_ids`). An empty list: never stop early."""
    seed: int | None = None
    """Seed of the sampling generator for this call; same seed + same inputs -> same samples.
    ``None``: continue the backend's own generator stream."""

    def __post_init__(self) -> None:
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (got {self.temperature}); use greedy=True for arg-max")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (got {self.top_k}); 0 disables it")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")

    def to_dict(self) -> dict[str, Any]:
        """What goes into ``Invocation.sampling`` (JSON-safe)."""
        return asdict(self)


@dataclass
class GenerationRequest:
    """One prompt to complete, with what the record needs to know about it."""

    prompt_ids: list[int]
    """The prompt as token ids (assembled by the agent from token-id segments)."""
    prefix_len: int
    """``prompt_ids[:prefix_len]`` is the episode's shared prefix (instructions + question)."""
    role: str = "memory"
    """``"memory"`` (a memory write) or ``"answer"`` (the final answer)."""
    turn: int = 0
    """Index of this call within its episode."""
    position_offset: int = 0
    """Positions of the prompt are ``position_offset .. position_offset + len(prompt_ids) - 1``
    and the response continues from there. Normally 0."""
    spans: dict[str, list[int]] | None = None
    """Prompt segments, slot -> ``[start, end)`` (``"memory"``: the memory this call received);
    copied into ``Invocation.spans`` (see there)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form data copied into ``Invocation.meta`` (e.g. episode id, env index)."""

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ValueError("GenerationRequest.prompt_ids is empty; a prompt needs at least one token")
        if not 0 <= self.prefix_len <= len(self.prompt_ids):
            raise ValueError(f"prefix_len={self.prefix_len} outside the prompt (length {len(self.prompt_ids)})")
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is not one of {ROLES}")
        if self.position_offset < 0:
            raise ValueError(f"position_offset must be >= 0 (got {self.position_offset})")

    def prompt_positions(self) -> list[int]:
        return list(range(self.position_offset, self.position_offset + len(self.prompt_ids)))


def default_stop_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's EOS id plus chat end tokens (``<|im_end|>``, ``<|endoftext|>``,
    ``<|eot_id|>``, ``<end_of_turn>``) that exist in its vocabulary, deduplicated and sorted."""
    ids: set[int] = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(i) for i in eos)
    vocab = tokenizer.get_vocab()
    for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"):
        if tok in vocab:
            ids.add(vocab[tok])
    return sorted(ids)


class Backend(ABC):
    """A model that samples responses for batches of token-id prompts and records them exactly.

    Attributes:
        tokenizer: a transformers tokenizer (the one the prompts were built with).
        policy_version: written into every record; bump it after a weight update.
        name: a short label for logs, e.g. ``"hf:tiny"``.
        max_context: the most positions the model supports (prompt + response), ``None`` if
            unknown; agents that grow a transcript truncate to fit it.

    A vLLM backend records the log-prob of each sampled token under the temperature-scaled,
    untruncated distribution (vLLM's processed, not raw, log-probs; or a re-scoring pass).
    """

    tokenizer: Any
    policy_version: int = 0
    name: str = "backend"
    max_context: int | None = None
    record_topk: int = 0
    """Also record, at every sampled position, the ids and log-probs of the k most likely tokens
    of the distribution sampled from (``Invocation.topk_ids`` / ``topk_logprobs``): what a
    learner compares with a teacher's top-k without a forward of its own. 0: none. A backend
    that cannot leaves them None (the learner then runs the forward)."""

    def prefix_scope(self) -> ContextManager[None]:
        """A span of calls by fixed weights (one rollout), within which the backend may keep the
        keys/values of episode prefixes (``prompt_ids[:prefix_len]``) from call to call. The
        rollout loop opens one; nothing is kept by default."""
        return contextlib.nullcontext()

    @abstractmethod
    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[Invocation]:
        """Sample one response per request, batched; returns one record per request, in order.

        Each record has the request's prompt ids, prefix_len, role, turn and meta;
        ``response_ids`` without padding, ending with the stop token if one was sampled
        (``finish_reason="eos"`` for the tokenizer's EOS / chat end, ``"stop"`` for another
        stop id, ``"length"`` at ``max_new_tokens``); ``logprobs[k] = log_softmax(logits / T)
        [response_ids[k]]`` over the full vocabulary (greedy: T = 1); ``position_ids`` of prompt
        then response as used; ``policy_version``; ``sampling`` (``SamplingParams.to_dict()``);
        ``timing`` ``{"start": unix time, "latency_s": batch wall time}``; ``response_text``
        decoded with ``skip_special_tokens=True``.
        """

    def __call__(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[Invocation]:
        return self.generate(requests, sampling)

    # What a trainer asks of the backend it rolls out with (memopd.learn.actor). The defaults fit a
    # backend that samples the trainer's own module in this process (hf); an engine overrides them.
    def reseed(self, seed: int) -> None:
        """Restart the seed stream of calls whose ``SamplingParams.seed`` is None, so that a trainer
        replays a step's sampling exactly after a resume. Default: nothing to restart."""

    def load_weights(self, model: Any) -> None:
        """Sample ``model``'s current weights from now on (an engine copies them in). Default:
        nothing, for a backend that samples the trainer's module itself. The caller bumps
        ``policy_version``."""

    def sleep(self) -> None:
        """Free accelerator memory while a colocated trainer updates. Default: nothing to free."""

    def wake_up(self) -> None:
        """Undo :meth:`sleep` before the next generation. Default: nothing."""
