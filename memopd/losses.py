"""The MemOPD objective, term by term:  L_actor = L_PPO - alpha * H + lambda * L_OPD.

(The maths of the training methods beyond it live with each method, in :mod:`memopd.plugins`.)

Every function works on flat tensors over the action tokens of a batch (shape ``[N]``), or on
hidden states gathered at those tokens (``[N, hidden]``), so the learner never materialises
``[all positions, vocab]``. Masks are float weights in ``[0, 1]``; a masked mean divides by
their sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from memopd.scoring import ActionStates, map_chunks

DIVERGENCES = ("rkl", "fkl", "jsd")


def masked_mean(x: torch.Tensor, weights: torch.Tensor, norm: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted mean of ``x`` [N] under ``weights`` [N]: ``sum(x * weights) / sum(norm)``, with
    ``norm`` the weights themselves unless given (the weights a plugin lowered are divided by the
    ones before it did, so the lowering stays in the loss); 0 when the normaliser sums to 0."""
    total = (weights if norm is None else norm).sum()
    return (x * weights).sum() / total.clamp_min(1e-8)


# --------------------------------------------------------------------------------------------
# PPO
# --------------------------------------------------------------------------------------------

def ppo_policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                    weights: torch.Tensor, clip_eps: float = 0.2,
                    is_weights: torch.Tensor | None = None,
                    norm: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate: mean_w( -c * min(r*A, clip(r, 1-eps, 1+eps)*A) ), r = exp(logp - logp_old).

    All inputs [N]. ``is_weights`` (c, default 1): per-token importance weights correcting for
    tokens sampled by another engine than the one ``logp_old`` comes from (see
    :func:`truncated_is_weights`); they scale each token's term, not the normaliser. ``norm``: the
    normaliser's weights (:func:`masked_mean`; default ``weights``).
    Returns the loss and stats (clip fraction, approx KL old->new).
    """
    log_ratio = logp - logp_old
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    term = -torch.minimum(unclipped, clipped)
    loss = masked_mean(term if is_weights is None else term * is_weights, weights, norm)
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
               weights: torch.Tensor, clip_eps: float | None = 0.2, norm: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Clipped value loss 0.5 * max((v - R)^2, (clip(v, v_old +- eps) - R)^2), masked mean
    (normalised by ``norm``'s sum when given)."""
    err = (values - returns) ** 2
    if clip_eps is not None:
        v_clip = values_old + torch.clamp(values - values_old, -clip_eps, clip_eps)
        err = torch.maximum(err, (v_clip - returns) ** 2)
    return 0.5 * masked_mean(err, weights, norm)


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


Divergence = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""A divergence of two log-distributions [n, V] (student's, teacher's) -> [n]."""


def student_terms(student: ActionStates, targets: torch.Tensor, teacher: ActionStates | None = None,
                  kind: str | Divergence = "rkl", chunk_size: int = 1024, teacher_logp: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per action: the student's log p(target), its entropy and (given a teacher) the
    full-vocabulary divergence to it, from one projection of the student's states per chunk: the
    output head is applied once in the forward and once in the backward's recomputation, where
    :func:`memopd.scoring.token_logprobs` then :func:`divergence_from_states` apply it twice each.
    The teacher comes as states (projected per chunk, no grad) or as ``teacher_logp`` [N, V]
    (:func:`teacher_logprobs`, kept across epochs); ``kind`` names a divergence of
    :func:`divergence_from_logprobs` or is one (a :data:`Divergence`). Returns ([N], [N], [N] or None)."""
    divergence = kind if callable(kind) else lambda s, t: divergence_from_logprobs(s, t, kind)
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
        return out + (divergence(logp_s, _teacher_chunk(teacher, t, logp_s)),)

    extra = _teacher_inputs(teacher, teacher_logp) if teacher is not None or teacher_logp is not None else ()
    parts = map_chunks(fn, (student.hidden, student.temperatures, targets, *extra), chunk_size)
    empty = student.hidden.new_zeros(0)
    cat = lambda k: torch.cat([p[k] for p in parts]) if parts else empty  # noqa: E731
    return cat(0), cat(1), (cat(2) if extra else None)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per row: [n, V] -> [n]."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def actor_loss(pg_loss: torch.Tensor, entropy: torch.Tensor, opd: torch.Tensor,
               entropy_coef: float, opd_coef: float) -> torch.Tensor:
    """L_actor = L_PPO - alpha * H + lambda * L_OPD (each term already a masked mean)."""
    return pg_loss - entropy_coef * entropy + opd_coef * opd
