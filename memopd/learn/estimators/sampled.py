"""``sampled``: the divergence at the sampled token, from one teacher log-prob a token.

**The reverse KL** (``k1`` / ``k3`` at the sampled token ``a ~ s``). With ``log r = log s(a) -
log t(a)``: ``k1 = log r`` and ``k3 = (1/r - 1) + log r``. Both are unbiased estimates of
``KL(s || t)`` over the sampling of ``a`` (k1 can be negative, k3 is never negative and has lower
variance when ``s`` and ``t`` are close). Needs one teacher log-prob a token (what any inference
server returns). As a **loss**, the value reported is the estimate and the gradient is the
score-function gradient ``sg(log r) * grad log s(a)``, whose expectation is the gradient of
``KL(s || t)`` (``E_s[grad log s] = 0`` drops the ``+1``); as an **advantage** (the Tinker
cookbook's on-policy distillation), ``-lambda * log r`` is added to the PPO advantage of every
supervised token, with PPO's clipping and importance ratio doing the rest.

**The forward KL** (``--opd-divergence fkl``, from the same one log-prob a token). With ``r = t(a)
/ s(a)`` at ``a ~ s``: ``E_s[r f(a)] = E_t[f(a)]``, so ``r log r - (r - 1)`` (never negative) is an
unbiased estimate of ``KL(t || s)``, and ``-sg(r - 1) * grad log s(a)`` has the expectation
``-E_t[grad log s] = grad KL(t || s)`` (the ``-1`` a baseline: ``E_s[grad log s] = 0``). As an
advantage, ``lambda * (r - 1)`` with ``r`` against the behaviour policy. Unbiased where the
student's support covers the teacher's; its variance grows with ``r``, which is at most ``1 /
s(a)``. This is the mass-covering divergence a student on its copy plateau needs
(docs/teacher.md), through a teacher that returns one log-prob a token: a served one, or one with
another tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memopd import losses
from memopd.config import Config, field
from memopd.learn.estimators.base import Estimator, TeacherScores, Terms
from memopd.packing import PackedBatch
from memopd.scoring import ActionStates

SAMPLED_KINDS = ("k1", "k3")


@dataclass
class SampledOptions(Config):
    """The sampled estimator (--opd-estimator sampled)"""

    opd_sampled: str = field("k3", help="sampled estimator of the reverse KL: k1 (log r) or k3 ((1/r - 1) + log r, "
                                        "never negative), r = p_student / p_teacher at the sampled token (the "
                                        "forward KL has one form)", choices=SAMPLED_KINDS)
    opd_sampled_as: str = field("loss", help="sampled estimator: a loss (value the estimate, gradient the score "
                                             "function's) or a dense per-token advantage -lambda * log r added to "
                                             "PPO's (the Tinker cookbook's form)", choices=("loss", "advantage"))


class SampledEstimator(Estimator):
    name = "sampled"
    needs = frozenset({"sampled"})
    divergences = ("rkl", "fkl")
    Options = SampledOptions

    def __init__(self, cfg, options=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(cfg, options)
        self.as_loss = self.options.opd_sampled_as == "loss"

    def prepare(self, scores: TeacherScores, batch: PackedBatch) -> torch.Tensor:
        return scores.token_logprobs(batch.action_ids, self.chunk)

    def terms(self, states: ActionStates, mb: PackedBatch, teacher_lp: torch.Tensor) -> Terms:
        logp, ent, _ = losses.student_terms(states, mb.action_ids, chunk_size=self.chunk)
        t_lp = teacher_lp[mb.action_uid].to(logp.device)
        kind = self.options.opd_sampled
        if not self.as_loss:  # its value for the metrics; PPO carries the gradient
            return logp, ent, sampled_estimate(logp, t_lp, kind, self.divergence)
        return logp, ent, sampled_loss(logp, t_lp, kind, self.divergence, mb.old_logprobs.to(logp.device))

    def advantage(self, batch: PackedBatch, teacher_lp: torch.Tensor) -> torch.Tensor | None:
        return None if self.as_loss else sampled_advantage(batch.old_logprobs, teacher_lp, self.divergence)


def sampled_estimate(logp_s: torch.Tensor, logp_t: torch.Tensor, kind: str = "k3",
                     divergence: str = "rkl") -> torch.Tensor:
    """[n] the estimate of the divergence at the sampled tokens, from the student's and the
    teacher's log-probs of them (no gradient: the estimate's value): k1 or k3 of KL(s || t)
    (``rkl``), or ``r log r - (r - 1)``, ``r = t / s``, of KL(t || s) (``fkl``; ``kind`` unused)."""
    log_r = (logp_s - logp_t).detach().double()
    if divergence == "fkl":
        return (torch.exp(-log_r) * -log_r - torch.expm1(-log_r)).float()
    if divergence != "rkl":
        raise ValueError(f"the sampled estimator estimates rkl or fkl, not {divergence!r}")
    if kind == "k1":
        return log_r.float()
    if kind == "k3":
        return (torch.expm1(-log_r) + log_r).float()
    raise ValueError(f"unknown sampled estimator {kind!r}; choose one of {SAMPLED_KINDS}")


def sampled_loss(logp_s: torch.Tensor, logp_t: torch.Tensor, kind: str = "k3", divergence: str = "rkl",
                 behaviour_logp: torch.Tensor | None = None) -> torch.Tensor:
    """[n] the sampled estimator as a loss: its value is :func:`sampled_estimate`, its gradient
    ``sg(log s(a) - log t(a)) * grad log s(a)`` for ``rkl`` and ``-sg(t(a) / s(a) - 1) * grad log
    s(a)`` for ``fkl`` (unbiased gradients of KL(s || t) and KL(t || s) when ``a ~ s``).

    ``behaviour_logp``: the log-probs the tokens were sampled with. After an update within the
    step (a second PPO epoch, a later minibatch) the tokens are no longer samples of the current
    ``s``; the gradient is then importance-weighted by ``sg(s(a) / s_behaviour(a))``, which keeps
    it unbiased (1 before any update). Without the weight, epochs past the first re-apply the
    first epoch's push to the same tokens."""
    log_r = (logp_s - logp_t.to(logp_s)).detach()
    coef = -torch.expm1(-log_r) if divergence == "fkl" else log_r
    if behaviour_logp is not None:
        coef = coef * torch.exp(logp_s.detach() - behaviour_logp.to(logp_s))
    surrogate = coef * logp_s
    return sampled_estimate(logp_s, logp_t, kind, divergence).to(logp_s) + surrogate - surrogate.detach()


def sampled_advantage(logp_behaviour: torch.Tensor, logp_t: torch.Tensor, divergence: str = "rkl") -> torch.Tensor:
    """[n] the per-token advantage of the sampled divergence (to be scaled by lambda): ``rkl``:
    ``-(log s_behaviour(a) - log t(a))``, the teacher's log-prob of the action above the
    student's; ``fkl``: ``t(a) / s_behaviour(a) - 1``."""
    log_ratio = logp_t.float() - logp_behaviour.float()
    return torch.expm1(log_ratio) if divergence == "fkl" else log_ratio


__all__ = ["SAMPLED_KINDS", "SampledEstimator", "SampledOptions", "sampled_advantage", "sampled_estimate",
           "sampled_loss"]
