"""The MemOPD trainer: the fit loop and one short step.

    step = rollout -> pack -> advantages -> teacher -> loss weights -> PPO + OPD update -> metrics

Each phase lives in a module named for it: the rollout worker (:mod:`memopd.learn.actor`),
packing (:mod:`memopd.packing`), rewards and advantages (:mod:`memopd.learn.advantage`), the
teacher (:mod:`memopd.learn.teacher`), the update (:mod:`memopd.learn.update`); the training
methods beyond PPO + OPD are plugins (:mod:`memopd.learn.plugin`, :mod:`memopd.plugins`) that may
limit or replace the rollout, change the loss weights and act at the end of a step. The
distributed world is a value (:data:`memopd.distributed.SINGLE` in one process), so the step
reads the same alone and under torchrun.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

from agents.models import RUN_ADAPTER_DIR, RUN_MODEL_DIR
from agents.records import ROLES, Episode, save_episodes
from memopd import checkpoint, distributed
from memopd import config as cfgmod
from memopd.audit import RCEAuditHook
from memopd.config import ConfigError
from memopd.learn.actor import Actor, Rollout, RolloutLimits
from memopd.learn.advantage import compute_advantages, episode_rewards, role_masks
from memopd.learn.env_check import check_env, check_env_settings
from memopd.learn.lora import checkpoint_view, lora_on, trainable_parameters
from memopd.learn.models import Critic, pad_id, resolve_defaults, resolve_memory_defaults, warm_start_student
from memopd.learn.options import TrainConfig
from memopd.learn.plugin import (LossWeights, Plugin, PluginContext, RolloutFn, StepResult, TrainingError,
                                 WeighContext, plugin_options, resolve_plugin)
from memopd.learn.state import TrainState
from memopd.learn.teacher import load_teacher
from memopd.learn.update import PPOUpdate, UpdateInputs
from memopd.packing import PackedBatch, pack_episodes
from memopd.runlog import RunLogger, check_mirrors, plot_curves, read_metrics
from memopd.runtime import PhaseTimes, adamw, compute_dtype, lr_lambda, peak_rss_mb, prepare_model, set_threads
from memopd.scoring import ActionStates, action_states


class Trainer:
    """One MemOPD run. Construction loads and checks everything (env, student, teacher, env
    options, logging mirrors) before the run directory is touched; :meth:`fit` trains."""

    def __init__(self, cfg: TrainConfig, log=print):
        from agents.models import load
        from agents.presets import TINY_PRESETS

        cfg = resolve_defaults(cfg)
        set_threads(cfg.threads)
        self.world = distributed.setup(cfg.device, cfg.dist_timeout)  # one process: nothing to join
        distributed.check_batch(self.world, cfg.questions_per_step, cfg.group_size)
        if self.world.enabled and cfg.backend != "hf":
            distributed.shutdown()
            raise ConfigError(f"--backend {cfg.backend} runs in one process only in this version; under torchrun "
                              "use --backend hf (each rank samples with a whole copy of the student)")
        if not self.world.is_main:  # only rank 0 logs and draws progress bars
            cfg, log = dataclasses.replace(cfg, progress=False), _quiet
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # transformers' own bars (loading weights)
        self.cfg, self.log = cfg, log
        torch.manual_seed(cfg.seed)
        check_env(cfg.env)
        check_mirrors(cfg.tensorboard, cfg.wandb_project)
        self.run_dir = Path(cfg.run_dir)
        self.student, self.tokenizer = load(cfg.model, device=cfg.device)
        cfg = self.cfg = resolve_memory_defaults(cfg, self.student, distributed.launched_size())
        prepare_model(self.student, cfg)
        check_env_settings(cfg, self.tokenizer)
        self.teacher = load_teacher(cfg, self.tokenizer, self.world, log)
        # a randomly initialised preset learns the output format first; a real model starts as is
        self.fresh_student = cfg.student_warmup_steps > 0 and cfg.model in TINY_PRESETS and not cfg.resume
        self.ref: torch.nn.Module | None = None
        self.critic = Critic(self.student) if cfg.advantage == "gae" else None
        self.twin = self._go_parallel()  # whole weights for rollouts: the student itself in one process
        self.actor = Actor(cfg, self.twin, self.tokenizer, self.world)
        self.plugins = self._make_plugins()
        self.collect = self._rollout_chain()
        # a LoRA student: the adapters only (a full-weight one: every parameter, as parameters() lists them)
        opt = adamw(trainable_parameters(self.student), self.student, lr=cfg.lr, weight_decay=cfg.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, cfg.steps,
                                                                 cfg.lr_floor))
        critic_opt = (torch.optim.AdamW(trainable_parameters(self.critic), lr=cfg.critic_lr)
                      if self.critic is not None else None)
        self.updater = PPOUpdate(cfg, self.world, self.student, self._student_states, opt, sched, self.critic,
                                 self.critic_fwd, critic_opt)
        self.audit = (RCEAuditHook(every=cfg.audit_every, max_episodes=4, lowering=cfg.attn, strict=False,
                                   tolerance=1e-1 if cfg.dtype == "bfloat16" else None)  # autocast: bf16's bound
                      if cfg.audit_every else None)
        self.state = TrainState()
        self.last_episodes: list[Episode] = []
        self.made_run_dir = False
        self.logger = self._open_run_dir()

    # -- components ------------------------------------------------------------------------------
    def _go_parallel(self) -> torch.nn.Module:
        """Under torchrun, shard (FSDP2) or replicate (DDP) the student and the critic; returns the
        model with whole weights that rollouts, evaluations and audits use. Alone: the student."""
        from memopd.heads import output_head

        self.student_fwd, self.critic_fwd, self.head = None, self.critic, None
        if not self.world.enabled:
            return self.student
        cfg, world = self.cfg, self.world
        self.head = output_head(self.student)  # probed through the model's own forward, before sharding
        twin = copy.deepcopy(self.student) if cfg.parallel == "fsdp" else self.student
        self.student_fwd = distributed.wrap(distributed.PackedStates(self.student),
                                            distributed.decoder_layers(self.student), cfg.parallel, cfg.device, world)
        if self.critic is not None:
            self.critic_fwd = distributed.wrap(self.critic, distributed.decoder_layers(self.critic.lm), cfg.parallel,
                                               cfg.device, world)
        return twin

    def _make_plugins(self) -> list[Plugin]:
        """The built-in methods the options switch on, in their order, then the ``--plugin`` ones."""
        from memopd.plugins import BUILTIN_PLUGINS

        ctx = PluginContext(self.cfg, self.world, self.twin, self.tokenizer, self.teacher, self.log, self.run_dir)
        plugins = [cls(ctx) for cls in BUILTIN_PLUGINS if cls.enabled(self.cfg)]
        for spec in self.cfg.plugin:
            cls = resolve_plugin(spec)
            plugins.append(cls(dataclasses.replace(ctx, options=plugin_options(cls, self.cfg.plugin_kwargs, spec))))
        return plugins

    def _rollout_chain(self) -> RolloutFn:
        """The actor's rollout, wrapped by every plugin (the first plugin's wrapper outermost)."""
        fn: RolloutFn = self.actor.rollout
        for plugin in reversed(self.plugins):
            fn = plugin.wrap_rollout(fn)
        return fn

    def plugin(self, name: str) -> Plugin:
        """The running plugin called ``name`` (KeyError: none is on)."""
        for p in self.plugins:
            if p.name == name:
                return p
        raise KeyError(f"no plugin {name!r} is on in this run (on: {[p.name for p in self.plugins]})")

    def _student_states(self, mb: PackedBatch) -> ActionStates:
        """The student's states at a minibatch's action tokens (through the FSDP2/DDP wrapper
        under torchrun, so that gradients are reduced across ranks)."""
        if self.student_fwd is None:
            return action_states(self.student, mb, lowering=self.cfg.attn)
        hidden = self.student_fwd(mb, self.cfg.attn)
        return ActionStates(hidden, self.head, mb.temperatures.to(hidden.device))

    @property
    def step(self) -> int:
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    # -- one step --------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """rollout -> pack -> advantages -> teacher -> loss weights -> PPO + OPD update -> metrics."""
        t0 = time.perf_counter()
        rollout = self.collect(self.step, RolloutLimits())  # plugins may limit, wrap or replace it
        self.last_episodes = rollout.episodes
        result = self.update(rollout.episodes, rollout_s=time.perf_counter() - t0)
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
            batch = pack_episodes(local, cfg.pack_tokens, mode="aligned", teacher_roles=self._teacher_roles(),
                                  pad_token_id=pad_id(self.tokenizer))
        with phase("advantages"):
            adv = compute_advantages(cfg, batch, episodes, own, world, self.ref, self.critic_fwd)
        with phase("teacher"):
            scores = self.teacher.score(local, batch) if self.teacher is not None else None
        with phase("prepare"):  # the old log-probs' pass where one is needed, the teacher's kept distribution
            inputs = self.updater.prepare(batch, scores, any(p.needs_trainer_logprobs for p in self.plugins))
        with phase("weigh"):
            weights, plugin_stats = self.weigh(inputs, local, adv.weights, scored=scores is not None,
                                               supervised=scores.supervised if scores is not None else None)
        if scores is not None:
            plugin_stats.update(scores.metrics)
        with phase("update"):  # forward + backward of every epoch and minibatch, and the optimizer steps
            stats, token_kl = self.updater.run(inputs, adv, weights, role_masks(batch, local))
        if world.enabled:  # rollouts, evaluations and audits sample from the updated weights
            distributed.sync_twin(self.student, self.twin)
        metrics = self._metrics(episodes, batch, rollout_s, time.perf_counter() - t0,
                                {**stats, **plugin_stats, **phase.metrics()})
        self._save_samples(episodes, own, batch, token_kl)
        return StepResult(self.step, episodes, own, batch, token_kl, metrics)

    def learn(self, episodes: list[Episode], rollout_s: float = 0.0) -> dict[str, float]:
        """:meth:`update` on given episodes; returns the step's metrics."""
        return self.update(episodes, rollout_s).metrics

    def rollout(self) -> list[Episode]:
        """The actor's episodes of this step (every rank's), without any plugin's rollout changes."""
        return self.actor.rollout(self.step).episodes

    def weigh(self, inputs: UpdateInputs, local: Sequence[Episode], ppo_weights: torch.Tensor, scored: bool = True,
              supervised: torch.Tensor | None = None) -> tuple[LossWeights, dict[str, float]]:
        """The loss weights of the step: the trajectory weights and the teacher mask (less the
        actions the teacher has no target for, ``supervised``), then every plugin's changes in
        order; and the plugins' metrics."""
        batch = inputs.batch
        opd = batch.teacher.float() if supervised is None else batch.teacher.float() * supervised.float()
        weights = LossWeights(ppo_weights, opd)
        lags = torch.tensor([float(self.step - max((i.policy_version for i in e.invocations), default=self.step))
                             for e in local])  # policy versions between each sample's and the one trained
        ctx = WeighContext(self.step, self._progress(), batch, local, lags, self.world, inputs.minibatches,
                           inputs.teacher_states, inputs.teacher_logp, inputs.trainer_logp, self._student_states, scored)
        self.student.eval()  # what a plugin reads of the student is the policy before the update
        stats: dict[str, float] = {}
        for plugin in self.plugins:
            stats.update(plugin.weigh(weights, ctx))
        return weights, stats

    def _teacher_roles(self) -> tuple[str, ...]:
        return ROLES if self.cfg.teacher_mask == "both" else (self.cfg.teacher_mask,)

    def _progress(self) -> float:
        """How far training is, in [0, 1]: the share of --time-budget spent when a budget is set
        (the steps it allows are not known in advance), else of --steps."""
        if self.cfg.time_budget:
            return min(1.0, self.state.train_clock / self.cfg.time_budget)
        return self.step / max(1, self.cfg.steps)

    def _metrics(self, episodes: Sequence[Episode], batch: PackedBatch, rollout_s: float, learn_s: float,
                 stats: dict[str, float]) -> dict[str, float]:
        """The step's metrics: outcomes of the episodes that ran to their answer, the shape of the
        batch, throughput and time, the learning rate, and the update's and plugins' stats."""
        cfg = self.cfg
        n_calls = sum(len(e.invocations) for e in episodes)
        mem_tokens = [len(i.response_ids) for e in episodes for i in e.invocations if i.role == "memory"]
        n_actions, n_real, n_slots = distributed.all_sum(
            [batch.num_actions, batch.num_real_tokens, batch.block_ids.numel()], self.world)
        done = [e for e in episodes if e.cut is None]
        return {
            "reward": float(episode_rewards(done, cfg.reward if cfg.reward != "none" else "f1").mean()) if done
            else float("nan"),
            "f1": _mean([e.metrics.get("f1", 0.0) for e in done]),
            "em": _mean([e.metrics.get("em", 0.0) for e in done]),
            "calls_per_episode": n_calls / max(1, len(episodes)),
            "memory_tokens_per_call": _mean(mem_tokens),
            "action_tokens": int(n_actions),
            "packing_efficiency": 1.0 - (1.0 - n_real / max(1, n_slots)),
            "tokens_per_s": n_real * cfg.ppo_epochs / max(1e-9, learn_s),
            "rollout_s": rollout_s, "step_s": rollout_s + learn_s, "lr": self.updater.sched.get_last_lr()[0],
            **stats,
        }

    def _save_samples(self, episodes: Sequence[Episode], own: Sequence[int], batch: PackedBatch,
                      token_kl: torch.Tensor) -> None:
        """The step's first episodes, each invocation with its ``teacher_kl`` (one value per
        response token; None where the teacher does not supervise) for the viewer's heatmap.
        ``own`` maps the batch's episodes to ``episodes``; under torchrun rank 0 collects every
        rank's values and writes the file."""
        n = self.cfg.sample_episodes
        if not n:
            return
        kl: dict[tuple[int, int], list[float | None]] = {}
        if self.teacher is not None:
            for (e, i, t), v in zip(batch.token_map.tolist(), token_kl.tolist()):
                if own[e] < n:
                    kl.setdefault((own[e], i), [None] * len(episodes[own[e]].invocations[i].response_ids))[t] = \
                        v if math.isfinite(v) else None
            if self.world.enabled:
                kl = {k: v for part in distributed.gather_objects(kl, self.world) for k, v in part.items()}
        if not self.world.is_main:
            return
        for (e, i), values in kl.items():
            inv = episodes[e].invocations[i]
            inv.teacher_kl, inv.teacher_mode = values, self.cfg.teacher_context
        save_episodes(self.run_dir / "episodes" / f"step-{self.step + 1:06d}.jsonl", episodes[:n])

    # -- the run directory and checkpoints ---------------------------------------------------------
    def _open_run_dir(self) -> Any:
        """A fresh run: refuse a directory that holds a run, else make it and write config.toml.
        A resume: the directory must hold the run (its config is rewritten after the restore)."""
        cfg = self.cfg
        if not cfg.resume:
            if checkpoint.list_checkpoints(self.run_dir):
                raise ConfigError(f"--run-dir {self.run_dir} already holds a run with checkpoints; continue it with "
                                  f"--resume {self.run_dir}, or choose another --run-dir")
            text = cfgmod.dump_toml(cfg)  # fails (None in env kwargs) before anything is made
            if not self.world.is_main:  # rank 0 alone writes the run directory
                return _QuietLogger()
            self.made_run_dir = not self.run_dir.exists()
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                cfgmod.write_text_atomic(self.run_dir / "config.toml", text)
                # a directory whose earlier start died before its first checkpoint starts clean
                return RunLogger(self.run_dir, cfg.tensorboard, cfg.wandb_project, dataclasses.asdict(cfg),
                                 fresh=True)
            except BaseException:
                self._discard_failed_start()
                raise
        if not self.world.is_main:
            return _QuietLogger()
        return RunLogger(self.run_dir, cfg.tensorboard, cfg.wandb_project, dataclasses.asdict(cfg))

    def _discard_failed_start(self) -> None:
        """Remove the run directory this start made, when it never got a checkpoint."""
        if self.made_run_dir and not checkpoint.list_checkpoints(self.run_dir):
            if getattr(self, "logger", None) is not None:
                self.logger.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _make_ref(self) -> None:
        """The ``--ref-beta`` reference: a frozen copy of the student as it starts; with LoRA the
        student itself, read with its adapters off (the base model: no second copy, nothing to
        checkpoint)."""
        if self.cfg.ref_beta <= 0:
            return
        self.ref = self.twin if lora_on(self.cfg) else copy.deepcopy(self.twin).requires_grad_(False)

    def modules(self) -> dict[str, Any]:
        """What a checkpoint keeps: the models, each as its trainable tensors only under LoRA."""
        mods = {"student": checkpoint_view(self.student)}
        if self.critic is not None:
            mods["critic"] = checkpoint_view(self.critic)
        if self.ref is not None and not lora_on(self.cfg):
            mods["ref"] = self.ref
        return mods

    def save(self) -> Path:
        """Checkpoint this step, with the metrics rows logged at it: a resume rewrites
        ``metrics.jsonl`` as the rows before this step plus these, so a kill on either side of a
        row's write never duplicates or loses it. Under torchrun every rank writes its shards
        (a Distributed Checkpoint, :func:`memopd.checkpoint.save_sharded`)."""
        self.state.plugins = {p.name: p.state_dict() for p in self.plugins}
        common = {"scheduler": self.updater.sched.state_dict(), "train_state": self.state.to_dict()}
        if self.world.enabled:
            return checkpoint.save_sharded(self.run_dir, self.step, self.sharded_state(), common, self.world,
                                           keep=self.cfg.keep_checkpoints)
        critic_opt = self.updater.critic_opt
        state = {"optimizer": self.updater.opt.state_dict(),
                 "critic_optimizer": critic_opt.state_dict() if critic_opt else None,
                 "rng": checkpoint.rng_state(), **common}
        return checkpoint.save(self.run_dir, self.step, self.modules(), state, keep=self.cfg.keep_checkpoints)

    def sharded_state(self) -> distributed.ShardedState:
        """The models and optimizers as Distributed Checkpoint saves and loads them."""
        optimizers = {"optimizer": (self.student, self.updater.opt)}
        if self.updater.critic_opt is not None:
            optimizers["critic_optimizer"] = (self.critic, self.updater.critic_opt)
        models = {k: getattr(m, "module", m) for k, m in self.modules().items()}
        return distributed.ShardedState(models, optimizers, trainable_only=lora_on(self.cfg))

    def log_row(self, metrics: dict[str, Any], save: bool = False) -> None:
        """Record a metrics row of the current step; with ``save``, checkpoint first (row included)."""
        self.state.rows.append(self.logger.clean_row(self.step, metrics))
        if save:
            self.save()
        self.logger.log(self.step, metrics)

    def restore(self) -> None:
        """Continue from the newest complete checkpoint, written by one process (safetensors) or
        by any number of ranks (sharded), at this run's world size; also one written before the
        learner's components (:class:`memopd.learn.state.TrainState` reads both layouts)."""
        self._make_ref()
        whole = {k: distributed.FullState(m) if self.world.enabled and k != "ref" else m
                 for k, m in self.modules().items()}
        state, path = checkpoint.load_latest(self.run_dir, whole, self.sharded_state(), self.world.rank)
        if state["format"] == "safetensors":  # one-process layout: whole optimizer state, one RNG state
            for opt, saved in [(self.updater.opt, state["optimizer"]),
                               (self.updater.critic_opt, state.get("critic_optimizer"))]:
                if opt is not None and saved:
                    distributed.load_full_optimizer_state(opt, saved)
            rngs = state.get("rng_ranks") or [state["rng"]]  # gathered by rank 0 in earlier versions
            state["rng"] = rngs[self.world.rank % len(rngs)]
        checkpoint.set_rng_state(state["rng"])
        distributed.sync_twin(self.student, self.twin)
        self.updater.sched.load_state_dict(state["scheduler"])
        self.state = TrainState.from_checkpoint(state)
        self.state.step = state["step"]
        for plugin in self.plugins:
            plugin.load_state_dict(self.state.plugins.get(plugin.name, {}))
        earlier = [r for r in read_metrics(self.run_dir) if r.get("step", -1) < self.step]
        self.logger.rewrite(earlier + self.state.rows)
        self.log(f"resumed from {path} at step {self.step}")
        if self.world.is_main:
            self._record_changes()

    def _record_changes(self) -> None:
        """Settings a resume changed (e.g. more --steps): written to config.toml, with a comment
        line per change, and said in the log. An option the saved config predates counts as
        changed only when it is not at its default."""
        path = self.run_dir / "config.toml"
        saved = cfgmod.load_toml(path)
        now = cfgmod.to_dict(self.cfg)
        defaults = cfgmod.to_dict(TrainConfig())
        changed = {k: (saved.get(k), v) for k, v in now.items()
                   if k not in ("resume", "run_dir") and saved.get(k, defaults.get(k)) != v}
        if not changed:
            return
        what = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in sorted(changed.items()))
        self.log(f"resume changes settings (recorded in {path}): {what}")
        header = cfgmod.toml_header(path) + [f"resumed at step {self.step} on {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                                             f"{what}"]
        cfgmod.save_toml(dataclasses.replace(self.cfg, resume=None), path, header)  # as a fresh start writes it

    # -- the loop --------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to ``cfg.steps`` (from the last checkpoint with ``cfg.resume``); writes the final
        model to ``RUN_DIR/model`` and ``summary.json``. A start that fails before its first
        checkpoint removes the run directory it made."""
        with compute_dtype(self.cfg.dtype, self.cfg.device):  # rollouts, teacher, updates, evals
            try:
                if self.cfg.resume:
                    self.restore()
                else:
                    self._start()
            except BaseException:
                self._discard_failed_start()
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
        cfg = self.cfg
        if self.fresh_student:  # on the whole weights; under torchrun rank 0's result goes to every rank
            warm_start_student(self.twin, self.tokenizer, cfg, self.log)
            distributed.publish_twin(self.twin, self.student, self.world)
        self._make_ref()
        if self.teacher is not None and self.teacher.model is None:
            self.log(f"teacher: served at {self.cfg.teacher} (not evaluated here; evaluate it with memopd.eval "
                     "--backend openai)")
        elif self.teacher is not None:
            # on hf: a second in-process vLLM engine would tear down the student engine's state when freed
            judge = Actor(dataclasses.replace(cfg, backend="hf"), self.teacher.model, self.teacher.tokenizer,
                          self.world)
            self.state.eval_teacher = judge.evaluate()
            self.log(f"teacher held-out: F1 {self.state.eval_teacher['f1']:.3f}  "
                     f"EM {self.state.eval_teacher['em']:.3f}  ({cfg.eval_episodes} test episodes)")
        self.state.eval_before = self.actor.evaluate()
        self.log(f"held-out before training: F1 {self.state.eval_before['f1']:.3f}  "
                 f"EM {self.state.eval_before['em']:.3f}  ({cfg.eval_episodes} test episodes)")
        self.log_row({f"eval/{k}": v for k, v in self.state.eval_before.items()}, save=True)

    def _train(self) -> dict[str, Any]:
        cfg = self.cfg
        from tqdm.auto import tqdm

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
            self._count_bad_step(metrics)
            evaluated = bool(cfg.eval_every) and self.step % cfg.eval_every == 0 and self.step < cfg.steps
            if evaluated:
                metrics.update({f"eval/{k}": v for k, v in self.actor.evaluate().items()})
            audit = (self.audit(self.step, self.twin, self.last_episodes)
                     if self.audit is not None and self.world.is_main else None)
            if audit is not None:
                metrics["audit/max_abs_diff"] = audit.max_abs_diff
                metrics["audit/passed"] = bool(audit.passed)
            saving = self.state.bad_steps == 0 and (self.step % cfg.save_every == 0 or out_of_time)
            self.log_row(metrics, save=saving)
            bar.update(1)
            bar.set_postfix(f1=f"{metrics['f1']:.3f}", kl=f"{metrics.get('kl/all', float('nan')):.3f}", refresh=False)
            if saving or evaluated:  # drawing costs ~10% of a tiny step: at checkpoints, evaluations and the end
                self._plot()
            if out_of_time:
                self.log(f"time budget: {spent:.0f} s of {cfg.budget_clock} time after step {self.step} "
                         f"(--time-budget {cfg.time_budget:g}); stopping")
                break
        bar.close()
        return self._finish()

    def _count_bad_step(self, metrics: dict[str, float]) -> None:
        """A step whose every minibatch had a non-finite loss changed nothing; too many in a row
        end the run (its last good checkpoint intact)."""
        cfg = self.cfg
        if not math.isnan(metrics.get("loss", float("nan"))):
            self.state.bad_steps = 0
            return
        self.state.bad_steps += 1
        warnings.warn(f"step {self.step}: non-finite loss, update skipped "
                      f"({self.state.bad_steps}/{cfg.max_bad_steps} in a row)", RuntimeWarning, stacklevel=3)
        if self.state.bad_steps >= cfg.max_bad_steps:
            last = checkpoint.list_checkpoints(self.run_dir)
            raise TrainingError(
                f"{self.state.bad_steps} steps in a row had a non-finite loss; stopped at step {self.step}. "
                f"The last good checkpoint is intact: {last[0] if last else 'none'}. "
                "Lower --lr or --opd-coef, or check the teacher, then --resume.")

    def _finish(self) -> dict[str, Any]:
        """The held-out evaluation after training (unless the last step had it), the final model and
        ``summary.json``."""
        state = self.state
        if state.eval_after is None or state.eval_after_step != self.step:
            state.eval_after, state.eval_after_step = self.actor.evaluate(), self.step
            self.log_row({f"eval/{k}": v for k, v in state.eval_after.items()}, save=True)
        self._plot()
        self.logger.close()
        before, after = state.eval_before or {}, state.eval_after
        self.log(f"held-out F1: before {before.get('f1', float('nan')):.3f} -> after {after['f1']:.3f}  "
                 f"(EM {before.get('em', float('nan')):.3f} -> {after['em']:.3f})")
        self.log(f"run directory: {self.run_dir}  (final model: {self.run_dir / RUN_MODEL_DIR})")
        summary = {"eval_before": before, "eval_after": after, "eval_teacher": state.eval_teacher, "steps": self.step,
                   "peak_rss_mb": peak_rss_mb()}
        if self.world.is_main:  # rank 0 alone writes files
            self.export_final()
            cfgmod.write_text_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        distributed.barrier(self.world)
        return summary

    def _plot(self) -> None:
        if self.world.is_main:
            plot_curves(read_metrics(self.run_dir), self.run_dir / "curves.png",
                        title=f"{self.cfg.env}  {self.run_dir.name}")

    def export_final(self) -> Path:
        """The student as a standard transformers directory (weights + tokenizer), ``RUN_DIR/model``
        (under torchrun the whole weights, as the rollouts use them); with LoRA the merged model,
        and the adapter directory in ``RUN_DIR/adapter``."""
        from agents.models import save_pretrained

        if not lora_on(self.cfg):
            return save_pretrained(self.run_dir / RUN_MODEL_DIR, self.twin, self.tokenizer)
        from agents.lora import AdapterWriter, merged_copy

        save_pretrained(self.run_dir / RUN_ADAPTER_DIR, AdapterWriter(self.twin), self.tokenizer)
        return save_pretrained(self.run_dir / RUN_MODEL_DIR, merged_copy(self.twin), self.tokenizer)


def _quiet(message: str) -> None:
    """The log of ranks other than 0."""


class _QuietLogger:
    """The metrics logger of ranks other than 0: rows are made (for checkpoints) but not written."""

    clean_row = RunLogger.clean_row

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def rewrite(self, rows: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


__all__ = ["Rollout", "Trainer", "TrainingError"]
