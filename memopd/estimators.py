"""Estimators of the distillation divergence at an action token, by what they need of the teacher.

Every estimator compares the student's next-token distribution ``s`` with the teacher's ``t`` at
the same action position, both scored in the state the student sampled the action in.

``full`` (MemOPD's, :func:`memopd.losses.divergence_from_logprobs`)
    ``D(s, t)`` over the whole vocabulary. Exact; needs the teacher's full distribution (its
    hidden states and output head in this process, or ``V`` floats a token).

``topk`` (k + 1 buckets)
    The teacher's ``k`` most likely tokens ``S`` at the position, plus one bucket for the rest:
    ``t_S`` and ``t_tail = 1 - sum(t_S)``; the student's distribution is projected on the same
    buckets (``s_S`` and ``s_tail = 1 - sum(s_S)``, its own mass outside ``S``), and ``D`` is
    taken over the ``k + 1`` buckets. Needs ``2k`` numbers a token. Bias: merging the tail into
    one bucket can only lower a divergence (the data-processing inequality), so the estimate is
    a lower bound of the full one, equal to it when both distributions agree in shape within the
    tail (exactly equal at ``k = V``). Unlike dropping the tail (top-k renormalised), the student
    is not rewarded for moving mass outside ``S``. A teacher tail below ``1e-12`` is clamped there
    (a rounding-level sum of the top ``k`` above 1 would otherwise make it ``-inf``).

``sampled`` (``k1`` / ``k3`` at the sampled token ``a ~ s``)
    With ``log r = log s(a) - log t(a)``: ``k1 = log r`` and ``k3 = (1/r - 1) + log r``. Both are
    unbiased estimates of ``KL(s || t)`` over the sampling of ``a`` (k1 can be negative, k3 is
    never negative and has lower variance when ``s`` and ``t`` are close). Needs one teacher
    log-prob a token (what any inference server returns). As a **loss**, the value reported is
    the estimate and the gradient is the score-function gradient ``sg(log r) * grad log s(a)``,
    whose expectation is the gradient of ``KL(s || t)`` (``E_s[grad log s] = 0`` drops the
    ``+1``); as an **advantage** (the Tinker cookbook's on-policy distillation), ``-lambda *
    log r`` is added to the PPO advantage of every supervised token, with PPO's clipping and
    importance ratio doing the rest.

``sampled`` with ``--opd-divergence fkl`` (the forward KL from the same one log-prob a token)
    With ``r = t(a) / s(a)`` at ``a ~ s``: ``E_s[r f(a)] = E_t[f(a)]``, so ``r log r - (r - 1)``
    (never negative) is an unbiased estimate of ``KL(t || s)``, and ``-sg(r - 1) * grad log s(a)``
    has the expectation ``-E_t[grad log s] = grad KL(t || s)`` (the ``-1`` a baseline:
    ``E_s[grad log s] = 0``). As an advantage, ``lambda * (r - 1)`` with ``r`` against the
    behaviour policy. Unbiased where the student's support covers the teacher's; its variance
    grows with ``r``, which is at most ``1 / s(a)``. This is the mass-covering divergence a student
    on its copy plateau needs (docs/teacher.md), through a teacher that returns one log-prob a
    token: a served one, or one with another tokenizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from memopd.losses import DIVERGENCES
from memopd.scoring import ActionStates, map_chunks

ESTIMATORS = ("full", "topk", "sampled")
SAMPLED_KINDS = ("k1", "k3")
TAIL_FLOOR = 1e-12
"""The least tail mass of the teacher in the top-k estimator."""


@dataclass
class TopK:
    """The teacher's k most likely tokens at each of N actions and their log-probs, [N, k] each.

    ``project`` ([V_student] long, a teacher with another tokenizer): the teacher token each
    student token's text starts with (-1: none); ``ids`` are then teacher ids, and the student's
    distribution is summed onto the teacher's tokens through it before the buckets are taken
    (:func:`project_student`). None: both are in the student's ids."""

    ids: torch.Tensor
    logp: torch.Tensor
    project: torch.Tensor | None = None

    def select(self, index: torch.Tensor) -> TopK:
        return TopK(self.ids[index], self.logp[index], self.project)


