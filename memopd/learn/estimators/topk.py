"""``topk`` (k + 1 buckets): the teacher's k most likely tokens plus one bucket for the rest.

The teacher's ``k`` most likely tokens ``S`` at the position, plus one bucket for the rest:
``t_S`` and ``t_tail = 1 - sum(t_S)``; the student's distribution is projected on the same
buckets (``s_S`` and ``s_tail = 1 - sum(s_S)``, its own mass outside ``S``), and ``D`` is taken over
the ``k + 1`` buckets. Needs ``2k`` numbers a token. Bias: merging the tail into one bucket can only
lower a divergence (the data-processing inequality), so the estimate is a lower bound of the full
one, equal to it when both distributions agree in shape within the tail (exactly equal at
``k = V``). Unlike dropping the tail (top-k renormalised), the student is not rewarded for moving
mass outside ``S``. A teacher tail below ``1e-12`` is clamped there (a rounding-level sum of the
top ``k`` above 1 would otherwise make it ``-inf``).

A teacher with another tokenizer gives its top-k in its own ids, with the map of each student token
to the teacher token its text starts with (``TopK.project``, :mod:`memopd.retokenize` rule 4): the
student's distribution is first summed onto the teacher's tokens (:func:`project_student`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from memopd import losses
from memopd.config import Config, field
from memopd.learn.estimators.base import Estimator, TeacherScores, Terms, TopK
from memopd.packing import PackedBatch
from memopd.scoring import ActionStates, map_chunks

TAIL_FLOOR = 1e-12
"""The least tail mass of the teacher in the top-k estimator."""
PROJECT_FLOOR = 1e-30
"""The least mass of a teacher token in the student's projected distribution (an empty bucket's
log would be -inf, and its gradient NaN)."""


@dataclass
class TopKOptions(Config):
    """The top-k estimator (--opd-estimator topk)"""

    opd_topk: int = field(20, help="topk estimator: the teacher's most likely tokens kept per action",
                          range=(1, None))


class TopKEstimator(Estimator):
    name = "topk"
    needs = frozenset({"topk"})
    Options = TopKOptions

    @property
    def topk(self) -> int:
        return self.options.opd_topk

    def prepare(self, scores: TeacherScores, batch: PackedBatch) -> TopK:
        return scores.topk(self.topk, batch.action_ids, self.chunk)

    def terms(self, states: ActionStates, mb: PackedBatch, top: TopK) -> Terms:
        return student_terms_topk(states, mb.action_ids, top.select(mb.action_uid), self.divergence, self.chunk)


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
    raise ValueError(f"unknown divergence {kind!r}; choose one of {losses.DIVERGENCES}")


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


__all__ = ["PROJECT_FLOOR", "TAIL_FLOOR", "TopKEstimator", "TopKOptions", "bucket_divergence", "project_student",
           "student_terms_topk", "topk_buckets", "topk_divergence"]
