"""A distillation estimator of your own: GKD's generalized Jensen-Shannon divergence, with its beta.

    python -m memopd.train --env memgym/LongQA-v0 \
        --opd-estimator examples.gkd:GeneralizedJSD --opd-estimator-kwarg beta=0.5

GKD (Agarwal et al., 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes") distils with the generalized JSD between the student ``s`` and the teacher ``t`` over the
whole vocabulary at every supervised token, with the mixture ``m = beta * t + (1 - beta) * s``::

    JSD_beta(s, t) = beta * KL(t || m) + (1 - beta) * KL(s || m)

As TRL's ``GKDTrainer.generalized_jsd_loss`` defines it at the ends, ``beta = 0`` is the forward
KL(t || s) and ``beta = 1`` the reverse KL(s || t); ``beta = 0.5`` is the Jensen-Shannon divergence
(``--opd-divergence jsd`` of the full estimator). ``--opd-divergence`` is not read: beta sets it.

An estimator is one class (``memopd.learn.estimators.base.Estimator``): what it needs of the
teacher (here its whole distribution, so a local teacher with the student's tokenizer), its
options, and its terms. This one reuses the full estimator's machinery (chunked projections, the
teacher's log-distribution kept across PPO epochs) and only swaps the divergence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from memopd.config import Config, field
from memopd.learn.estimators.full import FullEstimator


@dataclass
class GKDOptions(Config):
    beta: float = field(0.5, help="the mixture's weight on the teacher: 0 the forward KL, 1 the reverse KL, "
                                  "0.5 the Jensen-Shannon divergence", range=(0.0, 1.0))


def generalized_jsd(logp_s: torch.Tensor, logp_t: torch.Tensor, beta: float) -> torch.Tensor:
    """[n] ``beta * KL(t || m) + (1 - beta) * KL(s || m)``, ``m = beta * t + (1 - beta) * s``, from
    the student's and the teacher's log-distributions [n, V] (the forward KL at ``beta = 0``, the
    reverse KL at 1)."""
    if beta == 0.0:
        return _kl(logp_t, logp_s)
    if beta == 1.0:
        return _kl(logp_s, logp_t)
    log_m = torch.logsumexp(torch.stack([logp_s + math.log1p(-beta), logp_t + math.log(beta)]), dim=0)
    return beta * _kl(logp_t, log_m) + (1.0 - beta) * _kl(logp_s, log_m)


def _kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """[n] KL(p || q) of two log-distributions [n, V]."""
    return (logp.exp() * (logp - logq)).sum(-1)


class GeneralizedJSD(FullEstimator):
    name = "gkd"
    Options = GKDOptions

    def kind(self):  # type: ignore[no-untyped-def]
        beta = self.options.beta
        return lambda logp_s, logp_t: generalized_jsd(logp_s, logp_t, beta)
