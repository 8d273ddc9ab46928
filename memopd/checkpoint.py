"""Atomic training checkpoints: a kill never leaves a half-written checkpoint behind.

Layout of a run directory::

    checkpoints/step-000040/   student.safetensors, critic.safetensors?, trainer.pt, meta.json
    checkpoints/latest         the name of the newest complete checkpoint (replaced atomically)

Under torchrun a checkpoint is sharded (:func:`save_sharded`): a Distributed Checkpoint
(``torch.distributed.checkpoint``) of every rank's shards of the models and optimizers, plus
each rank's RNG state::

    checkpoints/step-000040/   dcp/ (.metadata, __<rank>_0.distcp), rng-00000.pt, rng-00001.pt, ...,
                               trainer.pt, meta.json ("format": "dcp", "world_size": N)

DCP reshards on load: a sharded checkpoint resumes at any world size, and one process reads it
whole (no process group needed); a one-process checkpoint resumes under torchrun as well.

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
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file


DCP_DIR = "dcp"
"""The Distributed Checkpoint folder inside a sharded checkpoint."""


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
    """The module's tensors, each stored once: a tied weight (an output head that is the input
    embedding) is saved under its first name only; loading re-ties it (a tied head may be absent).
    SmolLM2's checkpoints were 110 MB larger with the embedding written twice."""
    out, seen = {}, set()
    for k, v in module.state_dict().items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)) if v.numel() else None
        if key is not None and key in seen and "lm_head" in k:  # the tie loading restores (see _load_one)
            continue
        seen.add(key)
        out[k] = v.detach().contiguous().clone()  # safetensors refuses tensors that share storage
    return out


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


