"""The options of ``memopd.train``, in slices: each part of the learner declares the options it
owns, with their help and checks (the estimators' and the served teacher's in their modules);
:class:`CoreConfig` is their union. The command line (:mod:`memopd.train`) adds the slices of the
registered plugins (:func:`config_slices`) and :class:`PluginOptions`, so every flag and TOML key is
a field's name, and ``--help`` shows one group per slice. No slice reads another's fields in its
checks but the core's own; the rules between plugins are the plugins' (:func:`select_plugins`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Sequence

from agents.records import ROLES
from agents.registry import agent_names as _agent_names
from memopd import distributed, losses
from memopd.config import Config, ConfigError, TrainingOptions, field
from memopd.learn.estimators import BUILTIN, OPTION_SLICES, REGISTRY, SampledOptions, TopKOptions, estimator_options
from memopd.learn.registry import SpecError
from memopd.learn.mix import parse_mix
from memopd.learn.models import MODEL_LR, TINY_LR
from memopd.learn.plugin import (Plugin, PluginSpecError, check_plugin_kwargs, plugin_options, resolve_plugin,
                                 select_plugins)
from memopd.learn.policy_loss import PolicyLossOptions
from memopd.learn.rewards import RewardShapingOptions
from memopd.learn.teachers import check_served, run_needs
from memopd.learn.teachers.routing import route_table
from memopd.learn.teachers.served import ServedTeacherOptions
from memopd.lora import LoRAOptions


@dataclass
class RunOptions:
    """What to train and for how long"""

    model: str = field("tiny", help="student: preset (tiny, tiny-teacher, smollm2), local model directory, "
                                    "training run directory or checkpoint, .gguf file or hub id")
    teacher: str = field("auto", help="teacher spec (as --model takes), or the URL of an OpenAI-compatible server "
                                      "(a stock vllm serve, e.g. http://127.0.0.1:8000/v1; see --teacher-model); "
                                      "'auto' = the tiny-teacher preset fine-tuned on oracle trajectories of --env "
                                      "(built and cached on first use)")
    teacher_sft_steps: int = field(250, help="SFT steps of the auto teacher (--teacher auto), 32 oracle trajectories "
                                            "each: the embedded recipe's 250, or what the task's task.toml [train] "
                                            "table recommends for a task the recipe learns more slowly",
                                   range=(1, None))
    teacher_routes: list = field(default_factory=list, repeat=True, table=lambda t: [f"{k}={v}" for k, v in t.items()],
                                 help="a teacher per env and per call role (memopd.learn.teachers.routing): one "
                                      "route per use, KEY=SPEC with KEY ENV:ROLE, ENV, memory, answer or * (ENV an "
                                      "env tag of the run, e.g. LongQA-v0) and SPEC any --teacher; a call goes to "
                                      "its most specific route, a call with none is unsupervised. --teacher "
                                      "KEY=SPEC means this. In a TOML config: a table, teacher_routes = { memory = "
                                      "\"URL\", answer = \"tiny-teacher\" } (or a list of KEY=SPEC)")
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
    env_mix: list = field(default_factory=list, repeat=True, table=lambda t: [
                              {"name": k, **(v if isinstance(v, dict) else {"weight": v})} for k, v in t.items()],
                          help="several envs in one run (memopd.learn.mix): one env per use, NAME[:WEIGHT]"
                               "[,KEY=VALUE...] (weight 1 by default, its own env options over --env-kwarg); each "
                               "step draws its questions' envs by weight. --env given more than once, or with a "
                               "weight, means this. In a TOML config: a table of weights or of tables, env_mix = "
                               "{ \"memgym/LongQA-v0\" = 2, \"memgym/KnowledgeUpdate-v0\" = { weight = 1, "
                               "num_chunks = 6 } }, or a list of specs")
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
        if self.env_mix:  # kept as canonical specs; --env names the first env (run directory, checks)
            specs = parse_mix(self.env_mix)
            self.env_mix = [s.text() for s in specs]
            self.env = specs[0].name  # type: ignore[attr-defined]
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
    opd_estimator: str = field("full", help=lambda: (
        "how the divergence is estimated at each supervised token: full (the whole vocabulary, exact), topk (the "
        "teacher's --opd-topk most likely tokens plus one tail bucket: a lower bound, 2k numbers a token), sampled "
        "(the reverse KL's k1 / k3 of the log-ratio at the sampled token, or the forward KL's importance-weighted "
        "estimate with --opd-divergence fkl: one teacher log-prob a token; see --opd-sampled, --opd-sampled-as), "
        "an installed estimator (" + (", ".join(n for n in REGISTRY.names() if n not in BUILTIN) or "none") +
        "), or module:Class, an Estimator subclass (e.g. examples.gkd:GeneralizedJSD)"), names=REGISTRY.names)
    opd_estimator_kwargs: dict = field(default_factory=dict,
                                       help="an option of an --opd-estimator given as module:Class or installed "
                                            "(repeatable): KEY=VALUE for a field of its Options dataclass")
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

    def teacher_roles(self) -> tuple[str, ...]:
        """The roles of the calls whose tokens the teacher supervises (``--teacher-mask``)."""
        return ROLES if self.teacher_mask == "both" else (self.teacher_mask,)

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]
        self._check_estimator()

    def _check_estimator(self) -> None:
        """``--opd-estimator`` names an estimator that estimates ``--opd-divergence`` and takes its
        ``--opd-estimator-kwarg`` options."""
        try:
            cls = REGISTRY.resolve(self.opd_estimator)
        except SpecError as exc:
            raise ConfigError(str(exc)) from None
        if self.opd_divergence != "auto" and self.opd_divergence not in cls.divergences:
            others = [n for n in BUILTIN if self.opd_divergence in REGISTRY.resolve(n).divergences]
            raise ConfigError(f"--opd-estimator {self.opd_estimator} estimates {_divergences(cls.divergences)} "
                              f"(--opd-divergence {' or '.join(cls.divergences)}), not {self.opd_divergence}; use "
                              f"--opd-estimator {' or '.join(others)} for it")
        if self.opd_estimator_kwargs and cls.Options in OPTION_SLICES:
            raise ConfigError(f"--opd-estimator-kwarg: the built-in estimator {self.opd_estimator} takes its options "
                              "as flags of their own (see --help-all)")
        if self.opd_estimator_kwargs:
            known = {f.name for f in dataclasses.fields(cls.Options)} if cls.Options else set()
            unknown = sorted(set(self.opd_estimator_kwargs) - known)
            if unknown:
                raise ConfigError(f"--opd-estimator-kwarg {unknown[0]}: --opd-estimator {self.opd_estimator} does not "
                                  f"take it (its options: {', '.join(sorted(known)) or 'none'})")
            estimator_options(cls, self)


def _divergences(kinds: tuple[str, ...]) -> str:
    """``("rkl", "fkl")`` -> ``the reverse or the forward KL``."""
    if set(kinds) <= {"rkl", "fkl"}:
        return " or ".join(f"the {'reverse' if k == 'rkl' else 'forward'}" for k in kinds) + " KL"
    return " or ".join(kinds)


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
class CoreConfig(LoggingOptions, ParallelOptions, LoRAOptions, UpdateOptions, ServedTeacherOptions, SampledOptions,
                 TopKOptions, RewardShapingOptions, PolicyLossOptions, ObjectiveOptions, RolloutOptions, RunOptions,
                 TrainingOptions):
    """The run's own options: every one but the training methods' (plugins'). Every field is a flag:
    ``opd_coef`` -> ``--opd-coef``; the options shared with ``memopd.sft`` (env, model, seed, threads,
    optimiser, attention) mean the same in both. What a plugin reads of the run
    (``PluginContext.cfg``)."""

    COMMON_OPTIONS = ("env", "env_kwargs", "model", "teacher", "agent", "steps", "run_dir", "resume", "threads",
                      "seed", "lr", "opd_estimator", "opd_coef", "eval_episodes", "device", "config")
    """What ``--help`` shows in full; ``--help-all`` shows every option."""


@dataclass
class PluginOptions(Config):
    """Your own training methods"""

    plugin: list = field(default_factory=list,
                         help="training methods of your own, comma-separated: module:Class, a "
                               "memopd.learn.plugin.Plugin subclass importable from the current directory (e.g. "
                               "examples.answer_weight:AnswerWeight), or a name under the memopd.plugins entry points; "
                               "they run after the built-in methods. In a TOML config: plugin = [\"m:C\"]")
    plugin_kwargs: dict = field(default_factory=dict,
                                help="an option of a --plugin (repeatable): KEY=VALUE for a field of its Options "
                                     "dataclass; VALUE is read as a Python literal when it is one")

    builtin_plugins: ClassVar[tuple[type[Plugin], ...]] = ()
    """The built-in plugins whose options the config holds as flags (set by the command line)."""

    def __post_init__(self) -> None:
        """(The first slice of an assembled config: every other has checked itself by now.) The
        ``--plugin`` specs, the rules between the plugins, and a served teacher's needs."""
        super().__post_init__()
        try:
            classes = [resolve_plugin(spec) for spec in self.plugin]
            for spec, c in zip(self.plugin, classes):
                plugin_options(c, self.plugin_kwargs, spec)
            check_plugin_kwargs(classes, self.plugin_kwargs)
        except PluginSpecError as exc:
            raise ConfigError(str(exc)) from None
        if isinstance(self, CoreConfig):
            chosen = select_plugins(type(self).builtin_plugins, self)
            reading = [c.name for c, _ in chosen if c.teacher_needs]
            if self.opd_coef > 0 and reading and route_table(self):
                raise ConfigError(f"--{reading[0].replace('_', '-')} reads one teacher's states, and this run routes its calls to "
                                  "several (--teacher KEY=SPEC); use one --teacher with it")
            check_served(self, run_needs(self, [c for c, _ in chosen], distributed.launched_size()))


def config_slices(plugins: Sequence[type[Plugin]]) -> tuple[type, ...]:
    """The plugins' option slices, as the bases of an assembled config (the first plugin's last, so
    that its flags follow the core's in ``--help`` and TOML)."""
    return tuple(reversed([p.Options for p in plugins if p.Options is not None]))


def core_config(cfg: CoreConfig) -> CoreConfig:
    """The run's core options alone, out of an assembled config (what a plugin is given)."""
    return CoreConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(CoreConfig)})


__all__ = ["CoreConfig", "LoggingOptions", "ObjectiveOptions", "ParallelOptions", "PluginOptions", "PolicyLossOptions",
           "RewardShapingOptions", "RolloutOptions", "RunOptions", "ServedTeacherOptions", "UpdateOptions", "config_slices", "core_config"]
