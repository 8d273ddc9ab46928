"""TurnOPD (Zhou et al., 2026, "Making On-Policy Distillation Turn-Aware"): two budgets of
on-policy distillation over the turns (model calls) of a long-horizon episode, as one plugin.

**Loss budgeting** (``--opd-weighting progressive``, the paper's; ``turn`` and ``token`` are its
two ends held fixed). Within a trajectory, turn ``t``'s share of the loss blends the token share
(``n_t / N``: long turns dominate, deep turns get a few percent) with the turn share (``1 / T``)::

    q_t = (1 - alpha) * n_t / N + alpha / T,      alpha = clip((k / K - s) / (e - s), 0, 1)

spread equally over the turn's tokens, and the trajectories averaged alike
(:func:`turn_blend_weights`); ``alpha`` follows training progress ``k / K`` from
``--opd-turn-start`` s = 0 to ``--opd-turn-end`` e = 1 (:func:`turn_share`). The
schedule alone drives alpha: the paper blends rather than switching because equal turn shares
over-amplify deep turns that few trajectories reach.

**Depth budgeting** (``--adaptive-depth``). Every ``--depth-probe-every`` steps (and during the
first ``--depth-warmup`` steps) the rollout is full: a *probe*. Only probes update the controller
(a cut rollout's missing tail would bias it down). From a probe's trajectories
(:class:`DepthController`):

    K_t   the mean over the trajectories alive at turn t of their turn-t divergence to the teacher
    n_t   the trajectories alive at turn t (n_0: all of them)
    m_t = max(K_t, 0) * n_t / n_0,   q_t = m_t / (sum_j m_j + eps),   H_eff = round(sum_t t * q_t)
    H_cov = the --depth-coverage quantile of the last turn index of the successful probe
            trajectories (F1 >= --depth-success-f1), refreshed once --depth-min-successes succeed
    H_ctrl = max(H_eff, H_cov);  H_bar = (1 - a) * H_bar + a * H_ctrl  (a = --depth-ema)
    cap = clip(round(H_bar) + 1, --depth-min, --depth-max)

The rollouts between probes are cut at ``cap`` calls (no answer and no reward: distillation terms
only). On MemAgent every trajectory that answers reads every chunk, so the coverage floor keeps
the whole depth; ``--depth-coverage 0`` leaves the floor out and lets the KL centroid alone set it
(docs/methods.md says where this departs from the paper).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from memopd import distributed
from memopd.config import Config, ConfigError, field
from memopd.learn.actor import Rollout, RolloutLimits
from memopd.learn.plugin import LossWeights, Plugin, RolloutFn, StepResult, WeighContext
from memopd.runlog import mean


# -- the maths ------------------------------------------------------------------------------------

OPD_WEIGHTINGS = ("token", "turn", "progressive")
TURN_SHAPES = ("linear", "cosine")


def turn_share(weighting: str, progress: float, start: float = 0.0, end: float = 1.0,
               shape: str = "linear") -> float:
    """TurnOPD's mixing coefficient alpha at ``progress`` (the fraction of training done): how far
    the distillation loss has moved from token-level (0) to turn-balanced (1). ``token``: 0
    throughout; ``turn``: 1 throughout; ``progressive`` (the paper's): ``clip((progress - start) /
    (end - start), 0, 1)``, or a cosine ease of it (``0.5 * (1 - cos(pi * x))``)."""
    if weighting not in OPD_WEIGHTINGS:
        raise ValueError(f"unknown OPD weighting {weighting!r}; choose one of {OPD_WEIGHTINGS}")
    if weighting != "progressive":
        return 0.0 if weighting == "token" else 1.0
    if progress <= start:
        return 0.0
    if progress >= end:
        return 1.0
    x = (progress - start) / (end - start)
    return x if shape == "linear" else 0.5 * (1.0 - math.cos(math.pi * x))


def turn_blend_weights(token_map: torch.Tensor, supervised: torch.Tensor, alpha: float,
                       trajectories: float | None = None) -> torch.Tensor:
    """[N] TurnOPD's blended weights of a step's supervised tokens.

    Within a trajectory ``e`` with ``T_e`` turns that have supervised tokens, ``n_{e,t}`` of them in
    turn ``t`` and ``N_e`` in all, turn ``t``'s share of the trajectory's loss is
    ``(1 - alpha) * n_{e,t} / N_e + alpha / T_e`` (the token share, where long turns dominate,
    blended with the turn share, every turn alike), spread equally over the turn's tokens:

        w_i = ((1 - alpha) / N_e + alpha / (T_e * n_{e,t})) / E

    with ``E`` the trajectories that have supervised tokens, so the weights sum to 1 over the step
    (the mean over trajectories of each one's blended mean). ``token_map`` [N, 3] names each
    token's (episode, call, token); ``trajectories``: E over the whole step when this is one
    rank's share of it."""
    sup = supervised.float()
    if not len(sup) or float(sup.sum()) == 0:
        return sup
    _, traj = torch.unique(token_map[:, 0], return_inverse=True)
    _, call = torch.unique(token_map[:, 0] * (int(token_map[:, 1].max()) + 1) + token_map[:, 1], return_inverse=True)
    n_call = torch.zeros(int(call.max()) + 1).index_add_(0, call, sup)  # n_{e,t}
    n_traj = torch.zeros(int(traj.max()) + 1).index_add_(0, traj, sup)  # N_e
    call_traj = torch.zeros(len(n_call), dtype=torch.long).index_copy_(0, call, traj)
    turns = torch.zeros(len(n_traj)).index_add_(0, call_traj, (n_call > 0).float())  # T_e
    e = float((n_traj > 0).sum()) if trajectories is None else trajectories
    w = (1.0 - alpha) / n_traj[traj].clamp_min(1.0) + alpha / (turns[traj] * n_call[call]).clamp_min(1.0)
    return torch.where(supervised, w / e, 0.0)


@dataclass
class TurnOPDOptions(Config):
    """TurnOPD: turn-level loss and depth budgeting"""

    opd_weighting: str = field("token", help="how the distillation loss weighs the supervised tokens of a "
                                             "trajectory: token (all alike, so long calls dominate), turn (every "
                                             "model call alike), progressive (TurnOPD's loss budgeting: token to turn "
                                             "over training, see --opd-turn-start/end/shape)",
                               choices=OPD_WEIGHTINGS)
    opd_turn_start: float = field(0.0, help="progressive: fraction of the steps (of --time-budget when one is "
                                            "set) at which the move from token to turn weighting starts",
                                  range=(0.0, 1.0))
    opd_turn_end: float = field(1.0, help="progressive: fraction of the steps (of --time-budget when one is set) "
                                          "from which the weighting is all turn", range=(0.0, 1.0))
    opd_turn_shape: str = field("linear", help="progressive: the ramp between start and end (linear, the paper's, "
                                               "or a cosine ease)", choices=TURN_SHAPES)
    adaptive_depth: bool = field(False, help="TurnOPD's adaptive rollout depth: full rollouts (probes) every "
                                             "--depth-probe-every steps set a depth cap from their per-turn teacher "
                                             "divergence and the depth successful trajectories need; the rollouts "
                                             "between probes are cut there (no answer, no reward: distillation only)")
    depth_probe_every: int = field(8, help="adaptive depth: a full rollout (a probe) every N steps",
                                   range=(1, None))
    depth_warmup: int = field(3, help="adaptive depth: the first N steps are probes", range=(1, None))
    depth_ema: float = field(0.3, help="adaptive depth: weight of a probe's depth in the moving average",
                             range=(0.0, 1.0))
    depth_coverage: float = field(0.8, help="adaptive depth: the depth floor is this quantile of the depth "
                                            "successful probe trajectories reach (0: no floor, the KL centroid "
                                            "alone)", range=(0.0, 1.0))
    depth_success_f1: float = field(1.0, help="adaptive depth: a probe trajectory with this F1 or more counts as "
                                              "successful", range=(0.0, 1.0))
    depth_min_successes: int = field(8, help="adaptive depth: successful probe trajectories needed to refresh the "
                                             "depth floor", range=(1, None))
    depth_min: int = field(2, help="adaptive depth: the fewest model calls an episode is cut at", range=(1, None))
    depth_max: int = field(0, help="adaptive depth: the most model calls of a cut (0: no limit but the env's)",
                           range=(0, None))

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]  (the composed config validates first)
        if self.opd_weighting == "progressive" and not self.opd_turn_start < self.opd_turn_end:
            raise ConfigError(f"--opd-turn-start {self.opd_turn_start} must be below --opd-turn-end "
                              f"{self.opd_turn_end} (fractions of the steps) for --opd-weighting progressive")
        if self.depth_max and self.depth_max < self.depth_min:
            raise ConfigError(f"--depth-max {self.depth_max} must be at least --depth-min {self.depth_min}")


