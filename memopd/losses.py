"""The MemOPD objective, term by term:  L_actor = L_PPO - alpha * H + lambda * L_OPD.

Every function works on flat tensors over the action tokens of a batch (shape ``[N]``), or on
hidden states gathered at those tokens (``[N, hidden]``), so the learner never materialises
``[all positions, vocab]``. Masks are float weights in ``[0, 1]``; a masked mean divides by
their sum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from memopd.scoring import ActionStates, map_chunks

DIVERGENCES = ("rkl", "fkl", "jsd")
OPD_WEIGHTINGS = ("token", "turn", "progressive")
TURN_SHAPES = ("linear", "cosine")


def masked_mean(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted mean of ``x`` [N] under ``weights`` [N]; 0 when the weights sum to 0."""
    total = weights.sum()
    return (x * weights).sum() / total.clamp_min(1e-8)


# --------------------------------------------------------------------------------------------
# PPO
# --------------------------------------------------------------------------------------------

def ppo_policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                    weights: torch.Tensor, clip_eps: float = 0.2,
                    is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate: mean_w( -c * min(r*A, clip(r, 1-eps, 1+eps)*A) ), r = exp(logp - logp_old).

    All inputs [N]. ``is_weights`` (c, default 1): per-token importance weights correcting for
    tokens sampled by another engine than the one ``logp_old`` comes from (see
    :func:`truncated_is_weights`); they scale each token's term, not the normaliser.
    Returns the loss and stats (clip fraction, approx KL old->new).
    """
    log_ratio = logp - logp_old
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    term = -torch.minimum(unclipped, clipped)
    loss = masked_mean(term if is_weights is None else term * is_weights, weights)
    with torch.no_grad():
        clipfrac = masked_mean(((ratio - 1.0).abs() > clip_eps).float(), weights)
        # k3 estimator of KL(old || new) from samples of old: (r - 1) - log r, r = p_new / p_old;
        # non-negative and unbiased (Schulman, "Approximating KL divergence")
        approx_kl = masked_mean((ratio - 1.0) - log_ratio, weights)
    return loss, {"clip_frac": clipfrac.item(), "approx_kl": approx_kl.item()}


def truncated_is_weights(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """min(pi_trainer(a) / pi_rollout(a), cap) per token [N], no gradient.

    The rollout engine (vLLM: other kernels, other dtype) samples from a slightly different
    distribution than the trainer's forward of the same weights. With the old log-probs
    recomputed by the trainer, PPO's ratio is against the trainer's policy; this weight corrects
    for the tokens having come from the engine's. Truncation at ``cap`` bounds the variance a
    rare large mismatch would add ("truncated importance sampling", as verl / slime do)."""
    return torch.exp(trainer_logp.detach() - rollout_logp.detach()).clamp(max=cap)


def value_loss(values: torch.Tensor, values_old: torch.Tensor, returns: torch.Tensor,
               weights: torch.Tensor, clip_eps: float | None = 0.2) -> torch.Tensor:
    """Clipped value loss 0.5 * max((v - R)^2, (clip(v, v_old +- eps) - R)^2), masked mean."""
    err = (values - returns) ** 2
    if clip_eps is not None:
        v_clip = values_old + torch.clamp(values - values_old, -clip_eps, clip_eps)
        err = torch.maximum(err, (v_clip - returns) ** 2)
    return 0.5 * masked_mean(err, weights)


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over one trajectory's action tokens, in order.

    rewards, values: [T]. The trajectory ends after the last token (bootstrap value 0).
    Returns (advantages [T], returns [T]) with returns = advantages + values.
    """
    T = rewards.shape[0]
    adv = torch.zeros_like(rewards)
    last = rewards.new_zeros(())
    for t in reversed(range(T)):
        next_value = values[t + 1] if t + 1 < T else rewards.new_zeros(())
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, adv + values


