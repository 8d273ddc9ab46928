"""DAPO's dynamic sampling (``--dynamic-sampling``): groups whose rewards are all equal are dropped, and
more questions drawn until the batch is full.

The rule (DAPO, arXiv 2503.14476): ``0 < |{o_i : o_i is correct}| < G`` for every question kept; a
group whose G samples all have the same reward has group-relative advantage 0 for each of them, so it
adds no policy gradient and only dilutes the others (with a token-mean aggregation) and shrinks the
batch's effective size. DAPO over-samples and filters until the batch holds its number of prompts.

Here: after the step's rollout, groups of equal rewards (to ``1e-9``, the run's ``--reward``, before
any shaping) are dropped; then extra draws, each ``--questions-per-step`` new questions (seeds of their
own, :data:`memopd.learn.actor.EXTRA_DRAW_STEPS`), are rolled out until ``--questions-per-step`` groups
are kept or ``--dynamic-max-draws`` rollouts were made. The batch always has ``--questions-per-step``
groups: the first ones kept, in draw order; when the cap is reached first, the last-dropped groups fill
it (they add no policy gradient, but their tokens still carry the distillation term) and the step
logs how many (verl instead stops the run: a cap reached is a setting's problem, not a step's).

A memory agent's episode is its group's sample: the reward compared is the episode's (shared by its
calls). Metrics: ``dynamic/dropped_share`` (dropped groups over groups drawn), ``dynamic/draws``
(rollouts made), ``dynamic/filled`` (groups of equal rewards kept to fill the batch).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from agents.records import Episode
from memopd.config import Config, ConfigError, field
from memopd.learn.actor import MAX_DRAWS, Rollout, RolloutLimits
from memopd.learn.plugin import Plugin, RolloutFn

EQUAL = 1e-9
"""Rewards closer than this are equal."""


@dataclass
class DynamicSamplingOptions(Config):
    """DAPO's dynamic sampling: drop groups of equal rewards, draw more questions"""

    dynamic_sampling: bool = field(False, help="drop groups whose samples all have the same reward and roll out "
                                               "more questions until the batch holds --questions-per-step groups "
                                               "(DAPO); logs dynamic/dropped_share")
    dynamic_max_draws: int = field(4, help="the most rollouts of --questions-per-step questions a step makes "
                                           "(the first included); when reached, groups of equal rewards fill the "
                                           "batch", range=(1, MAX_DRAWS))


def group_rewards(episodes: list[Episode], kind: str) -> list[tuple[list[Episode], bool]]:
    """The episodes by group, in order of first appearance, each with whether its rewards all agree
    (the run's reward metric ``kind``; ``Episode.reward`` where an episode has none)."""
    groups: dict[str, list[Episode]] = {}
    for e in episodes:
        groups.setdefault(e.group_id or e.episode_id, []).append(e)
    out = []
    for eps in groups.values():
        r = [float(e.metrics.get(kind, e.reward)) for e in eps]
        out.append((eps, max(r) - min(r) <= EQUAL))
    return out


def fill_batch(draws: list[list[Episode]], size: int, kind: str) -> tuple[list[Episode], dict[str, float]]:
    """``size`` groups out of the rollouts ``draws`` (in order): those of unequal rewards first, then,
    if too few, the last groups of equal rewards; and the metrics of the choice."""
    kept, dropped, total = [], [], 0
    for episodes in draws:
        for group, equal in group_rewards(episodes, kind):
            total += 1
            (dropped if equal else kept).append(group)
    chosen = kept[:size]
    filled = dropped[len(dropped) - (size - len(chosen)):] if len(chosen) < size else []
    metrics = {"dynamic/dropped_share": len(dropped) / max(1, total), "dynamic/draws": float(len(draws)),
               "dynamic/filled": float(len(filled))}
    return [e for g in chosen + filled for e in g], metrics


class DynamicSampling(Plugin):
    name = "dynamic_sampling"
    Options = DynamicSamplingOptions
    order = 45  # inside simulated staleness: the batches it queues are already filtered
    excludes = {"async": "--dynamic-sampling filters the synchronous rollout; asynchronous workers make theirs "
                         "elsewhere"}

    @classmethod
    def enabled(cls, options: DynamicSamplingOptions) -> bool:
        return options.dynamic_sampling

    @classmethod
    def check(cls, options: DynamicSamplingOptions, cfg: Any) -> None:
        if cfg.group_size < 2:
            raise ConfigError(f"--dynamic-sampling compares the rewards within a group: --group-size {cfg.group_size} "
                              "must be 2 or more")
        if cfg.reward == "none":
            raise ConfigError("--dynamic-sampling filters groups by their reward: it needs a task reward, not "
                              "--reward none")

    def wrap_rollout(self, rollout: RolloutFn) -> RolloutFn:
        size, kind = self.ctx.cfg.questions_per_step, self.ctx.cfg.reward

        def dynamic(step: int, limits: RolloutLimits) -> Rollout:
            t0 = time.perf_counter()
            first = rollout(step, limits)
            draws, seconds = [first.episodes], first.seconds
            while (sum(not eq for eps in draws for _, eq in group_rewards(eps, kind)) < size
                   and len(draws) < self.options.dynamic_max_draws):
                more = rollout(step, dataclasses.replace(limits, draw=len(draws)))
                draws.append(more.episodes)
                seconds += more.seconds
            episodes, metrics = fill_batch(draws, size, kind)
            metrics["dynamic/seconds"] = time.perf_counter() - t0
            return Rollout(episodes, seconds, {**first.metrics, **metrics})
        return dynamic


__all__ = ["DynamicSampling", "DynamicSamplingOptions", "fill_batch", "group_rewards"]
