"""The run directory and its checkpoints: made (or refused) at the start, removed again when the
start fails before its first checkpoint, the metrics logged into it, and every checkpoint saved
and restored, in the layout :mod:`agents.run_layout` defines (one process: whole tensors,
:func:`memopd.checkpoint.save`; several ranks: a Distributed Checkpoint,
:func:`memopd.checkpoint.save_sharded`). What a checkpoint holds comes from its owners: the models
(:class:`~memopd.learn.student.Student`), the optimizers and schedule
(:class:`~memopd.learn.update.PPOUpdate`), the train state with every plugin's
(:class:`~memopd.learn.state.TrainState`), and the RNG.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from agents.run_layout import RUN_CONFIG
from memopd import checkpoint, distributed
from memopd import config as cfgmod
from memopd.config import ConfigError
from memopd.learn.mix import env_mix
from memopd.learn.state import TrainState
from memopd.learn.student import Student
from memopd.learn.update import PPOUpdate
from memopd.runlog import RunLogger, plot_curves, read_metrics

if TYPE_CHECKING:  # the run's options, for the annotations
    from memopd.learn.options import CoreConfig


class Checkpointer:
    """One run's directory (``cfg.run_dir``): a fresh run's is refused when it holds a run, else
    made with its ``config.toml``; a resumed run's must hold the run. Rank 0 alone writes files
    (other ranks keep a logger that writes nothing), but every rank writes its checkpoint shards."""

    def __init__(self, cfg: CoreConfig, world: distributed.World, log: Callable[[str], None]):
        self.cfg, self.world, self.log = cfg, world, log
        self.run_dir = Path(cfg.run_dir)
        self.made = False
        self.logger: Any = None
        self.logger = self._open()

    def _open(self) -> Any:
        cfg = self.cfg
        if not cfg.resume:
            if checkpoint.list_checkpoints(self.run_dir):
                raise ConfigError(f"--run-dir {self.run_dir} already holds a run with checkpoints; continue it with "
                                  f"--resume {self.run_dir}, or choose another --run-dir")
            text = cfgmod.dump_toml(cfg)  # fails (None in env kwargs) before anything is made
            if not self.world.is_main:  # rank 0 alone writes the run directory
                return _QuietLogger()
            self.made = not self.run_dir.exists()
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                cfgmod.write_text_atomic(self.run_dir / RUN_CONFIG, text)
                # a directory whose earlier start died before its first checkpoint starts clean
                return RunLogger(self.run_dir, cfg.tensorboard, cfg.wandb_project, dataclasses.asdict(cfg),
                                 fresh=True)
            except BaseException:
                self.discard_failed_start()
                raise
        if not self.world.is_main:
            return _QuietLogger()
        return RunLogger(self.run_dir, cfg.tensorboard, cfg.wandb_project, dataclasses.asdict(cfg))

    def discard_failed_start(self) -> None:
        """Remove the run directory this start made, when it never got a checkpoint."""
        if self.made and not checkpoint.list_checkpoints(self.run_dir):
            if self.logger is not None:
                self.logger.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)

    # -- checkpoints -------------------------------------------------------------------------------
    def save(self, step: int, state: TrainState, student: Student, update: PPOUpdate) -> Path:
        """Checkpoint ``step``, with the metrics rows logged at it (``state.rows``): a resume
        rewrites ``metrics.jsonl`` as the rows before this step plus these, so a kill on either side
        of a row's write never duplicates or loses it."""
        owned = update.state_dict()
        common = {"scheduler": owned.pop("scheduler"), "train_state": state.to_dict()}
        if self.world.enabled:
            return checkpoint.save_sharded(self.run_dir, step, student.sharded_state(update.optimizers()), common,
                                           self.world, keep=self.cfg.keep_checkpoints)
        whole = {**owned, "rng": checkpoint.rng_state(), **common}
        return checkpoint.save(self.run_dir, step, student.modules(), whole, keep=self.cfg.keep_checkpoints)

    def restore(self, student: Student, update: PPOUpdate, plugins: Sequence[Any],
                state_type: type[TrainState] = TrainState) -> TrainState:
        """Continue from the newest complete checkpoint (:meth:`load`): the models, optimizers,
        schedule, RNG, the train state and every plugin's (an older layout's read by each plugin),
        ``metrics.jsonl`` as it stood then; the settings the resume changed recorded."""
        saved, path = self.load(student, update)
        state = state_type.from_checkpoint(saved, [type(p) for p in plugins])
        state.step = saved["step"]
        for plugin in plugins:
            plugin.load_state_dict(state.plugins.get(plugin.name, {}))
        self.resumed(state, path)
        return state

    def load(self, student: Student, update: PPOUpdate) -> tuple[dict[str, Any], Path]:
        """The newest complete checkpoint, written by one process or by any number of ranks, into
        the models, the optimizers, the schedule and the RNG; returns its trainer state and path."""
        state, path = checkpoint.load_latest(self.run_dir, student.whole_modules(),
                                             student.sharded_state(update.optimizers()), self.world.rank)
        if state["format"] == "safetensors":  # one-process layout: one RNG state
            rngs = state.get("rng_ranks") or [state["rng"]]  # gathered by rank 0 in earlier versions
            state["rng"] = rngs[self.world.rank % len(rngs)]
        checkpoint.set_rng_state(state["rng"])
        student.sync()
        update.load_state_dict(state)
        return state, path

    def resumed(self, state: TrainState, path: Path) -> None:
        """After a restore: ``metrics.jsonl`` as it stood at the checkpoint, and the settings the
        resume changed recorded in ``config.toml``."""
        earlier = [r for r in read_metrics(self.run_dir) if r.get("step", -1) < state.step]
        self.logger.rewrite(earlier + state.rows)
        self.log(f"resumed from {path} at step {state.step}")
        if self.world.is_main:
            self._record_changes(state.step)

    def _record_changes(self, step: int) -> None:
        """Settings a resume changed (e.g. more --steps): written to config.toml, with a comment
        line per change, and said in the log. An option the saved config predates counts as
        changed only when it is not at its default."""
        path = self.run_dir / RUN_CONFIG
        saved = cfgmod.load_toml(path)
        now = cfgmod.to_dict(self.cfg)
        defaults = cfgmod.to_dict(type(self.cfg)())
        changed = {k: (saved.get(k), v) for k, v in now.items()
                   if k not in ("resume", "run_dir") and saved.get(k, defaults.get(k)) != v}
        if not changed:
            return
        what = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in sorted(changed.items()))
        self.log(f"resume changes settings (recorded in {path}): {what}")
        header = cfgmod.toml_header(path) + [f"resumed at step {step} on {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                                             f"{what}"]
        cfgmod.save_toml(dataclasses.replace(self.cfg, resume=None), path, header)  # as a fresh start writes it

    def last(self) -> Path | None:
        """The newest complete checkpoint (None: none yet)."""
        found = checkpoint.list_checkpoints(self.run_dir)
        return found[0] if found else None

    # -- the log -----------------------------------------------------------------------------------
    def plot(self) -> None:
        if self.world.is_main:
            plot_curves(read_metrics(self.run_dir), self.run_dir / "curves.png",
                        title=f"{' + '.join(s.name for s in env_mix(self.cfg))}  {self.run_dir.name}")

    def close(self) -> None:
        self.logger.close()

    def write_summary(self, summary: dict[str, Any]) -> None:
        """``summary.json`` of the finished run (rank 0; every rank waits for it)."""
        if self.world.is_main:
            cfgmod.write_text_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        distributed.barrier(self.world)


class _QuietLogger:
    """The metrics logger of ranks other than 0: rows are made (for checkpoints) but not written."""

    clean_row = RunLogger.clean_row

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def rewrite(self, rows: Any) -> None:
        pass

    def close(self) -> None:
        pass


__all__ = ["Checkpointer"]
