"""The one interface through which a training method changes a MemOPD step.

The step (:meth:`memopd.learn.trainer.Trainer.train_step`) is a straight line: rollout -> pack ->
advantages -> teacher -> loss weights -> PPO + OPD update -> metrics. A plugin may touch three
places of it, and nothing else:

- **the rollout**: :meth:`Plugin.wrap_rollout` gets the step's rollout function and returns one
  that limits it (a depth budget, the top-k to record: :class:`~memopd.learn.actor.RolloutLimits`),
  wraps it (train on older batches) or replaces it (episodes from asynchronous workers);
- **the per-token loss weights**: :meth:`Plugin.weigh` multiplies or replaces
  :class:`LossWeights` (the PPO/entropy/value weights and the distillation weights of every
  action token) and returns its metrics; plugins weigh in the order they are listed;
- **the end of a step**: :meth:`Plugin.end_step` sees the :class:`StepResult` (to adapt its
  state: choose a depth, publish weights) and returns its metrics.

A plugin owns its options (``Options``: a :mod:`memopd.config` dataclass whose fields are flags of
``memopd.train``, shown in their own ``--help`` group), its metrics and its checkpoint state
(:meth:`state_dict` / :meth:`load_state_dict`, saved with every checkpoint). The built-in methods
live in :mod:`memopd.plugins`; a user adds one with ``--plugin module:Class`` or under the
``memopd.plugins`` entry-point group (see docs/extend.md, "Extend the learner").
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

from memopd.learn.needs import Need

if TYPE_CHECKING:
    import torch

    from agents.records import Episode
    from memopd.distributed import World
    from memopd.learn.actor import Rollout, RolloutLimits
    from memopd.packing import PackedBatch
    from memopd.scoring import ActionStates

RolloutFn = Callable[[int, "RolloutLimits"], "Rollout"]
"""A step's rollout: (step, limits) -> the episodes every rank trains on, with rollout metrics."""

ENTRY_POINT_GROUP = "memopd.plugins"


class TrainingError(RuntimeError):
    """Training cannot go on (too many non-finite losses in a row, rollout workers lost); the
    message says why and what to do. ``memopd.train`` prints it and exits 1."""


class PluginSpecError(ValueError):
    """A ``--plugin`` spec that names nothing importable, or not a :class:`Plugin`."""


@dataclass
class LossWeights:
    """Per-token weights of a step's loss terms, [N] in the packed batch's action order.

    ``ppo``: the PPO, entropy and value terms' weights (each trajectory 1 in all, split over its
    calls and tokens; 0 for an episode cut before its answer). ``opd``: the distillation weights
    (the teacher mask to start with).

    The loss divides each weighted sum by the sum of the weights *as the step made them*, before
    any plugin (``ppo_base`` and ``opd_base``, fixed at construction): a plugin that lowers
    weights lowers its tokens' part of the loss, also when it lowers every token alike (a
    uniformly stale step, an episode that drifted from its first token). A plugin that only moves
    weight between tokens keeps their sum (:meth:`redistribute_opd`)."""

    ppo: torch.Tensor
    opd: torch.Tensor
    ppo_base: torch.Tensor = field(init=False)
    opd_base: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.ppo_base, self.opd_base = self.ppo.clone(), self.opd.clone()

    def redistribute_opd(self, new: torch.Tensor, world: World | None = None) -> None:
        """Set the distillation weights to ``new`` scaled to the sum the current ones have (over
        every rank of ``world``: the sums are the whole step's)."""
        from memopd import distributed

        old, got = distributed.all_sum([float(self.opd.sum()), float(new.sum())], world or distributed.SINGLE)
        self.opd = new * (old / got) if got > 0 else new


@dataclass
class WeighContext:
    """What :meth:`Plugin.weigh` may read: the step's packed batch and its episodes (this rank's
    share under torchrun), each episode's policy-version lag, the teacher's states, and the
    student's states and log-probs before the update."""

    step: int
    progress: float  # how far training is, in [0, 1] (of --steps, or of --time-budget when one is set)
    batch: PackedBatch
    episodes: Sequence[Episode]
    lags: torch.Tensor  # [E] policy versions between each episode's sampling policy and the one trained
    world: World
    minibatches: Sequence[PackedBatch]
    teacher_states: ActionStates | None
    teacher_logp: torch.Tensor | None  # [N, V] the teacher's kept log-distribution (None: project the states)
    trainer_logp: torch.Tensor | None  # [N] the student's log-probs of the sampled tokens before the update
    student_states: Callable[[PackedBatch], ActionStates]  # the student's states at a minibatch's actions
    scored: bool = True  # whether a teacher scored the step (its states may be None: a served teacher)


