"""The hf backend's prefill: a batch of prompts into one KV cache, reusing the keys/values of
prompt heads computed by earlier calls.

A prompt's *head* is a prefix of its tokens whose keys/values are kept in the backend's
:class:`~agents.backends.hf_cache.PrefixCache` (keyed by the head's token ids and position
offset: the same tokens at the same positions give the same keys/values, whatever follows). Two
heads are kept:

- the episode prefix (``prompt_ids[:prefix_len]``: instructions + question), the start of every
  call of an episode;
- everything before the call's newest data segment (the prompt up to the start of its last
  ``spans`` entry, when a segment precedes it): for MemAgent, the prefix, the memory and the
  template text up to the chunk. The next call of the episode begins with the same tokens
  whenever the memory did not change, which is most calls of a trained agent on a long input.
  One such head is kept per episode (``meta["episode_id"]``, else per episode prefix; a newer
  one replaces it), and only where it fits in the cache without evicting anything.

Each row prefills only the rest of its prompt after its longest cached head. Rows are grouped by
that length (:func:`length_groups`): a group is one left-padded forward, and the groups' caches
are then laid side by side (left-padded to the widest) in one cache that the decode loop grows in
place (:class:`~agents.backends.hf_cache.GrowingLayer`). Models whose cache has sliding-window or
recurrent layers prefill whole prompts in one forward, as transformers does.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from transformers import DynamicCache

from agents.backends.base import GenerationRequest
from agents.backends.hf_cache import PrefixCache, growing_cache

GROUP_COST_TOKENS = 96
"""What one more prefill forward costs, in padded prompt tokens (a forward's fixed cost over the
cost of a token; tiny preset, one CPU thread: about 3 ms against 32 µs). Rows are split into
groups only where the padding saved is worth more."""

MAX_PREFILL_TOKENS = 16_384
"""Most padded prompt tokens in one prefill forward (of more than one row): bounds the forward's
activations when long prompts meet a large batch (64 full-context prompts of 9,000 tokens would
otherwise hold several GiB of MLP activations at once in the tiny preset)."""

Layers = list[tuple[torch.Tensor, torch.Tensor]]
"""Per model layer, keys and values ``[kv_heads, positions, head_dim]`` (one row) or with a
leading batch dimension."""


class Head(NamedTuple):
    """The cached start of one prompt: its length and keys/values (None: nothing cached)."""

    length: int
    layers: Layers | None


class Prefilled(NamedTuple):
    """A prefilled batch: the cache (one row per request), the ``[B, W]`` attention mask of its
    columns and the ``[B, vocab]`` logits after each prompt's last token."""

    cache: Any
    mask: torch.Tensor
    logits: torch.Tensor