def _fsync_tree(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
    for d in [path, *(p for p in path.rglob("*") if p.is_dir())]:
        _fsync_dir(d)


def save_sharded(run_dir: str | Path, step: int, state: Any, trainer_state: dict[str, Any], world: Any,
                 keep: int = 2) -> Path:
    """Checkpoint ``step`` of a multi-rank run, written by every rank in parallel (a collective).

    ``state`` is a :class:`memopd.distributed.ShardedState` (models and optimizers as this rank's
    shards): a Distributed Checkpoint in ``dcp/``. Each rank adds its RNG state
    (``rng-<rank>.pt``); rank 0 adds ``trainer_state`` (scheduler, history: the same on every
    rank) and ``meta.json``, then renames the folder into place and updates ``latest``, as
    :func:`save` does. The ranks must share the run directory's filesystem."""
    import torch.distributed.checkpoint as dcp

    from memopd import distributed

    ckpt_root = Path(run_dir) / "checkpoints"
    tmp_name = None
    if world.is_main:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        clean_leftovers(run_dir)
        tmp_name = Path(tempfile.mkdtemp(prefix=".tmp-", dir=ckpt_root)).name
    tmp = ckpt_root / distributed.from_rank0(tmp_name, world)
    final = step_dir(run_dir, step)
    try:
        sd = state.state_dict()
        with warnings.catch_warnings():  # one process: DCP says it assumes so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(sd, checkpoint_id=str(tmp / DCP_DIR), no_dist=not world.enabled)
        torch.save(rng_state(), tmp / f"rng-{world.rank:05d}.pt")
        distributed.barrier(world)
        if world.is_main:
            torch.save(trainer_state, tmp / "trainer.pt")
            (tmp / "meta.json").write_text(json.dumps({"step": step, "format": "dcp", "world_size": world.size,
                                                       "modules": sorted(state.models),
                                                       "optimizers": [k for k in state.optimizers if k in sd]}))
            _fsync_tree(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(ckpt_root)
            latest_tmp = ckpt_root / ".latest.tmp"
            latest_tmp.write_text(final.name)
            os.replace(latest_tmp, ckpt_root / "latest")
            _prune(ckpt_root, keep)
    finally:
        if world.is_main and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    distributed.barrier(world)  # no rank goes on before the checkpoint is complete
    return final


def is_sharded(path: str | Path) -> bool:
    """Whether checkpoint ``path`` was written by :func:`save_sharded`."""
    try:
        return read_meta(path).get("format") == "dcp"
    except CheckpointError:
        return False


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, newest first."""
    root = Path(run_dir) / "checkpoints"
    return sorted((p for p in root.glob("step-*") if (p / "meta.json").is_file()), reverse=True)


def _load_sharded(path: Path, state: Any, optimizers: list[str]) -> None:
    """Read a Distributed Checkpoint into ``state`` (a ShardedState), resharding as this world needs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if state is None:
        raise CheckpointError(f"{path} is a sharded checkpoint (written under torchrun); this reader takes only "
                              "one-process checkpoints")
    if not (path / DCP_DIR / ".metadata").is_file():
        raise CheckpointError(f"{path}: missing {DCP_DIR}/.metadata")
    fresh = [o for _, o in state.optimizers.values() if not o.state]
    sd = state.state_dict(optimizers)  # gives a fresh optimizer its state, to be overwritten
    try:
        with warnings.catch_warnings():  # one process: DCP says it assumes so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(sd, checkpoint_id=str(path / DCP_DIR), no_dist=not torch.distributed.is_initialized())
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP wraps every reader failure
        for o in fresh:  # as it was: the next checkpoint tried may hold no optimizer state
            o.state.clear()
        raise CheckpointError(f"{path / DCP_DIR}: unreadable or does not match the model ({_dcp_reason(exc)}); "
                              "was it written for another model?") from None
    state.load_state_dict(sd)


def _dcp_reason(exc: BaseException) -> str:
    """The error line of what DCP raised (it wraps each rank's traceback in one message)."""
    lines = [x.strip() for x in str(exc).strip().splitlines() if x.strip()]
    errors = [x for x in lines if re.match(r"^[\w.]+(Error|Exception)\b", x)]
    return (errors or lines or [type(exc).__name__])[-1][:300]


def read_meta(path: str | Path) -> dict[str, Any]:
    """A checkpoint's ``meta.json``; one that is not a JSON object with its step is a
    :class:`CheckpointError` naming the file."""
    file = Path(path) / "meta.json"
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: unreadable ({type(exc).__name__}: {exc}); the checkpoint is damaged") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise CheckpointError(f"{file}: not a checkpoint's meta.json (expected an object with its \"step\"); the "
                              "checkpoint is damaged")
    return meta


def _load_one(path: Path, modules: dict[str, torch.nn.Module], sharded: Any = None, rank: int = 0) -> dict[str, Any]:
    meta = read_meta(path)
    if meta.get("format") == "dcp":
        _load_sharded(path, sharded, meta.get("optimizers", []))
        state = _load_trainer_state(path)
        saved = int(meta["world_size"])
        state["rng"] = torch.load(path / f"rng-{rank % saved:05d}.pt", weights_only=True)
        state["step"], state["format"], state["world_size"] = meta["step"], "dcp", saved
        return state
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
    state = _load_trainer_state(path)
    state["step"], state["format"] = meta["step"], "safetensors"
    return state


def _load_trainer_state(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path / "trainer.pt", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()
        raise CheckpointError(
            f"{path / 'trainer.pt'}: refused: it holds pickled objects other than tensors and plain data, and "
            f"loading them could run code ({first[0][:200] if first else 'weights_only load failed'}). "
            "Resume only run directories written by memopd.train from a source you trust") from None


def load_latest(run_dir: str | Path, modules: dict[str, torch.nn.Module], sharded: Any = None,
                rank: int = 0) -> tuple[dict[str, Any], Path]:
    """Load the newest loadable checkpoint; returns (trainer_state, path).

    A one-process checkpoint is read into ``modules`` (its optimizer state is in the returned
    state); a sharded one into ``sharded`` (a :class:`memopd.distributed.ShardedState`, models and
    optimizers both), with the RNG state saved by rank ``rank`` modulo the saved world size as
    ``state["rng"]``. ``state["format"]`` says which it was. A damaged newest checkpoint is
    reported and the previous one is tried.
    """
    candidates = list_checkpoints(run_dir)
    if not candidates:
        raise CheckpointError(f"no checkpoint in {Path(run_dir) / 'checkpoints'}; nothing to resume "
                              "(start a new run without --resume)")
    clean_leftovers(run_dir)
    errors = []
    named = _latest_name(run_dir)
    missing = named is not None and named not in {p.name for p in candidates}
    for path in candidates:
        try:
            state = _load_one(path, modules, sharded, rank)
        except Exception as exc:  # corrupt safetensors/pickle raise many types
            errors.append(f"{path.name}: {exc}")
            continue
        if missing:
            warnings.warn(f"{Path(run_dir) / 'checkpoints' / 'latest'} names checkpoint {named}, which is missing "
                          f"(deleted, or its files incomplete); resuming from {path.name}, the newest complete one",
                          RuntimeWarning, stacklevel=2)
        if errors:
            warnings.warn(f"skipped damaged checkpoint(s), resuming from {path.name}: " + "; ".join(errors),
                          RuntimeWarning, stacklevel=2)
        return state, path
    raise CheckpointError(f"every checkpoint in {Path(run_dir) / 'checkpoints'} failed to load (start a new run, "
                          "or restore the checkpoints from a backup):\n  " + "\n  ".join(errors))


def _latest_name(run_dir: str | Path) -> str | None:
    """The checkpoint name ``checkpoints/latest`` gives (None when there is no readable one)."""
    try:
        name = (Path(run_dir) / "checkpoints" / "latest").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name or None