@dataclass
class StepResult:
    """What a step leaves for :meth:`Plugin.end_step`: the episodes trained on (all ranks'), the
    indices of this rank's share, its packed batch, the per-token teacher divergence of the first
    epoch ([N], NaN where unsupervised) and the step's metrics so far."""

    step: int
    episodes: list[Episode]
    own: list[int]
    batch: PackedBatch
    token_kl: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class PluginContext:
    """What a plugin is built with: the run's config, the distributed world, the student with whole
    weights (what rollouts sample), its tokenizer, the teacher (None without one), the log, the
    run directory, and the step the run starts at."""

    cfg: Any
    world: World
    student: Any
    tokenizer: Any
    teacher: Any  # a memopd.learn.teachers.Teacher, or None
    log: Callable[[str], None]
    run_dir: Path
    options: Any = None  # the plugin's own Options, for a plugin given by --plugin


class Plugin:
    """Base of every training method plugged into the step; each hook's default does nothing."""

    name: ClassVar[str] = ""
    """Its name in metrics, checkpoints and ``Trainer.plugin(name)``."""
    Options: ClassVar[type | None] = None
    """Its config slice: a dataclass of :func:`memopd.config.field` fields (built-ins: flags of
    ``memopd.train``; a ``--plugin``'s: set with ``--plugin-kwarg KEY=VALUE``)."""
    needs_trainer_logprobs: bool = False
    """Set when :meth:`weigh` reads ``WeighContext.trainer_logp`` (a forward pass of its own)."""
    teacher_needs: ClassVar[tuple[Need, ...]] = ()
    """What it reads of the teacher beyond the estimator (checked at start against what the teacher
    provides: :mod:`memopd.learn.needs`)."""

    def __init__(self, ctx: PluginContext) -> None:
        self.ctx = ctx

    @classmethod
    def enabled(cls, cfg: Any) -> bool:
        """Whether a built-in plugin is on for ``cfg`` (its options switch it on)."""
        return True

    def start(self, step: int) -> None:
        """The run (fresh or resumed) is about to train from ``step``."""

    def wrap_rollout(self, rollout: RolloutFn) -> RolloutFn:
        """The step's rollout function, limited, wrapped or replaced (default: as it is)."""
        return rollout

    def weigh(self, weights: LossWeights, ctx: WeighContext) -> dict[str, float]:
        """Change the step's loss weights in place; returns metrics."""
        return {}

    def end_step(self, result: StepResult) -> dict[str, float]:
        """After the update; returns metrics."""
        return {}

    def close(self) -> None:
        """The run ends (also on an error): release what the plugin holds."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON-able or torch-saveable values)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


def resolve_plugin(spec: str) -> type[Plugin]:
    """``module:Class`` (imported from the current directory too, as ``--agent`` is) or a name in
    the ``memopd.plugins`` entry-point group -> the plugin class."""
    target = spec if ":" in spec else _entry_point(spec)
    module_name, _, attr = target.partition(":")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # examples.my_plugin:MyPlugin from the working directory
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginSpecError(f"--plugin {spec}: cannot import {module_name!r} ({exc}); give module:Class "
                              "importable from the current directory or installed") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Plugin)):
        raise PluginSpecError(f"--plugin {spec}: {module_name}.{attr} is not a memopd.learn.plugin.Plugin subclass")
    if not cls.name:
        raise PluginSpecError(f"--plugin {spec}: {cls.__name__} has no `name` (a class attribute naming it in "
                              "metrics and checkpoints)")
    return cls


def _entry_point(name: str) -> str:
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == name:
            return entry.value
    raise PluginSpecError(f"--plugin {name}: no such plugin; give module:Class, or install a package that "
                          f"registers {name!r} under the {ENTRY_POINT_GROUP!r} entry points")


def plugin_options(cls: type[Plugin], kwargs: dict[str, Any], spec: str) -> Any:
    """A ``--plugin``'s Options from the ``--plugin-kwarg`` values it declares (None without Options)."""
    from memopd.config import ConfigError, from_dict

    if cls.Options is None:
        return None
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls.Options)}
    try:
        return from_dict(cls.Options, {k: v for k, v in kwargs.items() if k in names}, source=f"--plugin {spec}")
    except ConfigError as exc:
        message = str(exc)
        for name in names:  # its options are --plugin-kwarg values, not flags of their own
            message = message.replace(f"--{name.replace('_', '-')}=", f"--plugin-kwarg {name}=")
        raise PluginSpecError(message) from None


def check_plugin_kwargs(classes: Sequence[type[Plugin]], kwargs: dict[str, Any]) -> None:
    """Every ``--plugin-kwarg`` must name an option of one of the ``--plugin`` classes."""
    import dataclasses

    known = {f.name for c in classes if c.Options is not None for f in dataclasses.fields(c.Options)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise PluginSpecError(f"--plugin-kwarg {unknown[0]}: no --plugin takes it (their options: "
                              f"{', '.join(sorted(known)) or 'none'})")


__all__ = ["ENTRY_POINT_GROUP", "LossWeights", "Plugin", "PluginContext", "PluginSpecError", "RolloutFn",
           "StepResult", "TrainingError", "WeighContext", "check_plugin_kwargs", "plugin_options", "resolve_plugin"]
