"""The PPO + OPD update of one step: ``--ppo-epochs`` passes over minibatches of packed rows.

For each minibatch (an optimizer step)::

    L_actor = L_PPO - alpha * H + lambda * L_OPD        (memopd.losses.actor_loss)

``L_PPO`` is the clipped surrogate with the trajectory weights (masked mean; its ratio, clip and
aggregation as :mod:`memopd.learn.policy_loss` sets them: PPO's, DAPO's, GSPO's, Dr. GRPO's), ``H`` the entropy
with the same weights, ``L_OPD`` the masked mean of the divergence to the teacher with the
distillation weights, as the run's estimator (:mod:`memopd.learn.estimators`) computes it; an
estimator may instead give a per-token advantage that PPO optimises. With GAE a critic regresses
on the returns (``--vf-coef``).

Under torchrun the loss is global: each rank's masked means are rescaled from its own normalisers
(trajectory weights, teacher tokens) to the sums over all ranks, and its loss is multiplied by the
world size because data-parallel gradients are averaged; one process rescales by exactly 1.

:class:`PPOUpdate` owns the student's (and the critic's) optimizer and the learning-rate schedule,
and their checkpoint state (:meth:`PPOUpdate.state_dict`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from agents.records import ROLES
from memopd import distributed, losses
from memopd.learn.advantage import Advantages
from memopd.learn.estimators.base import Estimator, TeacherScores
from memopd.learn.plugin import LossWeights
from memopd.learn.policy_loss import SURROGATE_STATS, clipped_surrogate, sequence_ids
from memopd.lora import trainable_parameters
from memopd.packing import PackedBatch
from memopd.runlog import mean
from memopd.runtime import PhaseTimes, adamw, lr_lambda
from memopd.scoring import ActionStates, token_logprobs

if TYPE_CHECKING:  # the run's options, for the annotations
    from memopd.learn.options import CoreConfig


@dataclass
class UpdateInputs:
    """What the epochs read besides the weights: the minibatches, the estimator's targets (what
    it keeps of the teacher), the student's log-probs before the update where a pass computed
    them, and PPO's old log-probs with their importance weights."""

    batch: PackedBatch
    minibatches: list[PackedBatch]
    targets: Any
    trainer_logp: torch.Tensor | None
    old_logp: torch.Tensor
    is_weights: torch.Tensor | None


