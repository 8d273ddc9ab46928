"""The PPO + OPD update of one step: ``--ppo-epochs`` passes over minibatches of packed rows.

For each minibatch (an optimizer step)::

    L_actor = L_PPO - alpha * H + lambda * L_OPD        (memopd.losses.actor_loss)

``L_PPO`` is the clipped surrogate with the trajectory weights (masked mean), ``H`` the entropy
with the same weights, ``L_OPD`` the masked mean of the divergence to the teacher with the
distillation weights, estimated by ``--opd-estimator`` (:mod:`memopd.estimators`: the full
vocabulary, the teacher's top-k plus a tail bucket, or k1 / k3 at the sampled token, as a loss or
as a per-token advantage); with GAE a critic regresses on the returns (``--vf-coef``).

Under torchrun the loss is global: each rank's masked means are rescaled from its own normalisers
(trajectory weights, teacher tokens) to the sums over all ranks, and its loss is multiplied by the
world size because data-parallel gradients are averaged; one process rescales by exactly 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from agents.records import ROLES
from memopd import distributed, estimators, losses
from memopd.estimators import TeacherScores
from memopd.learn.advantage import Advantages
from memopd.learn.plugin import LossWeights
from memopd.packing import PackedBatch
from memopd.runlog import mean
from memopd.runtime import PhaseTimes
from memopd.scoring import ActionStates, token_logprobs


@dataclass
class UpdateInputs:
    """What the epochs read besides the weights: the minibatches, the teacher's states (and its
    kept log-distribution), the student's log-probs before the update where a pass computed them,
    and PPO's old log-probs with their importance weights."""

    batch: PackedBatch
    minibatches: list[PackedBatch]
    teacher_states: ActionStates | None
    teacher_logp: torch.Tensor | None
    trainer_logp: torch.Tensor | None
    old_logp: torch.Tensor
    is_weights: torch.Tensor | None
    teacher_top: estimators.TopK | None = None  # --opd-estimator topk: the teacher's top-k at each action
    teacher_sampled: torch.Tensor | None = None  # --opd-estimator sampled: [N] its log-probs of the sampled tokens