@dataclass
class Probe:
    """What a probe step tells the depth controller, per turn t: ``kl[t]`` (K_t, NaN where no
    trajectory has supervised tokens there) and ``alive[t]`` (n_t); and the last turn index of
    each successful trajectory."""

    kl: list[float]
    alive: list[float]
    success_depths: list[int]


class DepthController:
    """TurnOPD's depth rule; its state (the moving average, the coverage floor) is checkpointed."""

    def __init__(self, ema: float, coverage: float, min_successes: int, least: int, most: int = 0) -> None:
        self.ema, self.coverage, self.min_successes = ema, coverage, min_successes
        self.least, self.most = least, most
        self.h_bar: float | None = None  # the moving average of H_ctrl (None: no probe yet)
        self.h_cov: int | None = None  # the coverage floor (None: not enough successes yet)
        self.h_eff: int | None = None

    @staticmethod
    def centroid(kl: Sequence[float], alive: Sequence[float], eps: float = 1e-8) -> int:
        """H_eff: the turn index at the centroid of the survivor-weighted divergence."""
        n0 = alive[0] if alive and alive[0] > 0 else 1.0
        m = [max(k, 0.0) * n / n0 if math.isfinite(k) else 0.0 for k, n in zip(kl, alive)]
        total = sum(m)
        return _round(sum(t * mt for t, mt in enumerate(m)) / (total + eps))

    @staticmethod
    def quantile_depth(depths: Sequence[int], p: float) -> int:
        """The p-quantile of the depths: the least H with F(H) >= p (the empirical CDF)."""
        ordered = sorted(depths)
        return ordered[max(0, math.ceil(p * len(ordered)) - 1)]

    def update(self, probe: Probe) -> int:
        """A probe's statistics in; the cap (model calls) for the rollouts until the next probe out."""
        self.h_eff = self.centroid(probe.kl, probe.alive)
        if self.coverage > 0 and len(probe.success_depths) >= self.min_successes:
            self.h_cov = self.quantile_depth(probe.success_depths, self.coverage)
        h_ctrl = max(self.h_eff, self.h_cov) if self.h_cov is not None else self.h_eff
        self.h_bar = float(h_ctrl) if self.h_bar is None else (1 - self.ema) * self.h_bar + self.ema * h_ctrl
        return self.cap()

    def cap(self) -> int | None:
        if self.h_bar is None:
            return None
        cap = max(self.least, _round(self.h_bar) + 1)  # +1: a turn index to a number of calls
        return min(cap, self.most) if self.most else cap

    def state_dict(self) -> dict[str, Any]:
        return {"h_bar": self.h_bar, "h_cov": self.h_cov, "h_eff": self.h_eff}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.h_bar, self.h_cov, self.h_eff = state.get("h_bar"), state.get("h_cov"), state.get("h_eff")