PROJECT_FLOOR = 1e-30
"""The least mass of a teacher token in the student's projected distribution (an empty bucket's
log would be -inf, and its gradient NaN)."""


def project_student(logp_s: torch.Tensor, project: torch.Tensor, width: int) -> torch.Tensor:
    """[n, width + 1] the student's log-distribution [n, V_s] summed onto the teacher's ``width``
    tokens: the mass of teacher token ``u`` is that of every student token ``v`` with
    ``project[v] == u``; the last column holds the student tokens with none (``-1``), which are in
    no teacher token's bucket (the top-k's tail has them)."""
    v = logp_s.shape[-1]  # a head padded past the tokenizer: its extra columns have no teacher token
    index = torch.full((v,), width, dtype=torch.long, device=logp_s.device)
    index[: min(v, len(project))] = project[:v].to(logp_s.device)
    index = torch.where(index >= 0, index, width)
    out = logp_s.new_zeros(logp_s.shape[0], width + 1).index_add_(1, index, logp_s.exp())
    return out.clamp_min(PROJECT_FLOOR).log()


@dataclass
class TeacherScores:
    """The teacher at a step's N actions, in the batch's action order: its states (a local teacher:
    the full distribution), or its top-k and its log-probs of the sampled tokens (a served one);
    and metrics of the scoring (time, bytes)."""

    states: ActionStates | None = None
    top: TopK | None = None
    sampled: torch.Tensor | None = None  # [N]
    supervised: torch.Tensor | None = None  # [N] bool: the actions it has a target for (None: every one)
    metrics: dict[str, float] = field(default_factory=dict)


def _plogq(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """``p * (log p - log q)`` with ``0 * anything = 0`` (an empty bucket adds nothing)."""
    p = logp.exp()
    return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p))


def bucket_divergence(logp_s: torch.Tensor, logp_t: torch.Tensor, kind: str = "rkl") -> torch.Tensor:
    """Divergence per row between two log-distributions over the same buckets [n, B] -> [n], where
    buckets may be empty (``-inf``)."""
    if kind == "rkl":
        return _plogq(logp_s, logp_t).sum(-1)
    if kind == "fkl":
        return _plogq(logp_t, logp_s).sum(-1)
    if kind == "jsd":
        log_m = torch.logsumexp(torch.stack([logp_s, logp_t]), dim=0) - math.log(2.0)
        return 0.5 * (_plogq(logp_s, log_m).sum(-1) + _plogq(logp_t, log_m).sum(-1))
    raise ValueError(f"unknown divergence {kind!r}; choose one of {DIVERGENCES}")


def topk_buckets(logp_s: torch.Tensor, top: TopK) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's and the teacher's log-masses on the teacher's top-k tokens plus the tail
    bucket, [n, k + 1] each (no tail bucket when k covers the vocabulary). With ``top.project``,
    the student's distribution is first summed onto the teacher's tokens."""
    if top.project is not None:
        width = max(int(top.project.max()), int(top.ids.max()) if top.ids.numel() else 0) + 1
        logp_s = project_student(logp_s, top.project, width)
    s_top = logp_s.gather(-1, top.ids)
    t_top = top.logp.to(logp_s)
    if top.ids.shape[-1] >= logp_s.shape[-1]:
        return s_top, t_top
    outside = torch.ones_like(logp_s, dtype=torch.bool).scatter_(-1, top.ids, False)
    s_tail = torch.logsumexp(logp_s.masked_fill(~outside, float("-inf")), dim=-1, keepdim=True)
    t_tail = torch.log((-torch.expm1(torch.logsumexp(t_top, dim=-1, keepdim=True))).clamp_min(TAIL_FLOOR))
    return torch.cat([s_top, s_tail], -1), torch.cat([t_top, t_tail], -1)


def topk_divergence(logp_s: torch.Tensor, top: TopK, kind: str = "rkl") -> torch.Tensor:
    """[n] the top-k + tail estimate of the divergence from the student's full log-distribution
    [n, V] (differentiable) and the teacher's top-k."""
    s_b, t_b = topk_buckets(logp_s, top)
    return bucket_divergence(s_b, t_b, kind)


