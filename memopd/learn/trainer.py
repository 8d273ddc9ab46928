"""The MemOPD trainer: the fit loop and one short step, wired from components that own their state.

    step = rollout -> pack -> advantages -> teacher -> loss weights -> PPO + OPD update -> metrics

Each phase lives in a module named for it: the rollout worker (:mod:`memopd.learn.actor`),
packing (:mod:`memopd.packing`), rewards and advantages (:mod:`memopd.learn.advantage`), the
teacher (:mod:`memopd.learn.teachers`) and the estimator (:mod:`memopd.learn.estimators`), the
update with its optimizers (:mod:`memopd.learn.update`). Around the step: the student in its
distributed world (:mod:`memopd.learn.student`), the run directory and checkpoints
(:mod:`memopd.learn.checkpointer`), what watches the run (:mod:`memopd.learn.observers`), and the
training methods beyond PPO + OPD, plugins (:mod:`memopd.learn.plugin`) that may limit or replace
the rollout, change the loss weights and act at the end of a step.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from agents.records import Episode
from agents.run_layout import RUN_MODEL_DIR
from memopd import distributed
from memopd.learn.actor import Actor, Rollout, RolloutLimits
from memopd.learn.advantage import Advantages, compute_advantages, role_masks, step_metrics
from memopd.learn.checkpointer import Checkpointer
from memopd.learn.env_check import check_env, check_env_settings
from memopd.learn.estimators import TeacherScores, make_estimator
from memopd.learn.mix import env_configs
from memopd.learn.models import pad_id, resolve_defaults, resolve_memory_defaults, warm_start_student
from memopd.learn.observers import Evaluation, observers
from memopd.learn.options import CoreConfig, core_config
from memopd.learn.plugin import (LossWeights, Plugin, PluginContext, StepResult, TrainingError, WeighContext,
                                 chain_rollouts, policy_lags, select_plugins)
from memopd.learn.state import TrainState
from memopd.learn.student import Student, join_world
from memopd.learn.teachers import load_teacher, run_needs
from memopd.learn.update import PPOUpdate, UpdateInputs
from memopd.packing import pack_episodes
from memopd.runlog import check_mirrors
from memopd.runtime import PhaseTimes, compute_dtype, peak_rss_mb, prepare_model, set_threads


class Trainer:
    """One MemOPD run. Construction loads and checks everything (env, student, teacher, env
    options, logging mirrors) before the run directory is touched; :meth:`fit` trains."""

    def __init__(self, cfg: CoreConfig, log=print):
        from agents.models import load
        from agents.presets import TINY_PRESETS

        cfg = resolve_defaults(cfg)
        set_threads(cfg.threads)
        self.world, cfg, log = join_world(cfg, log)
        self.cfg, self.log = cfg, log
        torch.manual_seed(cfg.seed)
        for each in env_configs(cfg):  # every env of the mix
            check_env(each.env)
        check_mirrors(cfg.tensorboard, cfg.wandb_project)
        model, self.tokenizer = load(cfg.model, device=cfg.device)
        cfg = self.cfg = resolve_memory_defaults(cfg, model, distributed.launched_size())
        prepare_model(model, cfg)
        for each in env_configs(cfg):
            check_env_settings(each, self.tokenizer)
        self.estimator = make_estimator(cfg)
        self.chosen = select_plugins(getattr(type(cfg), "builtin_plugins", ()), cfg)  # plugins and their options
        needs = run_needs(cfg, [c for c, _ in self.chosen], self.world.size)  # of the teacher: checked as it loads
        self.teacher = load_teacher(cfg, self.tokenizer, self.world, needs, self.estimator.topk, log)
        # a randomly initialised preset learns the output format first; a real model starts as is
        self.fresh_student = cfg.student_warmup_steps > 0 and cfg.model in TINY_PRESETS and not cfg.resume
        self.models = Student(cfg, self.world, model)
        self.actor = Actor(cfg, self.models.twin, self.tokenizer, self.world)
        ctx = PluginContext(core_config(cfg), self.world, self.models.twin, self.tokenizer, self.teacher, log,
                            Path(cfg.run_dir))
        self.plugins: list[Plugin] = [cls(dataclasses.replace(ctx, options=o)) for cls, o in self.chosen]
        self.collect = chain_rollouts(self.plugins, self.actor.rollout)
        self.updater = PPOUpdate(cfg, self.world, model, self.models.states, self.estimator, self.models.critic,
                                 self.models.critic_forward)
        self.state = TrainState()
        self.last_episodes: list[Episode] = []
        self.checkpointer = Checkpointer(cfg, self.world, log)
        self.evaluation = Evaluation(cfg, self.actor, lambda: self.state, log)
        self.observers = observers(cfg, self.world, self.evaluation, self.models, self.checkpointer, self.tokenizer,
                                   distilled=self.teacher is not None)

    # the student's forms, as the tests and examples reach them
    student = property(lambda self: self.models.model)
    twin = property(lambda self: self.models.twin)
    critic = property(lambda self: self.models.critic)
    ref = property(lambda self: self.models.ref, lambda self, m: setattr(self.models, "ref", m))
    step = property(lambda self: self.state.step, lambda self, v: setattr(self.state, "step", v))
    run_dir = property(lambda self: self.checkpointer.run_dir,
                       lambda self, d: setattr(self.checkpointer, "run_dir", Path(d)))

    def plugin(self, name: str) -> Plugin:
        """The running plugin called ``name`` (KeyError: none is on)."""
        for p in self.plugins:
            if p.name == name:
                return p
        raise KeyError(f"no plugin {name!r} is on in this run (on: {[p.name for p in self.plugins]})")

    # -- one step --------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """rollout -> pack -> advantages -> teacher -> loss weights -> PPO + OPD update -> metrics."""
        t0 = time.perf_counter()
        rollout = self.collect(self.step, RolloutLimits())  # plugins may limit, wrap or replace it
        self.last_episodes = rollout.episodes
        result = self.last_result = self.update(rollout.episodes, rollout_s=time.perf_counter() - t0)
        metrics = {**result.metrics, **rollout.metrics}
        for plugin in self.plugins:
            metrics.update(plugin.end_step(result))
        return metrics

    def update(self, episodes: list[Episode], rollout_s: float = 0.0) -> StepResult:
        """Everything after the rollout, on a step's episodes (all of them, on every rank). Under
        torchrun a rank packs and scores only its share of whole episodes, and the update is the
        one a single process makes on all of them."""
        cfg, world = self.cfg, self.world
        t0 = time.perf_counter()
        phase = self.updater.phases = PhaseTimes()  # the step's profile, time/<phase>_s
        own = distributed.own_episodes(episodes, world)
        local = [episodes[i] for i in own]
        with phase("pack"):
            batch = pack_episodes(local, cfg.pack_tokens, mode="aligned", teacher_roles=cfg.teacher_roles(),
                                  pad_token_id=pad_id(self.tokenizer))
        with phase("advantages"):
            adv = compute_advantages(cfg, batch, episodes, own, world, self.models.ref, self.models.critic_forward)
        with phase("teacher"):
            scores = self.teacher.score(local, batch) if self.teacher is not None else None
        with phase("prepare"):  # the old log-probs' pass where one is needed, the teacher's kept distribution
            inputs = self.updater.prepare(batch, scores, any(p.needs_trainer_logprobs for p in self.plugins))
        with phase("weigh"):
            weights, stats = self.weigh(inputs, local, adv, scores)
        with phase("update"):  # forward + backward of every epoch and minibatch, and the optimizer steps
            update_stats, token_kl = self.updater.run(inputs, adv, weights, role_masks(batch, local))
        self.models.sync()  # rollouts, evaluations and audits sample from the updated weights
        metrics = step_metrics(cfg, world, episodes, batch, rollout_s, time.perf_counter() - t0, self.updater.lr,
                               {**update_stats, **stats, **phase.metrics()})
        result = StepResult(self.step, episodes, own, batch, token_kl, metrics)
        for observer in self.observers:  # the step's sample episodes, with the divergence just computed
            metrics.update(observer.after_update(result))
        return result

    def learn(self, episodes: list[Episode], rollout_s: float = 0.0) -> dict[str, float]:
        """:meth:`update` on given episodes; returns the step's metrics."""
        return self.update(episodes, rollout_s).metrics

    def rollout(self) -> list[Episode]:
        """The actor's episodes of this step (every rank's), without any plugin's rollout changes."""
        return self.actor.rollout(self.step).episodes

    def weigh(self, inputs: UpdateInputs, local: Sequence[Episode], adv: Advantages,
              scores: TeacherScores | None) -> tuple[LossWeights, dict[str, float]]:
        """The loss weights of the step (the trajectory weights and the teacher mask, less the
        actions the teacher has no target for), then every plugin's changes in order; the plugins'
        metrics, and the teacher's."""
        scored = scores is not None
        weights = LossWeights.initial(adv.weights, inputs.batch.teacher, scores.supervised if scored else None,
                                      adv.norm)
        ctx = WeighContext(self.step, self._progress(), inputs.batch, local, policy_lags(local, self.step), self.world,
                           inputs.minibatches, scores.states if scored else None, scores.logp if scored else None,
                           inputs.trainer_logp, self.models.states, scored)
        self.student.eval()  # what a plugin reads of the student is the policy before the update
        stats: dict[str, float] = {}
        for plugin in self.plugins:
            stats.update(plugin.weigh(weights, ctx))
        return weights, {**stats, **(scores.metrics if scored else {})}

    def _progress(self) -> float:
        return self.state.progress(self.cfg.steps, self.cfg.time_budget)

    # -- checkpoints -----------------------------------------------------------------------------
    def modules(self) -> dict[str, Any]:
        return self.models.modules()

    def _make_ref(self) -> None:
        self.models.make_ref()

    def save(self) -> Any:
        """Checkpoint this step (:meth:`memopd.learn.checkpointer.Checkpointer.save`)."""
        self.state.plugins = {p.name: p.state_dict() for p in self.plugins}
        return self.checkpointer.save(self.step, self.state, self.models, self.updater)

    def log_row(self, metrics: dict[str, Any], save: bool = False) -> None:
        """Record a metrics row of the current step; with ``save``, checkpoint first (row included)."""
        self.state.rows.append(self.checkpointer.logger.clean_row(self.step, metrics))
        if save:
            self.save()
        self.checkpointer.logger.log(self.step, metrics)

    def restore(self) -> None:
        """Continue from the newest complete checkpoint (:meth:`Checkpointer.restore`)."""
        self.models.make_ref()
        self.state = self.checkpointer.restore(self.models, self.updater, self.plugins, type(self.state))

    # -- the loop --------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to ``cfg.steps`` (from the last checkpoint with ``cfg.resume``); writes the final
        model to ``RUN_DIR/model`` and ``summary.json``. A start that fails before its first
        checkpoint removes the run directory it made."""
        with compute_dtype(self.cfg.dtype, self.cfg.device):  # rollouts, teacher, updates, evals
            try:
                self.restore() if self.cfg.resume else self._start()
            except BaseException:
                self.checkpointer.discard_failed_start()
                raise
            try:
                for plugin in self.plugins:
                    plugin.start(self.step)
                return self._train()
            finally:
                for plugin in self.plugins:
                    plugin.close()

    def _start(self) -> None:
        """A fresh run: the student's warm start, the reference copy, and the held-out evaluations
        of the teacher and of the student before training (checkpoint 0)."""
        if self.fresh_student:  # on the whole weights; under torchrun rank 0's result goes to every rank
            warm_start_student(self.twin, self.tokenizer, self.cfg, self.log)
            self.models.publish()
        self.models.make_ref()
        before = self.evaluation.before(self.teacher, self.world)
        self.log_row({f"eval/{k}": v for k, v in before.items()}, save=True)

    def _train(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        cfg = self.cfg
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", unit="step", disable=not cfg.progress)
        clock = time.process_time if cfg.budget_clock == "cpu" else time.perf_counter
        while self.step < cfg.steps:
            t0 = clock()
            metrics = self.train_step()
            self.state.train_clock += clock() - t0
            (spent,) = distributed.all_max([self.state.train_clock], self.world)  # every rank stops alike
            metrics["train_clock_s"] = spent
            out_of_time = bool(cfg.time_budget) and spent >= cfg.time_budget
            self.step += 1
            self.state.rows = []
            self.state.count_bad_step(metrics, self.cfg.max_bad_steps, self.checkpointer.last)
            for observer in self.observers:
                metrics.update(observer.after_step(self.step, self.last_result))
            saving = self.state.bad_steps == 0 and (self.step % cfg.save_every == 0 or out_of_time)
            self.log_row(metrics, save=saving)
            bar.update(1)
            bar.set_postfix(f1=f"{metrics['f1']:.3f}", kl=f"{metrics.get('kl/all', float('nan')):.3f}", refresh=False)
            if saving or "eval/f1" in metrics:  # drawing costs ~10% of a tiny step: at saves, evaluations, the end
                self.checkpointer.plot()
            if out_of_time:
                self.log(f"time budget: {spent:.0f} s of {cfg.budget_clock} time after step {self.step} "
                         f"(--time-budget {cfg.time_budget:g}); stopping")
                break
        bar.close()
        return self._finish()

    def _finish(self) -> dict[str, Any]:
        """The held-out evaluation after training (unless the last step had it), the final model and
        ``summary.json``."""
        after = self.evaluation.after(self.step)
        if after is not None:
            self.log_row({f"eval/{k}": v for k, v in after.items()}, save=True)
        self.checkpointer.plot()
        self.checkpointer.close()
        summary = {**self.evaluation.summary(), "steps": self.step, "peak_rss_mb": peak_rss_mb()}
        self.log(f"run directory: {self.run_dir}  (final model: {self.run_dir / RUN_MODEL_DIR})")
        for observer in self.observers:
            observer.at_end()
        self.checkpointer.write_summary(summary)
        return summary


__all__ = ["Rollout", "Trainer", "TrainingError"]