class TurnOPD(Plugin):
    name = "turn_opd"
    Options = TurnOPDOptions
    order = 10

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        o = self.options
        self.controller = DepthController(o.depth_ema, o.depth_coverage, o.depth_min_successes, o.depth_min,
                                          o.depth_max)
        self.probe = False  # whether this step's rollout is a probe
        self.last_probe: Probe | None = None

    @classmethod
    def enabled(cls, options: TurnOPDOptions) -> bool:
        return options.opd_weighting != "token" or options.adaptive_depth

    @classmethod
    def features(cls, options: TurnOPDOptions) -> set[str]:
        return {cls.name, "adaptive_depth"} if options.adaptive_depth else {cls.name}

    @classmethod
    def legacy_state(cls, saved: Any) -> dict[str, Any]:
        return {"depth": saved.get("history", {}).get("depth")}

    @property
    def depth(self) -> int | None:
        """The cap the rollouts between probes are cut at (None: no probe yet)."""
        return self.controller.cap()

    # -- depth budgeting ----------------------------------------------------------------------
    def is_probe(self, step: int) -> bool:
        cfg = self.options
        return step < cfg.depth_warmup or step % cfg.depth_probe_every == 0 or self.depth is None

    def wrap_rollout(self, rollout: RolloutFn) -> RolloutFn:
        if not self.options.adaptive_depth:
            return rollout

        def limited(step: int, limits: RolloutLimits) -> Rollout:
            self.probe = self.is_probe(step)
            return rollout(step, dataclasses.replace(limits, max_calls=None if self.probe else self.depth))
        return limited

    def end_step(self, result: StepResult) -> dict[str, float]:
        cfg = self.options
        if not cfg.adaptive_depth:
            return {}
        out = {"depth/probe": float(self.probe),
               "depth/cut_episodes": mean([float(e.cut is not None) for e in result.episodes])}
        if self.probe:
            self.last_probe = probe_stats(result, cfg.depth_success_f1, self.ctx.world)
            self.controller.update(self.last_probe)
            c = self.controller
            out.update({"depth/h_eff": float(c.h_eff), "depth/h_bar": float(c.h_bar),
                        "depth/successes": float(len(self.last_probe.success_depths))})
            if c.h_cov is not None:
                out["depth/h_cov"] = float(c.h_cov)
            # the probe's profile K_t and n_t / n_0, for reading where the signal sits (docs/RESULTS.md)
            n0 = self.last_probe.alive[0] if self.last_probe.alive else 0.0
            for t, (k, n) in enumerate(zip(self.last_probe.kl, self.last_probe.alive)):
                if not math.isnan(k):
                    out[f"depth/kl/{t}"] = float(k)
                out[f"depth/alive/{t}"] = float(n / n0) if n0 else 0.0
        out["depth/limit"] = float(0 if self.probe else (self.depth or 0))
        return out

    # -- loss budgeting -----------------------------------------------------------------------
    def weigh(self, weights: LossWeights, ctx: WeighContext) -> dict[str, float]:
        cfg = self.options
        if cfg.opd_weighting == "token" or not ctx.scored:
            return {}
        alpha = turn_share(cfg.opd_weighting, ctx.progress, cfg.opd_turn_start, cfg.opd_turn_end,
                                  cfg.opd_turn_shape)
        batch = ctx.batch
        if batch.num_actions:
            sup = batch.teacher & (weights.opd > 0)
            (trajectories,) = distributed.all_sum([float(len(torch.unique(batch.token_map[sup, 0])))], ctx.world)
            blend = turn_blend_weights(batch.token_map, sup, alpha, trajectories)
            weights.redistribute_opd(weights.opd * blend, ctx.world)  # the same total: shares move
        return {"opd/turn_share": alpha}

    # -- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"depth": self.controller.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("depth")
        if isinstance(saved, dict):
            self.controller.load_state_dict(saved)


