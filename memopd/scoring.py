"""Actor / reference / teacher scoring of the sampled tokens of a packed batch.

Any causal LM scores a :class:`~memopd.packing.PackedBatch` the same way: run the decoder stack
once over the packed rows (explicit visibility, recorded positions, ``use_cache=False``), gather
the final hidden states at the action positions first (``[N, H]``), then project with the LM
head in chunks of action tokens — never ``[all tokens, vocab]``. Logits are divided by each
token's sampling temperature (from the record), so log-probs are comparable with the recorded
ones. Everything is differentiable; with grad enabled each chunk's projection is checkpointed,
so the full-vocabulary work of a backward pass also stays at one chunk at a time.

The teacher context mode is one flag of :func:`episode_states` / :func:`score_episodes`:
``aligned`` (each invocation's own state, MemOPD) or ``persistent`` (flattened history). Both
enumerate action tokens in the same canonical order, so student and teacher results line up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from agents.records import ROLES, Episode, Invocation
from memopd.attention import packed_hidden_states
from memopd.losses import divergence_from_states
from memopd.packing import PackedBatch, pack_episodes


@dataclass
class ActionStates:
    """Final hidden states at the action gather positions, and how to turn them into logits."""

    hidden: torch.Tensor  # [N, H]; differentiable when computed with grad
    head: torch.nn.Module  # the LM head (hidden -> vocab logits)
    temperatures: torch.Tensor  # [N]; logits are divided by these (1.0 = raw logits)
    softcap: float | None = None  # final logit soft-capping (Gemma-2 style), if the model uses it
    vocab_size: int | None = None  # keep the first vocab_size columns (teacher/student with padded vocabs)

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def select(self, index: torch.Tensor) -> "ActionStates":
        """States of a subset of actions, e.g. ``teacher.select(micro_batch.action_uid)``."""
        index = index.to(self.hidden.device)
        return ActionStates(self.hidden[index], self.head, self.temperatures[index], self.softcap, self.vocab_size)

    def logits(self, hidden: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """[n, V] temperature-scaled logits of a chunk of hidden states."""
        z = self.head(hidden)
        if self.vocab_size is not None:
            z = z[:, : self.vocab_size]
        z = z.float()
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z / temperatures[:, None].to(z)


def _chunks(n: int, size: int) -> Iterable[slice]:
    if size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {size}")
    return (slice(i, min(i + size, n)) for i in range(0, n, size))


def _maybe_checkpoint(fn: Callable, *args: torch.Tensor):
    """Recompute a chunk's full-vocab tensors in backward instead of keeping them alive."""
    if torch.is_grad_enabled() and any(a.requires_grad for a in args if isinstance(a, torch.Tensor)):
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def logit_config(model: torch.nn.Module) -> dict:
    """How a model post-processes logits beyond its LM head (soft-capping)."""
    return {"softcap": getattr(model.config, "final_logit_softcapping", None)}


def action_states(model: torch.nn.Module, batch: PackedBatch, *, lowering: str | None = None,
                  apply_temperature: bool = True, vocab_size: int | None = None) -> ActionStates:
    """Run ``model`` on the packed batch and keep the hidden states at its action positions."""
    hidden = packed_hidden_states(model, batch, lowering)
    temps = batch.temperatures.to(hidden.device) if apply_temperature else torch.ones(len(hidden), device=hidden.device)
    return ActionStates(hidden, model.get_output_embeddings(), temps, vocab_size=vocab_size, **logit_config(model))


def token_logprobs(states: ActionStates, targets: torch.Tensor, *, chunk_size: int = 1024,
                   full_logdist: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per action: log p(target), entropy, and optionally the full log-distribution ``[N, V]``."""
    targets = targets.to(states.hidden.device)

    def chunk(h: torch.Tensor, t: torch.Tensor, y: torch.Tensor):
        logp = F.log_softmax(states.logits(h, t), dim=-1)
        ent = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, y[:, None])[:, 0], ent, logp

    lps, ents, dists = [], [], []
    for sl in _chunks(len(states), chunk_size):
        args = (states.hidden[sl], states.temperatures[sl], targets[sl])
        if full_logdist:
            lp, ent, logp = chunk(*args)
            dists.append(logp)
        else:
            lp, ent = _maybe_checkpoint(lambda *a: chunk(*a)[:2], *args)
        lps.append(lp)
        ents.append(ent)
    empty = states.hidden.new_zeros(0)
    return (torch.cat(lps) if lps else empty, torch.cat(ents) if ents else empty,
            torch.cat(dists) if full_logdist and dists else None)


def reverse_kl(student: ActionStates, teacher: ActionStates, *, chunk_size: int = 1024) -> torch.Tensor:
    """[N] full-vocabulary KL(p_student || p_teacher) per action token, in chunks; differentiable
    with respect to the student (the teacher is detached). See
    :func:`memopd.losses.divergence_from_states` for the other divergences."""
    return divergence_from_states(student, teacher, "rkl", chunk_size)


@dataclass
class TokenScores:
    """Per-action results of :func:`score`, in the batch's canonical action order."""

    logprobs: torch.Tensor  # [N] log p(sampled token) at the record's temperature
    entropy: torch.Tensor  # [N]
    logdist: torch.Tensor | None  # [N, V] full log-distribution, only when requested
    batch: PackedBatch

    def per_invocation(self, which: str = "logprobs") -> dict[tuple[int, int], torch.Tensor]:
        """``{(episode, invocation): [n_tokens]}`` of one of the per-action fields."""
        return self.batch.per_invocation(getattr(self, which))


def score(model: torch.nn.Module, batch: PackedBatch, *, lowering: str | None = None, chunk_size: int = 1024,
          full_logdist: bool = False, apply_temperature: bool = True) -> TokenScores:
    """Log-prob of each sampled token, entropy and (on request) the full log-distribution."""
    states = action_states(model, batch, lowering=lowering, apply_temperature=apply_temperature)
    lp, ent, dist = token_logprobs(states, batch.action_ids, chunk_size=chunk_size, full_logdist=full_logdist)
    return TokenScores(lp, ent, dist, batch)


def episode_states(model: torch.nn.Module, episodes: Sequence[Episode | Sequence[Invocation]], *,
                   mode: str = "aligned", max_tokens: int = 4096, lowering: str | None = None,
                   teacher_roles: Iterable[str] = ROLES, apply_temperature: bool = True,
                   vocab_size: int | None = None) -> tuple[ActionStates, PackedBatch]:
    """Teacher-side helper: pack episodes in a context mode and return the action states (canonical
    order, so they line up with a student's aligned batch of the same episodes)."""
    batch = pack_episodes(episodes, max_tokens, mode=mode, teacher_roles=teacher_roles)
    return action_states(model, batch, lowering=lowering, apply_temperature=apply_temperature,
                         vocab_size=vocab_size), batch


def score_episodes(model: torch.nn.Module, episodes: Sequence[Episode | Sequence[Invocation]], *,
                   mode: str = "aligned", max_tokens: int = 4096, lowering: str | None = None,
                   chunk_size: int = 1024, full_logdist: bool = False) -> TokenScores:
    """Pack episodes in a context mode (``aligned`` or ``persistent``) and score them."""
    batch = pack_episodes(episodes, max_tokens, mode=mode)
    return score(model, batch, lowering=lowering, chunk_size=chunk_size, full_logdist=full_logdist)


__all__ = ["ActionStates", "TokenScores", "action_states", "episode_states", "reverse_kl", "score",
           "score_episodes", "token_logprobs"]
