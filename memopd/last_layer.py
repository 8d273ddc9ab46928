"""The last decoder layer computed for the scored tokens only.

A packed forward needs final hidden states at the gather positions alone (the position before each
sampled token: about a fifth of a MemAgent batch's tokens). Every layer but the last must run on
every token, because later tokens attend to their keys and values; the last layer's keys and values
are needed for every token too, but its queries, attention output, output projection and MLP only
at the gather positions. On a shallow model that is a large share of the work (a 2-layer model:
about a third of its linear compute), on a deep one little (1/L of it).

This module runs that layer by hand for the Llama family of decoder layers (pre-norm attention with
rotary embeddings and a gated MLP: Llama, Qwen2, Qwen3, Mistral), under the ``blocks`` lowering's
visibility (a token sees its own block up to itself and its block's prefix). Whether a model may
use it is decided by :func:`supported` (the layer's structure) and then checked numerically, once
per model, by :func:`memopd.attention.verify_lowering` against the model's own forward of each call
alone; a model that fails the check runs its last layer whole.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

# Decoder layers whose forward this module reproduces (transformers' own classes; the numeric check
# still runs for each model). Gemma's extra norms, Phi's parallel block, ... are not among them.
LAYER_CLASSES = frozenset({"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer"})


def supported(base: torch.nn.Module) -> bool:
    """Whether ``base``'s last decoder layer has the structure :class:`GatheredLastLayer` computes,
    and is not sharded (an FSDP-wrapped layer gathers its weights in its own forward hooks)."""
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        return False
    layer = layers[-1]
    if type(layer).__name__ not in LAYER_CLASSES or _is_sharded(layer):
        return False
    attn = getattr(layer, "self_attn", None)
    need = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
    return attn is not None and all(hasattr(attn, a) for a in need) and _rope(attn) is not None and all(
        hasattr(layer, a) for a in ("input_layernorm", "post_attention_layernorm", "mlp"))


def _is_sharded(layer: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return isinstance(layer, FSDPModule)


def _rope(attn: torch.nn.Module) -> Callable | None:
    """The model's own ``apply_rotary_pos_emb`` (from the module that defines its attention)."""
    return getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)


