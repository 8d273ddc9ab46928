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
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from memopd import last_layer
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


class UnsupportedLoweringError(NotImplementedError):
    """A lowering cannot reproduce this model's attention exactly; the message says why and what to use."""


def layer_windows(model: torch.nn.Module) -> list[int | None]:
    """Per decoder layer, the sliding-window size its attention uses (None: full causal).

    Read from the config the way transformers builds its masks: ``layer_types`` (Gemma 2/3,
    Qwen2 with ``use_sliding_window``, Ministral ...) marks sliding layers, which use
    ``sliding_window``; without ``layer_types`` a set ``sliding_window`` applies to every layer
    (Mistral, Phi3). A token at index i of its call then sees keys j with ``i - W < j <= i``."""
    cfg = model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise UnsupportedLoweringError(
                f"{type(model).__name__} has attention layer types {unknown}; packed scoring implements full "
                "causal and sliding-window attention only")
        return [window if t == "sliding_attention" and window else None for t in types]
    if getattr(cfg, "use_sliding_window", True) is False:
        return [None] * n
    return [int(window) if window else None] * n


def effective_windows(model: torch.nn.Module, batch: PackedBatch | None) -> list[int | None]:
    """:func:`layer_windows`, with windows that no call of ``batch`` is long enough to reach
    dropped (a window of W never hides anything from a context of at most W tokens)."""
    windows = layer_windows(model)
    if batch is None or not any(windows):
        return windows
    longest = int(call_index(batch).max()) + 1 if batch.block_ids.numel() else 0
    return [w if w is not None and w < longest else None for w in windows]


def check_supported(model: torch.nn.Module, lowering: str, batch: PackedBatch | None = None) -> None:
    """Refuse, before any work, what a lowering would silently get wrong for this model."""
    cfg = model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    name = type(model).__name__
    windows = effective_windows(model, batch)
    if any(windows) and lowering in ("flex", "flash"):
        raise UnsupportedLoweringError(
            f"{name} uses sliding-window attention (window {max(w for w in windows if w)}) and some calls are "
            f"longer than it; the {lowering!r} lowering does not apply the window; use blocks, sdpa or eager")
    if getattr(cfg, "attn_logit_softcapping", None) and lowering in ("blocks", "sdpa"):
        raise UnsupportedLoweringError(
            f"{name} soft-caps its attention scores (attn_logit_softcapping), which the {lowering!r} lowering "
            "does not do; use eager (CPU) or flex / flash (GPU)")
    if lowering == "blocks" and not blocks_supported(model):
        raise UnsupportedLoweringError(
            f"{name} does not pass extra arguments down to its attention function, so the 'blocks' lowering "
            "cannot give it the segment structure; use sdpa or eager")
    verify_lowering(model, lowering)


def preferred_lowerings(device: torch.device | str) -> list[str]:
    """Lowerings in order of preference on a device (fastest exact first)."""
    if torch.device(device).type == "cuda":
        return [x for x, ok in (("flex", flex_available()), ("flash", flash_available())) if ok] + \
            ["blocks", "sdpa", "eager"]
    return ["blocks", "sdpa", "eager"]


def resolve_lowering(model: torch.nn.Module, device: torch.device | str, override: str | None = None,
                     batch: PackedBatch | None = None) -> str:
    """The lowering to use: ``override`` if given (refused with the reason when it cannot score this
    model exactly), else the first of :func:`preferred_lowerings` that can; when none can, the
    error says why for each."""
    if override is not None:
        lowering = choose_lowering(device, override)
        check_supported(model, lowering, batch)
        return lowering
    reasons = []
    for lowering in preferred_lowerings(device):
        try:
            check_supported(model, lowering, batch)
            return lowering
        except UnsupportedLoweringError as exc:
            reasons.append(f"{lowering}: {exc}")
    raise UnsupportedLoweringError(f"no attention lowering scores {type(model).__name__} exactly:\n  "
                                   + "\n  ".join(reasons))


def call_index(batch: PackedBatch) -> torch.Tensor:
    """[R, L] long: each token's index within its own call's context ``[prefix, block]`` (what a
    sliding window counts in when the call runs alone); 0 in padding."""
    idx = torch.zeros_like(batch.block_ids)
    for r, segs in enumerate(batch.segments):
        for s in segs:
            offset = (segs[s.prefix].end - segs[s.prefix].start) if s.prefix >= 0 else 0
            idx[r, s.start:s.end] = torch.arange(offset, offset + s.end - s.start)
    return idx.to(batch.block_ids.device)


