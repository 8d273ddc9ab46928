"""The policy-gradient term: its importance ratio, its clip, and how its tokens are aggregated.

The rules, as the papers write them (``o_i``: the i-th sampled sequence, ``|o_i|`` its length,
``r_{i,t} = pi(o_{i,t}) / pi_old(o_{i,t})``, ``A_i`` its advantage):

- **PPO / GRPO** (DeepSeekMath, arXiv 2402.03300): ``1/G sum_i 1/|o_i| sum_t min(r_{i,t} A_i,
  clip(r_{i,t}, 1 - eps, 1 + eps) A_i)``: each sequence's token mean, then the mean over sequences
  (``--loss-agg sequence``).
- **DAPO** (arXiv 2503.14476), two of its four pieces here: *token-level aggregation*,
  ``1 / sum_i |o_i| * sum_i sum_t ...`` (every token of the batch weighs the same, so a long
  sequence is not diluted: ``--loss-agg token``), and *clip-higher*, ``clip(r, 1 - eps_low,
  1 + eps_high)`` with ``eps_high > eps_low`` (0.2 and 0.28 in the paper) so that a token of low
  probability can grow further before its gradient is cut (``--clip-eps-high``). Its other two
  pieces are elsewhere: overlong shaping in :mod:`memopd.learn.rewards`, dynamic sampling a
  training-method plugin (``--dynamic-sampling``).
- **Dr. GRPO** ("Understanding R1-Zero-Like Training", arXiv 2503.20783): no ``1/|o_i|`` (it
  favours long wrong answers and short right ones) but a constant normaliser, ``1 / (G * L)`` with
  ``L`` the generation cap (``--loss-agg constant``, ``L = --max-new-tokens``); its advantage without
  the standard-deviation division is ``--scale-rewards none`` (:mod:`memopd.learn.rewards`).
- **GSPO** (arXiv 2507.18071): the ratio is the sequence's, length-normalised, ``s_i =
  (pi(o_i) / pi_old(o_i))^(1/|o_i|) = exp(1/|o_i| sum_t log r_{i,t})``, clipped as a whole:
  ``1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``
  (``--importance-level sequence``; the paper's aggregation is ``--loss-agg sequence``, and its clip
  ranges are far smaller than PPO's, 3e-4 / 4e-4).

A memory agent makes several calls per episode, each sampled from its own prompt. **A sequence here
is one call** (its prompt, the state the agent saw, and its sampled tokens): GSPO's ratio is a call's
(the likelihood ratio of the tokens sampled under one state; an episode's would be the geometric
mean over calls made under different states, and one call far off-policy would clip the whole
episode), the ``sequence`` and ``constant`` aggregations count calls, and every call of an episode
carries the episode's advantage (its reward is shared by its calls). The default aggregation,
``trajectory``, is the one MemOPD has always used: each episode weighs 1 in all, split equally over
its calls and within a call over its tokens, so the number of calls is not a hidden weight.

Every function works on flat ``[N]`` tensors over the action tokens of a batch, as
:mod:`memopd.losses` does; ``seq`` gives each token's sequence (call) as an integer id.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from memopd.config import Config, ConfigError, field
from memopd.losses import masked_mean
from memopd.packing import PackedBatch

AGGREGATIONS = ("trajectory", "token", "sequence", "constant")
SURROGATE_STATS = ("clip_frac", "clip_frac_low", "clip_frac_high", "approx_kl", "ratio_mean")
"""The stats :func:`clipped_surrogate` returns (each a weighted mean over tokens)."""


@dataclass
class PolicyLossOptions(Config):
    """RL objective: loss aggregation, clip-higher, GSPO (DAPO, GSPO, Dr. GRPO)"""

    loss_agg: str = field("trajectory", help="how the policy-gradient, entropy and value terms average over tokens: "
                                             "trajectory (each episode weighs 1, split over its calls and their "
                                             "tokens), token (every token of the batch alike: DAPO), sequence (the "
                                             "mean over calls of each call's token mean: GRPO, GSPO), constant (the "
                                             "token sum over calls x --max-new-tokens: Dr. GRPO)",
                          choices=AGGREGATIONS)
    clip_eps_high: float | None = field(None, help="upper clip of the importance ratio, 1 + eps_high (clip-higher, "
                                                   "DAPO: 0.28 with --clip-eps 0.2); default: --clip-eps",
                                        range=(0.0, 10.0))
    importance_level: str = field("token", help="the importance ratio: token (PPO's, per token) or sequence (GSPO's: "
                                                "one per call, the geometric mean of its tokens' ratios, clipped as "
                                                "a whole)", choices=("token", "sequence"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.importance_level == "sequence" and getattr(self, "advantage", "grpo") == "gae":
            raise ConfigError("--importance-level sequence needs one advantage per call (--advantage grpo); GAE "
                              "gives every token its own")


def sequence_ids(batch: PackedBatch) -> torch.Tensor:
    """[N] an integer id per action token: the same for the tokens of one call (episode, call)."""
    pairs = batch.token_map[:, :2].long()
    return torch.unique(pairs, dim=0, return_inverse=True)[1]


def aggregation_weights(call_len: torch.Tensor, calls: torch.Tensor, kind: str, cap: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] per-token weights of the loss's numerator and of its normaliser (a term is ``sum(x * w) /
    sum(norm)`` over a minibatch), for ``--loss-agg kind``, from each token's call length ``call_len``
    [N] and its episode's number of calls ``calls`` [N]; ``cap`` is the constant of ``constant``."""
    call_len, calls = call_len.float(), calls.float()
    if kind == "trajectory":
        w = 1.0 / (calls * call_len)
        return w, w
    if kind == "token":
        w = torch.ones_like(call_len)
        return w, w
    if kind == "sequence":
        w = 1.0 / call_len
        return w, w
    if kind == "constant":  # each call's tokens sum to cap in the normaliser: calls x cap in all
        return torch.ones_like(call_len), cap / call_len
    raise ValueError(f"unknown loss aggregation {kind!r}; choose one of {AGGREGATIONS}")


