"""Rewards, the trajectory weights of the PPO terms, advantages (group-relative or GAE), and the
step's outcome metrics.

- A trajectory's reward is its ``--reward`` metric (0 for ``--reward none``, OPD only); a
  ``--ref-beta`` penalty ``beta * [logp_old - logp_ref]_+`` per token is taken off it.
- Each trajectory weighs 1 in all, split equally over its invocations and, within one, over its
  tokens: the number of calls is not a hidden weight (``--loss-agg trajectory``, the default; the
  other aggregations, DAPO's, GRPO's and Dr. GRPO's, are :mod:`memopd.learn.policy_loss`'s).
- ``--overlong-buffer`` adds DAPO's overlong shaping to the reward (:mod:`memopd.learn.rewards`).
- An episode cut before its answer (a rollout-depth budget, a drift stop: ``Episode.cut``) has
  no reward: its tokens get no PPO, entropy or value terms, and it is a group of its own.
- ``grpo``: the episode's reward minus its group's mean, over the group's std
  (:func:`memopd.losses.group_advantages`; ``--scale-rewards`` batch / none: the batch's, or none as
  Dr. GRPO), on every token of the episode; ``gae``: GAE over the
  trajectory's action tokens in call order with a critic, the reward on the last token, then
  standardised over the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from agents.lora import adapters_off
from agents.records import ROLES, Episode
from memopd import distributed, losses
from memopd.learn.policy_loss import aggregation_weights
from memopd.learn.rewards import scaled_group_advantages, shaped_rewards
from memopd.packing import PackedBatch
from memopd.runlog import mean
from memopd.scoring import action_states, token_logprobs

if TYPE_CHECKING:  # the run's options, for the annotations
    from memopd.learn.options import CoreConfig


@dataclass
class Advantages:
    """[N] per-token advantages and trajectory weights of a packed batch (``norm``: the weights of
    the loss's normaliser where they differ from ``weights``, :func:`memopd.learn.policy_loss.aggregation_weights`);
    with GAE also the critic's values and the returns it regresses on."""

    advantages: torch.Tensor
    weights: torch.Tensor
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    norm: torch.Tensor | None = None


def episode_rewards(episodes: Sequence[Episode], kind: str) -> torch.Tensor:
    """[E] each episode's ``kind`` metric (its reward if it has none); zeros for ``none``."""
    if kind == "none":
        return torch.zeros(len(episodes))
    return torch.tensor([float(e.metrics.get(kind, e.reward)) for e in episodes], dtype=torch.float32)


def trajectory_weights(batch: PackedBatch, episodes: Sequence[Episode]) -> torch.Tensor:
    """[N] per-token weights: each trajectory weighs 1 in all, split equally over its invocations
    and within an invocation equally over its tokens."""
    e, i = batch.token_map[:, 0].tolist(), batch.token_map[:, 1].tolist()
    w = [1.0 / (len(episodes[ei].invocations) * len(episodes[ei].invocations[ii].response_ids))
         for ei, ii in zip(e, i)]
    return torch.tensor(w, dtype=torch.float32)


def loss_weights(batch: PackedBatch, episodes: Sequence[Episode], kind: str, cap: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] the weights and normaliser weights of the ``--loss-agg kind`` aggregation of a batch."""
    e, i = batch.token_map[:, 0].tolist(), batch.token_map[:, 1].tolist()
    call_len = torch.tensor([len(episodes[ei].invocations[ii].response_ids) for ei, ii in zip(e, i)])
    calls = torch.tensor([len(episodes[ei].invocations) for ei in e])
    return aggregation_weights(call_len, calls, kind, cap)


def gae_token_advantages(batch: PackedBatch, rewards: torch.Tensor, values: torch.Tensor,
                         penalty: torch.Tensor | None, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over each trajectory's action tokens in call order; the reward lands on the last token."""
    adv = torch.zeros_like(values)
    ret = torch.zeros_like(values)
    ep = batch.token_map[:, 0]
    for e in ep.unique().tolist():
        idx = (ep == e).nonzero()[:, 0]  # canonical order: invocation, then token
        r = torch.zeros(len(idx))
        r[-1] = rewards[e]
        if penalty is not None:
            r = r + penalty[idx]
        a, g = losses.gae(r, values[idx], gamma, lam)
        adv[idx], ret[idx] = a, g
    return adv, ret


def role_masks(batch: PackedBatch, episodes: Sequence[Episode]) -> dict[str, torch.Tensor]:
    """[N] bool per role (memory, answer): which action tokens belong to that kind of call."""
    roles = [episodes[e].invocations[i].role for e, i in batch.token_map[:, :2].tolist()]
    return {r: torch.tensor([x == r for x in roles], dtype=torch.bool) for r in ROLES}


def compute_advantages(cfg: CoreConfig, batch: PackedBatch, episodes: Sequence[Episode], own: Sequence[int],
                       world: distributed.World, ref: torch.nn.Module | None = None,
                       critic: Any = None) -> Advantages:
    """Advantages of this rank's packed share (``own`` indexes ``episodes``, the whole step's, which
    group-relative baselines need)."""
    local = [episodes[i] for i in own]
    all_rewards = shaped_rewards(episode_rewards(episodes, cfg.reward), episodes, cfg, cfg.max_new_tokens)
    rewards = all_rewards[own]
    weights, norm = loss_weights(batch, local, cfg.loss_agg, cfg.max_new_tokens)
    cut = [e.cut is not None for e in episodes]
    if any(cut):
        cut_tokens = torch.tensor([cut[own[e]] for e in batch.token_map[:, 0].tolist()], dtype=torch.bool)
        weights, norm = weights.masked_fill(cut_tokens, 0.0), norm.masked_fill(cut_tokens, 0.0)
    penalty = None
    if ref is not None and cfg.ref_beta > 0:
        with torch.no_grad(), adapters_off(ref):  # a LoRA student as its own reference: the base model
            ref_lp, _, _ = token_logprobs(action_states(ref, batch, lowering=cfg.attn), batch.action_ids)
        penalty = losses.penalised_rewards(rewards, batch.old_logprobs, ref_lp, cfg.ref_beta)
    if cfg.advantage == "gae":
        with torch.no_grad():
            values = critic(batch, cfg.attn)
        adv, returns = gae_token_advantages(batch, rewards, values, penalty, cfg.gamma, cfg.lam)
        return Advantages(distributed.standardise(adv, world), weights, values, returns, norm)
    if penalty is not None:  # spread the trajectory's mean penalty onto its reward
        pen_ep = torch.zeros(len(local)).index_add_(0, batch.token_map[:, 0],
                                                   penalty * trajectory_weights(batch, local))
        all_rewards = all_rewards + distributed.all_sum_tensor(
            torch.zeros(len(episodes)).index_copy_(0, torch.tensor(own), pen_ep), world)
    groups = [f"cut:{e.episode_id}" if c else e.group_id or e.episode_id for e, c in zip(episodes, cut)]
    ep_adv = scaled_group_advantages(all_rewards, groups, cfg.scale_rewards)
    return Advantages(ep_adv[own][batch.token_map[:, 0]], weights, norm=norm)


def step_metrics(cfg: CoreConfig, world: distributed.World, episodes: Sequence[Episode], batch: PackedBatch,
                 rollout_s: float, learn_s: float, lr: float, stats: dict[str, float]) -> dict[str, float]:
    """The step's metrics: outcomes of the episodes that ran to their answer (every rank's), the
    shape of the batch, throughput and time, the learning rate, and ``stats`` (the update's, the
    plugins', the teacher's, the phases' times)."""
    n_calls = sum(len(e.invocations) for e in episodes)
    mem_tokens = [len(i.response_ids) for e in episodes for i in e.invocations if i.role == "memory"]
    n_actions, n_real, n_slots = distributed.all_sum([batch.num_actions, batch.num_real_tokens,
                                                      batch.block_ids.numel()], world)
    done = [e for e in episodes if e.cut is None]
    return {
        "reward": float(episode_rewards(done, cfg.reward if cfg.reward != "none" else "f1").mean()) if done
        else float("nan"),
        "f1": mean([e.metrics.get("f1", 0.0) for e in done]),
        "em": mean([e.metrics.get("em", 0.0) for e in done]),
        "calls_per_episode": n_calls / max(1, len(episodes)),
        "memory_tokens_per_call": mean(mem_tokens),
        "action_tokens": int(n_actions),
        "packing_efficiency": 1.0 - (1.0 - n_real / max(1, n_slots)),
        "tokens_per_s": n_real * cfg.ppo_epochs / max(1e-9, learn_s),
        "rollout_s": rollout_s, "step_s": rollout_s + learn_s, "lr": lr,
        **stats,
    }


__all__ = ["Advantages", "compute_advantages", "episode_rewards", "gae_token_advantages", "loss_weights", "role_masks", "step_metrics",
           "trajectory_weights"]