class PPOUpdate:
    """The optimizer side of the student (and critic): owns their optimizers and the schedule."""

    def __init__(self, cfg: Any, world: distributed.World, student: torch.nn.Module,
                 student_states: Callable[[PackedBatch], ActionStates], opt: torch.optim.Optimizer,
                 sched: Any, critic: Any = None, critic_fwd: Any = None, critic_opt: Any = None):
        self.cfg, self.world, self.student, self.student_states = cfg, world, student, student_states
        self.opt, self.sched = opt, sched
        self.phases = PhaseTimes()  # the trainer gives each step its own
        self.critic, self.critic_fwd, self.critic_opt = critic, critic_fwd, critic_opt

    # -- before the epochs ----------------------------------------------------------------------
    def prepare(self, batch: PackedBatch, scores: TeacherScores | None,
                need_trainer_logp: bool = False) -> UpdateInputs:
        """Minibatches, the teacher's kept distribution, and the student's log-probs before the
        update: in a pass of their own when PPO needs them as its old log-probs, when minibatches
        would update between them, or when a plugin reads them; else from epoch 0."""
        cfg = self.cfg
        minibatches = distributed.row_groups(batch, cfg.minibatches, self.world)
        trainer_logp = self.trainer_logprobs(minibatches, batch.num_actions) \
            if cfg.old_logprobs == "recompute" or len(minibatches) > 1 or need_trainer_logp else None
        old_logp, is_w = self.old_logprobs(batch, trainer_logp)
        teacher_states = scores.states if scores is not None else None
        inputs = UpdateInputs(batch, minibatches, teacher_states, None, trainer_logp, old_logp, is_w)
        if scores is not None and teacher_states is None:  # a served teacher: what it returned
            inputs.teacher_top, inputs.teacher_sampled = (scores.top, None) if cfg.opd_estimator == "topk" \
                else (None, scores.sampled)
            return inputs
        if teacher_states is None:
            return inputs
        if cfg.opd_estimator == "full":
            inputs.teacher_logp = teacher_logprobs(teacher_states, cfg)
        elif cfg.opd_estimator == "topk":
            inputs.teacher_top = estimators.teacher_targets(teacher_states, batch.action_ids, "topk", cfg.opd_topk,
                                                            cfg.kl_chunk)
        else:
            inputs.teacher_sampled = estimators.teacher_targets(teacher_states, batch.action_ids, "sampled", 0,
                                                                cfg.kl_chunk)
        return inputs

    @torch.no_grad()
    def trainer_logprobs(self, minibatches: Sequence[PackedBatch], num_actions: int) -> torch.Tensor:
        """[N] log-probs of the sampled tokens under the trainer's own forward of the current
        weights (eval mode), in the batch's action order."""
        self.student.eval()
        out = torch.zeros(num_actions)
        rows = self.cfg.micro_batch_rows
        for mb in minibatches:
            for part in mb.micro_batches(rows) if rows and mb.num_rows > rows else [mb]:
                lp, _, _ = token_logprobs(self.student_states(part), part.action_ids, chunk_size=self.cfg.kl_chunk)
                out[part.action_uid] = lp.float().cpu()
        return out

    def old_logprobs(self, batch: PackedBatch, trainer_logp: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """PPO's old log-probs and the per-token importance weights (None: no correction).
        ``recorded``: the rollout engine's, and the ratio itself absorbs the engine/trainer gap.
        ``recompute``: the trainer's, with the truncated weight pi_trainer / pi_rollout."""
        if self.cfg.old_logprobs == "recorded":
            return batch.old_logprobs, None
        is_w = losses.truncated_is_weights(trainer_logp, batch.old_logprobs, self.cfg.tis_cap) \
            if self.cfg.tis_cap > 0 else None
        return trainer_logp, is_w

    # -- the epochs -----------------------------------------------------------------------------
    def run(self, inp: UpdateInputs, adv: Advantages, weights: LossWeights,
            roles: dict[str, torch.Tensor]) -> tuple[dict[str, float], torch.Tensor]:
        """The PPO epochs. Returns the stats and the per-token divergence to the teacher of the
        first epoch ([N], NaN where the teacher does not supervise)."""
        cfg, batch = self.cfg, inp.batch
        token_kl = torch.full((batch.num_actions,), float("nan"))
        sums: dict[str, list[float]] = {}
        kl_parts: dict[str, list[tuple[float, float]]] = {f"kl/{r}": [] for r in ("all", *ROLES)}
        skipped = 0
        trainer_logp = inp.trainer_logp
        if self._kl_advantage() and inp.teacher_sampled is not None:  # the sampled reverse KL as a dense
            # advantage: PPO optimises it
            kl_adv = estimators.sampled_advantage(batch.old_logprobs, inp.teacher_sampled,
                                                   cfg.opd_divergence) * weights.opd
            adv = Advantages(adv.advantages + cfg.opd_coef * kl_adv, adv.weights, adv.values, adv.returns)
        self.student.train()
        for epoch in range(cfg.ppo_epochs):
            for mb in inp.minibatches:
                stats, parts = self._minibatch(mb, inp, adv, weights)
                for part, logp, div in parts:
                    if trainer_logp is None or (epoch == 0 and len(inp.minibatches) == 1 and
                                                inp.trainer_logp is None):
                        # one minibatch: epoch 0 is the forward before any update
                        trainer_logp = torch.zeros(batch.num_actions) if trainer_logp is None else trainer_logp
                        trainer_logp[part.action_uid] = logp.detach().float().cpu()
                    if div is not None:
                        with torch.no_grad():
                            if epoch == 0:  # as the student sampled them (before any update, with one minibatch)
                                token_kl[part.action_uid] = torch.where(part.teacher, div.detach().float(),
                                                                        float("nan"))
                            kl_parts["kl/all"].append(_sum_count(div.detach()[part.teacher]))
                            for r in ROLES:
                                kl_parts[f"kl/{r}"].append(
                                    _sum_count(div.detach()[roles[r][part.action_uid] & part.teacher]))
                if stats is None:
                    skipped += 1
                    continue
                for k, v in stats.items():
                    sums.setdefault(k, []).append(v)
        if sums:  # at least one optimizer step happened
            self.sched.step()
        self.student.eval()
        out = {k: mean(v) for k, v in sums.items()}
        out.update(distributed.weighted_stats(kl_parts, self.world))
        out["skipped_minibatches"] = skipped
        if skipped and not sums:
            out["loss"] = float("nan")
        if trainer_logp is not None:
            out.update(self.mismatch(trainer_logp, batch.old_logprobs, inp.is_weights))
        return out, token_kl

    def _minibatch(self, mb: PackedBatch, inp: UpdateInputs, adv: Advantages, weights: LossWeights
                   ) -> tuple[dict[str, float] | None, list[tuple[PackedBatch, torch.Tensor, torch.Tensor | None]]]:
        """One optimizer step on a minibatch, its gradient accumulated over ``--micro-batch-rows``
        row groups (each one's loss its share of the minibatch's masked means); its stats (each
        rank's part of the global value), or None when a non-finite loss or gradient skipped it; and
        each row group's log-probs and divergence."""
        cfg, world = self.cfg, self.world
        uid = mb.action_uid
        # the normalisers: the minibatch's weights as the step made them, before any plugin
        w_sum, t_sum = float(weights.ppo_base[uid].sum()), float(weights.opd_base[uid].sum())
        w_scale, t_scale = distributed.global_scales([w_sum, t_sum], world)
        groups = mb.micro_batches(cfg.micro_batch_rows) if cfg.micro_batch_rows and mb.num_rows > 1 else [mb]
        self.opt.zero_grad(set_to_none=True)
        if self.critic_opt is not None:
            self.critic_opt.zero_grad(set_to_none=True)
        parts, sums = [], {}
        for part in groups:
            # the row group's share of the minibatch's normalisers (exactly 1 for one group)
            w_share = float(weights.ppo_base[part.action_uid].sum()) / w_sum if len(groups) > 1 and w_sum > 0 else 1.0
            t_share = float(weights.opd_base[part.action_uid].sum()) / t_sum if len(groups) > 1 and t_sum > 0 else 1.0
            terms, logp, div = self._part_loss(part, inp, adv, weights, w_scale * w_share, t_scale * t_share)
            parts.append((part, logp, div))
            loss, vloss = terms["loss"], terms.get("value_loss")
            if distributed.any_rank(not torch.isfinite(loss) or (vloss is not None and not torch.isfinite(vloss)),
                                    world):
                self._zero_grads()
                return None, parts
            (loss * world.size).backward()  # data-parallel gradients are averaged over ranks
            if vloss is not None:
                (cfg.vf_coef * vloss * world.size).backward()
            for k, v in terms.items():
                sums[k] = sums.get(k, 0.0) + (v.item() if torch.is_tensor(v) else v)
        with self.phases("optimizer"):  # clipping and the optimizer step, inside time/update_s
            gnorm = distributed.clip_gradients(self.student.parameters(), cfg.max_grad_norm, world)
            if not torch.isfinite(gnorm):
                self._zero_grads()
                return None, parts
            self.opt.step()
            if self.critic is not None:
                distributed.clip_gradients(self.critic.parameters(), cfg.max_grad_norm, world)
                self.critic_opt.step()
        totals = distributed.all_sum(list(sums.values()), world)
        return {**dict(zip(sums, totals)), "grad_norm": float(gnorm)}, parts

    def _part_loss(self, part: PackedBatch, inp: UpdateInputs, adv: Advantages, weights: LossWeights,
                   w_scale: float, t_scale: float) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor | None]:
        """The loss terms of a row group, each its part of the minibatch's (and every rank's) mean."""
        cfg, uid = self.cfg, part.action_uid
        w, tmask = weights.ppo[uid], weights.opd[uid]
        w_norm, t_norm = weights.ppo_base[uid], weights.opd_base[uid]
        logp, ent, div = self._terms(part, inp)
        if cfg.reward != "none" or (self._kl_advantage() and inp.teacher_sampled is not None):
            pg, pg_stats = losses.ppo_policy_loss(logp, inp.old_logp[uid], adv.advantages[uid], w, cfg.clip_eps,
                                                  None if inp.is_weights is None else inp.is_weights[uid], norm=w_norm)
        else:
            pg, pg_stats = logp.sum() * 0.0, {"clip_frac": 0.0, "approx_kl": 0.0}
        pg = pg * w_scale
        entropy = losses.masked_mean(ent, w, w_norm) * w_scale
        opd = (losses.masked_mean(div, tmask, t_norm) * t_scale if div is not None and not self._kl_advantage()
               else logp.sum() * 0.0)
        terms: dict[str, Any] = {"loss": losses.actor_loss(pg, entropy, opd, cfg.entropy_coef, cfg.opd_coef),
                                 "pg_loss": pg, "opd_loss": opd, "entropy": entropy,
                                 "clip_frac": pg_stats["clip_frac"] * w_scale,
                                 "approx_kl": pg_stats["approx_kl"] * w_scale}
        if self.critic is not None:
            v = self.critic_fwd(part, cfg.attn)
            terms["value_loss"] = losses.value_loss(v, adv.values[uid], adv.returns[uid], w, norm=w_norm) * w_scale
        return terms, logp, div

    def _zero_grads(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        if self.critic_opt is not None:
            self.critic_opt.zero_grad(set_to_none=True)

    def _terms(self, mb: PackedBatch, inp: UpdateInputs
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The student's log-probs of the sampled tokens, its entropy, and the estimated divergence
        to the teacher at each of a minibatch's actions (None without a teacher)."""
        cfg, uid = self.cfg, mb.action_uid
        states = self.student_states(mb)
        if inp.teacher_top is not None:
            return estimators.student_terms_topk(states, mb.action_ids, inp.teacher_top.select(uid),
                                                 cfg.opd_divergence, cfg.kl_chunk)
        if inp.teacher_sampled is not None:
            logp, ent, _ = losses.student_terms(states, mb.action_ids, chunk_size=cfg.kl_chunk)
            t_lp = inp.teacher_sampled[uid].to(logp.device)
            if self._kl_advantage():  # its value for the metrics; PPO carries the gradient
                return logp, ent, estimators.sampled_estimate(logp, t_lp, cfg.opd_sampled, cfg.opd_divergence)
            return logp, ent, estimators.sampled_loss(logp, t_lp, cfg.opd_sampled, cfg.opd_divergence,
                                                      mb.old_logprobs.to(logp.device))
        t = inp.teacher_states.select(uid) if inp.teacher_states is not None and inp.teacher_logp is None else None
        return losses.student_terms(states, mb.action_ids, t, cfg.opd_divergence, cfg.kl_chunk,
                                    inp.teacher_logp[uid] if inp.teacher_logp is not None else None)

    def _kl_advantage(self) -> bool:
        return self.cfg.opd_estimator == "sampled" and self.cfg.opd_sampled_as == "advantage"

    def mismatch(self, trainer_logp: torch.Tensor, rollout_logp: torch.Tensor,
                 is_w: torch.Tensor | None) -> dict[str, float]:
        """Rollout/trainer mismatch of the step: mean and max |log p_trainer - log p_rollout| over
        the sampled tokens (every rank's), and the importance weights' mean and capped share."""
        d = (trainer_logp - rollout_logp.float()).abs()
        n, total = distributed.all_sum([len(d), float(d.double().sum())], self.world)
        (worst,) = distributed.all_max([float(d.max()) if len(d) else 0.0], self.world)
        out = {"mismatch/mean_abs_logp": total / max(1, n), "mismatch/max_abs_logp": worst}
        if is_w is not None:
            capped = float((is_w >= self.cfg.tis_cap).sum())
            w_sum, c_sum = distributed.all_sum([float(is_w.double().sum()), capped], self.world)
            out.update({"mismatch/is_weight_mean": w_sum / max(1, n), "mismatch/is_capped_frac": c_sum / max(1, n)})
        return out


def teacher_logprobs(teacher_states: ActionStates | None, cfg: Any) -> torch.Tensor | None:
    """The teacher's [N, V] log-distribution of the step, computed once for every PPO epoch when
    it fits ``--teacher-cache-mb`` (else None: each epoch projects the teacher's states again)."""
    if teacher_states is None or cfg.ppo_epochs == 1:
        return None
    vocab = teacher_states.vocab_size or next(teacher_states.head.lm_head.parameters()).shape[0]
    if len(teacher_states) * vocab * 4 > cfg.teacher_cache_mb * 2**20:
        return None
    return losses.teacher_logprobs(teacher_states, cfg.kl_chunk)


def _sum_count(x: torch.Tensor) -> tuple[float, float]:
    return float(x.double().sum()), float(x.numel())



__all__ = ["PPOUpdate", "UpdateInputs", "teacher_logprobs"]
