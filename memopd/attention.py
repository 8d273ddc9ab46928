"""Attention lowerings of a packed batch's segment structure, and the packed model call.

Visibility (the same in every lowering): a token sees earlier-or-equal columns of its own block,
and every column of the prefix block its block attends to (a prefix always precedes its blocks
in the row); never another block. Padding sees only itself (so no softmax row is empty).

- ``sdpa`` / ``eager`` (CPU and GPU): an explicit additive float mask ``[R, 1, L, L]`` (0 where
  visible, dtype-min elsewhere). transformers passes a 4-D mask through untouched; ``eager``
  *adds* the mask to the scores, so a bool mask would be wrong there — always additive float.
  Cost: attention over the full ``L x L`` square of every row.
- ``blocks`` (CPU and GPU): causal SDPA per segment — each prefix over itself, each block over
  ``[its prefix, itself]`` keeping the block's rows — via a custom transformers attention function.
  Same visibility, no ``L x L`` square: attention work is about what running each call alone
  costs, while everything else (projections, MLP, norms) runs once per stored token. A Python
  loop over segments.
- ``flex`` (GPU): a FlexAttention ``BlockMask`` from the same structure; the shared prefix is
  stored once and fully masked tiles are skipped.
- ``flash`` (GPU, flash-attn): varlen attention over independent causal sequences, so each
  block gets its own copy of its prefix: ``[prefix, block]`` sequences flattened into one row
  with explicit ``cu_seqlens``.

Models are always called with ``use_cache=False`` and the recorded ``position_ids``.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from memopd.packing import PackedBatch

LOWERINGS = ("sdpa", "eager", "blocks", "flex", "flash")
BLOCKS_IMPLEMENTATION = "memopd_blocks"
# transformers' attn_implementation for each lowering
HF_IMPLEMENTATION = {"sdpa": "sdpa", "eager": "eager", "blocks": BLOCKS_IMPLEMENTATION, "flex": "flex_attention",
                     "flash": "flash_attention_2"}


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401
    except ImportError:
        return False
    return True


def flash_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def choose_lowering(device: torch.device | str, override: str | None = None) -> str:
    """``override`` if given; else ``blocks`` on CPU (exact work; the dense-mask ``sdpa``/``eager``
    lowerings are the reference; FlexAttention on CPU compiles per shape and has no backward) and
    ``flex`` on CUDA when available (else ``flash``, else ``blocks``)."""
    if override is not None:
        if override not in LOWERINGS:
            raise ValueError(f"unknown attention lowering {override!r}; choose from {LOWERINGS}")
        if override in ("flex", "flash") and torch.device(device).type != "cuda":
            raise ValueError(f"the {override!r} lowering needs a CUDA device (got {device}); use blocks, sdpa or eager")
        if override == "flex" and not flex_available():
            raise ValueError("FlexAttention is not available in this torch build; use blocks, sdpa, eager or flash")
        if override == "flash" and not flash_available():
            raise ValueError("flash-attn is not installed (pip install flash-attn); use blocks, sdpa, eager or flex")
        return override
    if torch.device(device).type == "cuda":
        return "flex" if flex_available() else "flash" if flash_available() else "blocks"
    return "blocks"


def check_supported(model: torch.nn.Module, lowering: str) -> None:
    """Refuse model features a lowering would silently get wrong."""
    cfg = model.config
    sliding = "sliding_attention" in (getattr(cfg, "layer_types", None) or ()) or (
        getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None))
    if sliding:
        raise NotImplementedError(
            f"{type(model).__name__} uses sliding-window attention; the packed lowerings implement full causal "
            "attention only (packing would let tokens see past the window)")
    if lowering == "blocks" and getattr(cfg, "attn_logit_softcapping", None):
        raise NotImplementedError("the blocks lowering has no attention soft-capping; use eager")


def token_prefix(batch: PackedBatch) -> torch.Tensor:
    """[R, L] block id of the prefix each token's block attends to (-1: none, or padding)."""
    safe = batch.block_ids.clamp(min=0)
    pref = torch.gather(batch.block_prefix, 1, safe) if batch.block_prefix.numel() else torch.full_like(safe, -1)
    return torch.where(batch.block_ids >= 0, pref, torch.full_like(pref, -1))


def allowed_mask(batch: PackedBatch) -> torch.Tensor:
    """[R, L, L] bool: query column i may attend to key column j."""
    bid, pref = batch.block_ids, token_prefix(batch)
    L = bid.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=bid.device).tril()
    q_blk, k_blk = bid[:, :, None], bid[:, None, :]
    real = (q_blk >= 0) & (k_blk >= 0)
    visible = (q_blk == k_blk) | (pref[:, :, None] == k_blk)
    eye = torch.eye(L, dtype=torch.bool, device=bid.device)
    return (causal & real & visible) | (eye & (q_blk < 0))


