"""The options of ``memopd.train``, in slices: each part of the learner (and each built-in method,
in its own module under :mod:`memopd.plugins`) declares the options it owns, with their help and
checks; :class:`TrainConfig` is their union, so every flag and TOML key is the field's name, and
``--help`` shows one group per slice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agents.registry import agent_names as _agent_names
from memopd import distributed, losses
from memopd.config import ConfigError, TrainingOptions, field
from memopd.estimators import ESTIMATORS, SAMPLED_KINDS
from memopd.learn.lora import LoRAOptions
from memopd.learn.models import MODEL_LR, TINY_LR
from memopd.plugins.async_ray import AsyncOptions
from memopd.plugins.freshness import FreshnessOptions
from memopd.plugins.prune_opd import PruneOPDOptions
from memopd.plugins.staleness import StalenessOptions
from memopd.plugins.turn_opd import TurnOPDOptions


@dataclass
class RunOptions:
    """What to train and for how long"""

    model: str = field("tiny", help="student: preset (tiny, tiny-teacher, smollm2), local model directory, "
                                    "training run directory or checkpoint, .gguf file or hub id")
    teacher: str = field("auto", help="teacher spec (as --model takes), or the URL of an OpenAI-compatible server "
                                      "(a stock vllm serve, e.g. http://127.0.0.1:8000/v1; see --teacher-model); "
                                      "'auto' = the tiny-teacher preset fine-tuned on oracle trajectories of --env "
                                      "(built and cached on first use)")
    student_warmup_steps: int = field(100, help="SFT steps on oracle trajectories before RL when --model is a "
                                               "tiny preset (learns the output format; 0 = start from --model as is)",
                                      range=(0, None))
    lr: float | None = field(None, help=f"peak learning rate (AdamW); default {TINY_LR} for a tiny-preset "
                                        f"student, {MODEL_LR} for any other model", range=(0.0, 1.0))
    run_dir: str | None = field(None, help="run directory (default runs/train/<env>-<time>)")
    resume: str | None = field(None, help="resume the run in this directory from its last checkpoint (its saved "
                                          "settings are kept; flags given with it change them, recorded in "
                                          "config.toml)")
    steps: int = field(80, help="training steps (one rollout batch each)", range=(1, None))


@dataclass
class RolloutOptions:
    """Rollouts: the agent, the batch and the sampling backend"""

    agent: str = field("memagent", help=lambda: (
        "the policy rolled out and trained: a registered name (built-ins and installed memopd.agents plugins: "
        f"{', '.join(_agent_names())}; the oracle calls no model and cannot be trained) or module:Class, a "
        "MemoryPolicy subclass taking backend= and sampling= (e.g. examples.notes_agent:NotesAgent, imported from "
        "the current directory)"))
    agent_kwargs: dict = field(default_factory=dict,
                               help="agent constructor option (repeatable), e.g. answer_max_new_tokens=16; VALUE is "
                                    "read as a Python literal when it is one, else kept as a string. In a TOML "
                                    "config: a table, agent_kwargs = { answer_max_new_tokens = 16 }")
    questions_per_step: int = field(8, help="questions per step (B)", range=(1, None))
    group_size: int = field(4, help="samples per question (G)", range=(1, None))
    rollout_envs: int = field(64, help="environments stepped in lockstep (model calls batched across them)",
                              range=(1, None))
    temperature: float = field(1.0, help="sampling temperature of rollouts", range=(1e-3, 10.0))
    max_new_tokens: int = field(48, help="most tokens sampled per call", range=(1, None))
    backend: str = field("hf", help="what samples rollouts: hf (transformers, shares the student's weights) or vllm "
                                    "(a vLLM engine in this process; the student's weights are pushed into it in "
                                    "memory before every rollout). openai is eval-only (no weight-sync path)",
                         choices=("hf", "vllm", "openai"))
    vllm_dtype: str = field("auto", help="vllm: engine dtype (auto, float32, bfloat16, float16)")
    max_model_len: int | None = field(None, help="vllm: most positions per sequence (prompt + response)",
                                      range=(16, None))
    gpu_memory_utilization: float = field(0.5, help="vllm: fraction of GPU memory the engine takes (the trainer "
                                                    "shares the GPU)", range=(0.01, 1.0))
    tensor_parallel_size: int = field(1, help="vllm: GPUs one engine shards over", range=(1, None))
    kv_cache_gib: float | None = field(None, help="vllm: KV cache GiB (default 1 on CPU, vLLM's sizing on GPU)",
                                       range=(0.01, None))
    vllm_sleep: bool = field(False, help="vllm, GPU: the engine frees its GPU memory while the trainer updates")
    old_logprobs: str = field("recorded", help="PPO's old log-probs: recorded (the rollout engine's) or recompute "
                                               "(the trainer's own forward before the update; the rollout/trainer "
                                               "mismatch is then corrected by a truncated importance weight)",
                              choices=("recorded", "recompute"))
    tis_cap: float = field(2.0, help="with --old-logprobs recompute: cap of the importance weight pi_trainer / "
                                     "pi_rollout per token (0 = no correction)", range=(0.0, None))
    memory_perturbation: str | None = field(None, help="the perturbed-memory control on training rollouts "
                                                       "(memgym.perturb; held-out evaluation is left as is): "
                                                       "KIND (drop, stale, distractor) once per episode, KIND@N "
                                                       "after chunk N, KIND@pP after each chunk with probability P")

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]
        self._check_agent()
        if self.memory_perturbation is not None:
            from memgym.perturb import parse_spec

            try:
                parse_spec(self.memory_perturbation)
            except ValueError as exc:
                raise ConfigError(f"--memory-perturbation: {exc}") from None
        if self.backend == "openai":
            raise ConfigError("--backend openai cannot train: a served model has no weight-sync path from the "
                              "trainer; use --backend vllm (an engine in this process) or hf, and openai for eval")

    def _check_agent(self) -> None:
        """``--agent`` must name a trainable agent that takes its ``--agent-kwarg`` options: refused
        here, when the config is made, before any model or teacher is loaded."""
        from agents.registry import MODEL_ARGS, AgentSpecError, check_options, check_trainable, resolve_agent

        try:
            cls = resolve_agent(self.agent)
            check_trainable(cls, self.agent)
            check_options(cls, self.agent, self.agent_kwargs, reserved=MODEL_ARGS)
        except AgentSpecError as exc:
            raise ConfigError(f"--agent {exc}") from None

@dataclass
class ObjectiveOptions:
    """Objective: reward, advantages and distillation"""

    reward: str = field("f1", help="task reward; 'none' = OPD only", choices=("f1", "em", "sub_em", "none"))
    advantage: str = field("grpo", help="advantage estimator: group-relative (grpo) or GAE with a critic (gae)",
                           choices=("grpo", "gae"))
    opd_coef: float = field(1.0, help="lambda: weight of the distillation term (0 = PPO only)", range=(0.0, None))
    opd_divergence: str = field("auto", help="distillation divergence: rkl = KL(student || teacher) (MemOPD's), "
                                             "fkl, jsd; auto = fkl for a tiny-preset student learnt from scratch, "
                                             "rkl for any other model", choices=("auto", *losses.DIVERGENCES))
    opd_estimator: str = field("full", help="how the divergence is estimated at each supervised token: full (the "
                                            "whole vocabulary, exact), topk (the teacher's --opd-topk most likely "
                                            "tokens plus one tail bucket: a lower bound, 2k numbers a token), "
                                            "sampled (the reverse KL's k1 / k3 of the log-ratio at the sampled token, "
                                            "or the forward KL's importance-weighted estimate with --opd-divergence "
                                            "fkl: one teacher log-prob a token; see --opd-sampled, --opd-sampled-as)",
                               choices=ESTIMATORS)
    opd_topk: int = field(20, help="topk estimator: the teacher's most likely tokens kept per action",
                          range=(1, None))
    opd_sampled: str = field("k3", help="sampled estimator of the reverse KL: k1 (log r) or k3 ((1/r - 1) + log r, "
                                        "never negative), r = p_student / p_teacher at the sampled token (the "
                                        "forward KL has one form)", choices=SAMPLED_KINDS)
    opd_sampled_as: str = field("loss", help="sampled estimator: a loss (value the estimate, gradient the score "
                                             "function's) or a dense per-token advantage -lambda * log r added to "
                                             "PPO's (the Tinker cookbook's form)", choices=("loss", "advantage"))
    teacher_context: str = field("aligned", help="teacher scoring context: aligned (MemOPD) or persistent "
                                                 "(flattened history, the control)", choices=("aligned", "persistent"))
    teacher_mask: str = field("both", help="which action tokens the teacher supervises",
                              choices=("both", "memory", "answer"))
    entropy_coef: float = field(0.0, help="alpha: entropy bonus", range=(0.0, None))
    ref_beta: float = field(0.0, help="beta: reward penalty beta * [logp_old - logp_ref]_+ against the "
                                      "frozen initial student (with --lora-r: the base model, the student with "
                                      "its adapters off; no second copy)", range=(0.0, None))
    clip_eps: float = field(0.2, help="PPO ratio clip", range=(0.0, 1.0))
    gamma: float = field(1.0, help="GAE discount", range=(0.0, 1.0))
    lam: float = field(1.0, help="GAE lambda", range=(0.0, 1.0))
    vf_coef: float = field(0.5, help="value loss weight (GAE critic)", range=(0.0, None))

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]
        if self.opd_estimator == "sampled" and self.opd_divergence == "jsd":
            raise ConfigError("--opd-estimator sampled estimates the reverse or the forward KL (--opd-divergence rkl "
                              "or fkl), not jsd; use --opd-estimator full or topk for it")


@dataclass
class ServedTeacherOptions:
    """A teacher behind a server (--teacher URL)"""

    teacher_model: str | None = field(None, help="served teacher: the model's name on the server (default: the "
                                                 "first it lists)")
    teacher_concurrency: int = field(8, help="served teacher: requests in flight at once", range=(1, None))
    teacher_retries: int = field(4, help="served teacher: attempts after a connection error or timeout, with "
                                         "backoff 0.5 s, 1 s, 2 s, ...", range=(0, None))
    teacher_timeout: float = field(120.0, help="served teacher: seconds a request may take", range=(1.0, None))
    teacher_audit_model: str | None = field(None, help="served teacher: a local copy of the served model (a model "
                                                       "spec); at start the probe's log-probs, then at the first and "
                                                       "every --audit-every step the served log-probs of the step's "
                                                       "first calls, are checked against its forward of each call "
                                                       "alone (audit/teacher_max_abs_diff)")
    teacher_audit_tolerance: float = field(1e-4, help="served teacher: the largest |served - copy| log-prob the "
                                                      "audit passes; past it the run stops before the step's update",
                                           range=(0.0, None))
    teacher_audit_warn_only: bool = field(False, help="served teacher: a failed audit warns and training goes on "
                                                      "(default: it stops the run)")

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]
        from memopd.learn.remote_teacher import is_url

        cfg: Any = self
        if cfg.teacher_audit_model and not is_url(cfg.teacher):
            raise ConfigError(f"--teacher-audit-model {cfg.teacher_audit_model}: it audits a served teacher "
                              "(--teacher URL); a local teacher is scored in this process, audited by --audit-every")
        if not (is_url(cfg.teacher) and cfg.opd_coef > 0):
            return
        if cfg.opd_estimator == "full":
            raise ConfigError(f"--teacher {cfg.teacher}: a server returns the top tokens of each position, not the "
                              "whole distribution; pass --opd-estimator topk (with --opd-topk, at most the server's "
                              "--max-logprobs) or sampled")
        if cfg.teacher_context != "aligned":
            raise ConfigError(f"--teacher {cfg.teacher}: a served teacher scores each call in its own state "
                              "(--teacher-context aligned); the persistent control needs a local teacher")
        if cfg.prune_opd:
            raise ConfigError(f"--teacher {cfg.teacher}: --prune-opd compares the teacher's whole distribution with "
                              "the student's; use a local teacher")


@dataclass
class UpdateOptions:
    """Update: PPO epochs, minibatches and the teacher cache"""

    ppo_epochs: int = field(4, help="passes over each rollout batch", range=(1, None))
    minibatches: int = field(1, help="minibatches per epoch (split by packed rows; raise it for big models)",
                             range=(1, None))
    micro_batch_rows: int | None = field(None, help="packed rows per forward: a minibatch's gradient is "
                                                    "accumulated over row groups of this many before its one "
                                                    "optimizer step, and the teacher's scoring and the old "
                                                    "log-probs run in groups of this many too (the same update, "
                                                    "a lower peak memory); 0: every row at once; default 1 for "
                                                    "a model of 10M parameters or more in one process, else 0",
                                         range=(0, None))
    critic_lr: float = field(1e-3, help="critic learning rate (GAE)", range=(0.0, 1.0))
    teacher_cache_mb: int = field(1024, help="keep the teacher's full-vocabulary log-probs of a step for all PPO "
                                             "epochs when they fit in this many MiB (N action tokens x vocabulary "
                                             "x 4 bytes); else each epoch projects the teacher again (0: always)",
                                  range=(0, None))
    kl_chunk: int | None = field(None, help="action tokens projected to the full vocabulary at a time; default: "
                                            "as many as keep one [tokens, vocabulary] float32 tensor within 32 MiB, "
                                            "at most 1024 (SmolLM2's 49,152 tokens: 170; the tiny presets: 1024)",
                                 range=(1, None))

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]
        if self.micro_batch_rows and distributed.launched_size() > 1:
            raise ConfigError("--micro-batch-rows runs in one process in this version (every rank would need the "
                              "same number of row groups); under torchrun lower --pack-tokens or raise --minibatches")


@dataclass
class ParallelOptions:
    """Several processes (torchrun; see docs/scale-out.md)"""

    parallel: str = field("fsdp", help="data parallelism of the student and critic under torchrun: FSDP2 "
                                       "sharding (fsdp) or whole replicas (ddp)", choices=distributed.PARALLEL_MODES)
    teacher_parallel: str = field("replicate", help="the teacher under torchrun: a whole copy on every rank "
                                                    "(replicate) or sharded with FSDP2 for its forward (fsdp: each "
                                                    "rank holds 1/N of it, plus a whole copy of its output head)",
                                  choices=("replicate", "fsdp"))
    dist_timeout: float = field(600.0, help="seconds any collective may wait for the other ranks before the job "
                                            "fails (a dead rank ends the run instead of hanging it)",
                                range=(1.0, None))


@dataclass
class LoggingOptions:
    """Evaluation, logging, checkpoints and budgets"""

    eval_every: int = field(20, help="held-out evaluation every N steps (0 = only before and after)",
                            range=(0, None))
    eval_episodes: int = field(64, help="held-out episodes per evaluation (test split, greedy)", range=(1, None))
    save_every: int = field(5, help="checkpoint every N steps", range=(1, None))
    keep_checkpoints: int = field(2, help="checkpoints kept", range=(1, None))
    sample_episodes: int = field(4, help="episodes saved per step to episodes/step-N.jsonl (with the teacher's "
                                         "per-token KL)", range=(0, None))
    audit_every: int = field(20, help="RCE audit (packed vs per-invocation log-probs on 4 of the step's "
                                      "episodes; logs audit/max_abs_diff, audit/passed) every N steps; 0 = off",
                             range=(0, None))
    time_budget: float = field(0.0, help="stop training after the step at which the steps' cumulative time "
                                         "(--budget-clock; evaluations not counted) reaches this many seconds; the "
                                         "final evaluation and export follow as usual (0: run all --steps)",
                               range=(0.0, None))
    budget_clock: str = field("wall", help="the clock of --time-budget and of the logged train_clock_s: wall "
                                           "seconds, or this process's CPU seconds (steadier on a shared machine)",
                              choices=("wall", "cpu"))
    max_bad_steps: int = field(3, help="stop after this many steps in a row with a non-finite loss",
                               range=(1, None))
    tensorboard: bool = field(False, help="also log to TensorBoard (RUN_DIR/tensorboard)")
    wandb_project: str | None = field(None, help="also log to this W&B project")


@dataclass
class PluginOptions:
    """Your own training methods"""

    plugin: list = field(default_factory=list,
                         help="training methods of your own, comma-separated: module:Class, a "
                               "memopd.learn.plugin.Plugin subclass importable from the current directory (e.g. "
                               "examples.answer_weight:AnswerWeight), or a name under the memopd.plugins entry points; "
                               "they run after the built-in methods. In a TOML config: plugin = [\"m:C\"]")
    plugin_kwargs: dict = field(default_factory=dict,
                                help="an option of a --plugin (repeatable): KEY=VALUE for a field of its Options "
                                     "dataclass; VALUE is read as a Python literal when it is one")

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]
        from memopd.learn.plugin import PluginSpecError, check_plugin_kwargs, plugin_options, resolve_plugin

        try:
            classes = [resolve_plugin(spec) for spec in self.plugin]
            for spec, c in zip(self.plugin, classes):
                plugin_options(c, self.plugin_kwargs, spec)
            check_plugin_kwargs(classes, self.plugin_kwargs)
        except PluginSpecError as exc:
            raise ConfigError(str(exc)) from None

@dataclass
class TrainConfig(PluginOptions, AsyncOptions, StalenessOptions, PruneOPDOptions, FreshnessOptions, TurnOPDOptions,
                  LoggingOptions, ParallelOptions, LoRAOptions, UpdateOptions, ServedTeacherOptions, ObjectiveOptions,
                  RolloutOptions, RunOptions,
                  TrainingOptions):
    """Everything a MemOPD run needs. Every field is a flag: ``opd_coef`` -> ``--opd-coef``; the
    options shared with ``memopd.sft`` (env, model, seed, threads, optimiser, attention) mean the
    same in both."""

    COMMON_OPTIONS = ("env", "env_kwargs", "model", "teacher", "agent", "steps", "run_dir", "resume", "threads",
                      "seed", "lr", "opd_estimator", "opd_coef", "eval_episodes", "device", "config")
    """What ``--help`` shows in full; ``--help-all`` shows every option."""


__all__ = ["LoggingOptions", "ObjectiveOptions", "ParallelOptions", "PluginOptions", "RolloutOptions", "RunOptions",
           "ServedTeacherOptions",
           "TrainConfig", "UpdateOptions"]
