"""Teachers with their weights in this process: whole (:class:`LocalTeacher`) or FSDP2-sharded
under torchrun (:class:`ShardedTeacher`, ``--teacher-parallel fsdp``).

What they give is their states at the action tokens of a packed batch
(:class:`memopd.scoring.ActionStates`: hidden states and the output head that turns them into the
full next-token distribution), each action scored in the context the run distils in:

- ``aligned`` (MemOPD): the batch the student is trained on, so every action is scored in the
  exact state the student sampled it in (prompt tokens, positions and visibility restored);
- ``persistent`` (the control): the episode flattened into one growing transcript, packed anew.

From the full distribution every estimator's input follows (the top-k and the sampled tokens'
log-probs are derived from it: :class:`~memopd.learn.estimators.base.TeacherScores`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from agents.records import ROLES, Episode
from memopd import distributed
from memopd.learn.estimators.base import TeacherScores
from memopd.learn.models import pad_id
from memopd.learn.teachers.base import Teacher
from memopd.packing import PackedBatch, fitting_budget, pack_episodes
from memopd.scoring import ActionStates, action_states, row_grouped_states


class LocalTeacher(Teacher):
    """Whole weights in this process (one process, or a replica on every rank)."""

    provides = frozenset({"distribution", "topk", "sampled", "persistent"})
    lacks = {"sharded": "a whole teacher is replicated on every rank"}
    instead = "a teacher with the student's tokenizer"

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, context: str = "aligned",
                 lowering: str | None = None, pack_tokens: int = 4096, roles: Sequence[str] = ROLES,
                 rows_per_forward: int = 0):
        self.model, self.tokenizer = model, tokenizer
        self.rows_per_forward = rows_per_forward  # packed rows per forward (0: every row at once)
        self.context, self.lowering, self.pack_tokens, self.roles = context, lowering, pack_tokens, tuple(roles)

    def action_states(self, batch: PackedBatch) -> ActionStates:
        """The teacher's states at ``batch``'s action tokens, detached (no grad)."""
        return row_grouped_states(lambda part: action_states(self.model, part, lowering=self.lowering).detach(),
                                  batch, self.rows_per_forward)

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


class ShardedTeacher(LocalTeacher):
    """FSDP2-sharded under torchrun: every rank runs its packed forward at once (one call a step
    each: FSDP2 gathers layer by layer). Sharded at its first use, so that the whole-weight uses
    before training (the held-out evaluation of a fresh run) are over by then."""

    provides = LocalTeacher.provides | {"sharded"}

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


__all__ = ["LocalTeacher", "ShardedTeacher"]