def additive_mask(batch: PackedBatch, dtype: torch.dtype) -> torch.Tensor:
    """[R, 1, L, L] float mask for sdpa/eager: 0 where visible, ``finfo(dtype).min`` elsewhere."""
    allowed = allowed_mask(batch)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


FLEX_BLOCK = 128  # FlexAttention's tile size; rows are padded to a multiple of it


def flex_inputs(batch: PackedBatch) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """(BlockMask, input_ids, position_ids) for the ``flex`` lowering (GPU). Rows are padded to a
    multiple of the tile size, so the mask function never indexes past the row."""
    from torch.nn.attention.flex_attention import create_block_mask

    R, L = batch.block_ids.shape
    pad = -L % FLEX_BLOCK
    grow = lambda t, v: F.pad(t, (0, pad), value=v)  # noqa: E731
    bid, pref = grow(batch.block_ids, -1), grow(token_prefix(batch), -1)

    def mask_mod(b, h, q, kv):
        qb, kb = bid[b, q], bid[b, kv]
        real = (qb >= 0) & (kb >= 0) & (kv <= q) & ((qb == kb) | (pref[b, q] == kb))
        return real | ((qb < 0) & (q == kv))

    mask = create_block_mask(mask_mod, B=R, H=None, Q_LEN=L + pad, KV_LEN=L + pad, device=bid.device)
    return mask, grow(batch.input_ids, 0), grow(batch.position_ids, 0)


@dataclass
class FlashLayout:
    """The packed batch with each prefix duplicated per block, flattened into one row."""

    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long; recorded positions
    cu_seqlens: torch.Tensor  # [S + 1] int32; sequence boundaries (each is [prefix, block])
    max_seqlen: int
    action_index: torch.Tensor  # [N] long; column in [T] of the position before each sampled token


def flash_layout(batch: PackedBatch) -> FlashLayout:
    """Each private block becomes one causal sequence ``[its prefix, block]``; S sequences."""
    dev = batch.input_ids.device
    src_rows, src_cols, bounds = [], [], [0]
    where: dict[tuple[int, int, int], int] = {}  # (row, block, column) -> flat column
    for r, segs in enumerate(batch.segments):
        by_block = {s.block: s for s in segs}
        for s in segs:
            if s.is_prefix:
                continue
            cols = list(range(s.start, s.end))
            if s.prefix >= 0:
                p = by_block[s.prefix]
                cols = list(range(p.start, p.end)) + cols
            for c in cols:
                where[(r, s.block, c)] = len(src_cols)
                src_rows.append(r)
                src_cols.append(c)
            bounds.append(len(src_cols))
    rows_t = torch.tensor(src_rows, dtype=torch.long, device=dev)
    cols_t = torch.tensor(src_cols, dtype=torch.long, device=dev)
    keys = zip(batch.action_rows.tolist(), batch.action_blocks.tolist(), batch.action_cols.tolist())
    cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
    return FlashLayout(
        input_ids=batch.input_ids[rows_t, cols_t][None],
        position_ids=batch.position_ids[rows_t, cols_t][None],
        cu_seqlens=cu,
        max_seqlen=int((cu[1:] - cu[:-1]).max()) if len(bounds) > 1 else 0,
        action_index=torch.tensor([where[k] for k in keys], dtype=torch.long, device=dev))


Span = tuple[int, int, int, int]  # (query start, query end, prefix start, prefix end); empty prefix: start == end


def block_spans(batch: PackedBatch) -> list[list[Span]]:
    """Per row, the attention problems of the ``blocks`` lowering, in column order."""
    out = []
    for segs in batch.segments:
        row = []
        for s in segs:
            p = segs[s.prefix] if s.prefix >= 0 else None
            row.append((s.start, s.end, p.start, p.end) if p else (s.start, s.end, s.start, s.start))
        out.append(row)
    return out


