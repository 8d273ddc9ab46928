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

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from agents.records import ROLES, Episode, Invocation
from memopd.attention import packed_hidden_states
from memopd.heads import OutputHead, output_head
from memopd.packing import PackedBatch, pack_episodes


@dataclass
class ActionStates:
    """Final hidden states at the action gather positions, and how to turn them into logits."""

    hidden: torch.Tensor  # [N, H]; differentiable when computed with grad
    head: OutputHead | torch.nn.Module  # hidden -> logits as the model's forward computes them
    temperatures: torch.Tensor  # [N]; logits are divided by these (1.0 = raw logits)
    softcap: float | None = None  # only with a bare nn.Module head: final logit soft-capping
    vocab_size: int | None = None  # keep the first vocab_size columns (teacher/student with padded vocabs)

    def __post_init__(self) -> None:
        if not isinstance(self.head, OutputHead):  # a bare LM head (e.g. in a benchmark)
            self.head, self.softcap = OutputHead(self.head, softcap=self.softcap), None

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def select(self, index: torch.Tensor) -> "ActionStates":
        """States of a subset of actions, e.g. ``teacher.select(micro_batch.action_uid)``."""
        index = index.to(self.hidden.device)
        return replace(self, hidden=self.hidden[index], temperatures=self.temperatures[index])

    def detach(self) -> "ActionStates":
        """The same states cut from the autograd graph (a teacher's, computed once per step)."""
        return replace(self, hidden=self.hidden.detach())

    def logits(self, hidden: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """[n, V] temperature-scaled float32 logits of a chunk of hidden states."""
        z = self.head(hidden)
        if self.vocab_size is not None:
            z = z[:, : self.vocab_size]
        return z / temperatures[:, None].to(z)


def map_chunks(fn: Callable[..., Any], tensors: Sequence[torch.Tensor], chunk_size: int) -> list[Any]:
    """``fn`` over row chunks of ``tensors`` (all ``[N, ...]``): the one chunk loop of every
    full-vocabulary computation. With grad enabled and a tensor requiring it, each chunk is
    checkpointed, so its ``[chunk, V]`` tensors are recomputed in backward instead of kept alive."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    n = tensors[0].shape[0] if tensors else 0
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    out = []
    for i in range(0, n, chunk_size):
        args = [t[i:i + chunk_size] for t in tensors]
        out.append(checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args))
    return out


def action_states(model: torch.nn.Module, batch: PackedBatch, *, lowering: str | None = None,
                  apply_temperature: bool = True, vocab_size: int | None = None) -> ActionStates:
    """Run ``model`` on the packed batch and keep the hidden states at its action positions. The
    head reproduces what the model's forward does after its decoder (checked once per model;
    :func:`memopd.heads.output_head`)."""
    head = output_head(model)
    hidden = packed_hidden_states(model, batch, lowering)
    temps = batch.temperatures.to(hidden.device) if apply_temperature else torch.ones(len(hidden), device=hidden.device)
    return ActionStates(hidden, head, temps, vocab_size=vocab_size)


def row_grouped_states(states_of: Callable[[PackedBatch], ActionStates], batch: PackedBatch,
                       rows: int) -> ActionStates:
    """``states_of(batch)`` computed over groups of ``rows`` packed rows at a time and put back in
    ``batch``'s action order: the same states, with one group's activations alive at a time (for
    passes without a backward: the teacher's, the trainer's old log-probs)."""
    if rows < 1 or batch.num_rows <= rows:
        return states_of(batch)
    parts = [(part, states_of(part)) for part in batch.micro_batches(rows)]
    first = parts[0][1]
    position = torch.empty(int(batch.action_uid.max()) + 1 if batch.num_actions else 0, dtype=torch.long)
    position[batch.action_uid] = torch.arange(batch.num_actions)
    hidden = first.hidden.new_empty(batch.num_actions, first.hidden.shape[-1])
    temps = first.temperatures.new_empty(batch.num_actions)
    for part, states in parts:
        at = position[part.action_uid].to(hidden.device)
        hidden[at], temps[at] = states.hidden, states.temperatures
    return replace(first, hidden=hidden, temperatures=temps)


def token_logprobs(states: ActionStates, targets: torch.Tensor, *, chunk_size: int = 1024,
                   full_logdist: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per action: log p(target), entropy, and optionally the full log-distribution ``[N, V]``."""
    targets = targets.to(states.hidden.device)

    def chunk(h: torch.Tensor, t: torch.Tensor, y: torch.Tensor):
        logp = F.log_softmax(states.logits(h, t), dim=-1)
        ent = -(logp.exp() * logp).sum(-1)
        return (logp.gather(-1, y[:, None])[:, 0], ent) + ((logp,) if full_logdist else ())

    parts = map_chunks(chunk, (states.hidden, states.temperatures, targets), chunk_size)
    empty = states.hidden.new_zeros(0)
    cat = lambda k: torch.cat([p[k] for p in parts]) if parts else empty  # noqa: E731
    return cat(0), cat(1), ((cat(2) if parts else None) if full_logdist else None)


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


__all__ = ["ActionStates", "TokenScores", "action_states", "episode_states", "map_chunks", "score", "score_episodes",
           "token_logprobs"]