class PPOUpdate:
    """The optimizer side of the student (and critic): owns their optimizers and the schedule."""

    def __init__(self, cfg: CoreConfig, world: distributed.World, student: torch.nn.Module,
                 student_states: Callable[[PackedBatch], ActionStates], estimator: Estimator,
                 critic: Any = None, critic_fwd: Any = None):
        self.cfg, self.world, self.student, self.student_states = cfg, world, student, student_states
        self.estimator = estimator
        # a LoRA student: the adapters only (a full-weight one: every parameter, as parameters() lists them)
        self.opt = adamw(trainable_parameters(student), student, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg.lr_schedule, cfg.warmup_steps,
                                                                           cfg.steps, cfg.lr_floor))
        self.critic, self.critic_fwd = critic, critic_fwd
        self.critic_opt = (torch.optim.AdamW(trainable_parameters(critic), lr=cfg.critic_lr)
                           if critic is not None else None)
        self.phases = PhaseTimes()  # the trainer gives each step its own

    @property
    def lr(self) -> float:
        return self.sched.get_last_lr()[0]

    # -- checkpoint state ----------------------------------------------------------------------
    def optimizers(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        """The optimizers by their checkpoint key, each with the model it steps."""
        out = {"optimizer": (self.student, self.opt)}
        if self.critic_opt is not None:
            out["critic_optimizer"] = (self.critic, self.critic_opt)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The optimizers' whole state (one process) and the schedule's."""
        return {"optimizer": self.opt.state_dict(),
                "critic_optimizer": self.critic_opt.state_dict() if self.critic_opt else None,
                "scheduler": self.sched.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The schedule, and the optimizers' whole state when the checkpoint holds it (a sharded one
        restored them with the models)."""
        for key, (_, opt) in self.optimizers().items():
            if state.get(key):
                distributed.load_full_optimizer_state(opt, state[key])
        self.sched.load_state_dict(state["scheduler"])

    # -- before the epochs ----------------------------------------------------------------------
    def prepare(self, batch: PackedBatch, scores: TeacherScores | None,
                need_trainer_logp: bool = False) -> UpdateInputs:
        """Minibatches, the estimator's targets, and the student's log-probs before the update: in
        a pass of their own when PPO needs them as its old log-probs, when minibatches would update
        between them, or when a plugin reads them; else from epoch 0."""
        cfg = self.cfg
        minibatches = distributed.row_groups(batch, cfg.minibatches, self.world)
        trainer_logp = self.trainer_logprobs(minibatches, batch.num_actions) \
            if cfg.old_logprobs == "recompute" or len(minibatches) > 1 or need_trainer_logp else None
        old_logp, is_w = self.old_logprobs(batch, trainer_logp)
        return UpdateInputs(batch, minibatches, self.estimator.prepare(scores, batch), trainer_logp, old_logp, is_w)

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
        dense = self.estimator.advantage(batch, inp.targets)  # the divergence as a dense advantage: PPO optimises it
        if dense is not None:
            adv = Advantages(adv.advantages + cfg.opd_coef * (dense * weights.opd), adv.weights, adv.values,
                             adv.returns)
        ppo = cfg.reward != "none" or dense is not None
        self.student.train()
        for epoch in range(cfg.ppo_epochs):
            for mb in inp.minibatches:
                stats, parts = self._minibatch(mb, inp, adv, weights, ppo)
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
        if sums:  # at least one minibatch was trained (its optimizer step skipped where it had no gradient)
            with warnings.catch_warnings():  # torch warns when no optimizer step came first; the schedule counts steps
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
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

    def _minibatch(self, mb: PackedBatch, inp: UpdateInputs, adv: Advantages, weights: LossWeights, ppo: bool
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
        self._zero_grads()
        parts, sums = [], {}
        for part in groups:
            # the row group's share of the minibatch's normalisers (exactly 1 for one group)
            w_share = float(weights.ppo_base[part.action_uid].sum()) / w_sum if len(groups) > 1 and w_sum > 0 else 1.0
            t_share = float(weights.opd_base[part.action_uid].sum()) / t_sum if len(groups) > 1 and t_sum > 0 else 1.0
            terms, logp, div = self._part_loss(part, inp, adv, weights, w_scale * w_share, t_scale * t_share, ppo)
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
            # no gradient (every advantage 0, no distillation term): AdamW would still move the weights
            # by its momentum from earlier steps, a drift with no signal behind it; the step is skipped
            if float(gnorm) > 0.0:
                self.opt.step()
            if self.critic is not None:
                distributed.clip_gradients(self.critic.parameters(), cfg.max_grad_norm, world)
                self.critic_opt.step()
        totals = distributed.all_sum(list(sums.values()), world)
        return {**dict(zip(sums, totals)), "grad_norm": float(gnorm)}, parts

    def _part_loss(self, part: PackedBatch, inp: UpdateInputs, adv: Advantages, weights: LossWeights,
                   w_scale: float, t_scale: float, ppo: bool
                   ) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor | None]:
        """The loss terms of a row group, each its part of the minibatch's (and every rank's) mean."""
        cfg, uid = self.cfg, part.action_uid
        w, tmask = weights.ppo[uid], weights.opd[uid]
        w_norm, t_norm = weights.ppo_base[uid], weights.opd_base[uid]
        logp, ent, div = self.estimator.terms(self.student_states(part), part, inp.targets)
        if ppo:
            seq = sequence_ids(part) if cfg.importance_level == "sequence" else None
            pg, pg_stats = clipped_surrogate(logp, inp.old_logp[uid], adv.advantages[uid], w, cfg.clip_eps,
                                             cfg.clip_eps_high, seq,
                                             None if inp.is_weights is None else inp.is_weights[uid], norm=w_norm)
        else:
            pg, pg_stats = logp.sum() * 0.0, dict.fromkeys(SURROGATE_STATS, 0.0)
        pg = pg * w_scale
        entropy = losses.masked_mean(ent, w, w_norm) * w_scale
        opd = (losses.masked_mean(div, tmask, t_norm) * t_scale if div is not None and self.estimator.as_loss
               else logp.sum() * 0.0)
        terms: dict[str, Any] = {"loss": losses.actor_loss(pg, entropy, opd, cfg.entropy_coef, cfg.opd_coef),
                                 "pg_loss": pg, "opd_loss": opd, "entropy": entropy,
                                 **{k: v * w_scale for k, v in pg_stats.items()}}
        if self.critic is not None:
            v = self.critic_fwd(part, cfg.attn)
            terms["value_loss"] = losses.value_loss(v, adv.values[uid], adv.returns[uid], w, norm=w_norm) * w_scale
        return terms, logp, div

    def _zero_grads(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        if self.critic_opt is not None:
            self.critic_opt.zero_grad(set_to_none=True)

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


def _sum_count(x: torch.Tensor) -> tuple[float, float]:
    return float(x.double().sum()), float(x.numel())


__all__ = ["PPOUpdate", "UpdateInputs"]
