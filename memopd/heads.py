"""Output heads: final hidden states -> logits, exactly as the model's own ``forward`` computes them.

Packed scoring runs the decoder stack once, gathers the final hidden states at the action
positions and projects only those. So everything a ``*ForCausalLM.forward`` does after its last
hidden state must be redone here, and families differ there: Granite divides the logits by
``logits_scaling``, Cohere multiplies them by ``logit_scale``, some multiply by an
``output_multiplier``, Gemma soft-caps them. :func:`output_head` builds the head from the config
and then **checks it against the model's own forward** on a short probe sequence: a model that
does anything else after its decoder (an unknown scale, a bias, a pre-head transform) is refused
with :class:`UnsupportedModelError` before any work, never scored silently wrong.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

PROBE_LEN = 12


class UnsupportedModelError(NotImplementedError):
    """The model does something packed scoring cannot reproduce exactly; the message says what."""


@dataclass
class OutputHead:
    """``hidden [n, H] -> logits [n, V]`` (float32) the way the model's forward computes them:
    ``softcap * tanh(scale * lm_head(h) / softcap)`` (each step only when the model has it)."""

    lm_head: torch.nn.Module
    scale: float = 1.0  # 1 / logits_scaling (Granite), logit_scale (Cohere), output_multiplier
    softcap: float | None = None  # final_logit_softcapping (Gemma 2/3)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        z = self.lm_head(hidden.to(self.weight_dtype)).float()
        if self.scale != 1.0:
            z = z * self.scale
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    @property
    def weight_dtype(self) -> torch.dtype:
        return next(self.lm_head.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.lm_head.parameters()).device

    def describe(self) -> str:
        steps = ["lm_head"] + ([f"x {self.scale:g}"] if self.scale != 1.0 else []) + (
            [f"softcap {self.softcap:g}"] if self.softcap else [])
        return " -> ".join(steps)


def head_from_config(model: torch.nn.Module) -> OutputHead:
    """The post-decoder steps a model's config declares (not yet checked; see :func:`output_head`)."""
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    get = lambda name: getattr(text, name, None) if getattr(text, name, None) is not None else getattr(cfg, name, None)  # noqa: E731
    scale = 1.0
    if get("logits_scaling"):
        scale /= float(get("logits_scaling"))
    if get("logit_scale") is not None and not isinstance(get("logit_scale"), bool):
        scale *= float(get("logit_scale"))
    if get("output_multiplier"):
        scale *= float(get("output_multiplier"))
    softcap = get("final_logit_softcapping")
    head = model.get_output_embeddings()
    if head is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no output embeddings (LM head); "
                                    "pass a *ForCausalLM model")
    return OutputHead(head, scale=scale, softcap=float(softcap) if softcap else None)


_CHECKED: "weakref.WeakKeyDictionary[torch.nn.Module, OutputHead]" = weakref.WeakKeyDictionary()


def probe_tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of the probe: float error only, far below any scale or cap error."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2


@torch.no_grad()
def output_head(model: torch.nn.Module) -> OutputHead:
    """The model's :class:`OutputHead`, checked once per model object against its own forward."""
    head = _CHECKED.get(model)
    if head is not None:
        return head
    from memopd.attention import base_model  # lazy: attention imports nothing from here

    head = head_from_config(model)
    params = next(model.parameters())
    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, PROBE_LEN), generator=gen).to(params.device)
    pos = torch.arange(PROBE_LEN, device=params.device)[None]
    was_training = model.training
    model.eval()
    try:
        ref = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()
        hidden = base_model(model)(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[0]
        ours = head(hidden)
    finally:
        model.train(was_training)
    if ours.shape[-1] != ref.shape[-1]:
        raise UnsupportedModelError(
            f"{type(model).__name__}: its forward returns {ref.shape[-1]} logits per token but its LM head gives "
            f"{ours.shape[-1]}; packed scoring cannot reproduce that")
    err = float((ours - ref).abs().max())
    tol = probe_tolerance(params.dtype) * (1.0 + float(ref.abs().max()))
    if not err <= tol:  # also catches NaN
        raise UnsupportedModelError(
            f"{type(model).__name__} ({model.config.model_type}) computes its logits in a way packed scoring "
            f"does not reproduce: '{head.describe()}' applied to the decoder's last hidden state is {err:.3g} "
            f"off the model's own forward on a probe (tolerance {tol:.2g}). Packed teacher/actor scores would be "
            "silently wrong, so this model is refused; supported post-decoder steps are logits_scaling, "
            "logit_scale, output_multiplier and final_logit_softcapping")
    _CHECKED[model] = head
    return head


__all__ = ["OutputHead", "UnsupportedModelError", "head_from_config", "output_head", "probe_tolerance"]