_VERIFIED: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, str | None]]" = weakref.WeakKeyDictionary()
_GATHERED: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()
"""Per model (checked by the ``blocks`` probe): whether its last layer runs on the gather positions alone."""
PROBE_WINDOW_LIMIT = 256  # probe windows up to this size by making a call longer than the window


def _probe_batch(model: torch.nn.Module) -> PackedBatch:
    """One packed row with every hard case: a shared prefix starting above position 0 with two
    private blocks (one longer than the model's smallest sliding window, when that is small), then
    a call without a prefix whose positions continue the previous block's."""
    from agents.records import Invocation
    from memopd.packing import pack_episodes

    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(1)
    toks = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()  # noqa: E731
    small = [w for w in layer_windows(model) if w is not None and w <= PROBE_WINDOW_LIMIT]
    long_private = (min(small) + 4) if small else 9

    def call(prefix: list[int], private: int, response: int, start: int) -> Invocation:
        prompt = prefix + toks(private)
        n = len(prompt) + response
        return Invocation(prompt_ids=prompt, response_ids=toks(response), logprobs=[0.0] * response,
                          position_ids=list(range(start, start + n)), prefix_len=len(prefix))

    q = toks(6)
    first = [call(q, long_private, 3, 2), call(q, 5, 2, 2)]
    single = call([], 7, 2, 2 + len(first[1].input_ids))
    return pack_episodes([first, [single]], max_tokens=4096, balance=False)


@torch.no_grad()
def verify_lowering(model: torch.nn.Module, lowering: str) -> None:
    """Check once per model and lowering, on a small probe batch, that packed execution gives the
    final hidden states of the model's own forward of each call alone (eager attention). This
    catches, before any work, what no config flag announces: token mixing outside attention
    (state-space or convolution layers), attention features a lowering drops, a model that does not
    honour the mask. Raises :class:`UnsupportedLoweringError` saying how far off it is."""
    done = _VERIFIED.setdefault(model, {})
    if lowering not in done:
        done[lowering] = _probe(model, lowering)
    if done[lowering] is not None:
        raise UnsupportedLoweringError(done[lowering])


