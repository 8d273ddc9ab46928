"""f-OPD (Chen et al., 2026, "Stabilizing Long-Horizon On-Policy Distillation with Freshness-Aware
Control"): the freshness of stale samples, and the weights that regulate them.

For each episode i of a step, trained at policy version t and sampled by version r(i):

    lag    tau_i = t - r(i)
    D_roll the rollout drift: the mean over its action tokens of the k3 estimate of
           KL(behaviour || current) at the sampled tokens (:func:`episode_drift`)
    D_sup  the supervision drift, the staleness of the teacher's context: the teacher scores each
           call in the state the episode's earlier calls made, sampled by the old policy; D_sup is
           the mean over the episode's calls of that k3 summed over the action tokens of the calls
           before it (:func:`context_drift`)
    f_i  = 1 / (tau_i + 1) * exp(-(alpha * sqrt(D_roll) + beta * sqrt(D_sup)))     (Eq. 11)
    w_i  = max(f_i - xi, 0)                                                        (Eq. 13)

(``--fresh-alpha``, ``--fresh-beta``, ``--fresh-threshold`` xi; :func:`freshness`).
With ``--freshness weight`` every PPO and distillation term of the episode is multiplied by w_i,
and the loss keeps dividing by the step's own token counts (:class:`memopd.learn.plugin.LossWeights`),
so a uniformly stale step moves the policy less, as the paper's unnormalised expectation does.
``fresh/ess`` logs the weights' effective sample size as a share of the episodes.

Where this departs from the paper: its teacher attaches the signal at rollout time, so a sample
also carries a stale signal. This trainer's teacher scores every sample at learn time, in the
sample's own state, so the signal at a state is never stale: what is stale is the state, and
D_sup measures that (docs/methods.md). The paper's rollout anchoring and adaptive buffer refresh
are not implemented.

The plugin is on whenever samples can be stale (``--simulated-staleness`` and ``--async-rollouts``
require it) or ``--freshness`` is set, and logs ``fresh/lag`` (and, with the student's log-probs, both drifts
(``fresh/drift``, ``fresh/sup_drift``), the score and the effective sample size) every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memopd import distributed
from memopd.config import Config, field
from memopd.learn.plugin import LossWeights, Plugin, WeighContext
from memopd.packing import PackedBatch


# -- the maths ------------------------------------------------------------------------------------

def episode_drift(trainer_logp: torch.Tensor, behaviour_logp: torch.Tensor, episode: torch.Tensor,
                  num_episodes: int) -> torch.Tensor:
    """[E] rollout drift of each episode: the mean over its action tokens of the k3 estimate of
    KL(behaviour || current), ``(r - 1) - log r`` with ``r = p_current / p_behaviour`` (0 when the
    two policies agree on the sampled tokens). ``episode`` [N] maps tokens to episodes."""
    log_r = (trainer_logp - behaviour_logp).double()
    k3 = torch.expm1(log_r) - log_r
    total = torch.zeros(num_episodes, dtype=torch.float64).index_add_(0, episode, k3)
    count = torch.zeros(num_episodes, dtype=torch.float64).index_add_(0, episode, torch.ones_like(k3))
    return (total / count.clamp_min(1)).float()


def context_drift(trainer_logp: torch.Tensor, behaviour_logp: torch.Tensor, token_map: torch.Tensor,
                  num_episodes: int) -> torch.Tensor:
    """[E] supervision drift of each episode: the staleness of the contexts its teacher scores in.

    The teacher scores call ``j`` in the state the earlier calls' actions made (the memory they
    wrote), and those actions were sampled by the old policy. The k3 estimate of
    KL(behaviour || current) summed over the action tokens of calls ``c < j`` estimates how far the
    distribution of that context has moved (a sequence's KL is the sum of its tokens'); D_sup is
    its mean over the episode's calls (0 for one call, or on-policy). ``token_map`` [N, 3] maps
    tokens to (episode, call, index)."""
    log_r = (trainer_logp - behaviour_logp).double()
    k3 = torch.expm1(log_r) - log_r
    ep, call = token_map[:, 0], token_map[:, 1]
    calls = int(call.max()) + 1 if len(call) else 1
    per_call = torch.zeros(num_episodes * calls, dtype=torch.float64).index_add_(0, ep * calls + call, k3)
    present = torch.zeros(num_episodes * calls, dtype=torch.float64).index_add_(
        0, ep * calls + call, torch.ones_like(k3)).view(num_episodes, calls) > 0
    prefix = per_call.view(num_episodes, calls).cumsum(1) - per_call.view(num_episodes, calls)  # calls before j
    total = (prefix * present).sum(1)
    return (total / present.sum(1).clamp_min(1)).float()


def freshness(lag: torch.Tensor, rollout_drift: torch.Tensor, alpha: float, beta: float = 0.0,
              supervision_drift: torch.Tensor | None = None) -> torch.Tensor:
    """[E] f-OPD's freshness of each sample (Eq. 11 of the paper), in (0, 1]:

        f = 1 / (lag + 1) * exp(-(alpha * sqrt(D_roll) + beta * sqrt(D_sup)))

    ``lag`` the optimizer steps since the policy that sampled it, ``rollout_drift`` D_roll (the
    current policy against that one on its tokens) and ``supervision_drift`` D_sup (how far the
    contexts the teacher scores in have moved, :func:`context_drift`; None: 0). 1: as fresh as an
    on-policy sample."""
    exponent = alpha * rollout_drift.double().clamp_min(0).sqrt()
    if supervision_drift is not None and beta:
        exponent = exponent + beta * supervision_drift.double().clamp_min(0).sqrt()
    return (torch.exp(-exponent) / (lag.double() + 1.0)).float()


def freshness_weights(fresh: torch.Tensor, threshold: float) -> torch.Tensor:
    """[E] f-OPD's sample weights ``max(f - threshold, 0)`` (Eq. 13): samples below the
    threshold drop out, the others weigh by how far they clear it. Not renormalised: a step whose
    samples are all stale moves the policy less."""
    return (fresh - threshold).clamp_min(0.0)


def effective_sample_size(weights: torch.Tensor) -> float:
    """Kish's effective sample size ``(sum w)^2 / sum w^2`` (0 when every weight is 0)."""
    w = weights.double()
    sq = float((w * w).sum())
    return float(w.sum()) ** 2 / sq if sq > 0 else 0.0


@dataclass
class FreshnessOptions(Config):
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
    """On with ``--freshness``, and wherever samples can be stale (the plugins that make them stale
    require it)."""

    name = "freshness"
    Options = FreshnessOptions
    order = 20

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.needs_trainer_logprobs = self.options.freshness != "off"

    @classmethod
    def enabled(cls, options: FreshnessOptions) -> bool:
        return options.freshness != "off"

    def weigh(self, weights: LossWeights, ctx: WeighContext) -> dict[str, float]:
        w, opd, stats = fresh_weights(ctx.batch, ctx.lags, ctx.trainer_logp, weights.ppo, weights.opd, self.options,
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
        drift = episode_drift(trainer_logp, batch.old_logprobs, ep, len(lags))
        sup = context_drift(trainer_logp, batch.old_logprobs, batch.token_map, len(lags))
        fresh = freshness(lags, drift, cfg.fresh_alpha, cfg.fresh_beta, sup)
        w = freshness_weights(fresh, cfg.fresh_threshold)
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


__all__ = ["Freshness", "FreshnessOptions", "context_drift", "effective_sample_size", "episode_drift", "fresh_weights",
           "freshness", "freshness_weights"]