def blockwise_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                        memopd_spans: list[list[Span]] | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function of the ``blocks`` lowering. query ``[R, H, L, D]``, key and
    value ``[R, H_kv, L, D]``; returns ``[R, L, H, D]``. Padding columns get zeros.

    The rows are flattened and cut into segments with one ``torch.split`` per tensor (its backward
    is one concatenation; slicing per segment would materialise a full-size gradient per slice).
    """
    if memopd_spans is None:
        raise ValueError("the memopd 'blocks' attention needs memopd_spans; call the model through "
                         "memopd.attention.packed_hidden_states")
    if kwargs.get("sliding_window"):
        raise ValueError("the 'blocks' lowering does not implement sliding-window attention; use sdpa")
    R, H, L, D = query.shape
    flat = lambda x: x.transpose(0, 1).reshape(x.shape[1], R * L, D)  # noqa: E731  [heads, R*L, D]
    sizes: list[int] = []
    jobs: list[tuple[int, int]] = []  # per piece: (its prefix piece or -1, kind: 0 pad, 1 causal, 2 block)
    for spans in memopd_spans:
        start_piece = {}
        for qs, qe, ps, pe in spans:
            start_piece[qs] = len(sizes)
            jobs.append((start_piece[ps], 2) if pe > ps else (-1, 1))
            sizes.append(qe - qs)
        used = spans[-1][1] if spans else 0
        if used < L:
            jobs.append((-1, 0))
            sizes.append(L - used)
    qp, kp, vp = (torch.split(flat(x), sizes, dim=1) for x in (query, key, value))
    gqa = H != key.shape[1]
    p_drop = dropout if module.training else 0.0
    outs = []
    for i, (pre, kind) in enumerate(jobs):
        if kind == 0:
            outs.append(query.new_zeros(H, sizes[i], D))
        elif kind == 1:  # a prefix, or a block without one: plain causal
            outs.append(F.scaled_dot_product_attention(qp[i][None], kp[i][None], vp[i][None], is_causal=True,
                                                       dropout_p=p_drop, scale=scaling, enable_gqa=gqa)[0])
        else:  # a block: run [prefix, block] causally and keep the block's rows. Recomputing the
            # prefix's own rows costs m^2/2, less than the masked m x n rectangle a mask would
            # force (a causal kernel skips the upper triangle; an explicit mask does not)
            m = sizes[pre]
            q = torch.cat([qp[pre], qp[i]], dim=1)[None]
            k = torch.cat([kp[pre], kp[i]], dim=1)[None]
            v = torch.cat([vp[pre], vp[i]], dim=1)[None]
            outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p_drop, scale=scaling,
                                                       enable_gqa=gqa)[0, :, m:])
    out = torch.cat(outs, dim=1).reshape(H, R, L, D)
    return out.permute(1, 2, 0, 3).contiguous(), None


def _register_blocks() -> None:
    from transformers import AttentionInterface

    if BLOCKS_IMPLEMENTATION not in AttentionInterface._global_mapping:
        AttentionInterface.register(BLOCKS_IMPLEMENTATION, blockwise_attention)


@contextlib.contextmanager
def attn_implementation(model: torch.nn.Module, lowering: str) -> Iterator[None]:
    """Temporarily switch a transformers model to the attention implementation of a lowering."""
    want = HF_IMPLEMENTATION[lowering]
    if lowering == "blocks":
        _register_blocks()
    before = getattr(model.config, "_attn_implementation", None)
    if before == want:
        yield
        return
    model.set_attn_implementation(want)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack without the LM head (returns final, normed hidden states)."""
    base = getattr(model, "base_model", None)
    if base is None or base is model:
        raise TypeError(f"{type(model).__name__} has no separate base model; pass a *ForCausalLM model")
    return base


def packed_hidden_states(model: torch.nn.Module, batch: PackedBatch, lowering: str | None = None) -> torch.Tensor:
    """Final hidden states ``[N, H]`` at the gather positions of a packed batch (the position before
    each sampled token), computed with the batch's explicit visibility."""
    device = next(model.parameters()).device
    lowering = choose_lowering(device, lowering)
    check_supported(model, lowering)
    batch = batch.to(device)
    base = base_model(model)
    with attn_implementation(model, lowering):
        if lowering == "flash":
            lay = flash_layout(batch)
            out = base(input_ids=lay.input_ids, position_ids=lay.position_ids, use_cache=False,
                       cu_seq_lens_q=lay.cu_seqlens, cu_seq_lens_k=lay.cu_seqlens,
                       max_length_q=lay.max_seqlen, max_length_k=lay.max_seqlen)
            return out.last_hidden_state[0, lay.action_index]
        if lowering == "blocks":
            out = base(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                       memopd_spans=block_spans(batch))
            return out.last_hidden_state[batch.action_rows, batch.action_cols]
        if lowering == "flex":
            mask, ids, pos = flex_inputs(batch)
        else:
            mask, ids, pos = additive_mask(batch, next(model.parameters()).dtype), batch.input_ids, batch.position_ids
        out = base(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        return out.last_hidden_state[batch.action_rows, batch.action_cols]


__all__ = ["LOWERINGS", "FlashLayout", "additive_mask", "allowed_mask", "attn_implementation", "base_model",
           "block_spans", "blockwise_attention", "check_supported", "choose_lowering", "flash_layout", "flex_inputs",
           "packed_hidden_states", "token_prefix"]
