"""f-OPD (Chen et al., 2026, "Stabilizing Long-Horizon On-Policy Distillation with Freshness-Aware
Control"): the freshness of stale samples, and the weights that regulate them.

For each episode i of a step, trained at policy version t and sampled by version r(i):

    lag    tau_i = t - r(i)
    D_roll the rollout drift: the mean over its action tokens of the k3 estimate of
           KL(behaviour || current) at the sampled tokens (:func:`memopd.losses.episode_drift`)
    D_sup  the supervision drift, the staleness of the teacher's context: the teacher scores each
           call in the state the episode's earlier calls made, sampled by the old policy; D_sup is
           the mean over the episode's calls of that k3 summed over the action tokens of the calls
           before it (:func:`memopd.losses.context_drift`)
    f_i  = 1 / (tau_i + 1) * exp(-(alpha * sqrt(D_roll) + beta * sqrt(D_sup)))     (Eq. 11)
    w_i  = max(f_i - xi, 0)                                                        (Eq. 13)

(``--fresh-alpha``, ``--fresh-beta``, ``--fresh-threshold`` xi; :func:`memopd.losses.freshness`).
With ``--freshness weight`` every PPO and distillation term of the episode is multiplied by w_i,
and the loss keeps dividing by the step's own token counts (:class:`memopd.learn.plugin.LossWeights`),
so a uniformly stale step moves the policy less, as the paper's unnormalised expectation does.
``fresh/ess`` logs the weights' effective sample size as a share of the episodes.

Where this departs from the paper: its teacher attaches the signal at rollout time, so a sample
also carries a stale signal. This trainer's teacher scores every sample at learn time, in the
sample's own state, so the signal at a state is never stale: what is stale is the state, and
D_sup measures that (docs/methods.md). The paper's rollout anchoring and adaptive buffer refresh
are not implemented.

The plugin is on whenever samples can be stale (``--simulated-staleness``, ``--async-rollouts``)
or ``--freshness`` is set, and logs ``fresh/lag`` (and, with the student's log-probs, both drifts
(``fresh/drift``, ``fresh/sup_drift``), the score and the effective sample size) every step.
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
                                       "times max(f - --fresh-threshold, 0), its freshness f = exp(-alpha * "
                                       "sqrt(D_roll) - beta * sqrt(D_sup)) / (lag + 1)) or off",
                               choices=("off", "weight"))
    fresh_alpha: float = field(1.0, help="freshness: alpha, the scale of the rollout drift's square root (the mean "
                                         "k3 KL(behaviour || current) per token) in the exponent", range=(0.0, None))
    fresh_beta: float = field(1.0, help="freshness: beta, the scale of the supervision drift's square root (the "
                                        "KL of the teacher's context: k3 summed over the calls before each call, "
                                        "averaged over the calls) in the exponent", range=(0.0, None))
    fresh_threshold: float = field(0.0, help="freshness: xi; a sample whose freshness is below it drops out, the "
                                             "others weigh f - xi", range=(0.0, 1.0))


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
    the update are given); with ``--freshness weight`` the PPO and distillation weights times its
    weight. Stats: means over the step's episodes (every rank), and the weights' effective sample
    size over the episode count."""
    ep = batch.token_map[:, 0]
    stats = [float(lags.sum()), float(len(lags))]
    if trainer_logp is not None:
        drift = losses.episode_drift(trainer_logp, batch.old_logprobs, ep, len(lags))
        sup = losses.context_drift(trainer_logp, batch.old_logprobs, batch.token_map, len(lags))
        fresh = losses.freshness(lags, drift, cfg.fresh_alpha, cfg.fresh_beta, sup)
        w = losses.freshness_weights(fresh, cfg.fresh_threshold)
        stats += [float(drift.sum()), float(fresh.sum()), float(w.double().sum()), float((w.double() ** 2).sum()),
                  float(sup.sum())]
        if cfg.freshness == "weight":
            weights = weights * w[ep]
            opd_weights = opd_weights * w[ep]
    totals = distributed.all_sum(stats, world)
    n = max(totals[1], 1.0)
    out = {"fresh/lag": totals[0] / n}
    if len(totals) > 2:
        w_sum, w_sq = totals[4], totals[5]
        out.update({"fresh/drift": totals[2] / n, "fresh/score": totals[3] / n, "fresh/weight": w_sum / n,
                    "fresh/ess": (w_sum ** 2 / w_sq if w_sq > 0 else 0.0) / n, "fresh/sup_drift": totals[6] / n})
    return weights, opd_weights, out


__all__ = ["Freshness", "FreshnessOptions", "fresh_weights"]
