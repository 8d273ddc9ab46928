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

A plugin owns its options (``Options``: a :mod:`memopd.config` dataclass, read as
``self.options``; a built-in's fields are flags of ``memopd.train`` in their own ``--help`` group,
any other's are set with ``--plugin-kwarg``), its metrics and its checkpoint state
(:meth:`state_dict` / :meth:`load_state_dict`, saved with every checkpoint), and states as data how
it goes with the others: ``order`` (where it runs), ``requires`` (plugins switched on with it),
``excludes`` (what it cannot run with, and why) and ``teacher_needs``; :func:`select_plugins`
checks them in one place. The built-in methods live in :mod:`memopd.plugins` (the command line
composes their options into its config); a user adds one with ``--plugin module:Class`` or under the
``memopd.plugins`` entry-point group (see docs/extend.md, "Extend the learner").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence

from memopd.config import ConfigError
from memopd.learn.needs import Need
from memopd.learn.registry import Registry, SpecError, options_of

# CoreConfig (memopd.learn.options) names the run's core options in the annotations; it is not imported,
# even for type checkers, because options imports this module (an import cycle otherwise).
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


class PluginSpecError(SpecError):
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

    @classmethod
    def initial(cls, ppo: torch.Tensor, teacher: torch.Tensor, supervised: torch.Tensor | None,
                ppo_norm: torch.Tensor | None = None) -> LossWeights:
        """A step's weights before any plugin: the trajectory weights, and the teacher mask less the
        actions the teacher has no target for (``supervised``; None: it has one for every action).
        ``ppo_norm``: the PPO normaliser's weights where the aggregation gives them apart (Dr. GRPO's
        constant, :func:`memopd.learn.policy_loss.aggregation_weights`)."""
        out = cls(ppo, teacher.float() if supervised is None else teacher.float() * supervised.float())
        if ppo_norm is not None:
            out.ppo_base = ppo_norm.clone()
        return out

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
    """What a plugin is built with: the run's config (its core options: no other plugin's), the
    distributed world, the student with whole weights (what rollouts sample), its tokenizer, the
    teacher (None without one), the log, the run directory, and the plugin's own options."""

    cfg: CoreConfig
    world: World
    student: Any
    tokenizer: Any
    teacher: Any  # a memopd.learn.teachers.Teacher, or None
    log: Callable[[str], None]
    run_dir: Path
    options: Any = None  # the plugin's own Options


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
    order: ClassVar[int] = 100
    """Where it runs among the plugins, lowest first (the first one's rollout wrapper is the
    outermost, its weights change first); ties keep the order the plugins were given in."""
    requires: ClassVar[tuple[str, ...]] = ()
    """Plugins (by name) switched on with this one."""
    excludes: ClassVar[Mapping[str, str]] = {}
    """What it cannot run with: a plugin's name or feature (:meth:`features`) -> why, one line."""

    def __init__(self, ctx: PluginContext) -> None:
        self.ctx = ctx

    @property
    def options(self) -> Any:
        """Its own options (an instance of ``Options``)."""
        return self.ctx.options

    @classmethod
    def enabled(cls, options: Any) -> bool:
        """Whether a built-in plugin is on for its ``options`` (a ``--plugin`` one always is)."""
        return True

    @classmethod
    def features(cls, options: Any) -> set[str]:
        """What it does with these options, by name (for others' ``excludes``): its name, and any
        part that can be on or off."""
        return {cls.name}

    @classmethod
    def check(cls, options: Any, cfg: CoreConfig) -> None:
        """Refuse (:class:`memopd.config.ConfigError`) what its options cannot do with the run's."""

    @classmethod
    def legacy_state(cls, saved: Mapping[str, Any]) -> dict[str, Any] | None:
        """Its state in a checkpoint written before plugins kept their own (None: it had none)."""
        return None

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


REGISTRY = Registry("--plugin", "plugin", ENTRY_POINT_GROUP, Plugin)


def policy_lags(episodes: Sequence[Episode], step: int) -> torch.Tensor:
    """[E] policy versions between each episode's sampling policy and the one trained at ``step``."""
    import torch

    return torch.tensor([float(step - max((i.policy_version for i in e.invocations), default=step))
                         for e in episodes])


def chain_rollouts(plugins: Sequence[Plugin], rollout: RolloutFn) -> RolloutFn:
    """``rollout`` wrapped by every plugin, the first plugin's wrapper outermost."""
    for plugin in reversed(plugins):
        rollout = plugin.wrap_rollout(rollout)
    return rollout


def resolve_plugin(spec: str) -> type[Plugin]:
    """``module:Class`` (imported from the current directory too, as ``--agent`` is) or a name in
    the ``memopd.plugins`` entry-point group -> the plugin class."""
    try:
        return REGISTRY.resolve(spec)
    except PluginSpecError:
        raise
    except SpecError as exc:
        raise PluginSpecError(str(exc)) from None


def plugin_options(cls: type[Plugin], kwargs: dict[str, Any], spec: str) -> Any:
    """A ``--plugin``'s Options from the ``--plugin-kwarg`` values it declares (None without Options)."""
    try:
        return options_of(cls, kwargs, f"--plugin {spec}", "--plugin-kwarg")
    except ConfigError as exc:
        raise PluginSpecError(str(exc)) from None


def check_plugin_kwargs(classes: Sequence[type[Plugin]], kwargs: dict[str, Any]) -> None:
    """Every ``--plugin-kwarg`` must name an option of one of the ``--plugin`` classes."""
    known = {f.name for c in classes if c.Options is not None for f in dataclasses.fields(c.Options)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise PluginSpecError(f"--plugin-kwarg {unknown[0]}: no --plugin takes it (their options: "
                              f"{', '.join(sorted(known)) or 'none'})")


def select_plugins(builtin: Sequence[type[Plugin]], cfg: CoreConfig) -> list[tuple[type[Plugin], Any]]:
    """The run's plugins with their options, in their order: the built-in ones that their options
    (read from ``cfg``'s flags) switch on, with what they require, then the ``--plugin`` ones (from
    ``--plugin-kwarg``). The rules between them (``excludes``) and each one's own checks against the
    run are applied here, the one place: a broken rule is a :class:`memopd.config.ConfigError`."""
    options = {c: _flag_options(c, cfg) for c in builtin}
    on = {c.name: c for c in builtin if c.enabled(options[c])}
    wanted = list(on.values())
    while wanted:  # what the switched-on plugins require, and what that requires
        for name in wanted.pop().requires:
            if name not in on:
                on[name] = next(c for c in builtin if c.name == name)
                wanted.append(on[name])
    chosen = [(c, options[c]) for c in builtin if c.name in on]
    chosen += [(c, plugin_options(c, cfg.plugin_kwargs, spec)) for spec, c in
               ((spec, resolve_plugin(spec)) for spec in cfg.plugin)]
    chosen.sort(key=lambda pair: pair[0].order)  # stable: ties keep the order given
    features = {f: c for c, o in chosen for f in c.features(o)}
    for cls, opts in chosen:
        for feature, why in cls.excludes.items():
            if feature in features:
                raise ConfigError(why)
        cls.check(opts, cfg)
    return chosen


def _flag_options(cls: type[Plugin], cfg: CoreConfig) -> Any:
    """A built-in plugin's options: its fields of the run's config (its flags)."""
    if cls.Options is None:
        return None
    from memopd.config import from_dict

    return from_dict(cls.Options, {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls.Options)})


__all__ = ["ENTRY_POINT_GROUP", "REGISTRY", "LossWeights", "Plugin", "PluginContext", "PluginSpecError", "RolloutFn",
           "StepResult", "TrainingError", "WeighContext", "chain_rollouts", "check_plugin_kwargs", "plugin_options",
           "policy_lags", "resolve_plugin", "select_plugins"]
