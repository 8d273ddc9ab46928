"""Atomic training checkpoints: a kill never leaves a half-written checkpoint behind.

Layout of a run directory::

    checkpoints/step-000040/   model.safetensors, critic.safetensors?, trainer.pt, meta.json
    checkpoints/latest         the name of the newest complete checkpoint (replaced atomically)

A checkpoint is first written to ``checkpoints/.tmp-...`` and renamed into place when every file
is flushed; ``latest`` is updated last with ``os.replace``. Loading verifies the files and falls
back to the previous checkpoint when the newest is damaged (with a warning). Leftover ``.tmp-*``
folders of a killed save are removed by the next save or resume.

``trainer.pt`` holds only tensors and plain data (RNG states included) and is read with
``torch.load(weights_only=True)``: a checkpoint that holds any other pickled object is refused,
so resuming a run directory from someone else cannot run code.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file


class CheckpointError(RuntimeError):
    """No usable checkpoint (missing or corrupt files); the message says which and what to do."""


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states as tensors and plain data (loadable with weights_only)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": {"version": version, "state": list(internal), "gauss": gauss},
            "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached"]))
    torch.set_rng_state(state["torch"])


def clean_leftovers(run_dir: str | Path) -> list[Path]:
    """Remove what a killed save left in ``checkpoints/`` (``.tmp-*`` folders, ``.latest.tmp``)."""
    root = Path(run_dir) / "checkpoints"
    gone = [p for p in root.glob(".tmp-*")] + [p for p in root.glob(".latest.tmp")]
    for p in gone:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return gone


def step_dir(run_dir: str | Path, step: int) -> Path:
    """Where checkpoint ``step`` lives (or will)."""
    return Path(run_dir) / "checkpoints" / f"step-{step:06d}"


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
    state: tensors and plain data only) atomically as checkpoint ``step``; keep the newest ``keep``.

    A module may be anything with ``state_dict()`` / ``load_state_dict(state, strict=False)``, such
    as :class:`memopd.distributed.FullState` (a sharded model seen whole)."""
    ckpt_root = Path(run_dir) / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    clean_leftovers(run_dir)
    name = step_dir(run_dir, step).name
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
    try:
        state = torch.load(path / "trainer.pt", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()
        raise CheckpointError(
            f"{path / 'trainer.pt'}: refused: it holds pickled objects other than tensors and plain data, and "
            f"loading them could run code ({first[0][:200] if first else 'weights_only load failed'}). "
            "Resume only run directories written by memopd.train from a source you trust") from None
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
    clean_leftovers(run_dir)
    errors = []
    for path in candidates:
        try:
            state = _load_one(path, modules)
        except Exception as exc:  # corrupt safetensors/pickle raise many types
            errors.append(f"{path.name}: {exc}")
            continue
        if errors:
            warnings.warn(f"skipped damaged checkpoint(s), resuming from {path.name}: " + "; ".join(errors),
                          RuntimeWarning, stacklevel=2)
        return state, path
    raise CheckpointError(f"every checkpoint in {Path(run_dir) / 'checkpoints'} failed to load (start a new run, "
                          "or restore the checkpoints from a backup):\n  " + "\n  ".join(errors))