def sequence_log_ratio(log_ratio: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """[N] GSPO's ``log s_i``, the mean of the log-ratios of the tokens of each token's sequence,
    broadcast back to its tokens (differentiable through every token of the sequence)."""
    n = int(seq.max()) + 1 if len(seq) else 0
    sums = torch.zeros(n, dtype=log_ratio.dtype, device=log_ratio.device).index_add(0, seq, log_ratio)
    counts = torch.zeros(n, dtype=log_ratio.dtype, device=log_ratio.device).index_add(
        0, seq, torch.ones_like(log_ratio))
    return (sums / counts.clamp_min(1.0))[seq]


def clipped_surrogate(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
                      clip_low: float = 0.2, clip_high: float | None = None, seq: torch.Tensor | None = None,
                      is_weights: torch.Tensor | None = None, norm: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, dict[str, float]]:
    """``masked_mean(-c * min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), weights, norm)``.

    ``r`` is the token's ratio, or with ``seq`` (GSPO) its sequence's length-normalised ratio. ``c``:
    the truncated importance weights of a rollout engine's samples (:func:`memopd.losses.truncated_is_weights`;
    they scale each token's term, not the normaliser). ``clip_high`` defaults to ``clip_low`` (PPO's
    symmetric clip). Returns the loss and its stats: the share of tokens whose ratio is outside the
    clip range (below and above apart), and the k3 estimate of KL(old || new) over tokens.
    """
    high = clip_low if clip_high is None else clip_high
    log_ratio = logp - logp_old
    ratio = torch.exp(log_ratio if seq is None else sequence_log_ratio(log_ratio, seq))
    term = -torch.minimum(ratio * advantages, torch.clamp(ratio, 1.0 - clip_low, 1.0 + high) * advantages)
    loss = masked_mean(term if is_weights is None else term * is_weights, weights, norm)
    with torch.no_grad():
        low_out, high_out = (ratio < 1.0 - clip_low).float(), (ratio > 1.0 + high).float()
        tok_ratio = torch.exp(log_ratio)
        stats = {"clip_frac": masked_mean(low_out + high_out, weights).item(),
                 "clip_frac_low": masked_mean(low_out, weights).item(),
                 "clip_frac_high": masked_mean(high_out, weights).item(),
                 # k3 estimator of KL(old || new) from samples of old (Schulman, "Approximating KL divergence")
                 "approx_kl": masked_mean((tok_ratio - 1.0) - log_ratio, weights).item(),
                 "ratio_mean": masked_mean(ratio, weights).item()}
    return loss, stats


__all__ = ["AGGREGATIONS", "SURROGATE_STATS", "PolicyLossOptions", "aggregation_weights", "clipped_surrogate", "sequence_ids",
           "sequence_log_ratio"]