def _probe(model: torch.nn.Module, lowering: str) -> str | None:
    device = next(model.parameters()).device
    batch = _probe_batch(model).to(device)
    was_training = model.training
    model.eval()
    try:
        try:
            packed = _packed_hidden(model, batch, lowering, effective_windows(model, batch), gathered=False)
            gathered = _packed_hidden(model, batch, lowering, effective_windows(model, batch), gathered=True) \
                if lowering == "blocks" and last_layer.supported(base_model(model)) else None
        except (TypeError, ValueError, RuntimeError, NotImplementedError) as exc:
            return (f"packed execution of {type(model).__name__} with the {lowering!r} lowering failed on a probe "
                    f"batch ({type(exc).__name__}: {exc})")
        base = base_model(model)
        ref = []
        with attn_implementation(model, "eager"):
            for segs in batch.segments:
                for s in segs:
                    if s.is_prefix:
                        continue
                    cols = list(range(segs[s.prefix].start, segs[s.prefix].end)) if s.prefix >= 0 else []
                    cols += list(range(s.start, s.end))
                    ids, pos = batch.input_ids[0, cols][None], batch.position_ids[0, cols][None]
                    h = base(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[0]
                    ref.append((cols, h))
    finally:
        model.train(was_training)
    where = {}  # packed column -> hidden state there when its call runs alone (a prefix column's
    for cols, h in ref:  # state is the same in every call that shares the prefix: it is causal)
        where.update({c: h[i] for i, c in enumerate(cols)})
    alone = torch.stack([where[int(c)] for c in batch.action_cols])
    err = float((packed.float() - alone.float()).abs().max())
    tol = (1e-4 if packed.dtype in (torch.float32, torch.float64) else 3e-2) * (1.0 + float(alone.abs().max()))
    if gathered is not None:  # the last layer on the gather positions alone, where it reproduces the model
        _GATHERED[model] = float((gathered.float() - alone.float()).abs().max()) <= tol
    if err <= tol:
        return None
    return (f"packed execution of {type(model).__name__} with the {lowering!r} lowering differs from the model's own "
            f"forward of each call alone by {err:.3g} (tolerance {tol:.2g}) on a probe batch; scores would be "
            "silently wrong (the model may mix tokens outside attention, e.g. state-space or convolution layers, or "
            "use an attention feature this lowering does not reproduce)" + ("; try eager" if lowering != "eager" else ""))


class _SpansMissing(NotImplementedError):
    pass


_BLOCKS_OK: dict[type, bool] = {}


@torch.no_grad()
def blocks_supported(model: torch.nn.Module) -> bool:
    """Whether the model passes extra forward kwargs down to its attention function (the
    ``blocks`` lowering needs that), found by one forward of two tokens; cached per class."""
    cls = type(model)
    if cls not in _BLOCKS_OK:
        device = next(model.parameters()).device
        ids = torch.zeros((1, 2), dtype=torch.long, device=device)
        try:
            with attn_implementation(model, "blocks"):
                base_model(model)(input_ids=ids, position_ids=torch.arange(2, device=device)[None], use_cache=False,
                                  memopd_spans=[[(0, 2, 0, 0)]])
            _BLOCKS_OK[cls] = True
        except _SpansMissing:
            _BLOCKS_OK[cls] = False
    return _BLOCKS_OK[cls]


def token_prefix(batch: PackedBatch) -> torch.Tensor:
    """[R, L] block id of the prefix each token's block attends to (-1: none, or padding)."""
    safe = batch.block_ids.clamp(min=0)
    pref = torch.gather(batch.block_prefix, 1, safe) if batch.block_prefix.numel() else torch.full_like(safe, -1)
    return torch.where(batch.block_ids >= 0, pref, torch.full_like(pref, -1))


def allowed_mask(batch: PackedBatch, window: int | None = None) -> torch.Tensor:
    """[R, L, L] bool: query column i may attend to key column j. With a sliding ``window`` W, a
    token also sees only the W last tokens of its own call's context (itself included)."""
    bid, pref = batch.block_ids, token_prefix(batch)
    L = bid.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=bid.device).tril()
    q_blk, k_blk = bid[:, :, None], bid[:, None, :]
    real = (q_blk >= 0) & (k_blk >= 0)
    visible = (q_blk == k_blk) | (pref[:, :, None] == k_blk)
    if window is not None:
        idx = call_index(batch)
        visible = visible & (idx[:, :, None] - idx[:, None, :] < window)
    eye = torch.eye(L, dtype=torch.bool, device=bid.device)
    return (causal & real & visible) | (eye & (q_blk < 0))


def additive_mask(batch: PackedBatch, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """[R, 1, L, L] float mask for sdpa/eager: 0 where visible, ``finfo(dtype).min`` elsewhere."""
    allowed = allowed_mask(batch, window)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def dense_masks(model: torch.nn.Module, batch: PackedBatch, dtype: torch.dtype,
                windows: list[int | None] | None = None) -> torch.Tensor | dict:
    """The ``attention_mask`` argument of the sdpa/eager lowerings: one additive mask, or, when
    full and sliding layers mix, a mapping from layer type to mask (transformers' own form)."""
    windows = effective_windows(model, batch) if windows is None else windows
    distinct = set(windows)
    if len(distinct) <= 1:
        return additive_mask(batch, dtype, next(iter(distinct), None))
    types = getattr(model.config.get_text_config(), "layer_types", None)
    if not types:
        raise UnsupportedLoweringError(f"{type(model).__name__}: layers use different windows {sorted(distinct, key=str)} "
                                       "without layer_types; cannot build per-layer masks")
    by_window = {w: additive_mask(batch, dtype, w) for w in distinct}
    return {t: by_window[w] for t, w in zip(types, windows)}


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


def _layer_window(module: torch.nn.Module, windows: list[int | None] | None, passed: int | None) -> int | None:
    """This layer's window: from the model's config (by ``module.layer_idx``), cross-checked with
    what the model passed to its attention function."""
    if not windows or not any(windows):
        return None
    idx = getattr(module, "layer_idx", None)
    if idx is None:
        if len(set(windows)) > 1:
            raise UnsupportedLoweringError(f"{type(module).__name__} has no layer_idx and layers use different "
                                           "sliding windows; use sdpa or eager")
        return windows[0]
    return windows[idx]


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, **kw: Any) -> torch.Tensor:
    """Causal SDPA over one call context ``[1, H, n, D]``; with a window shorter than the context,
    each query sees only its ``window`` last keys (itself included)."""
    n = q.shape[-2]
    if window is None or window >= n:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    i = torch.arange(n, device=q.device)
    allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, **kw)