def length_groups(lengths: list[int], cost: int = GROUP_COST_TOKENS, max_tokens: int = MAX_PREFILL_TOKENS
                  ) -> list[list[int]]:
    """Indices of ``lengths`` in runs of similar length, at least cost: the indices sorted by
    length, cut where ``sum(len(run) * max(run)) + cost * len(runs)`` is least (an exact dynamic
    programme over the cut points), with at most ``max_tokens`` padded tokens in a run of more
    than one row."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: least cost of the first j sorted rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        width = lengths[order[j - 1]]  # the longest of rows i..j-1 (sorted)
        for i in range(j):
            if j - i > 1 and (j - i) * width > max_tokens:
                continue
            c = best[i] + (j - i) * width + cost
            if c < best[j]:
                best[j], cut[j] = c, i
    runs, j = [], n
    while j > 0:
        runs.append(order[cut[j]:j])
        j = cut[j]
    return runs[::-1]


def head_cut(req: GenerationRequest) -> int | None:
    """Where the prompt's newest data segment starts, when another segment precedes it after the
    prefix (the memory before the chunk): the prompt before it may recur in the episode's next
    call. None otherwise."""
    starts = sorted(s for s, _ in (req.spans or {}).values())
    if len(starts) < 2:
        return None
    return starts[-1] if req.prefix_len < starts[-1] < len(req.prompt_ids) else None


def head_key(req: GenerationRequest, length: int) -> tuple[tuple[int, ...], int]:
    return tuple(req.prompt_ids[:length]), req.position_offset


def left_pad(rows: list[list[int]], positions: list[list[int]], pad_id: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, W]`` ids, attention mask and position ids of token rows, left-padded to the longest;
    each row keeps its own positions."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    for b, (row, p) in enumerate(zip(rows, positions)):
        n = len(row)
        if n:
            ids[b, width - n:] = torch.tensor(row)
            mask[b, width - n:] = 1
            pos[b, width - n:] = torch.tensor(p)
    return ids.to(device), mask.to(device), pos.to(device)


class Prefiller:
    """Prefills batches of prompts for :class:`agents.backends.hf.HFBackend` (see the module doc).

    Args:
        model: the causal LM.
        cache_kw: the name of the forward's cache argument (``cache`` or ``past_key_values``).
        pad_id: the token id of padding.
        device: where the model runs.
        plain: whether every cache layer is a plain ``DynamicLayer`` (heads, groups and caches
            grown in place need it).
    """

    def __init__(self, model: Any, cache_kw: str, pad_id: int, device: torch.device, plain: bool) -> None:
        self.model, self.cache_kw, self.pad_id, self.device, self.plain = model, cache_kw, pad_id, device, plain

    def __call__(self, reqs: list[GenerationRequest], room: int, heads_cache: PrefixCache | None,
                 max_batch_size: int) -> Prefilled:
        """Prefill ``reqs``; the cache has ``room`` free positions per row for decoding; missing
        episode prefixes are prefilled ``max_batch_size`` at a time."""
        if not self.plain:
            return self._whole(reqs)
        heads = self._heads(reqs, heads_cache, max_batch_size)
        rest = [len(r.prompt_ids) - h.length for r, h in zip(reqs, heads)]
        parts = [(g, self._group([reqs[i] for i in g], [heads[i] for i in g], heads_cache))
                 for g in length_groups(rest)]
        return self._merge(parts, len(reqs), room)

    # ------------------------------------------------------------------ internals
    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{self.cache_kw: cache})
        return out.logits[:, -1, :]

    def _whole(self, reqs: list[GenerationRequest]) -> Prefilled:
        ids, mask, pos = left_pad([r.prompt_ids for r in reqs], [r.prompt_positions() for r in reqs],
                                  self.pad_id, self.device)
        cache = DynamicCache(config=self.model.config)
        return Prefilled(cache, mask, self._forward(ids, mask, pos, cache))

    def _heads(self, reqs: list[GenerationRequest], heads_cache: PrefixCache | None, max_batch_size: int
               ) -> list[Head]:
        """Each row's longest cached head; missing episode prefixes are prefilled here and kept.
        At least one token of each prompt is left to prefill: it gives the first logits."""
        if heads_cache is None:
            return [Head(0, None)] * len(reqs)
        found: list[Head | None] = []
        for r in reqs:
            cut = head_cut(r)
            layers = heads_cache.get(head_key(r, cut)) if cut is not None else None
            found.append(Head(cut, layers) if layers is not None else None)
        plens = [min(r.prefix_len, len(r.prompt_ids) - 1) for r in reqs]
        wanted = {head_key(r, p): None for r, p, h in zip(reqs, plens, found) if h is None and p > 0}
        for key in wanted:
            wanted[key] = heads_cache.get(key)
        missing = [k for k, v in wanted.items() if v is None]
        for start in range(0, len(missing), max_batch_size):
            wanted.update(self._prefill_prefixes(missing[start:start + max_batch_size], heads_cache))
        return [h if h is not None else Head(p, wanted[head_key(r, p)]) if p > 0 else Head(0, None)
                for r, p, h in zip(reqs, plens, found)]

    def _prefill_prefixes(self, keys: list[tuple[tuple[int, ...], int]], heads_cache: PrefixCache) -> dict:
        """Prefill distinct episode prefixes (left-padded, their own positions); each one's
        per-layer ``[kv_heads, p, d]`` keys and values, kept in the cache."""
        ids, mask, pos = left_pad([list(p_ids) for p_ids, _ in keys],
                                  [list(range(offset, offset + len(p_ids))) for p_ids, offset in keys],
                                  self.pad_id, self.device)
        W = ids.shape[1]
        kv = DynamicCache(config=self.model.config)
        self._forward(ids, mask, pos, kv)
        out = {}
        for j, key in enumerate(keys):
            n = len(key[0])  # clones: an entry must not hold the whole batch's tensors alive
            out[key] = [(layer.keys[j, ..., W - n:, :].clone(), layer.values[j, ..., W - n:, :].clone())
                        for layer in kv.layers]
            heads_cache.put(key, out[key])
        return out

    def _group(self, reqs: list[GenerationRequest], heads: list[Head], heads_cache: PrefixCache | None
               ) -> tuple[Layers, torch.Tensor, torch.Tensor]:
        """One forward over rows of similar length: their heads' keys/values (right-aligned in P
        columns), then the rest of each prompt (left-padded in S columns). Returns per-layer
        ``[n, kv_heads, P + S, d]`` keys/values, the ``[n, P + S]`` mask and the last logits."""
        P = max(h.length for h in heads)
        kv = DynamicCache(config=self.model.config)
        pmask = torch.zeros((len(reqs), P), dtype=torch.long)
        if P:
            like = next(h.layers for h in heads if h.layers is not None)
            for layer, (k0, v0) in enumerate(like):
                k = k0.new_zeros((len(reqs), k0.shape[0], P, k0.shape[-1]))
                v = v0.new_zeros((len(reqs), v0.shape[0], P, v0.shape[-1]))
                for b, h in enumerate(heads):
                    if h.layers is not None:
                        k[b, ..., P - h.length:, :], v[b, ..., P - h.length:, :] = h.layers[layer]
                kv.update(k, v, layer)
            for b, h in enumerate(heads):
                pmask[b, P - h.length:] = 1
        s_ids, s_mask, s_pos = left_pad([r.prompt_ids[h.length:] for r, h in zip(reqs, heads)],
                                        [r.prompt_positions()[h.length:] for r, h in zip(reqs, heads)],
                                        self.pad_id, self.device)
        mask = torch.cat([pmask.to(self.device), s_mask], dim=1)
        logits = self._forward(s_ids, mask, s_pos, kv)
        layers = [(layer.keys, layer.values) for layer in kv.layers]
        if heads_cache is not None:
            self._keep_heads(reqs, heads, layers, P, s_ids.shape[1], heads_cache)
        return layers, mask, logits

    @staticmethod
    def _keep_heads(reqs: list[GenerationRequest], heads: list[Head], layers: Layers, P: int, S: int,
                    heads_cache: PrefixCache) -> None:
        """Keep each row's prompt before its newest data segment (see :func:`head_cut`), cut out of
        the keys/values just computed: the head's columns, then the first prefilled ones."""
        for b, (r, h) in enumerate(zip(reqs, heads)):
            cut = head_cut(r)
            if cut is None or cut <= h.length:
                continue  # no such head, or it came from the cache
            start = P + S - (len(r.prompt_ids) - h.length)  # the row's first prefilled column
            cols = list(range(P - h.length, P)) + list(range(start, start + cut - h.length))
            index = torch.tensor(cols, device=layers[0][0].device)
            kept = [(k[b].index_select(-2, index), v[b].index_select(-2, index)) for k, v in layers]
            owner = r.meta.get("episode_id") or head_key(r, r.prefix_len)
            heads_cache.put_head(owner, head_key(r, cut), kept)

    def _merge(self, parts: list[tuple[list[int], tuple[Layers, torch.Tensor, torch.Tensor]]], B: int, room: int
               ) -> Prefilled:
        """The groups' caches side by side in one cache (each row right-aligned in the widest
        group's width, zeros and a masked column before it), rows in request order."""
        W = max(mask.shape[1] for _, (_, mask, _) in parts)
        cache = growing_cache(self.model.config, room)
        like = parts[0][1][0]
        for layer, (k0, v0) in enumerate(like):
            if len(parts) == 1 and parts[0][0] == list(range(B)):
                k, v = k0, v0
            else:
                k = k0.new_zeros((B, k0.shape[1], W, k0.shape[-1]))
                v = v0.new_zeros((B, v0.shape[1], W, v0.shape[-1]))
                for rows, (layers, mask, _) in parts:
                    idx = torch.tensor(rows, device=k.device)
                    w = mask.shape[1]
                    k[idx, :, W - w:, :] = layers[layer][0]
                    v[idx, :, W - w:, :] = layers[layer][1]
            cache.update(k, v, layer)
        mask = torch.zeros((B, W), dtype=torch.long, device=self.device)
        logits = None
        for rows, (_, m, lg) in parts:
            idx = torch.tensor(rows, device=self.device)
            mask[idx, W - m.shape[1]:] = m
            if logits is None:
                logits = lg.new_empty((B, lg.shape[-1]))
            logits[idx] = lg
        return Prefilled(cache, mask, logits)
