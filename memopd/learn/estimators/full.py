"""``full`` (MemOPD's): the divergence over the whole vocabulary at every supervised action.

``D(s, t)`` from the student's and the teacher's full next-token distributions
(:func:`memopd.losses.divergence_from_logprobs`), both projected in chunks from the hidden states
gathered at the action tokens. Exact; needs the teacher's whole distribution (its hidden states and
output head in this process). With several PPO epochs the teacher's ``[N, V]`` log-distribution is
computed once and kept when it fits ``--teacher-cache-mb``.
"""

from __future__ import annotations

import torch

from memopd import losses
from memopd.learn.estimators.base import Estimator, TeacherScores, Terms
from memopd.packing import PackedBatch
from memopd.scoring import ActionStates

# CoreConfig (memopd.learn.options) names the run's core options in the annotations; it is not imported,
# even for type checkers, because options imports this module (an import cycle otherwise).


class FullEstimator(Estimator):
    """Subclass it for another divergence over the whole vocabulary: override :meth:`kind`."""

    name = "full"
    needs = frozenset({"distribution"})

    def kind(self) -> str | losses.Divergence:
        """The divergence: a name of :func:`memopd.losses.divergence_from_logprobs` (``--opd-divergence``),
        or a function of the student's and the teacher's log-distributions [n, V] -> [n]."""
        return self.divergence

    def prepare(self, scores: TeacherScores, batch: PackedBatch) -> TeacherScores:
        if scores.logp is None:  # a routing table's scores come with their distribution (several heads)
            scores.logp = teacher_logprobs(scores.states, self.cfg)
        return scores

    def terms(self, states: ActionStates, mb: PackedBatch, scores: TeacherScores) -> Terms:
        uid = mb.action_uid
        kept = scores.logp[uid] if scores.logp is not None else None
        teacher = scores.states.select(uid) if scores.logp is None else None
        return losses.student_terms(states, mb.action_ids, teacher, self.kind(), self.chunk, kept)


def teacher_logprobs(teacher_states: ActionStates | None, cfg: CoreConfig) -> torch.Tensor | None:
    """The teacher's [N, V] log-distribution of the step, computed once for every PPO epoch when
    it fits ``--teacher-cache-mb`` (else None: each epoch projects the teacher's states again)."""
    if teacher_states is None or cfg.ppo_epochs == 1:
        return None
    vocab = teacher_states.vocab_size or next(teacher_states.head.lm_head.parameters()).shape[0]
    if len(teacher_states) * vocab * 4 > cfg.teacher_cache_mb * 2**20:
        return None
    return losses.teacher_logprobs(teacher_states, cfg.kl_chunk)


__all__ = ["FullEstimator", "teacher_logprobs"]
