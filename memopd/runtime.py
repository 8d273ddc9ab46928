"""What a trainer does to the process and its models before and while it runs: torch threads,
the compute dtype of every pass, the memory options of a model, the learning-rate schedule.

The options themselves are declared (and validated) in :mod:`memopd.config`; this module acts on
them, so the config module stays free of torch.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Iterator

from memopd.config import COMPUTE_DTYPES, LR_SCHEDULES, ConfigError, TrainingOptions


def set_threads(threads: int | None) -> None:
    """Apply ``--threads`` (None or 0: torch's default)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


MEMORY_SAVING_PARAMS = 10_000_000
"""Models of this many parameters or more get the memory-saving defaults (gradient checkpointing,
one packed row per forward): their peak is the activations of many layers over a packed row
(SmolLM2-135M: GiBs). The tiny presets (0.6M-1.2M parameters) peak at a few hundred MiB, where
the defaults keep the faster single pass."""


def memory_saving(model: Any) -> bool:
    """Whether ``model`` gets the memory-saving defaults (:data:`MEMORY_SAVING_PARAMS`)."""
    return sum(p.numel() for p in model.parameters()) >= MEMORY_SAVING_PARAMS


def adamw(params: Any, model: Any, **kwargs: Any) -> Any:
    """AdamW for ``model``'s ``params``: fused (one kernel over every tensor, no per-tensor
    temporaries) for a model that gets the memory-saving defaults; torch's default
    implementation otherwise. The default's temporaries are the size of the largest tensor it
    steps, and at SmolLM2 that is the 113 MiB embedding: its step peaked 0.2 GiB above the
    gradients and optimizer state (docs/BENCHMARKS.md)."""
    import torch

    return torch.optim.AdamW(params, fused=True if memory_saving(model) else None, **kwargs)


def default_checkpointing(model: Any) -> bool:
    """``--gradient-checkpointing``'s default: on for a large model (:func:`memory_saving`) that
    supports it."""
    return memory_saving(model) and bool(getattr(model, "supports_gradient_checkpointing", False))


def prepare_model(model: Any, options: TrainingOptions) -> Any:
    """Apply the LoRA options (``--lora-r`` > 0: adapters injected in place, the rest frozen; see
    :mod:`memopd.lora`) and the memory options of ``options`` to a model about to be
    trained; returns it."""
    if getattr(options, "lora_r", 0):
        from memopd.lora import apply

        apply(model, options)
    checkpointing = options.gradient_checkpointing
    if checkpointing is None:  # the default: by the model's size
        checkpointing = default_checkpointing(model)
    if checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ConfigError(f"--gradient-checkpointing: {type(model).__name__} does not support it")
        from memopd.attention import enable_activation_checkpointing

        enable_activation_checkpointing(model)
    return model


def compute_dtype(dtype: str, device: str) -> Any:
    """The context every forward and backward pass of a trainer runs in: nothing for float32,
    ``torch.autocast(device, bfloat16)`` for bfloat16 (weights and optimizer state stay fp32)."""
    import contextlib

    import torch

    if dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {list(COMPUTE_DTYPES)}")
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def lr_lambda(schedule: str, warmup: int, total: int, floor: float = 0.0) -> Callable[[int], float]:
    """The learning-rate multiplier of every trainer: linear warm-up over ``warmup`` steps, then
    ``schedule`` (constant, or cosine / linear decay to ``floor`` x the peak at step ``total``)."""
    if schedule not in LR_SCHEDULES:
        raise ConfigError(f"unknown lr schedule {schedule!r}; choose one of {list(LR_SCHEDULES)}")

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "cosine":
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))
        if schedule == "linear":
            return floor + (1.0 - floor) * (1.0 - frac)
        return 1.0
    return f


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports kilobytes; 0 where the
    platform has no ``resource`` module)."""
    try:
        import resource
    except ImportError:  # Windows
        return 0.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PhaseTimes:
    """Wall-clock seconds of a step's named phases, added up over repeated entries; read as
    ``time/<phase>_s`` metrics (the step's profile: docs/BENCHMARKS.md)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        return {f"time/{k}_s": v for k, v in self.seconds.items()}

