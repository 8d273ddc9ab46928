"""MemOPD training: PPO on the final reward + full-vocabulary on-policy distillation, on packed,
state-aligned reconstructions of every recorded model invocation.

    python -m memopd.train --env memgym/LongQA-v0                       # the embedded default
    python -m memopd.train --env memgym/LongQA-v0 --model DIR --teacher DIR

One step, top to bottom (:meth:`memopd.learn.trainer.Trainer.train_step`):
  1. rollout   B questions x G samples with the current student (MemAgent); every model call is
               recorded exactly (prompt ids, positions, sampled ids, sampling log-probs).
  2. pack      the invocations into rows (shared prefix once per row, recorded positions, no
               attention across calls) -> PackedBatch, N action tokens.
  3. advantage group-relative (GRPO-style) or GAE with a critic; trajectory rewards are spread
               over a trajectory's invocations with weight 1 / #invocations, so the number of
               calls is not a hidden weight.
  4. teacher   hidden states of the teacher at the N action positions, under the student's exact
               state (`aligned`, MemOPD) or the flattened history (`persistent`, the control).
  5. weights   the per-token loss weights; TurnOPD, Prune-OPD, f-OPD and your --plugin change them.
  6. update    for each PPO epoch and minibatch of rows:
                 L_actor = L_PPO - alpha * H + lambda * L_OPD
               L_OPD = mean over teacher-mask tokens of KL(p_student || p_teacher) over the full
               vocabulary, projected in chunks from gathered hidden states.

This module is the command line; the learner is the package memopd.learn (see its modules), the
training methods beyond PPO + OPD are plugins in memopd.plugins.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Sequence

from memgym.cli import fail, run_main
from memopd import checkpoint, distributed
from memopd import config as cfgmod
from memopd.config import ConfigError
from memopd.learn.env_check import check_env, check_env_settings, needs_oracle
from memopd.learn.models import MODEL_LR, TINY_LR, default_teacher_dir, ensure_teacher, resolve_defaults
from memopd.learn import state
from memopd.learn.options import CoreConfig, PluginOptions, config_slices
from memopd.learn.mix import split_weight
from memopd.learn.plugin import TrainingError
from memopd.learn.teachers.routing import teacher_flags
from memopd.learn.trainer import Trainer
from memopd.plugins import BUILTIN_PLUGINS
from memopd.runlog import LoggingSetupError, read_metrics


@dataclass
class TrainConfig(PluginOptions, *config_slices(BUILTIN_PLUGINS), CoreConfig):  # type: ignore[misc]
    """Everything a MemOPD run needs: the core options, every built-in training method's, and your
    own plugins'. Every field is a flag: ``opd_coef`` -> ``--opd-coef``."""

    builtin_plugins: ClassVar = BUILTIN_PLUGINS


class TrainState(state.TrainState):
    """The train state of a checkpoint, with the built-in plugins' state in an older layout too."""

    legacy_plugins: ClassVar = BUILTIN_PLUGINS


def prepare(cfg: TrainConfig, explicit: set[str] = frozenset()) -> TrainConfig:
    """The run's config, without touching the disk: a new run gets its directory name and the
    student-dependent defaults (saved resolved, so a resume keeps them); a resume reads the saved
    config back, and only the options in ``explicit`` (flags given with ``--resume``, e.g. a larger
    ``--steps``) change it. The :class:`Trainer` writes ``config.toml``."""
    if cfg.resume:
        run_dir = Path(cfg.resume)
        saved = run_dir / "config.toml"
        if not saved.is_file():
            raise ConfigError(f"--resume {run_dir}: no config.toml there; pass the directory of a run started by "
                              "memopd.train (runs/train/<run>)")
        values = cfgmod.load_toml(saved)
        values.update({name: getattr(cfg, name) for name in explicit})
        values.update({"resume": str(run_dir), "run_dir": str(run_dir)})
        return cfgmod.from_dict(TrainConfig, values, source=str(saved))
    if cfg.run_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        cfg = dataclasses.replace(cfg, run_dir=f"runs/train/{cfg.env.replace('/', '_')}-{stamp}")
    return resolve_defaults(task_defaults(cfg, explicit))


