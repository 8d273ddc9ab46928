"""Atomic training checkpoints: a kill never leaves a half-written checkpoint behind.

Layout of a run directory::

    checkpoints/step-000040/   model.safetensors, critic.safetensors?, trainer.pt, meta.json
    checkpoints/latest         the name of the newest complete checkpoint (replaced atomically)

A checkpoint is first written to ``checkpoints/.tmp-...`` and renamed into place when every file
is flushed; ``latest`` is updated last with ``os.replace``. Loading verifies the files and falls
back to the previous checkpoint when the newest is damaged.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file


class CheckpointError(RuntimeError):
    """No usable checkpoint (missing or corrupt files); the message says which and what to do."""


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _state_dict_for_save(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    # tied weights share storage; safetensors refuses shared tensors, so save contiguous clones
    return {k: v.detach().contiguous().clone() for k, v in module.state_dict().items()}


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(run_dir: str | Path, step: int, modules: dict[str, torch.nn.Module],
         trainer_state: dict[str, Any], keep: int = 2) -> Path:
    """Write ``modules`` (as safetensors) and ``trainer_state`` (optimizer, scheduler, RNG, metrics
    state; torch-pickled) atomically as checkpoint ``step``; keep the newest ``keep``."""
    ckpt_root = Path(run_dir) / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=ckpt_root))
    try:
        for key, module in modules.items():
            save_file(_state_dict_for_save(module), str(tmp / f"{key}.safetensors"))
        torch.save(trainer_state, tmp / "trainer.pt")
        (tmp / "meta.json").write_text(json.dumps({"step": step, "modules": sorted(modules)}))
        for f in tmp.iterdir():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        final = ckpt_root / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(ckpt_root)
        latest_tmp = ckpt_root / ".latest.tmp"
        latest_tmp.write_text(name)
        os.replace(latest_tmp, ckpt_root / "latest")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _prune(ckpt_root, keep)
    return ckpt_root / name


def _prune(ckpt_root: Path, keep: int) -> None:
    done = sorted(p for p in ckpt_root.glob("step-*") if p.is_dir())
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, newest first."""
    root = Path(run_dir) / "checkpoints"
    return sorted((p for p in root.glob("step-*") if (p / "meta.json").is_file()), reverse=True)


def _load_one(path: Path, modules: dict[str, torch.nn.Module]) -> dict[str, Any]:
    meta = json.loads((path / "meta.json").read_text())
    for key, module in modules.items():
        f = path / f"{key}.safetensors"
        if not f.is_file():
            raise CheckpointError(f"{path}: missing {f.name}")
        state = load_file(str(f))
        try:
            missing, unexpected = module.load_state_dict(state, strict=False)
        except RuntimeError as exc:  # shape mismatch
            raise CheckpointError(f"{f}: does not match the model ({str(exc).splitlines()[1].strip()}); "
                                  "was it written for another model?") from None
        # tied output heads may legitimately be absent from one side
        real_missing = [m for m in missing if "lm_head" not in m]
        if real_missing or unexpected:
            raise CheckpointError(f"{f}: does not match the model (missing {real_missing[:3]}, "
                                  f"unexpected {unexpected[:3]}); was it written for another model?")
    state = torch.load(path / "trainer.pt", weights_only=False)
    state["step"] = meta["step"]
    return state


def load_latest(run_dir: str | Path, modules: dict[str, torch.nn.Module]) -> tuple[dict[str, Any], Path]:
    """Load the newest loadable checkpoint into ``modules``; returns (trainer_state, path).

    A damaged newest checkpoint is reported and the previous one is tried.
    """
    candidates = list_checkpoints(run_dir)
    if not candidates:
        raise CheckpointError(f"no checkpoint in {Path(run_dir) / 'checkpoints'}; nothing to resume "
                              "(start a new run without --resume)")
    errors = []
    for path in candidates:
        try:
            return _load_one(path, modules), path
        except Exception as exc:  # corrupt safetensors/pickle raise many types
            errors.append(f"{path.name}: {exc}")
    raise CheckpointError("every checkpoint failed to load:\n  " + "\n  ".join(errors))
