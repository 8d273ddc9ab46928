"""What the advantages are made from: overlong shaping of an episode's reward, and how group-relative
advantages are scaled.

The rules, as the papers write them:

- **DAPO's overlong shaping** (arXiv 2503.14476, "soft overlong punishment"): a response of length
  ``|y|`` under a cap ``L_max`` with a buffer ``L_cache`` gets the length reward ``0`` when ``|y| <=
  L_max - L_cache``, ``((L_max - L_cache) - |y|) / L_cache`` when ``L_max - L_cache < |y| <= L_max``
  (from 0 down to -1 as it nears the cap), and ``-1`` beyond, added to its task reward (``--overlong-buffer``,
  ``--overlong-coef`` scales it; the paper: ``L_max`` 20,480, ``L_cache`` 4,096, coefficient 1).
- **Dr. GRPO's advantage** ("Understanding R1-Zero-Like Training", arXiv 2503.20783): ``A_i = r_i -
  mean(r_group)``, without GRPO's division by the group's standard deviation, which weighs the
  questions with little spread (too easy or too hard) up (``--scale-rewards none``). ``batch``
  divides by the standard deviation over the whole batch instead (as TRL's ``scale_rewards="batch"``).

How they apply to a memory agent's several calls: a call's cap is the ``max_new_tokens`` it was
sampled with (recorded in ``Invocation.sampling``), and the episode's length reward is the **mean over
its calls** of theirs: the reward, and with it the group-relative advantage, is the episode's, shared
by its calls (one call's penalty on its own tokens would need an advantage per call, which the group
baseline does not give); the mean keeps the shaping in [-coef, 0] whatever the number of calls.

Departures from TRL's GRPO advantages (also said in docs/training.md): the group's standard deviation
is the population one (TRL divides by ``n - 1``) and the guard is ``1e-6`` (TRL ``1e-4``), as this
project has always had it; with ``--scale-rewards none`` the two are equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from agents.records import Episode
from memopd import losses
from memopd.config import Config, field

SCALES = ("group", "batch", "none")


@dataclass
class RewardShapingOptions(Config):
    """RL rewards: overlong shaping and advantage scale (DAPO, Dr. GRPO)"""

    scale_rewards: str = field("group", help="group-relative advantages (--advantage grpo) divided by the group's "
                                             "reward std (group: GRPO), the batch's (batch), or not at all (none: "
                                             "Dr. GRPO)", choices=SCALES)
    overlong_buffer: int = field(0, help="DAPO's soft overlong penalty: a call within this many tokens of its "
                                         "max_new_tokens cap loses up to 1 (linearly, -1 at the cap); the episode's "
                                         "reward takes the mean over its calls (0 = off)", range=(0, None))
    overlong_coef: float = field(1.0, help="weight of the overlong penalty on the episode's reward",
                                 range=(0.0, None))


def overlong_penalty(length: torch.Tensor, cap: torch.Tensor, buffer: int) -> torch.Tensor:
    """[n] DAPO's length reward of responses of ``length`` tokens under caps ``cap`` with a buffer
    of ``buffer`` tokens: 0 up to ``cap - buffer``, then linear down to -1 at ``cap``, -1 beyond."""
    length, cap = length.float(), cap.float()
    soft = ((cap - buffer) - length) / buffer
    return torch.where(length <= cap - buffer, torch.zeros_like(length),
                       torch.where(length <= cap, soft, -torch.ones_like(length)))


def episode_overlong(episodes: Sequence[Episode], default_cap: int, buffer: int) -> torch.Tensor:
    """[E] each episode's length reward: the mean over its calls of :func:`overlong_penalty` (a call's
    cap is the ``max_new_tokens`` it was sampled with, else ``default_cap``)."""
    out = torch.zeros(len(episodes))
    for k, ep in enumerate(episodes):
        if not ep.invocations:
            continue
        lengths = torch.tensor([len(i.response_ids) for i in ep.invocations])
        caps = torch.tensor([int(i.sampling.get("max_new_tokens", default_cap)) for i in ep.invocations])
        out[k] = overlong_penalty(lengths, caps, buffer).mean()
    return out


def shaped_rewards(rewards: torch.Tensor, episodes: Sequence[Episode], opts: RewardShapingOptions,
                   default_cap: int) -> torch.Tensor:
    """[E] the episodes' rewards with the overlong shaping added (as they are when it is off)."""
    if opts.overlong_buffer <= 0:
        return rewards
    return rewards + opts.overlong_coef * episode_overlong(episodes, default_cap, opts.overlong_buffer)


def scaled_group_advantages(rewards: torch.Tensor, groups: Sequence[str], scale: str) -> torch.Tensor:
    """[E] each episode's reward less its group's mean, over the group's std (``group``), the
    batch's (``batch``) or nothing (``none``); a group of one gets 0."""
    if scale == "group":
        return losses.group_advantages(rewards, list(groups))
    centred = losses.group_advantages(rewards, list(groups), scale=False)
    if scale == "none":
        return centred
    if scale == "batch":
        return centred / (rewards.std(unbiased=False) + 1e-6) if len(rewards) > 1 else centred
    raise ValueError(f"unknown reward scale {scale!r}; choose one of {SCALES}")


__all__ = ["RewardShapingOptions", "SCALES", "episode_overlong", "overlong_penalty", "scaled_group_advantages",
           "shaped_rewards"]
