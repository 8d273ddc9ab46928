"""The layout of a training run directory: the one definition that the learner writes and the
model loader reads (``memopd.checkpoint`` saves by it; :mod:`agents.models` loads a run, a
checkpoint or its final model by it, without importing the learner)::

    RUN_DIR/config.toml                  the run's resolved settings (``model`` names the base model)
    RUN_DIR/model/                       the final student, a transformers directory
    RUN_DIR/adapter/                     a LoRA run's final adapters
    RUN_DIR/checkpoints/latest           the name of the newest complete checkpoint
    RUN_DIR/checkpoints/step-000040/     meta.json, trainer.pt, and either <module>.safetensors
                                         (one process) or dcp/ and rng-<rank>.pt (several ranks)
"""

from __future__ import annotations

import os
from pathlib import Path

RUN_CONFIG = "config.toml"
RUN_MODEL_DIR = "model"
"""Where a training run keeps its final model, a standard transformers directory."""
RUN_ADAPTER_DIR = "adapter"
"""Where a LoRA training run keeps its final adapters, an adapter directory (:mod:`agents.lora`)."""
CHECKPOINTS_DIR = "checkpoints"
LATEST = "latest"
META = "meta.json"
TRAINER_STATE = "trainer.pt"
STUDENT = "student"
"""The module name of the student's weights in a checkpoint."""
DCP_DIR = "dcp"
"""A checkpoint written by several ranks holds its models as a Distributed Checkpoint here."""


def weights_file(module: str) -> str:
    """A one-process checkpoint's file of a module's weights (``student.safetensors``)."""
    return f"{module}.safetensors"


def rng_file(rank: int) -> str:
    """A multi-rank checkpoint's file of a rank's RNG state."""
    return f"rng-{rank:05d}.pt"


CHECKPOINT_WEIGHTS = weights_file(STUDENT)


def checkpoints_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def step_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """Where checkpoint ``step`` lives (or will)."""
    return checkpoints_root(run_dir) / f"step-{step:06d}"


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (their ``meta.json`` written last), newest first."""
    return sorted((p for p in checkpoints_root(run_dir).glob("step-*") if (p / META).is_file()), reverse=True)


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    """A checkpoint with the student's weights (one process's file, or a Distributed Checkpoint)."""
    p = Path(path)
    return (p / META).is_file() and ((p / CHECKPOINT_WEIGHTS).is_file() or (p / DCP_DIR / ".metadata").is_file())


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The run's newest complete checkpoint (``checkpoints/latest``, else the highest step)."""
    root = checkpoints_root(run_dir)
    latest = root / LATEST
    if latest.is_file():
        named = root / latest.read_text().strip()
        if is_checkpoint_dir(named):
            return named
    done = sorted(p for p in root.glob("step-*") if is_checkpoint_dir(p))
    return done[-1] if done else None


__all__ = ["CHECKPOINTS_DIR", "CHECKPOINT_WEIGHTS", "DCP_DIR", "LATEST", "META", "RUN_ADAPTER_DIR", "RUN_CONFIG",
           "RUN_MODEL_DIR", "STUDENT", "TRAINER_STATE", "checkpoints_root", "is_checkpoint_dir", "latest_checkpoint",
           "list_checkpoints", "rng_file", "step_dir", "weights_file"]
