"""f-OPD's freshness of buffered samples: each episode's policy-version lag, its rollout drift
(behaviour vs current policy on its sampled tokens), and the freshness that weighs its terms.

- lag: the policy versions between the one that sampled the episode and the one trained;
- drift: the mean over its action tokens of the k3 estimate of KL(behaviour || current)
  (:func:`memopd.losses.episode_drift`);
- freshness: ``exp(-lag / --fresh-lag-scale - drift / --fresh-drift-scale)``
  (:func:`memopd.losses.freshness`); with ``--freshness weight`` every PPO and distillation term of
  the episode is multiplied by it.

The plugin is on whenever samples can be stale (``--simulated-staleness``, ``--async-rollouts``)
or ``--freshness`` is set, and logs ``fresh/lag`` (and, with the student's log-probs, the drift
and the score) every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memopd import distributed, losses
from memopd.config import field
from memopd.learn.plugin import LossWeights, Plugin, WeighContext
from memopd.packing import PackedBatch


@dataclass
class FreshnessOptions:
    """f-OPD: freshness of stale samples"""

    freshness: str = field("off", help="f-OPD's regulation of stale samples: weight (each episode's loss terms "
                                       "times its freshness exp(-lag / --fresh-lag-scale - drift / "
                                       "--fresh-drift-scale)) or off", choices=("off", "weight"))
    fresh_lag_scale: float = field(2.0, help="freshness: policy-version lag that costs a factor e (0: ignore the "
                                             "lag)", range=(0.0, None))
    fresh_drift_scale: float = field(0.05, help="freshness: rollout drift (mean k3 KL(behaviour || current) per "
                                                "token) that costs a factor e (0: ignore the drift)", range=(0.0, None))


class Freshness(Plugin):
    name = "freshness"
    Options = FreshnessOptions

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.needs_trainer_logprobs = ctx.cfg.freshness != "off"

    @classmethod
    def enabled(cls, cfg: Any) -> bool:
        return cfg.freshness != "off" or bool(cfg.simulated_staleness) or cfg.async_rollouts

    def weigh(self, weights: LossWeights, ctx: WeighContext) -> dict[str, float]:
        w, opd, stats = fresh_weights(ctx.batch, ctx.lags, ctx.trainer_logp, weights.ppo, weights.opd, self.ctx.cfg,
                                      ctx.world)
        weights.ppo, weights.opd = w, opd
        return stats


def fresh_weights(batch: PackedBatch, lags: torch.Tensor, trainer_logp: torch.Tensor | None, weights: torch.Tensor,
                  opd_weights: torch.Tensor, cfg: Any, world: distributed.World = distributed.SINGLE
                  ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Each episode's lag, drift and freshness (the drift only where the student's log-probs before
    the update are given); with ``--freshness weight`` the PPO and distillation weights times it.
    Stats: means over the step's episodes (every rank)."""
    ep = batch.token_map[:, 0]
    stats = [float(lags.sum()), float(len(lags))]
    if trainer_logp is not None:
        drift = losses.episode_drift(trainer_logp, batch.old_logprobs, ep, len(lags))
        fresh = losses.freshness(lags, drift, cfg.fresh_lag_scale, cfg.fresh_drift_scale)
        stats += [float(drift.sum()), float(fresh.sum())]
        if cfg.freshness == "weight":
            weights = weights * fresh[ep]
            opd_weights = opd_weights * fresh[ep]
    totals = distributed.all_sum(stats, world)
    n = max(totals[1], 1.0)
    out = {"fresh/lag": totals[0] / n}
    if len(totals) > 2:
        out.update({"fresh/drift": totals[2] / n, "fresh/score": totals[3] / n})
    return weights, opd_weights, out


__all__ = ["Freshness", "FreshnessOptions", "fresh_weights"]
