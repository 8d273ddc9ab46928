"""What an estimator is, and what it reads of the teacher.

An estimator of the distillation divergence is an object (:class:`Estimator`) that declares what it
needs of a teacher (``needs``: capabilities of :mod:`memopd.learn.needs`), which divergences it
estimates, its options (``Options``), and computes, per step and per row group of the update:

- :meth:`Estimator.prepare`: once a step, what every PPO epoch reads of the teacher's scores
  (its targets: a kept log-distribution, a top-k, log-probs of the sampled tokens);
- :meth:`Estimator.terms`: the student's log-probs of the sampled tokens, its entropy and the
  estimated divergence at each action of a row group (differentiable);
- :meth:`Estimator.advantage`: a per-token advantage PPO optimises instead of a loss term (None:
  the divergence is a loss term).

:class:`TeacherScores` is what every teacher returns; its accessors give an estimator the payload
it needs whatever the teacher (the full distribution, or a top-k and sampled-token log-probs that
a served teacher returns and a local one derives from its distribution). The start-up check
(:func:`memopd.learn.needs.check_needs`) guarantees the payload is there, so no reader tests which
one came back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from memopd import losses
from memopd.packing import PackedBatch
from memopd.scoring import ActionStates, map_chunks

# CoreConfig (memopd.learn.options) names the run's core options in the annotations; it is not imported,
# even for type checkers, because options imports this module (an import cycle otherwise).


@dataclass
class TopK:
    """The teacher's k most likely tokens at each of N actions and their log-probs, [N, k] each.

    ``project`` ([V_student] long, a teacher with another tokenizer): the teacher token each
    student token's text starts with (-1: none); ``ids`` are then teacher ids, and the student's
    distribution is summed onto the teacher's tokens through it before the buckets are taken
    (:func:`memopd.learn.estimators.topk.project_student`). None: both are in the student's ids."""

    ids: torch.Tensor
    logp: torch.Tensor
    project: torch.Tensor | None = None

    def select(self, index: torch.Tensor) -> TopK:
        return TopK(self.ids[index], self.logp[index], self.project)


@dataclass
class TeacherScores:
    """The teacher at a step's N actions, in the batch's action order: its states (the full
    distribution, a teacher in this process), or its top-k and its log-probs of the sampled tokens
    (a served teacher, one with another tokenizer); which actions it has a target for; metrics of
    the scoring (time, bytes). ``logp``: its [N, V] log-distribution when an estimator keeps it for
    every PPO epoch (:class:`memopd.learn.estimators.full.FullEstimator`)."""

    states: ActionStates | None = None
    top: TopK | None = None
    sampled: torch.Tensor | None = None  # [N]
    supervised: torch.Tensor | None = None  # [N] bool: the actions it has a target for (None: every one)
    metrics: dict[str, float] = field(default_factory=dict)
    logp: torch.Tensor | None = None  # [N, V], kept

    def topk(self, k: int, targets: torch.Tensor, chunk_size: int) -> TopK:
        """Its top-k at every action: as returned, else from its full distribution."""
        if self.top is not None:
            return self.top
        return teacher_targets(self.states, targets, "topk", k, chunk_size)  # type: ignore[arg-type, return-value]

    def token_logprobs(self, targets: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """[N] its log-probs of the sampled tokens: as returned, else from its full distribution."""
        if self.sampled is not None:
            return self.sampled
        return teacher_targets(self.states, targets, "sampled", 0, chunk_size)  # type: ignore[arg-type, return-value]


def teacher_topk(logp_t: torch.Tensor, k: int) -> TopK:
    """The top-k of a teacher's full log-distribution [n, V]."""
    vals, ids = logp_t.topk(min(k, logp_t.shape[-1]), dim=-1)
    return TopK(ids, vals)


def teacher_token_logprobs(logp_t: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[n] a teacher's log-probs of the sampled tokens from its log-distribution [n, V]."""
    return logp_t.gather(-1, targets[:, None].to(logp_t.device))[:, 0]


def teacher_targets(teacher: ActionStates, targets: torch.Tensor, estimator: str, k: int,
                    chunk_size: int = 1024, allowed: torch.Tensor | None = None) -> TopK | torch.Tensor:
    """What an estimator reads of a local teacher, from its states at the N actions (no grad):
    its top-k (``"topk"``: :class:`TopK`) or its log-probs of the sampled tokens (``"sampled"``:
    [N]). ``allowed`` ([V] bool): the top-k only among these tokens (their log-probs unchanged:
    the rest is the tail)."""
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


Terms = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]
"""Per action of a row group: the student's log p(sampled token), its entropy, the divergence (None: none)."""


class Estimator:
    """An estimator of the distillation divergence at each supervised action; subclass it, set
    ``name`` and ``needs``, and implement :meth:`prepare` and :meth:`terms` (see the module doc).

    ``cfg`` is the run's config (an estimator reads ``opd_divergence`` and ``kl_chunk``, and what
    else of the run it needs), ``options`` its own ``Options`` (a built-in's from its flags, any
    other's from ``--opd-estimator-kwarg``)."""

    name: ClassVar[str] = ""
    """Its name for ``--opd-estimator``."""
    needs: ClassVar[frozenset[str]] = frozenset({"distribution"})
    """What it reads of the teacher (capabilities of :mod:`memopd.learn.needs`)."""
    divergences: ClassVar[tuple[str, ...]] = losses.DIVERGENCES
    """The ``--opd-divergence`` values it estimates."""
    Options: ClassVar[type | None] = None
    """Its config slice: a :mod:`memopd.config` dataclass, or None."""
    as_loss: bool = True
    """Whether its divergence is a loss term (else PPO optimises :meth:`advantage`)."""

    def __init__(self, cfg: CoreConfig, options: Any = None) -> None:
        self.cfg, self.options = cfg, options
        self.divergence, self.chunk = cfg.opd_divergence, cfg.kl_chunk

    @property
    def topk(self) -> int:
        """How many of the teacher's most likely tokens it reads at each action (0: none)."""
        return 0

    def prepare(self, scores: TeacherScores, batch: PackedBatch) -> Any:
        """What every epoch reads of the teacher, once a step (no grad)."""
        raise NotImplementedError

    def terms(self, states: ActionStates, mb: PackedBatch, targets: Any) -> Terms:
        """The student's log-probs, entropy and divergence at a row group's actions."""
        raise NotImplementedError

    def advantage(self, batch: PackedBatch, targets: Any) -> torch.Tensor | None:
        """[N] a per-token advantage (to be scaled by lambda and the distillation weights), or None."""
        return None


class NoDistillation(Estimator):
    """No teacher (``--opd-coef 0``): the student's log-probs and entropy, no divergence."""

    name = "none"
    needs = frozenset()

    def prepare(self, scores: TeacherScores | None, batch: PackedBatch) -> None:
        return None

    def terms(self, states: ActionStates, mb: PackedBatch, targets: Any) -> Terms:
        return losses.student_terms(states, mb.action_ids, None, self.divergence, self.chunk, None)


__all__ = ["Estimator", "NoDistillation", "TeacherScores", "Terms", "TopK", "teacher_targets", "teacher_token_logprobs",
           "teacher_topk"]
