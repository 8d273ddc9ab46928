"""Batched generation with transformers models, recording exactly what was sampled.

A short sampling loop instead of ``model.generate``: it needs exact control of the position ids
(each row's positions are its recorded ones, whatever the padding) and of the log-probs (the
full-vocabulary distribution sampled from, before top-k / top-p truncation).

Batching: requests are sorted by prompt length and cut into micro-batches of at most
``max_batch_size`` rows; each micro-batch is prefilled (:mod:`agents.backends.hf_prefill`), then
decoded one token per step with a KV cache that grows in place (:mod:`agents.backends.hf_cache`)
until every row has stopped. Identical prompts (a question's G samples at their first call) are
prefilled once. Episode prefixes (``prompt_ids[:prefix_len]``: instructions + question, the start
of every call of an episode and of every sample of its question) are prefilled once per call, and
once per rollout within :meth:`HFBackend.prefix_scope`, which the rollout loop opens: their
keys/values are kept (an LRU within ``prefix_cache_mb``), with each episode's prompt up to its
newest data segment (MemAgent: up to the chunk, reused while the memory does not change), and
each row prefills only the rest of its prompt after them, in groups of similar length (less
padding). Models whose cache has sliding-window or recurrent layers prefill whole prompts.

Sampling is batch-invariant: every request draws its uniforms from its own CPU generator seeded
from (call seed, request index), so the same call gives the same samples whatever
``max_batch_size`` is (up to float differences of padded vs. unpadded forward passes).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from typing import Any, Iterator

import torch
from agents.backends.base import Backend, GenerationRequest, SamplingParams, default_stop_ids
from agents.backends.hf_cache import PrefixCache, plain_layers
from agents.backends.hf_prefill import Prefiller
from agents.records import Invocation

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, index) over 63 bits


def _row_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index * _SEED_MIX) % (2**63 - 1)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside top-k / the top-p nucleus to -inf (rows of ``[B, V]`` logits).

    Top-k first, then the nucleus of what is left (renormalised), as transformers and vLLM do.
    The nucleus is the smallest set of most likely tokens whose probability reaches ``top_p``;
    the most likely token is always kept.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class HFBackend(Backend):
    """A transformers causal LM as a :class:`~agents.backends.base.Backend`.

    Args:
        model: a ``PreTrainedModel`` for causal LM (moved to ``device`` / ``dtype``, put in eval
            mode). The backend holds a reference: updating the model's weights in place updates
            what it samples (bump ``policy_version``).
        tokenizer: the tokenizer the prompts were built with.
        device: where to run.
        dtype: cast the model to this dtype; ``None`` keeps it.
        max_batch_size: most rows per forward pass.
        seed: seeds the stream used by calls whose ``SamplingParams.seed`` is ``None``.
        name: a label for logs.
        prefix_cache_mb: most MiB of episode-prefix keys/values kept from call to call within
            :meth:`prefix_scope` (0: none).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        max_batch_size: int = 32,
        seed: int = 0,
        name: str | None = None,
        prefix_cache_mb: float = 256.0,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 (got {max_batch_size})")
        if prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0 (got {prefix_cache_mb})")
        emb_rows = model.get_input_embeddings().weight.shape[0]
        if emb_rows < len(tokenizer):
            raise ValueError(
                f"the model has {emb_rows} embedding rows but the tokenizer has {len(tokenizer)} tokens; "
                "use the tokenizer the model was trained with")
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=dtype) if dtype is not None else model.to(self.device)
        self.model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.policy_version = 0
        self.name = name or f"hf:{getattr(model.config, 'name_or_path', '') or model.config.model_type}"
        self.eos_ids = set(default_stop_ids(tokenizer))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.max_context = getattr(model.config, "max_position_embeddings", None)
        # transformers renamed `past_key_values` to `cache` (5.2x); accept either.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._stream = torch.Generator().manual_seed(seed)
        # sliding-window, recurrent or other special cache layers keep their own state: their
        # prefixes are prefilled with each prompt, and their caches grow the transformers way
        self.prefix_cache_mb = prefix_cache_mb
        self._prefix_ok = plain_layers(self.model.config)
        self._prefix_cache: PrefixCache | None = None  # only within a prefix_scope()
        self._prefill = Prefiller(self.model, self._cache_kw, self.pad_id, self.device, plain=self._prefix_ok)

    # ------------------------------------------------------------------ public
    def reseed(self, seed: int) -> None:
        """Restart the backend's seed stream (used by calls whose ``SamplingParams.seed`` is None),
        so that a trainer replays a step's sampling exactly after a resume."""
        self._stream.manual_seed(seed)

    @contextlib.contextmanager
    def prefix_scope(self) -> Iterator[None]:
        """Keep each episode prefix's keys/values from call to call until the scope ends (the
        rollout loop's: the weights are fixed meanwhile). Inside it the cache still empties itself
        when ``policy_version`` changes or a parameter is replaced or modified through autograd
        (a fused optimizer step is not seen: close the scope before updating)."""
        if self._prefix_cache is not None or not self._prefix_ok or self.prefix_cache_mb <= 0:  # nested, or none
            yield
            return
        self._prefix_cache = PrefixCache(int(self.prefix_cache_mb * 2**20))
        try:
            yield
        finally:
            self._prefix_cache = None

    @torch.no_grad()
    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[Invocation]:
        if not requests:
            return []
        for i, req in enumerate(requests):
            self._check_request(i, req)
        stop_ids = set(default_stop_ids(self.tokenizer) if sampling.stop_token_ids is None else sampling.stop_token_ids)
        call_seed = sampling.seed
        if call_seed is None:  # continue this backend's stream
            call_seed = int(torch.randint(0, 2**62, (1,), generator=self._stream))
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        out: list[Invocation | None] = [None] * len(requests)
        if self._prefix_cache is not None:
            self._prefix_cache.check(self.policy_version, self.model)
        was_training = self.model.training  # a trainer may share this model; sample without dropout
        self.model.eval()
        try:
            with self.prefix_scope():  # outside a rollout's scope, prefixes are shared within this call
                for start in range(0, len(order), self.max_batch_size):
                    idx = order[start:start + self.max_batch_size]
                    gens = [torch.Generator().manual_seed(_row_seed(call_seed, i)) for i in idx]
                    for i, inv in zip(idx, self._generate_batch([requests[i] for i in idx], gens, sampling,
                                                                stop_ids)):
                        out[i] = inv
        finally:
            self.model.train(was_training)
        return out  # type: ignore[return-value]

    # ---------------------------------------------------------------- internals
    def _check_request(self, i: int, req: GenerationRequest) -> None:
        vocab = self.model.get_input_embeddings().weight.shape[0]
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab:  # the common case checked at C speed
            bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
            raise ValueError(f"request {i}: prompt token ids {bad[:5]} are outside the model vocabulary (size {vocab})")
        end = req.position_offset + len(req.prompt_ids)
        if self.max_context is not None and end >= self.max_context:
            raise ValueError(
                f"request {i}: prompt positions end at {end - 1}, leaving no room to generate within the "
                f"model's {self.max_context} positions; shorten the prompt (chunk size / memory budget)")

    def _generate_batch(self, reqs: list[GenerationRequest], gens: list[torch.Generator],
                        sp: SamplingParams, stop_ids: set[int]) -> list[Invocation]:
        t0, wall0 = time.perf_counter(), time.time()
        B, dev = len(reqs), self.device
        lens = [len(r.prompt_ids) for r in reqs]

        # Room left before the model's position limit, per row.
        ends = [r.position_offset + n for r, n in zip(reqs, lens)]
        budget = [sp.max_new_tokens if self.max_context is None else min(sp.max_new_tokens, self.max_context - e)
                  for e in ends]

        # identical prompts (a question's G samples start with the same first call) are prefilled
        # once; their keys/values and first logits are then copied to every row that has them
        keys = [(tuple(r.prompt_ids), r.position_offset) for r in reqs]
        first = {k: i for i, k in reversed(list(enumerate(keys)))}
        uniq = sorted(set(first.values()))
        kv, mask, logits = self._prefill([reqs[i] for i in uniq], max(budget), self._prefix_cache,
                                          self.max_batch_size)
        cache = {self._cache_kw: kv}
        if len(uniq) < B:
            row_of = {i: n for n, i in enumerate(uniq)}  # request -> its row in the prefill
            expand = torch.tensor([row_of[first[k]] for k in keys], device=dev)
            kv.batch_select_indices(expand)
            logits, mask = logits[expand], mask[expand]
        next_pos = torch.tensor(ends, device=dev)  # each row's next position
        tokens: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        top_ids: list[list[list[int]]] = [[] for _ in range(B)]  # with record_topk: per token, the k likeliest
        top_lps: list[list[list[float]]] = [[] for _ in range(B)]
        reasons: list[str | None] = [None] * B
        alive = list(range(B))  # the rows still decoding, in the cache's row order
        while True:
            tok, lp = self._sample(logits.float(), [gens[b] for b in alive], sp)  # each row its own stream
            if self.record_topk:
                self._record_topk(logits.float(), sp, alive, top_ids, top_lps)
            for b, t, p in zip(alive, tok.tolist(), lp.tolist()):
                tokens[b].append(t)
                logps[b].append(p)
                if t in stop_ids:
                    reasons[b] = "eos" if t in self.eos_ids else "stop"
                elif len(tokens[b]) >= budget[b]:
                    reasons[b] = "length"
            keep = [j for j, b in enumerate(alive) if reasons[b] is None]
            if not keep:
                break
            if len(keep) < len(alive):  # finished rows leave the batch (and their keys/values the cache)
                sel = torch.tensor(keep, device=dev)
                kv.batch_select_indices(sel)
                mask, next_pos, tok = mask[sel], next_pos[sel], tok[sel]
                alive = [alive[j] for j in keep]
            mask = torch.cat([mask, torch.ones((len(alive), 1), dtype=mask.dtype, device=dev)], dim=1)
            out = self.model(input_ids=tok[:, None].to(dev), attention_mask=mask, position_ids=next_pos[:, None],
                             use_cache=True, **cache)
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1

        latency = time.perf_counter() - t0
        samp = sp.to_dict()
        invs = []
        for b, r in enumerate(reqs):
            n_r = len(tokens[b])
            invs.append(Invocation(
                prompt_ids=list(r.prompt_ids),
                response_ids=tokens[b],
                logprobs=logps[b],
                position_ids=list(range(r.position_offset, r.position_offset + lens[b] + n_r)),
                prefix_len=r.prefix_len,
                role=r.role,
                turn=r.turn,
                policy_version=self.policy_version,
                finish_reason=reasons[b] or "length",
                sampling=dict(samp),
                timing={"start": wall0, "latency_s": latency},
                response_text=self.tokenizer.decode(tokens[b], skip_special_tokens=True),
                spans=None if r.spans is None else {k: list(v) for k, v in r.spans.items()},
                meta=dict(r.meta),
                topk_ids=top_ids[b] if self.record_topk else None,
                topk_logprobs=top_lps[b] if self.record_topk else None,
            ))
        return invs

    def _record_topk(self, logits: torch.Tensor, sp: SamplingParams, rows: list[int],
                     top_ids: list[list[list[int]]], top_lps: list[list[list[float]]]) -> None:
        """The k likeliest tokens of each row's sampling distribution (softmax(logits / T);
        greedy: T = 1) and their log-probs, appended to the rows' records."""
        scaled = logits if sp.greedy else logits / sp.temperature
        vals, idx = torch.log_softmax(scaled, dim=-1).topk(min(self.record_topk, logits.shape[-1]), dim=-1)
        for b, i, v in zip(rows, idx.tolist(), vals.tolist()):
            top_ids[b].append(i)
            top_lps[b].append(v)

    def _sample(self, logits: torch.Tensor, gens: list[torch.Generator], sp: SamplingParams
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row and its log-prob under the full-vocabulary softmax(logits / T)."""
        if sp.greedy:
            logp = torch.log_softmax(logits, dim=-1)
            tok = torch.argmax(logits, dim=-1)
            return tok, logp.gather(-1, tok[:, None])[:, 0]
        scaled = logits / sp.temperature
        logp = torch.log_softmax(scaled, dim=-1)
        probs = torch.softmax(filter_logits(scaled, sp.top_k, sp.top_p), dim=-1).double()
        # Inverse-CDF sampling with one uniform per row from that row's own generator.
        u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in gens]).to(probs.device)
        cdf = torch.cumsum(probs, dim=-1)
        tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        tok = tok.clamp_(max=logits.shape[-1] - 1)
        return tok, logp.gather(-1, tok[:, None])[:, 0]