def group_advantages(rewards: torch.Tensor, group_ids: list[str] | list[int],
                     scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO-style baseline: (r - mean of its group) / (std of its group) per trajectory.

    rewards: [B] trajectory rewards; group_ids: B labels (samples of the same question share
    one). A group of one gets advantage 0 (no baseline to compare with).
    """
    adv = torch.zeros_like(rewards)
    groups: dict = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    for idx in groups.values():
        r = rewards[idx]
        if len(idx) == 1:
            continue
        centred = r - r.mean()
        adv[idx] = centred / (r.std(unbiased=False) + eps) if scale else centred
    return adv


def penalised_rewards(rewards: torch.Tensor, logp_old: torch.Tensor, logp_ref: torch.Tensor,
                      beta: float) -> torch.Tensor:
    """Per-token penalty ``-beta * [logp_old - logp_ref]_+`` (the reward shaping against a frozen
    reference); returns it [N] so callers add it to per-token rewards or sum it per trajectory."""
    del rewards  # the final reward is added by the caller where the trajectory ends
    return -beta * torch.clamp(logp_old - logp_ref, min=0.0)


# --------------------------------------------------------------------------------------------
# Full-vocabulary distillation
# --------------------------------------------------------------------------------------------

def divergence_from_logprobs(logp_s: torch.Tensor, logp_t: torch.Tensor, kind: str = "rkl") -> torch.Tensor:
    """Per-row divergence between full-vocabulary log-distributions [n, V] -> [n].

    rkl: KL(student || teacher) (MemOPD's default, mode-seeking)
    fkl: KL(teacher || student)
    jsd: Jensen-Shannon with the equal mixture.
    """
    if kind == "rkl":
        return (logp_s.exp() * (logp_s - logp_t)).sum(-1)
    if kind == "fkl":
        return (logp_t.exp() * (logp_t - logp_s)).sum(-1)
    if kind == "jsd":
        log_m = torch.logsumexp(torch.stack([logp_s, logp_t]), dim=0) - torch.log(torch.tensor(2.0))
        kl_s = (logp_s.exp() * (logp_s - log_m)).sum(-1)
        kl_t = (logp_t.exp() * (logp_t - log_m)).sum(-1)
        return 0.5 * (kl_s + kl_t)
    raise ValueError(f"unknown divergence {kind!r}; choose one of {DIVERGENCES}")


def divergence_from_states(student: ActionStates, teacher: ActionStates, kind: str = "rkl",
                           chunk_size: int = 1024) -> torch.Tensor:
    """Full-vocabulary divergence per action token from two :class:`memopd.scoring.ActionStates`
    (hidden states gathered at the same N action positions, plus each model's output head and
    temperatures). Differentiable with respect to the student only; chunked and recomputed in
    backward, so memory stays at O(chunk_size * V). Returns [N]."""
    if len(student) != len(teacher):
        raise ValueError(f"student has {len(student)} action states, teacher {len(teacher)}; "
                         "score the same episodes (teacher.select(batch.action_uid) for minibatches)")
    t_device = teacher.head.device  # the teacher may live on another device

    def fn(hs: torch.Tensor, ts: torch.Tensor, ht: torch.Tensor, tt: torch.Tensor) -> torch.Tensor:
        logp_s = F.log_softmax(student.logits(hs, ts), dim=-1)
        with torch.no_grad():
            logp_t = F.log_softmax(teacher.logits(ht.to(t_device), tt.to(t_device)), dim=-1).to(logp_s.device)
        if logp_t.shape[-1] != logp_s.shape[-1]:
            raise ValueError(f"student and teacher vocabularies differ ({logp_s.shape[-1]} vs {logp_t.shape[-1]} "
                             "logits); full-vocabulary distillation needs the same tokenizer")
        return divergence_from_logprobs(logp_s, logp_t, kind)

    tensors = (student.hidden, student.temperatures, teacher.hidden.detach(), teacher.temperatures)
    parts = map_chunks(fn, tensors, chunk_size)
    return torch.cat(parts) if parts else student.hidden.new_zeros(0)


def teacher_logprobs(teacher: ActionStates, chunk_size: int = 1024) -> torch.Tensor:
    """[N, V] the teacher's full-vocabulary log-distribution at each action (no grad): computed
    once a step and reused by every PPO epoch when it fits the memory bound."""
    with torch.no_grad():
        parts = map_chunks(lambda h, t: F.log_softmax(teacher.logits(h, t), dim=-1),
                           (teacher.hidden.detach(), teacher.temperatures), chunk_size)
    return torch.cat(parts) if parts else teacher.hidden.new_zeros(0, 0)


def _teacher_inputs(teacher: ActionStates | None, teacher_logp: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The teacher's per-action tensors for a chunk loop: its kept log-distribution [N, V], else its
    states and temperatures (projected per chunk by :func:`_teacher_chunk`)."""
    if teacher_logp is not None:
        return (teacher_logp.detach(),)
    return teacher.hidden.detach(), teacher.temperatures


def _teacher_chunk(teacher: ActionStates | None, t: Sequence[torch.Tensor], logp_s: torch.Tensor) -> torch.Tensor:
    """[n, V] the teacher's log-distribution on a chunk (no grad), from :func:`_teacher_inputs`'
    slices, on the student's device; refused when the vocabularies differ."""
    if len(t) == 1:
        logp_t = t[0].to(logp_s.device)
    else:
        with torch.no_grad():
            dev = teacher.head.device  # the teacher may live on another device
            logp_t = F.log_softmax(teacher.logits(t[0].to(dev), t[1].to(dev)), dim=-1).to(logp_s.device)
    if logp_t.shape[-1] != logp_s.shape[-1]:
        raise ValueError(f"student and teacher vocabularies differ ({logp_s.shape[-1]} vs {logp_t.shape[-1]} "
                         "logits); full-vocabulary distillation needs the same tokenizer")
    return logp_t


def student_terms(student: ActionStates, targets: torch.Tensor, teacher: ActionStates | None = None,
                  kind: str = "rkl", chunk_size: int = 1024, teacher_logp: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per action: the student's log p(target), its entropy and (given a teacher) the
    full-vocabulary divergence to it, from one projection of the student's states per chunk: the
    output head is applied once in the forward and once in the backward's recomputation, where
    :func:`memopd.scoring.token_logprobs` then :func:`divergence_from_states` apply it twice each.
    The teacher comes as states (projected per chunk, no grad) or as ``teacher_logp`` [N, V]
    (:func:`teacher_logprobs`, kept across epochs). Returns ([N], [N], [N] or None)."""
    targets = targets.to(student.hidden.device)
    if teacher is not None and len(teacher) != len(student):
        raise ValueError(f"student has {len(student)} action states, teacher {len(teacher)}; "
                         "score the same episodes (teacher.select(batch.action_uid) for minibatches)")
    if teacher_logp is not None and len(teacher_logp) != len(student):
        raise ValueError(f"student has {len(student)} action states, teacher_logp {len(teacher_logp)} rows")
    def fn(h: torch.Tensor, temp: torch.Tensor, y: torch.Tensor, *t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logp_s = F.log_softmax(student.logits(h, temp), dim=-1)
        out = (logp_s.gather(-1, y[:, None])[:, 0], -(logp_s.exp() * logp_s).sum(-1))
        if not t:
            return out
        return out + (divergence_from_logprobs(logp_s, _teacher_chunk(teacher, t, logp_s), kind),)

    extra = _teacher_inputs(teacher, teacher_logp) if teacher is not None or teacher_logp is not None else ()
    parts = map_chunks(fn, (student.hidden, student.temperatures, targets, *extra), chunk_size)
    empty = student.hidden.new_zeros(0)
    cat = lambda k: torch.cat([p[k] for p in parts]) if parts else empty  # noqa: E731
    return cat(0), cat(1), (cat(2) if extra else None)


# --------------------------------------------------------------------------------------------
# Which tokens the distillation mean weighs (TurnOPD's turn-normalised loss budgeting)
# --------------------------------------------------------------------------------------------

def turn_share(weighting: str, progress: float, start: float = 0.0, end: float = 0.5,
               shape: str = "linear") -> float:
    """How far the OPD mean has moved from token-level (0) to turn-balanced (1) at ``progress``
    (the fraction of training done). ``token``: 0 throughout; ``turn``: 1 throughout;
    ``progressive``: 0 until ``start``, 1 from ``end``, between them a linear ramp or a cosine
    ease (``0.5 * (1 - cos(pi * x))``)."""
    if weighting not in OPD_WEIGHTINGS:
        raise ValueError(f"unknown OPD weighting {weighting!r}; choose one of {OPD_WEIGHTINGS}")
    if weighting != "progressive":
        return 0.0 if weighting == "token" else 1.0
    if progress <= start:
        return 0.0
    if progress >= end:
        return 1.0
    x = (progress - start) / (end - start)
    return x if shape == "linear" else 0.5 * (1.0 - math.cos(math.pi * x))


def opd_weights(call_ids: torch.Tensor, supervised: torch.Tensor, share: float,
                totals: tuple[float, float] | None = None) -> torch.Tensor:
    """[N] weights of the distillation mean over a step's action tokens.

    ``call_ids`` [N] names each token's model call (turn), ``supervised`` [N] marks the tokens the
    teacher supervises. The weights are ``(1 - share) * token + share * turn``, each part summing
    to 1 over the step: ``token`` gives every supervised token ``1 / T`` (today's mean over
    tokens, where long calls dominate), ``turn`` gives every call that has supervised tokens
    ``1 / C`` in all, split equally over them (the mean within a call, then over calls).
    ``totals`` = (T, C) over the whole step when this is one rank's part of it."""
    sup = supervised.float()
    _, inverse = torch.unique(call_ids, return_inverse=True)
    per_call = torch.zeros(int(inverse.max()) + 1 if len(inverse) else 0).index_add_(0, inverse, sup)
    tokens, calls = totals if totals is not None else (float(sup.sum()), float((per_call > 0).sum()))
    if tokens == 0:
        return sup
    token = sup / tokens
    turn = torch.where(supervised, 1.0 / per_call[inverse].clamp_min(1.0), 0.0) / calls
    return (1.0 - share) * token + share * turn


def call_counts(call_ids: torch.Tensor, supervised: torch.Tensor) -> tuple[float, float]:
    """(supervised tokens, calls with at least one) of a step's part: the totals of :func:`opd_weights`."""
    ids = torch.unique(call_ids[supervised])
    return float(supervised.sum()), float(len(ids))


# --------------------------------------------------------------------------------------------
# f-OPD: how fresh a buffered sample is
# --------------------------------------------------------------------------------------------

def episode_drift(trainer_logp: torch.Tensor, behaviour_logp: torch.Tensor, episode: torch.Tensor,
                  num_episodes: int) -> torch.Tensor:
    """[E] rollout drift of each episode: the mean over its action tokens of the k3 estimate of
    KL(behaviour || current), ``(r - 1) - log r`` with ``r = p_current / p_behaviour`` (0 when the
    two policies agree on the sampled tokens). ``episode`` [N] maps tokens to episodes."""
    log_r = (trainer_logp - behaviour_logp).double()
    k3 = torch.expm1(log_r) - log_r
    total = torch.zeros(num_episodes, dtype=torch.float64).index_add_(0, episode, k3)
    count = torch.zeros(num_episodes, dtype=torch.float64).index_add_(0, episode, torch.ones_like(k3))
    return (total / count.clamp_min(1)).float()


def freshness(lag: torch.Tensor, drift: torch.Tensor, lag_scale: float, drift_scale: float) -> torch.Tensor:
    """[E] f-OPD's sample freshness in (0, 1]: ``exp(-lag / lag_scale - drift / drift_scale)``, from
    the policy-version lag of the sample and its measured rollout drift (a scale of 0 leaves
    that part out). 1: as fresh as an on-policy sample."""
    score = torch.zeros_like(drift, dtype=torch.float64)
    if lag_scale > 0:
        score = score - lag.double() / lag_scale
    if drift_scale > 0:
        score = score - drift.double() / drift_scale
    return score.exp().float()


# --------------------------------------------------------------------------------------------
# Prune-OPD: where the student's prefix drifts from what the teacher would do
# --------------------------------------------------------------------------------------------

def topk_overlap(logp_s: torch.Tensor, logp_t: torch.Tensor, k: int) -> torch.Tensor:
    """[n] the share of the student's k most likely next tokens that are also among the
    teacher's k most likely (1: the same top-k set, 0: disjoint). Inputs [n, V]."""
    k = min(k, logp_s.shape[-1])
    top_s, top_t = logp_s.topk(k, dim=-1).indices, logp_t.topk(k, dim=-1).indices
    return (top_s[:, :, None] == top_t[:, None, :]).any(-1).float().mean(-1)


def overlap_from_states(student: ActionStates, k: int, chunk_size: int = 1024, teacher: ActionStates | None = None,
                        teacher_logp: torch.Tensor | None = None) -> torch.Tensor:
    """[N] :func:`topk_overlap` of the student's and the teacher's distributions at each action
    (no grad); the teacher as states or as its kept log-distribution [N, V]."""
    def fn(h: torch.Tensor, temp: torch.Tensor, *t: torch.Tensor) -> torch.Tensor:
        logp_s = F.log_softmax(student.logits(h, temp), dim=-1)
        return topk_overlap(logp_s, _teacher_chunk(teacher, t, logp_s), k)

    extra = _teacher_inputs(teacher, teacher_logp)
    with torch.no_grad():
        parts = map_chunks(fn, (student.hidden.detach(), student.temperatures, *extra), chunk_size)
    return torch.cat(parts) if parts else student.hidden.new_zeros(0)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per row: [n, V] -> [n]."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def actor_loss(pg_loss: torch.Tensor, entropy: torch.Tensor, opd: torch.Tensor,
               entropy_coef: float, opd_coef: float) -> torch.Tensor:
    """L_actor = L_PPO - alpha * H + lambda * L_OPD (each term already a masked mean)."""
    return pg_loss - entropy_coef * entropy + opd_coef * opd