class GatheredLastLayer(torch.nn.Module):
    """Stands in for the last decoder layer during one packed call: takes its input hidden states
    ``[R, L, H]`` and returns its output ``[1, N, H]`` at the gather positions ``flat`` (``[N]``
    indices into the flattened ``R * L`` tokens), in that order. The model's final norm, per token,
    then applies to these N rows.

    ``spans``: per row, the ``blocks`` lowering's attention problems ``(qs, qe, ps, pe)``;
    ``window``: this layer's sliding window (None: full causal)."""

    def __init__(self, layer: torch.nn.Module, flat: torch.Tensor, spans: list[list[tuple[int, int, int, int]]],
                 window: int | None) -> None:
        super().__init__()
        self.layer = layer
        self.flat = flat
        self.spans = spans
        self.window = window

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                **kwargs: Any) -> torch.Tensor:
        layer, attn = self.layer, self.layer.self_attn
        R, L, H = hidden_states.shape
        D, flat = attn.head_dim, self.flat
        x = layer.input_layernorm(hidden_states)                         # [R, L, H]
        residual = hidden_states.reshape(R * L, H)[flat]                 # [N, H]
        q = attn.q_proj(x.reshape(R * L, H)[flat]).view(1, len(flat), -1, D)  # [1, N, Hq, D]
        k = attn.k_proj(x).view(R, L, -1, D)                             # [R, L, Hkv, D]
        v = attn.v_proj(x).view(R, L, -1, D).transpose(1, 2)             # [R, Hkv, L, D]
        if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)                       # [1, Hq, N, D], [R, Hkv, L, D]
        cos, sin = position_embeddings                                   # [R, L, D] each
        rope = _rope(attn)
        q = rope(q, q, cos.reshape(R * L, -1)[flat][None], sin.reshape(R * L, -1)[flat][None])[0]
        k = rope(k, k, cos, sin)[0]
        out = self._attend(q, k, v, dropout=attn.attention_dropout if layer.training else 0.0, scale=attn.scaling)
        h = residual + attn.o_proj(out.reshape(len(flat), -1))           # [N, H]
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h[None]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, scale: float) -> torch.Tensor:
        """Attention of each gathered query over its visible keys: ``[N, Hq, D]`` in gather order."""
        L = k.shape[2]
        gqa = q.shape[1] != k.shape[1]
        rows, cols = (self.flat // L).tolist(), (self.flat % L).tolist()
        groups: dict[tuple[int, int], list[int]] = {}  # (row, span) -> gather indices, in column order
        for i, (r, c) in enumerate(zip(rows, cols)):
            groups.setdefault((r, _span_of(self.spans[r], c)), []).append(i)
        if not groups:
            return q.new_zeros(0, q.shape[1], q.shape[3])
        kp, vp, piece = _pieces(k, self.spans), _pieces(v, self.spans), _piece_index(self.spans, L)
        outs, order = [], []
        for (r, s), idx in groups.items():
            qs, qe, ps, pe = self.spans[r][s]
            m = pe - ps
            own, pre = piece[r][qs], piece[r].get(ps) if m else None
            ctx_k = (torch.cat([kp[pre], kp[own]], dim=1) if m else kp[own])[None]  # [1, Hkv, m + n, D]
            ctx_v = (torch.cat([vp[pre], vp[own]], dim=1) if m else vp[own])[None]
            at = torch.tensor([m + cols[i] - qs for i in idx], device=q.device)[:, None]  # query index in context
            key = torch.arange(m + qe - qs, device=q.device)[None, :]
            allowed = key <= at
            if self.window is not None:
                allowed = allowed & (at - key < self.window)
            contiguous = idx[-1] - idx[0] == len(idx) - 1
            qi = q[:, :, idx[0]:idx[-1] + 1] if contiguous else q[:, :, torch.tensor(idx, device=q.device)]
            o = F.scaled_dot_product_attention(qi, ctx_k, ctx_v, attn_mask=allowed,
                                               dropout_p=dropout, scale=scale, enable_gqa=gqa)  # [1, Hq, n, D]
            outs.append(o[0].transpose(0, 1))
            order.extend(idx)
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
        return torch.cat(outs, dim=0)[inverse.to(q.device)]               # [N, Hq, D] in gather order


def _sizes(spans: list[list[tuple[int, int, int, int]]], L: int) -> list[int]:
    """Lengths of the pieces the flattened ``R * L`` columns are cut into: each row's spans, then
    its padding."""
    sizes = []
    for row in spans:
        sizes += [qe - qs for qs, qe, _, _ in row]
        used = row[-1][1] if row else 0
        if used < L:
            sizes.append(L - used)
    return sizes


def _pieces(x: torch.Tensor, spans: list[list[tuple[int, int, int, int]]]) -> tuple[torch.Tensor, ...]:
    """``x`` ``[R, H, L, D]`` cut into its spans' pieces ``[H, n, D]`` with one ``torch.split`` (its
    backward is one concatenation; a slice per span would make a full-size gradient per slice)."""
    R, H, L, D = x.shape
    return torch.split(x.transpose(0, 1).reshape(H, R * L, D), _sizes(spans, L), dim=1)


def _piece_index(spans: list[list[tuple[int, int, int, int]]], L: int) -> list[dict[int, int]]:
    """Per row, span start column -> index of its piece in :func:`_pieces`."""
    out, n = [], 0
    for row in spans:
        out.append({})
        for qs, _, _, _ in row:
            out[-1][qs] = n
            n += 1
        if (row[-1][1] if row else 0) < L:
            n += 1
    return out


def _span_of(spans: list[tuple[int, int, int, int]], col: int) -> int:
    """Index of the span whose query range holds ``col`` (spans are in column order)."""
    lo, hi = 0, len(spans) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if spans[mid][0] <= col:
            lo = mid
        else:
            hi = mid - 1
    if not spans or not spans[lo][0] <= col < spans[lo][1]:
        raise ValueError(f"gather column {col} lies in no segment of its row")
    return lo


__all__ = ["GatheredLastLayer", "LAYER_CLASSES", "supported"]
