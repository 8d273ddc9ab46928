"""The teacher as the update sees it: a scorer of packed invocations.

What the update asks of a teacher is its states at the action tokens of a packed batch
(:class:`memopd.scoring.ActionStates`: hidden states and the output head that turns them into the
full next-token distribution, the full-vocabulary estimator's input), each action scored in the
context the run distils in:

- ``aligned`` (MemOPD): the batch the student is trained on, so every action is scored in the
  exact state the student sampled it in (prompt tokens, positions and visibility restored);
- ``persistent`` (the control): the episode flattened into one growing transcript, packed anew.

Three teachers live behind :meth:`Teacher.score` today: :class:`LocalTeacher` (whole weights in
this process), :class:`ShardedTeacher` (FSDP2 under torchrun, ``--teacher-parallel fsdp``: each
rank holds 1/N of the decoder and a whole copy of the output head) and
:class:`memopd.learn.remote_teacher.RemoteTeacher` (a model behind a stock ``vllm serve``: the
top-k and the sampled token's log-prob at every action, for the estimators that need no more).
What a score holds is :class:`TeacherScores`: whichever of these the teacher has.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

import torch

from agents.records import ROLES, Episode
from memopd import distributed
from memopd.estimators import TeacherScores
from memopd.learn.models import default_teacher_dir, ensure_teacher, pad_id
from memopd.packing import PackedBatch, fitting_budget, pack_episodes
from memopd.scoring import ActionStates, action_states


class Teacher(ABC):
    """Scores a step's packed invocations. ``model`` and ``tokenizer`` are the teacher's whole
    weights and tokenizer where it has them in this process (its held-out evaluation and
    Prune-OPD's rollout monitor use them)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, context: str = "aligned",
                 lowering: str | None = None, pack_tokens: int = 4096, roles: Sequence[str] = ROLES):
        self.model, self.tokenizer = model, tokenizer
        self.context, self.lowering, self.pack_tokens, self.roles = context, lowering, pack_tokens, tuple(roles)

    @abstractmethod
    def action_states(self, batch: PackedBatch) -> ActionStates:
        """The teacher's states at ``batch``'s action tokens, detached (no grad)."""

    @torch.no_grad()
    def score(self, episodes: Sequence[Episode], batch: PackedBatch) -> TeacherScores:
        """The teacher's states at the action tokens of ``batch`` (the packed ``episodes``), in the
        run's context; the action order is ``batch``'s in either context."""
        if self.context == "aligned":
            return TeacherScores(states=self.action_states(batch))
        # a flattened transcript cannot be split across rows: widen rows to fit it
        flat = pack_episodes(list(episodes), fitting_budget(list(episodes), "persistent", self.pack_tokens),
                             mode="persistent", teacher_roles=self.roles, pad_token_id=pad_id(self.tokenizer))
        return TeacherScores(states=self.action_states(flat))


class LocalTeacher(Teacher):
    """Whole weights in this process (one process, or a replica on every rank)."""

    def action_states(self, batch: PackedBatch) -> ActionStates:
        return action_states(self.model, batch, lowering=self.lowering).detach()


class ShardedTeacher(Teacher):
    """FSDP2-sharded under torchrun: every rank runs its packed forward at once (one call a step
    each: FSDP2 gathers layer by layer). Sharded at its first use, so that the whole-weight uses
    before training (the held-out evaluation of a fresh run) are over by then."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, world: distributed.World, device: str,
                 **kwargs: Any):
        super().__init__(model, tokenizer, **kwargs)
        self.world, self.device = world, device
        self._fwd: Any = None
        self._head: Any = None

    def action_states(self, batch: PackedBatch) -> ActionStates:
        if self._fwd is None:
            self._shard()
        hidden = self._fwd(batch, self.lowering)
        self._fwd.reshard()  # FSDP2 keeps a root's weights gathered after its forward, for a backward
        return ActionStates(hidden.detach(), self._head, batch.temperatures.to(hidden.device))

    def _shard(self) -> None:
        from memopd.heads import output_head

        self._head = distributed.whole_head(output_head(self.model))  # applied after the forward
        self._fwd = distributed.wrap(distributed.PackedStates(self.model), distributed.decoder_layers(self.model),
                                     "fsdp", self.device, self.world)


def load_teacher(cfg: Any, student_tokenizer: Any, world: distributed.World,
                 log: Callable[[str], None] = print) -> Any:
    """The run's teacher (None without distillation, ``--opd-coef 0``). ``--teacher URL`` is a
    served one. ``--teacher auto`` is built once per machine, by its local rank 0, while the
    machine's other ranks wait for the cache (on the filesystem: a build outlasts any collective
    timeout)."""
    from agents.models import check_same_vocab, load

    if cfg.opd_coef <= 0:
        return None
    from memopd.learn.remote_teacher import RemoteTeacher, is_url

    if is_url(cfg.teacher):
        k = cfg.opd_topk if cfg.opd_estimator == "topk" else 0  # the sampled estimator needs the action's only
        return RemoteTeacher(cfg.teacher, student_tokenizer, k=k, served_model=cfg.teacher_model,
                             concurrency=cfg.teacher_concurrency, retries=cfg.teacher_retries,
                             timeout_s=cfg.teacher_timeout)
    if cfg.teacher == "auto" and world.local_rank != 0:
        while not (default_teacher_dir(cfg) / "config.json").is_file():
            time.sleep(2.0)
    model, tokenizer = load(ensure_teacher(cfg, log), device=cfg.device)
    check_same_vocab(tokenizer, student_tokenizer)
    model.eval().requires_grad_(False)
    kw = dict(context=cfg.teacher_context, lowering=cfg.attn, pack_tokens=cfg.pack_tokens,
              roles=ROLES if cfg.teacher_mask == "both" else (cfg.teacher_mask,))
    if world.enabled and cfg.teacher_parallel == "fsdp":
        return ShardedTeacher(model, tokenizer, world=world, device=cfg.device, **kw)
    return LocalTeacher(model, tokenizer, **kw)


__all__ = ["LocalTeacher", "ShardedTeacher", "Teacher", "TeacherScores", "load_teacher"]