def _rows_after(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: int, window: int | None,
                **kw: Any) -> torch.Tensor:
    """Attention of the last n rows of a causal context of m + n tokens (queries ``[1, H, n, D]``,
    keys and values of the whole context): row r sees keys up to m + r (and, with a window, only
    the last ``window`` of them)."""
    n, total = q.shape[-2], k.shape[-2]
    row = torch.arange(m, m + n, device=q.device)[:, None]
    col = torch.arange(total, device=q.device)[None, :]
    allowed = col <= row
    if window is not None:
        allowed = allowed & (row - col < window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, **kw)


def blockwise_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                        memopd_spans: list[list[Span]] | None = None, memopd_windows: list[int | None] | None = None,
                        **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function of the ``blocks`` lowering. query ``[R, H, L, D]``, key and
    value ``[R, H_kv, L, D]``; returns ``[R, L, H, D]``. Padding columns get zeros.

    The rows are flattened and cut into segments with one ``torch.split`` per tensor (its backward
    is one concatenation; slicing per segment would materialise a full-size gradient per slice).
    """
    if memopd_spans is None:
        raise _SpansMissing("the memopd 'blocks' attention got no memopd_spans: call the model through "
                            "memopd.attention.packed_hidden_states, with a model that passes forward kwargs to "
                            "its attention (else use sdpa or eager)")
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise UnsupportedLoweringError(f"the 'blocks' lowering does not implement attention {name!r}; use eager")
    window = _layer_window(module, memopd_windows, kwargs.get("sliding_window"))
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
            outs.append(_causal(qp[i][None], kp[i][None], vp[i][None], window, dropout_p=p_drop, scale=scaling,
                                enable_gqa=gqa)[0])
        else:  # a block of n rows after a prefix of m: its rows see the prefix and themselves
            m, n = sizes[pre], sizes[i]
            k = torch.cat([kp[pre], kp[i]], dim=1)[None]
            v = torch.cat([vp[pre], vp[i]], dim=1)[None]
            if n < m:  # the block's rows alone, n x (m + n) scores with an explicit mask
                outs.append(_rows_after(qp[i][None], k, v, m, window, dropout_p=p_drop, scale=scaling,
                                        enable_gqa=gqa)[0])
            else:  # [prefix, block] causally, keeping the block's rows: (m + n)^2 / 2 scores, fewer
                # than the rectangle here (a causal kernel skips the upper triangle; a mask does not)
                q = torch.cat([qp[pre], qp[i]], dim=1)[None]
                outs.append(_causal(q, k, v, window, dropout_p=p_drop, scale=scaling, enable_gqa=gqa)[0, :, m:])
    out = torch.cat(outs, dim=1).reshape(H, R, L, D)
    return out.permute(1, 2, 0, 3).contiguous(), None


def _register_blocks() -> None:
    from transformers import AttentionInterface

    if BLOCKS_IMPLEMENTATION not in AttentionInterface._global_mapping:
        AttentionInterface.register(BLOCKS_IMPLEMENTATION, blockwise_attention)


_SWITCHED: list[tuple[torch.nn.Module, str]] = []
"""(model, implementation) of every :func:`attn_implementation` context open now, innermost last."""


@contextlib.contextmanager
def attn_implementation(model: torch.nn.Module, lowering: str) -> Iterator[None]:
    """Temporarily switch a transformers model to the attention implementation of a lowering."""
    want = HF_IMPLEMENTATION[lowering]
    if lowering == "blocks":
        _register_blocks()
    _SWITCHED.append((model, want))
    try:
        with _implementation(model, want):
            yield
    finally:
        _SWITCHED.pop()


@contextlib.contextmanager
def _implementation(model: torch.nn.Module, want: str) -> Iterator[None]:
    before = getattr(model.config, "_attn_implementation", None)
    if before == want:
        yield
        return
    model.set_attn_implementation(want)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


@contextlib.contextmanager
def _restored(switched: list[tuple[torch.nn.Module, str]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for model, want in switched:
            stack.enter_context(_implementation(model, want))
        yield


def _checkpoint_contexts() -> tuple[Any, Any]:
    """``context_fn`` of activation checkpointing: the forward runs as it is; its recomputation
    (in the backward, after the packed call's :func:`attn_implementation` has ended) runs under the
    attention implementations that were switched on when the forward ran."""
    return contextlib.nullcontext(), _restored(list(_SWITCHED))


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Per-layer activation checkpointing (transformers') that recomputes every layer under the
    attention lowering of its forward: a packed lowering is switched on only around the packed
    call, so a plain checkpoint would recompute with the model's default attention, without the
    packed visibility (torch refuses it: a different number of saved tensors)."""
    kwargs = {"use_reentrant": False, "context_fn": _checkpoint_contexts}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers before the rename
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack without the LM head (returns final, normed hidden states)."""
    base = getattr(model, "base_model", None)
    if base is None or base is model:
        raise TypeError(f"{type(model).__name__} has no separate base model; pass a *ForCausalLM model")
    return base


def packed_hidden_states(model: torch.nn.Module, batch: PackedBatch, lowering: str | None = None) -> torch.Tensor:
    """Final hidden states ``[N, H]`` at the gather positions of a packed batch (the position before
    each sampled token), computed with the batch's explicit visibility. The lowering (given, or
    the first exact one for the model, see :func:`resolve_lowering`) is checked for the model once."""
    device = next(model.parameters()).device
    lowering = resolve_lowering(model, device, lowering, batch)
    return _packed_hidden(model, batch.to(device), lowering, effective_windows(model, batch))


def _packed_hidden(model: torch.nn.Module, batch: PackedBatch, lowering: str, windows: list[int | None],
                   gathered: bool | None = None) -> torch.Tensor:
    """``gathered``: run the last decoder layer on the gather positions alone (``blocks`` only,
    :mod:`memopd.last_layer`); None: where the model's probe found it exact."""
    base = base_model(model)
    if gathered is None:
        gathered = lowering == "blocks" and _GATHERED.get(model, False) and last_layer.supported(base)
    if gathered:
        return _gathered_hidden(model, batch, windows)
    with attn_implementation(model, lowering):
        if lowering == "flash":
            lay = flash_layout(batch)
            out = base(input_ids=lay.input_ids, position_ids=lay.position_ids, use_cache=False,
                       cu_seq_lens_q=lay.cu_seqlens, cu_seq_lens_k=lay.cu_seqlens,
                       max_length_q=lay.max_seqlen, max_length_k=lay.max_seqlen)
            return out.last_hidden_state[0, lay.action_index]
        if lowering == "blocks":
            out = base(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                       memopd_spans=block_spans(batch), memopd_windows=windows)
            return out.last_hidden_state[batch.action_rows, batch.action_cols]
        if lowering == "flex":
            mask, ids, pos = flex_inputs(batch)
        else:
            mask, ids, pos = dense_masks(model, batch, next(model.parameters()).dtype, windows), batch.input_ids, \
                batch.position_ids
        out = base(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        return out.last_hidden_state[batch.action_rows, batch.action_cols]


def _gathered_hidden(model: torch.nn.Module, batch: PackedBatch, windows: list[int | None]) -> torch.Tensor:
    """The ``blocks`` forward with the last layer replaced, for this call, by
    :class:`memopd.last_layer.GatheredLastLayer`: hidden states ``[N, H]`` at the gather positions."""
    base = base_model(model)
    layers = base.layers
    last = layers[-1]
    spans = block_spans(batch)
    flat = batch.action_rows * batch.input_ids.shape[1] + batch.action_cols
    window = _layer_window(last.self_attn, windows, None)
    with attn_implementation(model, "blocks"):
        layers[-1] = last_layer.GatheredLastLayer(last, flat, spans, window)
        try:
            out = base(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                       memopd_spans=spans, memopd_windows=windows)
        finally:
            layers[-1] = last
    return out.last_hidden_state[0]


__all__ = ["LOWERINGS", "FlashLayout", "UnsupportedLoweringError", "additive_mask", "allowed_mask",
           "attn_implementation", "base_model", "block_spans", "blockwise_attention", "blocks_supported", "call_index",
           "check_supported", "choose_lowering", "dense_masks", "effective_windows", "enable_activation_checkpointing", "flash_layout", "flex_inputs",
           "layer_windows", "packed_hidden_states", "preferred_lowerings", "resolve_lowering", "token_prefix",
           "verify_lowering"]
