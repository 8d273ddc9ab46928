"""TurnOPD: turn-level budgeting of on-policy distillation, as two parts of one plugin.

- **Loss budgeting** (``--opd-weighting turn|progressive``): the distillation mean moves from
  token-level (every supervised token alike, so long calls dominate) to turn-balanced (every model
  call alike: the mean within a call, then over calls). ``progressive`` ramps the turn share from
  0 at ``--opd-turn-start`` to 1 at ``--opd-turn-end`` (fractions of the steps, or of
  ``--time-budget``), linearly or with a cosine ease (:func:`memopd.losses.turn_share`,
  :func:`memopd.losses.opd_weights`).
- **Depth budgeting** (``--adaptive-depth``): every ``--depth-probe-every`` steps the rollout is
  full (a probe); the probe's per-turn teacher KL (mean over the turn's calls of each call's mean
  KL, turn = call index) picks the depth D: up to the last turn whose mean is at least
  ``--depth-kl-frac`` of the largest, and at least ``--depth-min`` calls. Until the next probe the
  rollouts are cut at D calls (no answer and no reward: distillation terms only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from memopd import distributed, losses
from memopd.config import ConfigError, field
from memopd.learn.actor import Rollout, RolloutLimits
from memopd.learn.plugin import LossWeights, Plugin, RolloutFn, StepResult, WeighContext


@dataclass
class TurnOPDOptions:
    """TurnOPD: turn-level loss and depth budgeting"""

    opd_weighting: str = field("token", help="how the distillation mean weighs the supervised tokens: token (all "
                                             "alike, so long calls dominate), turn (every model call alike: the mean "
                                             "within a call, then over calls), progressive (token to turn over "
                                             "training, TurnOPD's loss budgeting; see --opd-turn-start/end/shape)",
                               choices=losses.OPD_WEIGHTINGS)
    opd_turn_start: float = field(0.0, help="progressive: fraction of the steps (of --time-budget when one is "
                                            "set) at which the move from token to turn weighting starts",
                                  range=(0.0, 1.0))
    opd_turn_end: float = field(0.5, help="progressive: fraction of the steps (of --time-budget when one is set) "
                                          "from which the weighting is all turn", range=(0.0, 1.0))
    opd_turn_shape: str = field("linear", help="progressive: the ramp between start and end (linear, or a cosine "
                                               "ease)", choices=losses.TURN_SHAPES)
    adaptive_depth: bool = field(False, help="TurnOPD's adaptive rollout depth: every --depth-probe-every steps the "
                                             "rollout is full (a probe); its per-turn teacher KL picks the depth D at "
                                             "which the rollouts until the next probe are cut (no answer, no reward: "
                                             "distillation terms only)")
    depth_probe_every: int = field(5, help="adaptive depth: a full rollout every N steps (the first step is one)",
                                   range=(1, None))
    depth_kl_frac: float = field(0.2, help="adaptive depth: a turn is worth rolling out while its mean teacher KL "
                                           "is at least this fraction of the largest turn's", range=(0.0, 1.0))
    depth_min: int = field(1, help="adaptive depth: the fewest model calls an episode is cut at", range=(1, None))

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]  (the composed config validates first)
        if self.opd_weighting == "progressive" and not self.opd_turn_start < self.opd_turn_end:
            raise ConfigError(f"--opd-turn-start {self.opd_turn_start} must be below --opd-turn-end "
                              f"{self.opd_turn_end} (fractions of the steps) for --opd-weighting progressive")


class TurnOPD(Plugin):
    name = "turn_opd"
    Options = TurnOPDOptions

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.depth: int | None = None  # the depth the last probe chose (None: none yet)
        self.probe = False  # whether this step's rollout is a probe
        self.last_turn_kl: list[tuple[float, float]] = []  # (mean, std) per turn of the last step

    @classmethod
    def enabled(cls, cfg: Any) -> bool:
        return cfg.opd_weighting != "token" or cfg.adaptive_depth

    # -- depth budgeting ----------------------------------------------------------------------
    def wrap_rollout(self, rollout: RolloutFn) -> RolloutFn:
        if not self.ctx.cfg.adaptive_depth:
            return rollout

        def limited(step: int, limits: RolloutLimits) -> Rollout:
            self.probe = step % self.ctx.cfg.depth_probe_every == 0 or self.depth is None
            return rollout(step, RolloutLimits(None if self.probe else self.depth, limits.monitor))
        return limited

    def end_step(self, result: StepResult) -> dict[str, float]:
        cfg = self.ctx.cfg
        if not cfg.adaptive_depth:
            return {}
        self.last_turn_kl = turn_kl(result, self.ctx.world)
        if self.probe:
            self.depth = self.choose_depth(self.last_turn_kl)
        limit = 0 if self.probe else self.depth
        return {"depth/limit": float(limit or 0), "depth/probe": float(self.probe),
                "depth/cut_episodes": _mean([float(e.cut is not None) for e in result.episodes])}

    def choose_depth(self, turn_kl: list[tuple[float, float]]) -> int:
        """The depth rule on a probe's per-turn (mean, std) teacher KL."""
        cfg = self.ctx.cfg
        means = [m for m, _ in turn_kl]
        if not means or max(means) <= 0:
            return max(cfg.depth_min, len(means))
        keep = [t for t, m in enumerate(means) if m >= cfg.depth_kl_frac * max(means)]
        return max(cfg.depth_min, keep[-1] + 1)

    # -- loss budgeting -----------------------------------------------------------------------
    def weigh(self, weights: LossWeights, ctx: WeighContext) -> dict[str, float]:
        cfg = self.ctx.cfg
        if cfg.opd_weighting == "token" or not ctx.scored:
            return {}
        share = losses.turn_share(cfg.opd_weighting, ctx.progress, cfg.opd_turn_start, cfg.opd_turn_end,
                                  cfg.opd_turn_shape)
        batch = ctx.batch
        if share != 0.0 and batch.num_actions:  # at share 0 the token-level weights stay exactly as they are
            calls = batch.token_map[:, 0] * (int(batch.token_map[:, 1].max()) + 1) + batch.token_map[:, 1]
            totals = distributed.all_sum(losses.call_counts(calls, batch.teacher), ctx.world)  # the whole step's
            weights.opd = weights.opd * losses.opd_weights(calls, batch.teacher, share, (totals[0], totals[1]))
        return {"opd/turn_share": share}

    # -- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"depth": self.depth}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.depth = state.get("depth")


def turn_kl(result: StepResult, world: distributed.World) -> list[tuple[float, float]]:
    """(mean, std) over the step's calls of each call's mean teacher KL, per turn (call index),
    over every rank."""
    calls: dict[tuple[int, int], list[float]] = {}
    for (e, j, _), v in zip(result.batch.token_map.tolist(), result.token_kl.tolist()):
        if math.isfinite(v):
            calls.setdefault((e, j), []).append(v)
    (turns,) = distributed.all_max([1 + max((j for _, j in calls), default=-1)], world)
    sums = [0.0] * (3 * int(turns))
    for (_, j), vals in calls.items():
        m = sum(vals) / len(vals)
        sums[3 * j] += m
        sums[3 * j + 1] += m * m
        sums[3 * j + 2] += 1
    sums = distributed.all_sum(sums, world)
    out = []
    for t in range(int(turns)):
        s1, s2, n = sums[3 * t: 3 * t + 3]
        mean = s1 / n if n else 0.0
        out.append((mean, math.sqrt(max(0.0, s2 / n - mean * mean)) if n else 0.0))
    return out


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


__all__ = ["TurnOPD", "TurnOPDOptions", "turn_kl"]
