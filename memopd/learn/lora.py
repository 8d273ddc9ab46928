"""LoRA training (``--lora-r`` > 0): the options, and what the learner does with them.

The adapters are injected in place into the transformers model (:func:`agents.lora.apply_lora`),
so the packed forward, the last-layer shortcut, gradient checkpointing, the RCE audit and the hf
rollout backend all run the adapted model through the same code as a full-weight student. What
changes:

- the optimizer holds the trainable parameters only (:func:`trainable_parameters`);
- the ``--ref-beta`` reference is the student itself with its adapters switched off
  (:func:`agents.lora.adapters_off`), not a second copy of the model;
- a checkpoint keeps the trainable tensors only (:class:`TrainableState`: the adapters, and a
  critic's value head) and their optimizer state; a resume rebuilds base + adapters from
  ``--model`` and the LoRA options, then loads them;
- the final model (``RUN_DIR/model``) is the merged model, and ``RUN_DIR/adapter`` the adapter
  directory (:func:`agents.lora.save_adapter_dir`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from agents.lora import DEFAULT_TARGETS, LoRAError, adapter_state, apply_lora, has_adapters, load_adapter_state
from memopd.config import ConfigError, field


@dataclass
class LoRAOptions:
    """LoRA: train low-rank adapters instead of every weight (needs peft)"""

    lora_r: int = field(0, help="LoRA rank: > 0 trains adapters of this rank on --lora-targets (through peft) and "
                                "freezes the rest of the model; 0 = train every weight", range=(0, None))
    lora_alpha: float = field(16.0, help="LoRA scale numerator: the adapters' update is B A x alpha / r",
                              range=(0.0, None))
    lora_dropout: float = field(0.0, help="dropout on the adapters' input while training", range=(0.0, 1.0))
    lora_targets: list = field(default_factory=lambda: list(DEFAULT_TARGETS),
                               help="the linear layers that get adapters, comma-separated, by their last name part, "
                                    "or all-linear (every linear layer but the output head). Default: the attention "
                                    f"and MLP projections {','.join(DEFAULT_TARGETS)}; on a model with fused "
                                    "projections (Phi3, GPT-NeoX) that lacks them, all-linear. In a TOML config: a "
                                    "list")

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]
        if self.lora_r:
            if not self.lora_targets:
                raise ConfigError("--lora-targets is empty; name at least one linear layer (e.g. q_proj,v_proj)")
            try:
                from agents.lora import require_peft

                require_peft()
            except LoRAError as exc:
                raise ConfigError(f"--lora-r {self.lora_r}: {exc}") from None


def lora_on(cfg: Any) -> bool:
    return bool(getattr(cfg, "lora_r", 0))


def apply(model: torch.nn.Module, cfg: Any) -> torch.nn.Module:
    """Inject ``cfg``'s adapters into ``model`` in place when ``--lora-r`` > 0 (else nothing)."""
    if not lora_on(cfg):
        return model
    try:
        return apply_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets, base=cfg.model)
    except LoRAError as exc:
        raise ConfigError(str(exc)) from None


def trainable_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What an optimizer gets: every parameter of a full-weight model (the same list, in the same
    order, as ``parameters()``), only the adapters (and heads) of a LoRA one."""
    return [p for p in module.parameters() if p.requires_grad]


class TrainableState:
    """A module as a checkpoint sees it under LoRA: ``state_dict`` is its trainable tensors only
    (live, not copies), ``load_state_dict`` loads them (missing / unexpected counted among them)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def state_dict(self) -> dict[str, torch.Tensor]:
        return adapter_state(self.module)

    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = False):
        return load_adapter_state(self.module, dict(state))


def checkpoint_view(module: torch.nn.Module) -> Any:
    """``module``, or its :class:`TrainableState` when it carries adapters."""
    return TrainableState(module) if has_adapters(module) else module


def parameter_bytes(modules: Iterable[torch.nn.Module]) -> int:
    """Bytes of the parameters and buffers of ``modules`` (each tensor counted once)."""
    seen, total = set(), 0
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


__all__ = ["LoRAOptions", "TrainableState", "apply", "checkpoint_view", "lora_on", "parameter_bytes",
           "trainable_parameters"]