def teacher_topk(logp_t: torch.Tensor, k: int) -> TopK:
    """The top-k of a teacher's full log-distribution [n, V]."""
    vals, ids = logp_t.topk(min(k, logp_t.shape[-1]), dim=-1)
    return TopK(ids, vals)


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


def teacher_token_logprobs(logp_t: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[n] a teacher's log-probs of the sampled tokens from its log-distribution [n, V]."""
    return logp_t.gather(-1, targets[:, None].to(logp_t.device))[:, 0]


def teacher_targets(teacher: ActionStates, targets: torch.Tensor, estimator: str, k: int,
                    chunk_size: int = 1024, allowed: torch.Tensor | None = None) -> TopK | torch.Tensor:
    """What an estimator reads of a local teacher, from its states at the N actions (no grad):
    its top-k (:class:`TopK`) or its log-probs of the sampled tokens ([N]). ``allowed`` ([V]
    bool): the top-k only among these tokens (their log-probs unchanged: the rest is the tail)."""
    def fn(h: torch.Tensor, temp: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logp_t = F.log_softmax(teacher.logits(h, temp), dim=-1)
        if estimator == "topk":
            top = teacher_topk(logp_t if allowed is None else logp_t.masked_fill(~allowed.to(logp_t.device),
                                                                                   float("-inf")), k)
            return top.ids, top.logp
        return (teacher_token_logprobs(logp_t, y),)

    with torch.no_grad():
        parts = map_chunks(fn, (teacher.hidden.detach(), teacher.temperatures, targets.to(teacher.hidden.device)),
                           chunk_size)
    if estimator == "topk":
        kk = min(k, teacher.vocab_size or 10**9)
        empty = (torch.zeros(0, kk, dtype=torch.long), torch.zeros(0, kk))
        return TopK(*(torch.cat([p[i] for p in parts]) if parts else empty[i] for i in range(2)))
    return torch.cat([p[0] for p in parts]) if parts else torch.zeros(0)


def student_terms_topk(student: ActionStates, targets: torch.Tensor, top: TopK, kind: str = "rkl",
                       chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per action: the student's log p(target), its entropy and the top-k + tail divergence to the
    teacher, from one projection of the student's states per chunk. Returns [N] x 3."""
    def fn(h: torch.Tensor, temp: torch.Tensor, y: torch.Tensor, ids: torch.Tensor,
           t_lp: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logp_s = F.log_softmax(student.logits(h, temp), dim=-1)
        s_b, t_b = topk_buckets(logp_s, TopK(ids, t_lp, top.project))
        return (logp_s.gather(-1, y[:, None])[:, 0], -(logp_s.exp() * logp_s).sum(-1),
                bucket_divergence(s_b, t_b, kind))

    dev = student.hidden.device
    parts = map_chunks(fn, (student.hidden, student.temperatures, targets.to(dev), top.ids.to(dev), top.logp.to(dev)),
                       chunk_size)
    empty = student.hidden.new_zeros(0)
    return tuple(torch.cat([p[i] for p in parts]) if parts else empty for i in range(3))  # type: ignore[return-value]


__all__ = ["ESTIMATORS", "PROJECT_FLOOR", "SAMPLED_KINDS", "TAIL_FLOOR", "TeacherScores", "TopK",
           "bucket_divergence", "project_student", "sampled_advantage", "sampled_estimate", "sampled_loss",
           "student_terms_topk", "teacher_targets", "teacher_token_logprobs", "teacher_topk", "topk_buckets",
           "topk_divergence"]