def task_defaults(cfg: TrainConfig, explicit: set[str] = frozenset()) -> TrainConfig:
    """The task folders' recommended settings (their task.toml ``[train]`` tables) for the options
    not given: a task whose default student needs e.g. a longer warm start says so once, where the
    task is defined, and every other task's run is unchanged. A mix of envs takes every task's table;
    two tasks that recommend different values for one option not given are refused (give it)."""
    from memgym.errors import UnknownEnvError
    from memgym.registry import TASKS, resolve_id
    from memopd.learn.mix import env_mix

    names = {f.name for f in dataclasses.fields(cfg)}
    recommended: dict[str, object] = {}
    source: dict[str, str] = {}
    for env in dict.fromkeys(spec.name for spec in env_mix(cfg)):
        try:
            task = TASKS[resolve_id(env)]
        except (KeyError, UnknownEnvError):
            continue  # not a task folder's env (check_env has accepted it): nothing recommended
        for key, value in task.train.items():
            if key not in names:
                raise ConfigError(f"{task.config_path}: key 'train.{key}': not a memopd.train option (see python -m "
                                  "memopd.train --help)")
            if key in explicit:
                continue
            if key in recommended and recommended[key] != value:
                raise ConfigError(f"the mix's tasks recommend different values for '{key}' ({source[key]}: "
                                  f"{recommended[key]!r}, {task.config_path}: {value!r}): give --{key.replace('_', '-')}")
            recommended[key], source[key] = value, str(task.config_path)
    if not recommended:
        return cfg
    values = {**cfgmod.to_dict(cfg), **recommended}
    return cfgmod.from_dict(TrainConfig, values, source=" and ".join(f"{p} [train]" for p in dict.fromkeys(source.values())))


def _resume_after_restart(cfg: TrainConfig) -> TrainConfig:
    """``torchrun --max-restarts`` starts the ranks again with the same flags: a ``--run-dir`` that
    holds a checkpoint by then is resumed from it."""
    if cfg.resume or not cfg.run_dir or not distributed.restarted():
        return cfg
    return dataclasses.replace(cfg, resume=cfg.run_dir) if checkpoint.list_checkpoints(cfg.run_dir) else cfg


def interrupted(cfg: TrainConfig) -> str:
    """What Ctrl-C leaves: the last checkpoint kept, and the command that continues from it."""
    run_dir = Path(cfg.run_dir)
    last = checkpoint.list_checkpoints(run_dir) if run_dir.is_dir() else []
    if last:
        return (f"interrupted: the last checkpoint is kept, {last[0]}; continue from it with: "
                f"python -m memopd.train --resume {run_dir}")
    return ("interrupted before the first checkpoint; nothing to resume: rerun the same command (a half-built "
            "auto teacher resumes where it stopped)")


def env_flags(argv: Sequence[str]) -> list[str]:
    """``--env`` given more than once, or with a weight or options of its own (``NAME:2``,
    ``NAME,num_chunks=6``; ``memgym:LongQA-v0`` is a name), is the mix: each use becomes ``--env-mix`` (:mod:`memopd.learn.mix`).
    One plain ``--env`` is left as is."""
    argv = list(argv)
    at = [i for i, a in enumerate(argv[:-1]) if a == "--env"]
    values = [argv[i + 1] for i in at] + [a.split("=", 1)[1] for a in argv if a.startswith("--env=")]
    if len(values) < 2 and not any("," in v or split_weight(v)[0] != v for v in values):
        return argv
    out: list[str] = []
    for a in argv:
        out.append("--env-mix" if a == "--env" else "--env-mix=" + a[6:] if a.startswith("--env=") else a)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: bad input prints ``error: ...`` and exits 2; a run stopped by non-finite losses
    exits 1."""
    from agents.models import ModelLoadError

    def _main() -> int:
        cfg, given = cfgmod.parse_known(TrainConfig, teacher_flags(env_flags(sys.argv[1:] if argv is None else argv)),
                                        "python -m memopd.train", __doc__)
        cfg = _resume_after_restart(cfg)
        if not cfg.resume:
            check_env(cfg.env)
        cfg = prepare(cfg, given - {"resume", "config"})
        if distributed.launched_size() > 1:  # every rank uses rank 0's run directory (its name holds a time)
            world = distributed.setup(cfg.device, cfg.dist_timeout)
            cfg = dataclasses.replace(cfg, run_dir=distributed.from_rank0(cfg.run_dir, world))
        if distributed.launched_rank() == 0:  # every option goes to RUN_DIR/config.toml
            print(f"config: {cfgmod.changed_options(cfg)} (all options: {cfg.run_dir}/config.toml)", file=sys.stderr)
        try:
            Trainer(cfg, log=lambda m: print(m, file=sys.stderr, flush=True)).fit()
        except TrainingError as exc:
            return fail(str(exc), code=1)
        except KeyboardInterrupt:
            if distributed.launched_rank() == 0:
                print("\n" + interrupted(cfg), file=sys.stderr, flush=True)  # below the progress bar's line
            return 130
        finally:
            distributed.shutdown()  # under torchrun: leave the process group cleanly
        return 0

    return run_main(_main, errors=(ConfigError, ModelLoadError, checkpoint.CheckpointError, LoggingSetupError,
                                   distributed.DistributedError, ValueError))


__all__ = ["MODEL_LR", "TINY_LR", "TrainConfig", "TrainState", "Trainer", "TrainingError", "check_env_settings",
           "default_teacher_dir", "ensure_teacher", "main", "needs_oracle", "prepare", "read_metrics",
           "resolve_defaults"]


if __name__ == "__main__":
    sys.exit(main())