def probe_stats(result: StepResult, success_f1: float, world: distributed.World) -> Probe:
    """A probe's per-turn statistics over every rank: each trajectory's turn-t divergence is the
    mean of its supervised tokens' in that call; K_t averages it over the trajectories alive at
    t; n_t counts the trajectories with a call at t (from the episodes, which every rank has)."""
    calls: dict[tuple[int, int], list[float]] = {}
    for (e, j, _), v in zip(result.batch.token_map.tolist(), result.token_kl.tolist()):
        if math.isfinite(v):
            calls.setdefault((e, j), []).append(v)
    turns = max((len(e.invocations) for e in result.episodes), default=0)
    sums = [0.0] * (2 * turns)
    for (_, j), vals in calls.items():
        sums[2 * j] += sum(vals) / len(vals)
        sums[2 * j + 1] += 1
    sums = distributed.all_sum(sums, world)
    kl = [sums[2 * t] / sums[2 * t + 1] if sums[2 * t + 1] else float("nan") for t in range(turns)]
    alive = [float(sum(len(e.invocations) > t for e in result.episodes)) for t in range(turns)]
    success = [len(e.invocations) - 1 for e in result.episodes
               if e.cut is None and e.metrics.get("f1", 0.0) >= success_f1]
    return Probe(kl, alive, success)


def _round(x: float) -> int:
    """Half up (2.5 -> 3), not Python's half to even."""
    return math.floor(x + 0.5)



__all__ = ["DepthController", "OPD_WEIGHTINGS", "Probe", "TURN_SHAPES", "TurnOPD", "TurnOPDOptions", "probe_stats",
           "turn_blend_weights", "turn_share"]
