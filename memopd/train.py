"""MemOPD training: PPO on the final reward + full-vocabulary on-policy distillation, on packed,
state-aligned reconstructions of every recorded model invocation.

    python -m memopd.train --env memgym/LongQA-v0                       # the embedded default
    python -m memopd.train --env memgym/LongQA-v0 --model DIR --teacher DIR

One step, top to bottom (see :func:`train_step`):
  1. rollout   B questions x G samples with the current student (MemAgent); every model call is
               recorded exactly (prompt ids, positions, sampled ids, sampling log-probs).
  2. advantage group-relative (GRPO-style) or GAE with a critic; trajectory rewards are spread
               over a trajectory's invocations with weight 1 / #invocations, so the number of
               calls is not a hidden weight.
  3. pack      the invocations into rows (shared prefix once per row, recorded positions, no
               attention across calls) -> PackedBatch, N action tokens.
  4. teacher   hidden states of the teacher at the N action positions, under the student's exact
               state (`aligned`, MemOPD) or the flattened history (`persistent`, the control).
  5. update    for each PPO epoch and minibatch of rows:
                 L_actor = L_PPO - alpha * H + lambda * L_OPD
               L_OPD = mean over teacher-mask tokens of KL(p_student || p_teacher) over the full
               vocabulary, projected in chunks from gathered hidden states.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from agents.models import RUN_MODEL_DIR
from agents.records import ROLES, Episode, save_episodes
from agents.registry import agent_names as _agent_names
from memgym.cli import fail, run_main, set_threads
from memopd import checkpoint, distributed, losses
from memopd import config as cfgmod
from memopd.audit import RCEAuditHook
from memopd.config import ConfigError, TrainingOptions, field
from memopd.packing import PackedBatch, fitting_budget, pack_episodes
from memopd.runlog import LoggingSetupError, RunLogger, check_mirrors, plot_curves, read_metrics
from memopd.scoring import ActionStates, action_states, token_logprobs


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. too many non-finite losses in a row); the message says why."""


TINY_LR = 2e-3
"""Default learning rate of a tiny-preset student: it must learn to copy within the default run."""
MODEL_LR = 1e-6
"""Default learning rate of any other (pretrained) student."""


@dataclass
class TrainConfig(TrainingOptions):
    """Everything a MemOPD run needs. Every field is a flag: ``opd_coef`` -> ``--opd-coef``; the
    options shared with ``memopd.sft`` (env, model, seed, threads, optimiser, attention) mean the
    same in both."""

    # what to train on (env, env_kwargs: shared)
    model: str = field("tiny", help="student: preset (tiny, tiny-teacher, smollm2), local model directory, "
                                    "training run directory or checkpoint, .gguf file or hub id")
    teacher: str = field("auto", help="teacher spec; 'auto' = the tiny-teacher preset fine-tuned on oracle "
                                      "trajectories of --env (built and cached on first use)")
    student_warmup_steps: int = field(100, help="SFT steps on oracle trajectories before RL when --model is a "
                                               "tiny preset (learns the output format; 0 = start from --model as is)",
                                      range=(0, None))
    lr: float | None = field(None, help=f"peak learning rate (AdamW); default {TINY_LR} for a tiny-preset "
                                        f"student, {MODEL_LR} for any other model", range=(0.0, 1.0))
    # run
    run_dir: str | None = field(None, help="run directory (default runs/train/<env>-<time>)")
    resume: str | None = field(None, help="resume the run in this directory from its last checkpoint (its saved "
                                          "settings are kept; flags given with it change them, recorded in "
                                          "config.toml)")
    steps: int = field(80, help="training steps (one rollout batch each)", range=(1, None))
    # rollout
    agent: str = field("memagent", help="the policy rolled out and trained: a registered name (built-ins and "
                                        f"installed memopd.agents plugins: {', '.join(_agent_names())}; the "
                                        "oracle calls no model and cannot be trained) or module:Class, a "
                                        "MemoryPolicy subclass taking backend= and sampling= (e.g. "
                                        "examples.notes_agent:NotesAgent, imported from the current directory)")
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
    # objective
    reward: str = field("f1", help="task reward; 'none' = OPD only", choices=("f1", "em", "sub_em", "none"))
    advantage: str = field("grpo", help="advantage estimator: group-relative (grpo) or GAE with a critic (gae)",
                           choices=("grpo", "gae"))
    opd_coef: float = field(1.0, help="lambda: weight of the distillation term (0 = PPO only)", range=(0.0, None))
    opd_divergence: str = field("auto", help="distillation divergence: rkl = KL(student || teacher) (MemOPD's), "
                                             "fkl, jsd; auto = fkl for a tiny-preset student learnt from scratch, "
                                             "rkl for any other model", choices=("auto", *losses.DIVERGENCES))
    teacher_context: str = field("aligned", help="teacher scoring context: aligned (MemOPD) or persistent "
                                                 "(flattened history, the control)", choices=("aligned", "persistent"))
    teacher_mask: str = field("both", help="which action tokens the teacher supervises",
                              choices=("both", "memory", "answer"))
    opd_weighting: str = field("token", help="how the distillation mean weighs the supervised tokens: token (all "
                                             "alike, so long calls dominate), turn (every model call alike: the mean "
                                             "within a call, then over calls), progressive (token to turn over "
                                             "training, TurnOPD's loss budgeting; see --opd-turn-start/end/shape)",
                               choices=losses.OPD_WEIGHTINGS)
    opd_turn_start: float = field(0.0, help="progressive: fraction of the steps (of --time-budget when one is "
                                            "set) at which the move from token to turn weighting starts",
                                  range=(0.0, 1.0))
    opd_turn_end: float = field(0.5, help="progressive: fraction of the steps (of --time-budget when one is set) "
                                          "from which the weighting is all turn", range=(0.0, 1.0))
    opd_turn_shape: str = field("linear", help="progressive: the ramp between start and end (linear, or a cosine "
                                               "ease)", choices=losses.TURN_SHAPES)
    adaptive_depth: bool = field(False, help="TurnOPD's adaptive rollout depth: every --depth-probe-every steps the "
                                             "rollout is full (a probe); its per-turn teacher KL picks the depth D at "
                                             "which the rollouts until the next probe are cut (no answer, no reward: "
                                             "distillation terms only)")
    depth_probe_every: int = field(5, help="adaptive depth: a full rollout every N steps (the first step is one)",
                                   range=(1, None))
    depth_kl_frac: float = field(0.2, help="adaptive depth: a turn is worth rolling out while its mean teacher KL "
                                           "is at least this fraction of the largest turn's", range=(0.0, 1.0))
    depth_min: int = field(1, help="adaptive depth: the fewest model calls an episode is cut at", range=(1, None))
    simulated_staleness: int = field(0, help="train each step on the rollouts of S steps before (made by the "
                                             "policy S updates back): asynchronous rollouts' staleness, simulated "
                                             "synchronously (0: on-policy)", range=(0, None))
    async_rollouts: bool = field(False, help="asynchronous actor-learner mode on Ray (pip install 'memopd[ray]'): "
                                             "--rollout-workers Ray actors sample episodes continuously with the "
                                             "latest published student weights into a bounded buffer; each step "
                                             "trains on a batch from it and publishes the new weights")
    max_staleness: int = field(1, help="async rollouts: the most policy versions a sample used may lag the trained "
                                       "policy (workers wait when this far ahead; staler samples are dropped and "
                                       "generated again; 0: every step waits for its own rollouts)", range=(0, None))
    rollout_workers: int = field(1, help="async rollouts: Ray actors sampling episodes (each a CPU copy of the "
                                         "student, one torch thread)", range=(1, None))
    max_worker_restarts: int = field(3, help="async rollouts: a dead worker is replaced (its unfinished episodes "
                                             "dropped) up to this many times in a run; one more death ends it",
                                     range=(0, None))
    ray_address: str | None = field(None, help="async rollouts: the Ray cluster to join (ray start ...); default: "
                                               "a local instance started and shut down by the run")
    freshness: str = field("off", help="f-OPD's regulation of stale samples: weight (each episode's loss terms "
                                       "times its freshness exp(-lag / --fresh-lag-scale - drift / "
                                       "--fresh-drift-scale)) or off", choices=("off", "weight"))
    fresh_lag_scale: float = field(2.0, help="freshness: policy-version lag that costs a factor e (0: ignore the "
                                             "lag)", range=(0.0, None))
    fresh_drift_scale: float = field(0.05, help="freshness: rollout drift (mean k3 KL(behaviour || current) per "
                                                "token) that costs a factor e (0: ignore the drift)", range=(0.0, None))
    prune_opd: bool = field(False, help="Prune-OPD: down-weight the distillation terms of an episode after its "
                                        "prefix drifts from the teacher (the student's and the teacher's top-k next "
                                        "tokens overlap below --prune-threshold for --prune-patience tokens in a row)")
    prune_topk: int = field(8, help="Prune-OPD: k of the top-k overlap", range=(1, None))
    prune_threshold: float = field(0.25, help="Prune-OPD: overlap below which a token counts towards a drift",
                                   range=(0.0, 1.0))
    prune_patience: int = field(4, help="Prune-OPD: consecutive low-overlap tokens that make a drift event",
                                range=(1, None))
    prune_decay: float = field(0.5, help="Prune-OPD: weight of the drifting call's later tokens; each later "
                                         "call's tokens weigh this times less again", range=(0.0, 1.0))
    prune_stop: bool = field(True, help="Prune-OPD: also stop a drifting episode's rollout after the call it "
                                        "drifts in (the student and the teacher score each round of calls as it "
                                        "is made; the episode then trains on distillation terms only); "
                                        "--no-prune-stop keeps full rollouts")
    entropy_coef: float = field(0.0, help="alpha: entropy bonus", range=(0.0, None))
    ref_beta: float = field(0.0, help="beta: reward penalty beta * [logp_old - logp_ref]_+ against the "
                                      "frozen initial student", range=(0.0, None))
    clip_eps: float = field(0.2, help="PPO ratio clip", range=(0.0, 1.0))
    gamma: float = field(1.0, help="GAE discount", range=(0.0, 1.0))
    lam: float = field(1.0, help="GAE lambda", range=(0.0, 1.0))
    vf_coef: float = field(0.5, help="value loss weight (GAE critic)", range=(0.0, None))
    # optimisation (lr, schedule, warm-up, decay, clipping, packing, attention: shared)
    ppo_epochs: int = field(4, help="passes over each rollout batch", range=(1, None))
    minibatches: int = field(1, help="minibatches per epoch (split by packed rows; raise it for big models)",
                             range=(1, None))
    critic_lr: float = field(1e-3, help="critic learning rate (GAE)", range=(0.0, 1.0))
    teacher_cache_mb: int = field(1024, help="keep the teacher's full-vocabulary log-probs of a step for all PPO "
                                             "epochs when they fit in this many MiB (N action tokens x vocabulary "
                                             "x 4 bytes); else each epoch projects the teacher again (0: always)",
                                  range=(0, None))
    kl_chunk: int = field(1024, help="action tokens projected to the full vocabulary at a time", range=(1, None))
    # several processes (torchrun; see README "Scale out")
    parallel: str = field("fsdp", help="data parallelism of the student and critic under torchrun: FSDP2 "
                                       "sharding (fsdp) or whole replicas (ddp)", choices=distributed.PARALLEL_MODES)
    teacher_parallel: str = field("replicate", help="the teacher under torchrun: a whole copy on every rank "
                                                    "(replicate) or sharded with FSDP2 for its forward (fsdp: each "
                                                    "rank holds 1/N of it, plus a whole copy of its output head)",
                                  choices=("replicate", "fsdp"))
    dist_timeout: float = field(600.0, help="seconds any collective may wait for the other ranks before the job "
                                            "fails (a dead rank ends the run instead of hanging it)",
                                range=(1.0, None))
    # evaluation, logging, checkpoints
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

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_agent()
        if self.opd_weighting == "progressive" and not self.opd_turn_start < self.opd_turn_end:
            raise ConfigError(f"--opd-turn-start {self.opd_turn_start} must be below --opd-turn-end "
                              f"{self.opd_turn_end} (fractions of the steps) for --opd-weighting progressive")
        if self.async_rollouts:
            self._check_async()
        if self.prune_opd and self.prune_stop:
            self._check_prune_stop()
        if self.backend == "openai":
            raise ConfigError("--backend openai cannot train: a served model has no weight-sync path from the "
                              "trainer; use --backend vllm (an engine in this process) or hf, and openai for eval")

    def _check_prune_stop(self) -> None:
        """Prune-OPD's rollout stop scores each call as it is made, in its state-aligned context, with
        whole-weight models in this process."""
        off = "; pass --no-prune-stop to keep full rollouts (the distillation weights still decay after a drift)"
        if self.teacher_context != "aligned":
            raise ConfigError("--prune-opd stops rollouts by scoring each call in its state-aligned context, which "
                              f"--teacher-context {self.teacher_context} does not train on" + off)
        if self.async_rollouts:
            raise ConfigError("--prune-opd cannot stop the rollouts of --async-rollouts workers" + off)
        if self.teacher_parallel == "fsdp" and distributed.launched_size() > 1:
            raise ConfigError("--prune-opd scores rollouts with a whole teacher on each rank; use --teacher-parallel "
                              "replicate" + off)

    def _check_async(self) -> None:
        """``--async-rollouts``: what it cannot be combined with, and Ray installed."""
        from memopd import async_rollouts

        if self.simulated_staleness:
            raise ConfigError("--async-rollouts and --simulated-staleness exclude each other: the simulation is the "
                              "synchronous stand-in for asynchronous workers; bound real staleness with "
                              "--max-staleness")
        if distributed.launched_size() > 1:
            raise ConfigError("--async-rollouts runs in one learner process in this version, not under torchrun")
        if self.backend != "hf":
            raise ConfigError(f"--async-rollouts: the rollout workers sample with transformers (--backend hf), "
                              f"not --backend {self.backend}")
        if self.adaptive_depth:
            raise ConfigError("--async-rollouts does not support --adaptive-depth yet (the workers roll out full "
                              "episodes)")
        if not async_rollouts.ray_available():
            raise ConfigError(f"--async-rollouts needs Ray, which is not installed: {async_rollouts.RAY_HINT}")

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


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------

# The auto teacher: sized so that building it fits the embedded default's 15-minute budget on 2 CPU cores.
TEACHER_SFT = {"model": "tiny-teacher", "num_episodes": 1000, "steps": 250, "batch_episodes": 32, "lr": 3e-3}


def default_teacher_dir(cfg: TrainConfig) -> Path:
    """Cache location of the auto teacher, keyed by everything that shapes it."""
    from agents.models import cache_dir
    from agents.presets import PRESET_FORMAT

    from memgym.registry import get_task

    # the task folder's files too: an edited custom task must not reuse a teacher of its old version
    task = get_task(cfg.env).fingerprint()
    key = json.dumps({"env": cfg.env, "env_kwargs": cfg.env_kwargs, "task": task, "preset_format": PRESET_FORMAT,
                      **TEACHER_SFT}, sort_keys=True)
    return cache_dir() / "teachers" / hashlib.sha256(key.encode()).hexdigest()[:16]


def ensure_teacher(cfg: TrainConfig, log=print) -> str:
    """Resolve ``--teacher auto``: fine-tune the tiny-teacher preset on oracle trajectories once."""
    if cfg.teacher != "auto":
        return cfg.teacher
    out = default_teacher_dir(cfg)
    if (out / "config.json").is_file():
        log(f"teacher: cached SFT teacher {out}")
        return str(out)
    from memopd.sft import SFTConfig, run as run_sft

    log(f"teacher: none cached for {cfg.env}; building it now: SFT of {TEACHER_SFT['model']} on "
        f"{TEACHER_SFT['num_episodes']} oracle trajectories, {TEACHER_SFT['steps']} steps (cached at {out})")
    sft_cfg = SFTConfig(env=cfg.env, env_kwargs=cfg.env_kwargs, out=str(out), seed=cfg.seed + 1,
                        threads=cfg.threads, **TEACHER_SFT)
    run_sft(sft_cfg, progress=cfg.progress)
    return str(out)


def warm_start_student(model: torch.nn.Module, tokenizer: Any, cfg: TrainConfig, log=print) -> None:
    """A short SFT on oracle trajectories so a from-scratch tiny student knows the output format."""
    from memopd.sft import SFTConfig, oracle_episodes, train_sft

    log(f"student: warm start, {cfg.student_warmup_steps} SFT steps on oracle trajectories")
    eps = oracle_episodes(cfg.env, cfg.env_kwargs, tokenizer, 1000, seed=cfg.seed + 2, progress=False)
    sft_cfg = SFTConfig(steps=cfg.student_warmup_steps, batch_episodes=32, lr=3e-3, warmup_steps=10,
                        seed=cfg.seed + 2)
    train_sft(model, eps, sft_cfg, pad_token_id=_pad_id(tokenizer), progress=cfg.progress)


def resolve_defaults(cfg: TrainConfig) -> TrainConfig:
    """Fill the defaults that depend on the student: ``--lr`` and ``--opd-divergence auto``.

    A tiny preset learns from scratch: it needs a high learning rate, and the forward KL. Until it
    can tell which fact the question asks for, the reverse KL's best answer is the geometric mean of
    the teachers of the contexts it cannot tell apart (near uniform over names), and on LongQA it
    stayed on its copy plateau where the forward KL, like SFT on the teacher, crossed it (measured;
    see README). A pretrained student gets MemOPD's reverse KL and a small learning rate."""
    from agents.presets import TINY_PRESETS

    tiny = cfg.model in TINY_PRESETS
    lr = cfg.lr if cfg.lr is not None else (TINY_LR if tiny else MODEL_LR)
    div = cfg.opd_divergence if cfg.opd_divergence != "auto" else ("fkl" if tiny else "rkl")
    return dataclasses.replace(cfg, lr=lr, opd_divergence=div)


def _pad_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


class Critic(torch.nn.Module):
    """Value model for GAE: a copy of the student's decoder with a scalar head, read at the same
    gather positions as the action logits (the state before each sampled token)."""

    def __init__(self, student: torch.nn.Module):
        super().__init__()
        self.lm = copy.deepcopy(student)
        hidden = self.lm.get_output_embeddings().weight.shape[1]
        self.v_head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.v_head.weight)
        torch.nn.init.zeros_(self.v_head.bias)

    def forward(self, batch: PackedBatch, lowering: str | None = None) -> torch.Tensor:
        from memopd.attention import packed_hidden_states

        return self.v_head(packed_hidden_states(self.lm, batch, lowering))[:, 0]  # [N]


# ------------------------------------------------------------------------------------------------
# Rollouts and evaluation
# ------------------------------------------------------------------------------------------------

class Roller:
    """Runs episodes of the ``--agent`` policy (default MemAgent) with the current student on a pool
    of envs, and checks that its records carry what the learner needs."""

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module, tokenizer: Any):
        import gymnasium as gym

        import memgym  # noqa: F401  (registers the envs)
        from agents.backends.hf import HFBackend

        self.cfg = cfg
        self.questions = (0, cfg.questions_per_step)  # (first, count): a rank's share under torchrun
        self.run_tag = ""  # tells the group ids of ranks apart
        self.world = distributed.SINGLE  # evaluations are split across the ranks of this world
        self.max_calls: int | None = None  # a rollout-depth budget (--adaptive-depth); None: full episodes
        self.monitor: Any = None  # Prune-OPD's drift monitor (memopd.prune.DriftMonitor) of training rollouts
        self.last_rollout_s = 0.0  # wall time of the last training rollout
        self.model = model
        self.backend = (HFBackend(model, tokenizer, device=cfg.device, seed=cfg.seed) if cfg.backend == "hf"
                        else self._engine(cfg, model, tokenizer))
        n = min(cfg.rollout_envs, cfg.questions_per_step * cfg.group_size)
        kw = {**cfg.env_kwargs, "tokenizer": tokenizer}
        try:
            self.train_envs = [gym.make(cfg.env, split="train", **kw) for _ in range(n)]
            self.test_envs = [gym.make(cfg.env, split="test", **kw)
                              for _ in range(min(cfg.rollout_envs, cfg.eval_episodes))]
        except (TypeError, ValueError, KeyError) as exc:  # env options are user input
            raise ConfigError(f"--env-kwarg: {cfg.env} refused {cfg.env_kwargs}: {exc}") from None

    @staticmethod
    def _engine(cfg: TrainConfig, model: torch.nn.Module, tokenizer: Any) -> Any:
        from agents.backends.vllm import VLLMBackend, VLLMUnsupportedError

        try:
            return VLLMBackend.from_model(
                model, tokenizer, dtype=cfg.vllm_dtype, max_model_len=cfg.max_model_len,
                gpu_memory_utilization=cfg.gpu_memory_utilization, tensor_parallel_size=cfg.tensor_parallel_size,
                kv_cache_gib=cfg.kv_cache_gib, enable_sleep_mode=cfg.vllm_sleep, seed=cfg.seed)
        except VLLMUnsupportedError as exc:
            raise ConfigError(f"--backend vllm: {exc}") from None

    def _sync(self) -> None:
        """An engine (vllm) samples the student's current weights: woken if asleep, then the weights
        are copied in, in memory. Pushing before every rollout rather than after every optimizer
        step costs one copy per step and leaves no path (resume, evaluation) with stale weights.
        The hf backend shares the student's module: nothing to do."""
        if hasattr(self.backend, "load_weights"):
            self.backend.wake_up()
            self.backend.load_weights(self.model)

    def _rest(self) -> None:
        """An engine in sleep mode frees its GPU memory for the update."""
        if hasattr(self.backend, "sleep"):
            self.backend.sleep()

    def _agent(self, greedy: bool, seed: int | None):
        """The ``--agent`` by the constructor convention: the student's backend, the run's sampling,
        and the ``--agent-kwarg`` options."""
        from agents.backends.base import SamplingParams
        from agents.registry import AgentSpecError, build_agent

        sp = SamplingParams(temperature=self.cfg.temperature, max_new_tokens=self.cfg.max_new_tokens,
                            greedy=greedy, seed=seed)
        try:
            return build_agent(self.cfg.agent, {"backend": self.backend, "sampling": sp}, options=self.cfg.agent_kwargs)
        except AgentSpecError as exc:
            raise ConfigError(f"--agent {exc}") from None

    def check(self, episodes: Sequence[Episode]) -> None:
        """The learner's contract on the agent's records (:func:`memopd.contexts.check_contract`) for
        this run's reward, teacher context and mask: a bad agent fails at its first rollout (the
        held-out evaluation before training), before any update, with its name."""
        from memopd.contexts import ContractError, check_contract

        cfg = self.cfg
        roles = None if cfg.opd_coef == 0 else ROLES if cfg.teacher_mask == "both" else (cfg.teacher_mask,)
        try:
            check_contract(episodes, cfg.teacher_context if roles is not None else "aligned", teacher_roles=roles,
                           reward=None if cfg.reward == "none" else cfg.reward)
        except ContractError as exc:
            raise ContractError(f"--agent {cfg.agent}: {exc}") from None

    def rollout(self, step: int) -> list[Episode]:
        episodes = self._rollout(step)
        self.check(episodes)
        return episodes

    def _rollout(self, step: int) -> list[Episode]:
        from agents.rollout import rollout

        cfg = self.cfg
        self.backend.policy_version = max(step, 0)  # the batches a stale queue starts with: the initial policy
        first, count = self.questions  # this process's share of the step's questions (all of them alone)
        # every step has its own seeds, so a resumed run replays exactly what it would have done
        seed_step = step if step >= 0 else 1_000_000 + step  # a stale queue's first batches: steps -S..-1
        base = cfg.seed * 1_000_003 + seed_step * cfg.questions_per_step + first
        self.backend.reseed(base)
        self._sync()
        t0 = time.perf_counter()
        try:
            return rollout(self.train_envs, self._agent(False, None), count * cfg.group_size,
                           group_size=cfg.group_size, seed=base, progress=False, run_id=f"step{step}{self.run_tag}",
                           max_calls=self.max_calls, monitor=self.monitor)
        finally:
            self.last_rollout_s = time.perf_counter() - t0
            self._rest()

    def heldout_episodes(self) -> list[Episode]:
        """This rank's share of the held-out evaluation: greedy episodes on the test split (test
        episode g has seed 10_000 + g), checked against the learner's contract."""
        from agents.rollout import rollout

        first, count = distributed.question_share(self.cfg.eval_episodes, self.world)
        self._sync()
        try:
            eps = rollout(self.test_envs, self._agent(True, 0), count, seed=10_000 + first,
                          progress=self.cfg.progress, run_id="eval")
        finally:
            self._rest()
        self.check(eps)
        return eps

    def evaluate(self) -> dict[str, float]:
        from memgym.scoring import aggregate

        eps = self.heldout_episodes()
        mine = [{**e.metrics, "gen_tokens": sum(len(i.response_ids) for i in e.invocations)} for e in eps]
        agg = aggregate([m for part in distributed.gather_objects(mine, self.world) for m in part])
        return {k: float(agg.get(k, 0.0)) for k in ("em", "f1", "sub_em", "gen_tokens")}  # gen_tokens: per episode


# ------------------------------------------------------------------------------------------------
# Advantages and weights
# ------------------------------------------------------------------------------------------------

def trajectory_weights(batch: PackedBatch, episodes: Sequence[Episode]) -> torch.Tensor:
    """[N] per-token weights: each trajectory weighs 1 in all, split equally over its invocations
    and within an invocation equally over its tokens."""
    e, i = batch.token_map[:, 0].tolist(), batch.token_map[:, 1].tolist()
    w = [1.0 / (len(episodes[ei].invocations) * len(episodes[ei].invocations[ii].response_ids))
         for ei, ii in zip(e, i)]
    return torch.tensor(w, dtype=torch.float32)


def episode_rewards(episodes: Sequence[Episode], kind: str) -> torch.Tensor:
    if kind == "none":
        return torch.zeros(len(episodes))
    return torch.tensor([float(e.metrics.get(kind, e.reward)) for e in episodes], dtype=torch.float32)


def grpo_token_advantages(batch: PackedBatch, episodes: Sequence[Episode], rewards: torch.Tensor) -> torch.Tensor:
    adv = losses.group_advantages(rewards, [e.group_id or e.episode_id for e in episodes])
    return adv[batch.token_map[:, 0]]


def gae_token_advantages(batch: PackedBatch, rewards: torch.Tensor, values: torch.Tensor,
                         penalty: torch.Tensor | None, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over each trajectory's action tokens in call order; the reward lands on the last token."""
    adv = torch.zeros_like(values)
    ret = torch.zeros_like(values)
    ep = batch.token_map[:, 0]
    for e in ep.unique().tolist():
        idx = (ep == e).nonzero()[:, 0]  # canonical order: invocation, then token
        r = torch.zeros(len(idx))
        r[-1] = rewards[e]
        if penalty is not None:
            r = r + penalty[idx]
        a, g = losses.gae(r, values[idx], gamma, lam)
        adv[idx], ret[idx] = a, g
    return adv, ret


def role_masks(batch: PackedBatch, episodes: Sequence[Episode]) -> dict[str, torch.Tensor]:
    roles = [episodes[e].invocations[i].role for e, i in batch.token_map[:, :2].tolist()]
    return {r: torch.tensor([x == r for x in roles], dtype=torch.bool) for r in ROLES}


# ------------------------------------------------------------------------------------------------
# The trainer
# ------------------------------------------------------------------------------------------------

class Trainer:
    """One MemOPD run. Construction loads and checks everything (env, student, teacher, env
    options, logging mirrors) before the run directory is touched; :meth:`fit` trains."""

    def __init__(self, cfg: TrainConfig, log=print):
        from agents.models import check_same_vocab, load

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
        _check_env(cfg.env)
        check_mirrors(cfg.tensorboard, cfg.wandb_project)
        self.run_dir = Path(cfg.run_dir)
        self.student, self.tokenizer = load(cfg.model, device=cfg.device)
        cfgmod.prepare_model(self.student, cfg)
        check_env_settings(cfg, self.tokenizer)
        self.teacher = self.teacher_tok = None
        if cfg.opd_coef > 0:
            self.teacher, self.teacher_tok = load(self._teacher_spec(), device=cfg.device)
            check_same_vocab(self.teacher_tok, self.tokenizer)
            self.teacher.eval().requires_grad_(False)
        from agents.presets import TINY_PRESETS

        # a randomly initialised preset learns the output format first; a real model starts as is
        self.fresh_student = cfg.student_warmup_steps > 0 and cfg.model in TINY_PRESETS and not cfg.resume
        self.ref = None
        self.critic = Critic(self.student) if cfg.advantage == "gae" else None
        self.twin = self._go_parallel()  # whole weights for rollouts: the student itself in one process
        self.roller = Roller(cfg, self.twin, self.tokenizer)
        if cfg.prune_opd and cfg.prune_stop and self.teacher is not None:
            self.roller.monitor = self._drift_monitor()
        if self.world.enabled:
            self.roller.questions = distributed.question_share(cfg.questions_per_step, self.world)
            self.roller.run_tag = f"-r{self.world.rank}"
            self.roller.world = self.world
        self.opt = torch.optim.AdamW(self.student.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, cfgmod.lr_lambda(cfg.lr_schedule, cfg.warmup_steps, cfg.steps, cfg.lr_floor))
        self.critic_opt = (torch.optim.AdamW(self.critic.parameters(), lr=cfg.critic_lr)
                           if self.critic is not None else None)
        self.audit = (RCEAuditHook(every=cfg.audit_every, max_episodes=4, lowering=cfg.attn, strict=False,
                                   tolerance=1e-1 if cfg.dtype == "bfloat16" else None)  # autocast: bf16's bound
                      if cfg.audit_every else None)
        self.step = 0
        self.bad_steps = 0
        self.history: dict[str, Any] = {}
        self.stale_queue: list[list[Episode]] = []  # --simulated-staleness: the batches made, oldest first
        self.pool = None  # --async-rollouts: the Ray workers (memopd.async_rollouts.RolloutPool) while training
        self.async_state: dict[str, Any] | None = None  # --async-rollouts: the units used, as checkpointed
        self.step_rows: list[dict[str, Any]] = []  # the metrics rows of self.step, saved with its checkpoint
        self.made_run_dir = False
        self.logger = self._open_run_dir()

    def _drift_monitor(self) -> Any:
        """Prune-OPD's rollout side: both models with whole weights (the rollout's student, and the
        teacher, which is sharded only with --teacher-parallel fsdp, refused with it)."""
        from memopd.prune import DriftMonitor

        cfg = self.cfg
        return DriftMonitor(lambda b: action_states(self.twin, b, lowering=cfg.attn),
                            lambda b: action_states(self.teacher, b, lowering=cfg.attn),
                            k=cfg.prune_topk, threshold=cfg.prune_threshold, patience=cfg.prune_patience,
                            pack_tokens=cfg.pack_tokens, pad_token_id=_pad_id(self.tokenizer), chunk_size=cfg.kl_chunk)

    def _teacher_spec(self) -> str:
        """``--teacher auto`` is built once per machine, by its local rank 0, while the machine's
        other ranks wait for the cache (on the filesystem: a build outlasts any collective timeout)."""
        if self.cfg.teacher == "auto" and self.world.local_rank != 0:
            while not (default_teacher_dir(self.cfg) / "config.json").is_file():
                time.sleep(2.0)
        return ensure_teacher(self.cfg, self.log)

    def _go_parallel(self) -> torch.nn.Module:
        """Under torchrun, shard (FSDP2) or replicate (DDP) the student and the critic; returns the
        model with whole weights that rollouts, evaluations and audits use. Alone: the student."""
        from memopd.heads import output_head

        self.student_fwd, self.critic_fwd, self.head = None, self.critic, None
        self.teacher_fwd = self.teacher_head = None
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

    def _shard_teacher(self) -> None:
        """``--teacher-parallel fsdp``: shard the teacher, once its whole-weight uses are over (the
        held-out evaluation of a fresh run generates with it)."""
        from memopd.heads import output_head

        self.teacher_head = distributed.whole_head(output_head(self.teacher))  # applied after the forward
        self.teacher_fwd = distributed.wrap(distributed.PackedStates(self.teacher),
                                            distributed.decoder_layers(self.teacher), "fsdp", self.cfg.device,
                                            self.world)

    def _teacher_states(self, batch: PackedBatch) -> ActionStates:
        """The teacher's states at a batch's action tokens (no grad). A sharded teacher runs its
        packed forward on every rank at once (one call a step each: FSDP2 gathers layer by layer)."""
        if self.teacher_fwd is None and self.world.enabled and self.cfg.teacher_parallel == "fsdp":
            self._shard_teacher()
        if self.teacher_fwd is None:
            return action_states(self.teacher, batch, lowering=self.cfg.attn).detach()
        hidden = self.teacher_fwd(batch, self.cfg.attn)
        self.teacher_fwd.reshard()  # FSDP2 keeps a root's weights gathered after its forward, for a backward
        return ActionStates(hidden.detach(), self.teacher_head, batch.temperatures.to(hidden.device))

    def _student_states(self, mb: PackedBatch) -> ActionStates:
        """The student's states at a minibatch's action tokens (through the FSDP2/DDP wrapper
        under torchrun, so that gradients are reduced across ranks)."""
        if self.student_fwd is None:
            return action_states(self.student, mb, lowering=self.cfg.attn)
        hidden = self.student_fwd(mb, self.cfg.attn)
        return ActionStates(hidden, self.head, mb.temperatures.to(hidden.device))

    def _open_run_dir(self) -> RunLogger:
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

    # -- state ---------------------------------------------------------------------------------
    def modules(self) -> dict[str, torch.nn.Module]:
        mods = {"student": self.student}
        if self.critic is not None:
            mods["critic"] = self.critic
        if self.ref is not None:
            mods["ref"] = self.ref
        return mods

    def save(self) -> Path:
        """Checkpoint this step, with the metrics rows logged at it: a resume rewrites
        ``metrics.jsonl`` as the rows before this step plus these, so a kill on either side of a
        row's write never duplicates or loses it. Under torchrun every rank writes its shards
        (a Distributed Checkpoint, :func:`memopd.checkpoint.save_sharded`)."""
        common = {"scheduler": self.sched.state_dict(), "bad_steps": self.bad_steps, "history": self.history,
                  "rows": list(self.step_rows), "stale_queue": [[e.to_dict() for e in b] for b in self.stale_queue],
                  "async": self.pool.state() if self.pool is not None else self.async_state}
        if self.world.enabled:
            return checkpoint.save_sharded(self.run_dir, self.step, self.sharded_state(), common, self.world,
                                           keep=self.cfg.keep_checkpoints)
        state = {"optimizer": self.opt.state_dict(),
                 "critic_optimizer": self.critic_opt.state_dict() if self.critic_opt else None,
                 "rng": checkpoint.rng_state(), **common}
        return checkpoint.save(self.run_dir, self.step, self.modules(), state, keep=self.cfg.keep_checkpoints)

    def sharded_state(self) -> distributed.ShardedState:
        """The models and optimizers as Distributed Checkpoint saves and loads them."""
        optimizers = {"optimizer": (self.student, self.opt)}
        if self.critic_opt is not None:
            optimizers["critic_optimizer"] = (self.critic, self.critic_opt)
        return distributed.ShardedState(self.modules(), optimizers)

    def log_row(self, metrics: dict[str, Any], save: bool = False) -> None:
        """Record a metrics row of the current step; with ``save``, checkpoint first (row included)."""
        self.step_rows.append(self.logger.clean_row(self.step, metrics))
        if save:
            self.save()
        self.logger.log(self.step, metrics)

    def restore(self) -> None:
        """Continue from the newest complete checkpoint, written by one process (safetensors) or
        by any number of ranks (sharded), at this run's world size."""
        if self.cfg.ref_beta > 0:
            self.ref = copy.deepcopy(self.twin).requires_grad_(False)
        whole = {k: distributed.FullState(m) if self.world.enabled and k != "ref" else m
                 for k, m in self.modules().items()}
        state, path = checkpoint.load_latest(self.run_dir, whole, self.sharded_state(), self.world.rank)
        if state["format"] == "safetensors":  # one-process layout: whole optimizer state, one RNG state
            for opt, saved in [(self.opt, state["optimizer"]), (self.critic_opt, state.get("critic_optimizer"))]:
                if opt is not None and saved:
                    distributed.load_full_optimizer_state(opt, saved)
            rngs = state.get("rng_ranks") or [state["rng"]]  # gathered by rank 0 in earlier versions
            state["rng"] = rngs[self.world.rank % len(rngs)]
        checkpoint.set_rng_state(state["rng"])
        distributed.sync_twin(self.student, self.twin)
        self.sched.load_state_dict(state["scheduler"])
        self.step, self.bad_steps, self.history = state["step"], state["bad_steps"], state["history"]
        self.stale_queue = [[Episode.from_dict(e) for e in b] for b in state.get("stale_queue", [])]
        self.async_state = state.get("async")
        self.step_rows = list(state.get("rows", []))
        earlier = [r for r in read_metrics(self.run_dir) if r.get("step", -1) < self.step]
        self.logger.rewrite(earlier + self.step_rows)
        self.log(f"resumed from {path} at step {self.step}")
        if self.world.is_main:
            self._record_changes()

    def _record_changes(self) -> None:
        """Settings a resume changed (e.g. more --steps): written to config.toml, with a comment
        line per change, and said in the log."""
        path = self.run_dir / "config.toml"
        saved = cfgmod.load_toml(path)
        now = cfgmod.to_dict(self.cfg)
        changed = {k: (saved.get(k), v) for k, v in now.items()
                   if k not in ("resume", "run_dir") and saved.get(k) != v}
        if not changed:
            return
        what = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in sorted(changed.items()))
        self.log(f"resume changes settings (recorded in {path}): {what}")
        header = cfgmod.toml_header(path) + [f"resumed at step {self.step} on {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                                             f"{what}"]
        cfgmod.save_toml(dataclasses.replace(self.cfg, resume=None), path, header)  # as a fresh start writes it

    # -- one step ------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        if self.pool is not None:
            return self._async_step()
        t0 = time.perf_counter()
        probe = self._depth_probe()
        monitor = self.roller.monitor
        if monitor is not None:
            monitor.reset()
        episodes = self._stale(self.rollout())
        self.last_episodes = episodes
        metrics = self.learn(episodes, rollout_s=time.perf_counter() - t0)
        if monitor is not None:
            metrics.update(self._stop_stats(monitor, episodes))
        if self.cfg.adaptive_depth:
            if probe:
                self.history["depth"] = self._choose_depth(self.last_turn_kl)
            metrics.update({"depth/limit": float(self.roller.max_calls or 0), "depth/probe": float(probe),
                            "depth/cut_episodes": _mean([float(bool(e.meta.get("cut"))) for e in episodes])})
        return metrics

    def _stop_stats(self, monitor: Any, episodes: Sequence[Episode]) -> dict[str, float]:
        """Prune-OPD's rollout stops of this step: episodes stopped, the calls they did not make (the
        env's turns left: a memory call per chunk and the answer), and the rollout time spent
        scoring calls; ``prune/rollout_saved_s`` estimates the time the skipped calls would have
        taken at this rollout's mean time per call."""
        calls = [len(e.invocations) for e in episodes]
        skipped = sum(max(0, int(e.meta.get("turns", c)) - c) for e, c in zip(episodes, calls) if e.meta.get("cut"))
        per_call = self.roller.last_rollout_s / max(1, sum(calls))
        return {"prune/stopped_episodes": _mean([float(bool(e.meta.get("cut"))) for e in episodes]),
                "prune/calls_skipped": float(skipped), "prune/monitor_s": monitor.seconds,
                "prune/rollout_saved_s": skipped * per_call}

    def _async_step(self) -> dict[str, float]:
        """--async-rollouts: train on the workers' next batch, then publish the new weights (the
        workers are stopped once the last batch is taken, so the final evaluation runs alone)."""
        t0 = time.perf_counter()
        episodes, async_metrics = self.pool.take(self.step)
        if self.step + 1 >= self.cfg.steps:
            self.async_state = self.pool.state()
            self.pool.close()
        self.last_episodes = episodes
        metrics = self.learn(episodes, rollout_s=time.perf_counter() - t0)
        self.pool.publish(self.step + 1, self.twin)  # the version of the weights after this step's update
        return {**metrics, **async_metrics}

    def _stale(self, fresh: list[Episode]) -> list[Episode]:
        """--simulated-staleness S: this step's rollouts join a queue and the step trains on the
        batch made S steps before (the queue starts with S batches of the initial policy, so the
        lag grows to S over the first S steps). Off: the rollouts themselves."""
        cfg = self.cfg
        if not cfg.simulated_staleness:
            return fresh
        if not self.stale_queue:  # a fresh start: S earlier batches, as asynchronous workers would hold
            self.stale_queue = [self.roller.rollout(-k) for k in range(cfg.simulated_staleness, 0, -1)]
            if self.world.enabled:
                self.stale_queue = [self._gather(part) for part in self.stale_queue]
        self.stale_queue.append(fresh)
        return self.stale_queue.pop(0)

    def _depth_probe(self) -> bool:
        """--adaptive-depth: whether this step's rollout is a full probe; else the rollouts are cut
        at the depth the last probe chose."""
        if not self.cfg.adaptive_depth:
            return False
        probe = self.step % self.cfg.depth_probe_every == 0 or "depth" not in self.history
        self.roller.max_calls = None if probe else int(self.history["depth"])
        return probe

    def _choose_depth(self, turn_kl: list[tuple[float, float]]) -> int:
        """TurnOPD's depth rule on a probe's per-turn teacher KL (mean over the turn's calls of each
        call's mean KL; turn = call index): roll out up to the last turn whose mean is at least
        ``--depth-kl-frac`` of the largest turn mean, and at least ``--depth-min`` calls."""
        means = [m for m, _ in turn_kl]
        if not means or max(means) <= 0:
            return max(self.cfg.depth_min, len(means))
        keep = [t for t, m in enumerate(means) if m >= self.cfg.depth_kl_frac * max(means)]
        return max(self.cfg.depth_min, keep[-1] + 1)

    def rollout(self) -> list[Episode]:
        """The step's episodes. Under torchrun each rank samples its share of the questions and
        every rank gets all of them, in rank order (group-relative advantages then need nothing
        more, and episode metrics are those of the whole batch)."""
        return self._gather(self.roller.rollout(self.step))

    def _gather(self, mine: list[Episode]) -> list[Episode]:
        """Every rank's episodes, in rank order, on every rank (one process: its own)."""
        if not self.world.enabled:
            return mine
        return [e for part in distributed.gather_objects(mine, self.world) for e in part]

    def learn(self, episodes: Sequence[Episode], rollout_s: float = 0.0) -> dict[str, float]:
        """Advantages, teacher scores and the PPO epochs on a step's episodes (all of them, on every
        rank); returns the step's metrics. Under torchrun a rank packs and scores only its share of
        whole episodes, and the update is the one a single process makes on all of them."""
        cfg = self.cfg
        t0 = time.perf_counter()
        own = self._own_episodes(episodes)
        local = [episodes[i] for i in own]

        # advantages ----------------------------------------------------------------------------
        teacher_roles = ROLES if cfg.teacher_mask == "both" else (cfg.teacher_mask,)
        batch = pack_episodes(local, cfg.pack_tokens, mode="aligned", teacher_roles=teacher_roles,
                              pad_token_id=_pad_id(self.tokenizer))
        all_rewards = episode_rewards(episodes, cfg.reward)
        rewards = all_rewards[own]
        weights = trajectory_weights(batch, local)
        cut = [bool(e.meta.get("cut")) for e in episodes]  # cut by a rollout-depth budget: no reward
        if any(cut):  # their tokens get no PPO, entropy or value terms; they are groups of their own
            weights = weights.masked_fill(torch.tensor([cut[own[e]] for e in batch.token_map[:, 0].tolist()],
                                                       dtype=torch.bool), 0.0)
        penalty = None
        if self.ref is not None and cfg.ref_beta > 0:
            with torch.no_grad():
                ref_lp, _, _ = token_logprobs(action_states(self.ref, batch, lowering=cfg.attn), batch.action_ids)
            penalty = losses.penalised_rewards(rewards, batch.old_logprobs, ref_lp, cfg.ref_beta)
        values = returns = None
        if cfg.advantage == "gae":
            with torch.no_grad():
                values = self.critic_fwd(batch, cfg.attn)
            adv, returns = gae_token_advantages(batch, rewards, values, penalty, cfg.gamma, cfg.lam)
            adv = self._standardise(adv)
        else:
            if penalty is not None:  # spread the trajectory's mean penalty onto its reward
                pen_ep = torch.zeros(len(local)).index_add_(0, batch.token_map[:, 0], penalty * weights)
                all_rewards = all_rewards + distributed.all_sum_tensor(
                    torch.zeros(len(episodes)).index_copy_(0, torch.tensor(own), pen_ep), self.world)
            ep_adv = losses.group_advantages(all_rewards, [f"cut:{e.episode_id}" if c else e.group_id or e.episode_id
                                                           for e, c in zip(episodes, cut)])
            adv = ep_adv[own][batch.token_map[:, 0]]

        # teacher -------------------------------------------------------------------------------
        teacher_states = None
        if self.teacher is not None:
            with torch.no_grad():
                tb = batch if cfg.teacher_context == "aligned" else pack_episodes(
                    # a flattened transcript cannot be split across rows: widen rows to fit it
                    local, fitting_budget(local, "persistent", cfg.pack_tokens), mode="persistent",
                    teacher_roles=teacher_roles, pad_token_id=_pad_id(self.tokenizer))
                teacher_states = self._teacher_states(tb)

        # updates -------------------------------------------------------------------------------
        roles = role_masks(batch, local)
        share = losses.turn_share(cfg.opd_weighting, self._progress(), cfg.opd_turn_start, cfg.opd_turn_end,
                                  cfg.opd_turn_shape)
        opd_w = self._opd_weights(batch, share) if teacher_states is not None else None
        lags = torch.tensor([float(self.step - max((i.policy_version for i in e.invocations), default=self.step))
                             for e in local])  # policy versions between each sample's and the one trained
        stats, token_kl = self._update(batch, adv, weights, teacher_states, values, returns, roles, opd_w, lags)
        if teacher_states is not None and cfg.opd_weighting != "token":
            stats["opd/turn_share"] = share
        if self.world.enabled:  # rollouts, evaluations and audits sample from the updated weights
            distributed.sync_twin(self.student, self.twin)
        learn_s = time.perf_counter() - t0

        n_calls = sum(len(e.invocations) for e in episodes)
        mem_tokens = [len(i.response_ids) for e in episodes for i in e.invocations if i.role == "memory"]
        n_actions, n_real, n_slots = distributed.all_sum(
            [batch.num_actions, batch.num_real_tokens, batch.block_ids.numel()], self.world)
        done = [e for e, c in zip(episodes, cut) if not c]  # outcomes: of the episodes that ran to the answer
        metrics = {
            "reward": float(episode_rewards(done, cfg.reward if cfg.reward != "none" else "f1").mean()) if done
            else float("nan"),
            "f1": _mean([e.metrics.get("f1", 0.0) for e in done]),
            "em": _mean([e.metrics.get("em", 0.0) for e in done]),
            "calls_per_episode": n_calls / max(1, len(episodes)),
            "memory_tokens_per_call": _mean(mem_tokens),
            "action_tokens": int(n_actions),
            "packing_efficiency": 1.0 - (1.0 - n_real / max(1, n_slots)),
            "tokens_per_s": n_real * cfg.ppo_epochs / max(1e-9, learn_s),
            "rollout_s": rollout_s, "step_s": rollout_s + learn_s, "lr": self.sched.get_last_lr()[0],
            **stats,
        }
        self._save_samples(episodes, own, batch, token_kl)
        if cfg.adaptive_depth:
            self.last_turn_kl = self._turn_kl(batch, token_kl)
        return metrics

    def _progress(self) -> float:
        """How far training is, in [0, 1]: the share of --time-budget spent when a budget is set
        (the steps it allows are not known in advance), else of --steps."""
        if self.cfg.time_budget:
            return min(1.0, self.history.get("train_clock", 0.0) / self.cfg.time_budget)
        return self.step / max(1, self.cfg.steps)

    def _turn_kl(self, batch: PackedBatch, token_kl: torch.Tensor) -> list[tuple[float, float]]:
        """(mean, std) over the step's calls of each call's mean teacher KL, per turn (call index),
        over every rank."""
        calls: dict[tuple[int, int], list[float]] = {}
        for (e, j, _), v in zip(batch.token_map.tolist(), token_kl.tolist()):
            if math.isfinite(v):
                calls.setdefault((e, j), []).append(v)
        (turns,) = distributed.all_max([1 + max((j for _, j in calls), default=-1)], self.world)
        sums = [0.0] * (3 * int(turns))
        for (_, j), vals in calls.items():
            m = sum(vals) / len(vals)
            sums[3 * j] += m
            sums[3 * j + 1] += m * m
            sums[3 * j + 2] += 1
        sums = distributed.all_sum(sums, self.world)
        out = []
        for t in range(int(turns)):
            s1, s2, n = sums[3 * t: 3 * t + 3]
            mean = s1 / n if n else 0.0
            out.append((mean, math.sqrt(max(0.0, s2 / n - mean * mean)) if n else 0.0))
        return out

    def _own_episodes(self, episodes: Sequence[Episode]) -> list[int]:
        """Indices of the episodes this rank packs and scores: all of them alone; under torchrun a
        share of whole episodes balanced by real tokens."""
        if not self.world.enabled:
            return list(range(len(episodes)))
        tokens = [distributed.episode_tokens(e) for e in episodes]
        return distributed.assign_episodes(tokens, self.world.size)[self.world.rank]

    def _opd_weights(self, batch: PackedBatch, share: float) -> torch.Tensor:
        """[N] weights of the distillation mean (:func:`memopd.losses.opd_weights`); the token and
        call totals are the whole step's (summed over ranks). At share 0 the teacher mask itself,
        so the token-level loss is computed exactly as it always was."""
        if share == 0.0 or batch.num_actions == 0:
            return batch.teacher.float()
        calls = batch.token_map[:, 0] * (int(batch.token_map[:, 1].max()) + 1) + batch.token_map[:, 1]
        totals = distributed.all_sum(losses.call_counts(calls, batch.teacher), self.world)
        return losses.opd_weights(calls, batch.teacher, share, (totals[0], totals[1]))

    def _standardise(self, adv: torch.Tensor) -> torch.Tensor:
        """GAE advantages to mean 0, std 1 over the whole batch (over every rank's tokens)."""
        if not self.world.enabled:
            return (adv - adv.mean()) / (adv.std() + 1e-6) if len(adv) > 1 else adv
        n, total = distributed.all_sum([len(adv), float(adv.double().sum())], self.world)
        if n <= 1:
            return adv
        mean = total / n
        (sq,) = distributed.all_sum([float(((adv.double() - mean) ** 2).sum())], self.world)
        return ((adv - mean) / (math.sqrt(sq / (n - 1)) + 1e-6)).float()

    def _update(self, batch: PackedBatch, advantages: torch.Tensor, weights: torch.Tensor,
                teacher_states: ActionStates | None, values: torch.Tensor | None, returns: torch.Tensor | None,
                roles: dict[str, torch.Tensor], opd_weights: torch.Tensor | None = None,
                lags: torch.Tensor | None = None) -> tuple[dict[str, float], torch.Tensor]:
        """PPO epochs over minibatches of rows. ``advantages`` is [N] in the batch's action order
        (selected per minibatch by ``action_uid``; the packed batch is not written to). Returns the
        stats and the per-token divergence to the teacher of the first epoch ([N], NaN where the
        teacher does not supervise). ``opd_weights`` [N] weighs the distillation mean (default: the
        teacher mask, every supervised token alike). ``lags`` [E]: each episode's policy-version
        lag (for ``--freshness``).

        Under torchrun the loss is global: each rank's masked means are rescaled from its own
        normalisers (trajectory weights, teacher tokens) to the sums over all ranks, and its loss
        is multiplied by the world size because data-parallel gradients are averaged; one process
        rescales by exactly 1."""
        cfg, world = self.cfg, self.world
        token_kl = torch.full((batch.num_actions,), float("nan"))
        sums: dict[str, list[float]] = {}
        kl_parts: dict[str, list[tuple[float, float]]] = {f"kl/{r}": [] for r in ("all", *ROLES)}
        skipped = 0
        minibatches = self._minibatches(batch)
        # the trainer's log-probs of the sampled tokens before this update: in a pass of their own when
        # PPO needs them as its old log-probs or minibatches would update between them; else from epoch 0
        trainer_lp = self._trainer_logprobs(minibatches, batch.num_actions) \
            if cfg.old_logprobs == "recompute" or len(minibatches) > 1 or cfg.freshness != "off" else None
        old_lp, is_w = self._old_logprobs(batch, trainer_lp)
        fresh_stats: dict[str, float] = {}
        if lags is not None and (cfg.freshness != "off" or cfg.simulated_staleness or cfg.async_rollouts):
            weights, opd_weights, fresh_stats = self._fresh(batch, lags, trainer_lp, weights, opd_weights)
        teacher_logp = self._teacher_logprobs(teacher_states)
        prune_stats: dict[str, float] = {}
        if cfg.prune_opd and teacher_states is not None:
            prune_w, prune_stats = self._prune_weights(batch, minibatches, teacher_states, teacher_logp)
            opd_weights = (opd_weights if opd_weights is not None else batch.teacher.float()) * prune_w
        self.student.train()
        for epoch in range(cfg.ppo_epochs):
            for mb in minibatches:
                uid = mb.action_uid
                w = weights[uid]
                tmask = opd_weights[uid] if opd_weights is not None else mb.teacher.float()
                w_scale, t_scale = self._global_scales(float(w.sum()), float(tmask.sum()))
                s = self._student_states(mb)
                t = teacher_states.select(uid) if teacher_states is not None and teacher_logp is None else None
                logp, ent, div = losses.student_terms(
                    s, mb.action_ids, t, cfg.opd_divergence, cfg.kl_chunk,
                    teacher_logp[uid] if teacher_logp is not None else None)
                if trainer_lp is None:  # one minibatch: epoch 0 is the forward before any update
                    trainer_lp = torch.zeros(batch.num_actions)
                    trainer_lp[uid] = logp.detach().float().cpu()
                pg, pg_stats = (losses.ppo_policy_loss(logp, old_lp[uid], advantages[uid], w, cfg.clip_eps,
                                                       None if is_w is None else is_w[uid])
                                if cfg.reward != "none" else (logp.sum() * 0.0, {"clip_frac": 0.0, "approx_kl": 0.0}))
                pg = pg * w_scale
                entropy = losses.masked_mean(ent, w) * w_scale
                opd = logp.sum() * 0.0
                if div is not None:
                    opd = losses.masked_mean(div, tmask) * t_scale
                    with torch.no_grad():
                        if epoch == 0:  # as the student sampled them (before any update, with one minibatch)
                            token_kl[uid] = torch.where(mb.teacher, div.detach().float(), float("nan"))
                        kl_parts["kl/all"].append(_sum_count(div.detach()[mb.teacher]))
                        for r in ROLES:
                            kl_parts[f"kl/{r}"].append(_sum_count(div.detach()[roles[r][uid] & mb.teacher]))
                loss = losses.actor_loss(pg, entropy, opd, cfg.entropy_coef, cfg.opd_coef)
                vloss = None
                if self.critic is not None:
                    v = self.critic_fwd(mb, cfg.attn)
                    vloss = losses.value_loss(v, values[uid], returns[uid], w) * w_scale
                if self._any_rank(not torch.isfinite(loss) or (vloss is not None and not torch.isfinite(vloss))):
                    skipped += 1
                    self.opt.zero_grad(set_to_none=True)
                    continue
                self.opt.zero_grad(set_to_none=True)
                (loss * world.size).backward()  # data-parallel gradients are averaged over ranks
                gnorm = self._clip(self.student.parameters())
                if not torch.isfinite(gnorm):
                    skipped += 1
                    self.opt.zero_grad(set_to_none=True)
                    continue
                self.opt.step()
                if vloss is not None:
                    self.critic_opt.zero_grad(set_to_none=True)
                    (cfg.vf_coef * vloss * world.size).backward()
                    self._clip(self.critic.parameters())
                    self.critic_opt.step()
                step_stats = {"loss": loss.item(), "pg_loss": pg.item(), "opd_loss": opd.item(),
                              "entropy": entropy.item(), "clip_frac": pg_stats["clip_frac"] * w_scale,
                              "approx_kl": pg_stats["approx_kl"] * w_scale,
                              **({"value_loss": vloss.item()} if vloss is not None else {})}
                totals = distributed.all_sum(list(step_stats.values()), world)  # each rank's part of the global value
                for k, v in {**dict(zip(step_stats, totals)), "grad_norm": float(gnorm)}.items():
                    sums.setdefault(k, []).append(v)
        if sums:  # at least one optimizer step happened
            self.sched.step()
        self.student.eval()
        out = {k: _mean(v) for k, v in sums.items()}
        out.update(distributed.weighted_stats(kl_parts, world))
        out.update(prune_stats)
        out.update(fresh_stats)
        out["skipped_minibatches"] = skipped
        if skipped and not sums:
            out["loss"] = float("nan")
        if trainer_lp is not None:
            out.update(self._mismatch(trainer_lp, batch.old_logprobs, is_w))
        return out, token_kl

    def _fresh(self, batch: PackedBatch, lags: torch.Tensor, trainer_lp: torch.Tensor | None, weights: torch.Tensor,
               opd_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """f-OPD: each episode's version lag, rollout drift (behaviour vs current policy on its
        sampled tokens) and freshness; with ``--freshness weight`` its PPO and distillation terms
        are weighed by it. Stats: means over the step's episodes (every rank)."""
        cfg = self.cfg
        ep = batch.token_map[:, 0]
        stats = [float(lags.sum()), float(len(lags))]
        if trainer_lp is not None:
            drift = losses.episode_drift(trainer_lp, batch.old_logprobs, ep, len(lags))
            fresh = losses.freshness(lags, drift, cfg.fresh_lag_scale, cfg.fresh_drift_scale)
            stats += [float(drift.sum()), float(fresh.sum())]
            if cfg.freshness == "weight":
                weights = weights * fresh[ep]
                opd_weights = (opd_weights if opd_weights is not None else batch.teacher.float()) * fresh[ep]
        totals = distributed.all_sum(stats, self.world)
        n = max(totals[1], 1.0)
        out = {"fresh/lag": totals[0] / n}
        if len(totals) > 2:
            out.update({"fresh/drift": totals[2] / n, "fresh/score": totals[3] / n})
        return weights, opd_weights, out

    @torch.no_grad()
    def _prune_weights(self, batch: PackedBatch, minibatches: Sequence[PackedBatch], teacher_states: ActionStates,
                       teacher_logp: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
        """Prune-OPD (:func:`memopd.losses.drift_weights`): the student's top-k overlap with the
        teacher at every action before the update (a forward pass of its own), each episode's drift
        event, and the weights of the distillation terms after it. Stats over every rank."""
        cfg = self.cfg
        self.student.eval()
        overlap = torch.zeros(batch.num_actions)
        for mb in minibatches:
            uid = mb.action_uid
            t, t_lp = (None, teacher_logp[uid]) if teacher_logp is not None else (teacher_states.select(uid), None)
            overlap[uid] = losses.overlap_from_states(self._student_states(mb), cfg.prune_topk, cfg.kl_chunk, t,
                                                      t_lp).float().cpu()
        weights, events = losses.drift_weights(overlap, batch.token_map, cfg.prune_threshold, cfg.prune_patience,
                                               cfg.prune_decay)
        sup = batch.teacher
        episodes = len(set(batch.token_map[:, 0].tolist()))
        n_sup, ov_sum, n_low, n_ep, n_drift = distributed.all_sum(
            [float(sup.sum()), float(overlap[sup].sum()), float((weights[sup] < 1).sum()), episodes, len(events)],
            self.world)
        return weights, {"prune/overlap": ov_sum / max(n_sup, 1.0), "prune/downweighted_tokens": n_low / max(n_sup, 1.0),
                         "prune/drift_episodes": n_drift / max(n_ep, 1.0)}

    def _teacher_logprobs(self, teacher_states: ActionStates | None) -> torch.Tensor | None:
        """The teacher's [N, V] log-distribution of the step, computed once for every PPO epoch when
        it fits ``--teacher-cache-mb`` (else None: each epoch projects the teacher's states again)."""
        if teacher_states is None or self.cfg.ppo_epochs == 1:
            return None
        vocab = teacher_states.vocab_size or next(teacher_states.head.lm_head.parameters()).shape[0]
        if len(teacher_states) * vocab * 4 > self.cfg.teacher_cache_mb * 2**20:
            return None
        return losses.teacher_logprobs(teacher_states, self.cfg.kl_chunk)

    @torch.no_grad()
    def _trainer_logprobs(self, minibatches: Sequence[PackedBatch], num_actions: int) -> torch.Tensor:
        """[N] log-probs of the sampled tokens under the trainer's own forward of the current
        weights (eval mode), in the batch's action order."""
        self.student.eval()
        out = torch.zeros(num_actions)
        for mb in minibatches:
            lp, _, _ = token_logprobs(self._student_states(mb), mb.action_ids, chunk_size=self.cfg.kl_chunk)
            out[mb.action_uid] = lp.float().cpu()
        return out

    def _old_logprobs(self, batch: PackedBatch, trainer_lp: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """PPO's old log-probs and the per-token importance weights (None: no correction).
        ``recorded``: the rollout engine's, and the ratio itself absorbs the engine/trainer gap.
        ``recompute``: the trainer's, with the truncated weight pi_trainer / pi_rollout."""
        if self.cfg.old_logprobs == "recorded":
            return batch.old_logprobs, None
        is_w = losses.truncated_is_weights(trainer_lp, batch.old_logprobs, self.cfg.tis_cap) \
            if self.cfg.tis_cap > 0 else None
        return trainer_lp, is_w

    def _mismatch(self, trainer_lp: torch.Tensor, rollout_lp: torch.Tensor,
                  is_w: torch.Tensor | None) -> dict[str, float]:
        """Rollout/trainer mismatch of the step: mean and max |log p_trainer - log p_rollout| over
        the sampled tokens (every rank's), and the importance weights' mean and capped share."""
        d = (trainer_lp - rollout_lp.float()).abs()
        n, total = distributed.all_sum([len(d), float(d.double().sum())], self.world)
        (worst,) = distributed.all_max([float(d.max()) if len(d) else 0.0], self.world)
        out = {"mismatch/mean_abs_logp": total / max(1, n), "mismatch/max_abs_logp": worst}
        if is_w is not None:
            capped = float((is_w >= self.cfg.tis_cap).sum())
            w_sum, c_sum = distributed.all_sum([float(is_w.double().sum()), capped], self.world)
            out.update({"mismatch/is_weight_mean": w_sum / max(1, n), "mismatch/is_capped_frac": c_sum / max(1, n)})
        return out

    def _minibatches(self, batch: PackedBatch) -> list[PackedBatch]:
        """``--minibatches`` groups of rows. Under torchrun every rank makes the same number (its
        rows in that many near-equal parts; fewer when a rank has fewer rows), since each
        minibatch is one collective optimizer step."""
        if not self.world.enabled:
            return batch.micro_batches(max(1, math.ceil(batch.num_rows / self.cfg.minibatches)))
        (m,) = distributed.all_min([min(self.cfg.minibatches, batch.num_rows)], self.world)
        size, extra = divmod(batch.num_rows, int(m))
        bounds = [i * size + min(i, extra) for i in range(int(m) + 1)]
        return [batch.select_rows(range(a, b)) for a, b in zip(bounds, bounds[1:])]

    def _global_scales(self, w_sum: float, t_sum: float) -> tuple[float, float]:
        """Factors turning this rank's masked means (over its trajectory weights / teacher tokens)
        into its part of the means over every rank: 1 for one process."""
        g_w, g_t = distributed.all_sum([w_sum, t_sum], self.world)
        return (w_sum / g_w if g_w > 0 else 0.0), (t_sum / g_t if g_t > 0 else 0.0)

    def _any_rank(self, flag: bool) -> bool:
        """A flag raised on any rank (a non-finite loss skips the minibatch everywhere)."""
        return bool(flag) if not self.world.enabled else distributed.all_max([float(bool(flag))], self.world)[0] > 0

    def _clip(self, params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
        """Clip the gradient norm (of the whole gradient, also when it is sharded) to --max-grad-norm."""
        if not self.world.enabled:
            return torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
        return distributed.clip_grad_norm(params, self.cfg.max_grad_norm, self.world)

    def _save_samples(self, episodes: Sequence[Episode], own: Sequence[int], batch: PackedBatch,
                      token_kl: torch.Tensor) -> None:
        """The step's first episodes, each invocation with ``meta["teacher_kl"]`` (one value per
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
            inv.meta["teacher_kl"] = values
            inv.meta["teacher_mode"] = self.cfg.teacher_context
        save_episodes(self.run_dir / "episodes" / f"step-{self.step + 1:06d}.jsonl", episodes[:n])

    # -- the loop ------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to ``cfg.steps`` (from the last checkpoint with ``cfg.resume``); writes the final
        model to ``RUN_DIR/model`` and ``summary.json``. A start that fails before its first
        checkpoint removes the run directory it made."""
        with cfgmod.compute_dtype(self.cfg.dtype, self.cfg.device):  # rollouts, teacher, updates, evals
            try:
                if self.cfg.resume:
                    self.restore()
                else:
                    self._start()
            except BaseException:
                self._discard_failed_start()
                raise
            return self._train_async() if self.cfg.async_rollouts else self._train()

    def _train_async(self) -> dict[str, Any]:
        """--async-rollouts: :meth:`_train` with the Ray workers running; whatever happens, they
        and the Ray instance the run started are shut down."""
        from memopd.async_rollouts import RolloutError, RolloutPool

        if self.step < self.cfg.steps:
            self.pool = RolloutPool(self.cfg, self.twin, self.tokenizer, self.step, self.async_state, log=self.log)
        try:
            return self._train()
        except RolloutError as exc:
            raise TrainingError(f"{exc}; the last checkpoint is intact: continue with --resume {self.run_dir}") from exc
        finally:
            if self.pool is not None:
                self.async_state = self.pool.state()
                self.pool.close()
                self.pool = None

    def _start(self) -> None:
        cfg = self.cfg
        if self.fresh_student:  # on the whole weights; under torchrun rank 0's result goes to every rank
            warm_start_student(self.twin, self.tokenizer, cfg, self.log)
            distributed.publish_twin(self.twin, self.student, self.world)
        if cfg.ref_beta > 0:
            self.ref = copy.deepcopy(self.twin).requires_grad_(False)
        if self.teacher is not None:
            # on hf: a second in-process vLLM engine would tear down the student engine's state when freed
            judge = Roller(dataclasses.replace(cfg, backend="hf"), self.teacher, self.teacher_tok)
            judge.world = self.world
            self.history["eval_teacher"] = judge.evaluate()
            self.log(f"teacher held-out: F1 {self.history['eval_teacher']['f1']:.3f}  "
                     f"EM {self.history['eval_teacher']['em']:.3f}  ({cfg.eval_episodes} test episodes)")
        self.history["eval_before"] = self.roller.evaluate()
        self.log(f"held-out before training: F1 {self.history['eval_before']['f1']:.3f}  "
                 f"EM {self.history['eval_before']['em']:.3f}  ({cfg.eval_episodes} test episodes)")
        self.log_row({f"eval/{k}": v for k, v in self.history["eval_before"].items()}, save=True)

    def _train(self) -> dict[str, Any]:
        cfg = self.cfg
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", unit="step", disable=not cfg.progress)
        clock = time.process_time if cfg.budget_clock == "cpu" else time.perf_counter
        while self.step < cfg.steps:
            t0 = clock()
            metrics = self.train_step()
            self.history["train_clock"] = self.history.get("train_clock", 0.0) + clock() - t0
            (spent,) = distributed.all_max([self.history["train_clock"]], self.world)  # every rank stops alike
            metrics["train_clock_s"] = spent
            out_of_time = bool(cfg.time_budget) and spent >= cfg.time_budget
            self.step += 1
            self.step_rows = []
            if math.isnan(metrics.get("loss", float("nan"))):
                self.bad_steps += 1
                warnings.warn(f"step {self.step}: non-finite loss, update skipped "
                              f"({self.bad_steps}/{cfg.max_bad_steps} in a row)", RuntimeWarning, stacklevel=2)
                if self.bad_steps >= cfg.max_bad_steps:
                    last = checkpoint.list_checkpoints(self.run_dir)
                    raise TrainingError(
                        f"{self.bad_steps} steps in a row had a non-finite loss; stopped at step {self.step}. "
                        f"The last good checkpoint is intact: {last[0] if last else 'none'}. "
                        "Lower --lr or --opd-coef, or check the teacher, then --resume.")
            else:
                self.bad_steps = 0
            evaluated = bool(cfg.eval_every) and self.step % cfg.eval_every == 0 and self.step < cfg.steps
            if evaluated:
                metrics.update({f"eval/{k}": v for k, v in self.roller.evaluate().items()})
            audit = (self.audit(self.step, self.twin, self.last_episodes)
                     if self.audit is not None and self.world.is_main else None)
            if audit is not None:
                metrics["audit/max_abs_diff"] = audit.max_abs_diff
                metrics["audit/passed"] = bool(audit.passed)
            saving = self.bad_steps == 0 and (self.step % cfg.save_every == 0 or out_of_time)
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
        if "eval_after" not in self.history or self.history.get("eval_after_step") != self.step:
            self.history["eval_after"] = self.roller.evaluate()
            self.history["eval_after_step"] = self.step
            self.log_row({f"eval/{k}": v for k, v in self.history["eval_after"].items()}, save=True)
        self._plot()
        self.logger.close()
        before, after = self.history.get("eval_before", {}), self.history["eval_after"]
        self.log(f"held-out F1: before {before.get('f1', float('nan')):.3f} -> after {after['f1']:.3f}  "
                 f"(EM {before.get('em', float('nan')):.3f} -> {after['em']:.3f})")
        self.log(f"run directory: {self.run_dir}  (final model: {self.run_dir / RUN_MODEL_DIR})")
        summary = {"eval_before": before, "eval_after": after, "eval_teacher": self.history.get("eval_teacher"),
                   "steps": self.step}
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
        (under torchrun the whole weights, as the rollouts use them)."""
        from agents.models import save_pretrained

        return save_pretrained(self.run_dir / RUN_MODEL_DIR, self.twin, self.tokenizer)


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


def _sum_count(x: torch.Tensor) -> tuple[float, float]:
    return float(x.double().sum()), float(x.numel())


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


def _check_env(env_id: str) -> None:
    import memgym

    try:
        memgym.resolve_id(env_id)
    except memgym.UnknownEnvError as exc:
        raise cfgmod.ConfigError(str(exc)) from None


def needs_oracle(cfg: TrainConfig) -> bool:
    """Whether the run learns from oracle trajectories: the auto teacher, or the warm start of a
    from-scratch tiny student."""
    from agents.presets import TINY_PRESETS

    warm = cfg.student_warmup_steps > 0 and cfg.model in TINY_PRESETS and not cfg.resume
    return warm or (cfg.teacher == "auto" and cfg.opd_coef > 0)


class OracleDataError(ValueError):
    """The oracle trajectories of the env cannot teach what the run needs (the message says why)."""


def check_env_settings(cfg: TrainConfig, tokenizer: Any, episodes: int = 4) -> None:
    """Play a few episodes of each split of ``--env`` as the run will, before any model work.

    The run counts ``chunk_size`` and ``memory_budget`` in the student's tokens, where a task's
    defaults may be written for words or for another tokenizer; and the auto teacher and the warm
    start learn from oracle trajectories, whose memory keeps whole supporting facts. A setting that
    cannot work here is a :class:`ConfigError` naming the ``--env-kwarg`` value to pass."""
    import gymnasium as gym

    import memgym  # noqa: F401  (registers the envs)
    from agents.oracle import OracleAgent
    from agents.rollout import run_episode
    from memgym.errors import MemgymError
    from memgym.generators.hotpot import DatasetUnavailableError

    oracle = needs_oracle(cfg)
    for split in ("train", "test"):
        try:
            env = gym.make(cfg.env, split=split, **{**cfg.env_kwargs, "tokenizer": tokenizer})
            agent = OracleAgent.for_env(env, tokenizer=tokenizer) if oracle else None
            for seed in range(episodes):
                if agent is not None:
                    _check_facts_fit(env.unwrapped, run_episode(env, agent, seed=seed).sample_id, cfg)
                else:
                    _play_empty(env, seed)
            env.close()
        except DatasetUnavailableError as exc:
            raise ConfigError(f"--env {cfg.env}: {' '.join(str(exc).split())} With memopd.train, pass the files "
                              "as --env-kwarg path=FILE_OR_DIR.") from None
        except OracleDataError as exc:
            raise ConfigError(str(exc)) from None
        except (ValueError, TypeError, KeyError, MemgymError) as exc:
            message = str(exc).split(" was raised from the environment creator")[0]  # not gymnasium's kwargs dump
            if oracle and "supporting_facts" in message:
                message += ("; the auto teacher and the student warm start learn from oracle trajectories: give "
                            "the samples supporting facts as sentences, or pass --teacher SPEC and "
                            "--student-warmup-steps 0")
            raise ConfigError(f"--env {cfg.env} (split {split!r}, env options {cfg.env_kwargs or 'the task defaults'}, "
                              f"sizes in the student's tokens): {message}") from None


def _play_empty(env: Any, seed: int) -> None:
    """Step one episode through with empty actions: every chunk of it is generated."""
    _, info = env.reset(seed=seed)
    while info["phase"] != "done":
        _, _, _, _, info = env.step("")


def _check_facts_fit(env: Any, sample_id: str, cfg: TrainConfig) -> None:
    """The oracle keeps whole supporting facts: one longer than the memory budget leaves it nothing."""
    from agents.oracle import supporting_texts

    sample = env.source[env.source.index_of(sample_id)]
    sizes = [env.counter.count(fact) for fact in supporting_texts(sample)]
    if max(sizes) > env.memory_budget:
        unit = env.counter.unit
        raise OracleDataError(
            f"--env {cfg.env}: memory_budget={env.memory_budget} {unit} cannot hold a supporting fact of "
            f"{max(sizes)} {unit} (in the student's tokenizer), so the oracle trajectories that build the auto teacher "
            f"and warm up the student keep no memory; pass --env-kwarg memory_budget={max(sizes)} or more")


def prepare(cfg: TrainConfig, explicit: set[str] = frozenset()) -> TrainConfig:
    """The run's config, without touching the disk: a new run gets its directory name and the
    student-dependent defaults (saved resolved, so a resume keeps them); a resume reads the saved
    config back, and only the options in ``explicit`` (flags given with ``--resume``, e.g. a larger
    ``--steps``) change it. The :class:`Trainer` writes ``config.toml``."""
    if cfg.resume:
        run_dir = Path(cfg.resume)
        saved = run_dir / "config.toml"
        if not saved.is_file():
            raise ConfigError(f"--resume {run_dir}: no config.toml there; pass the directory of a run started by "
                              "memopd.train (runs/train/<run>)")
        values = cfgmod.load_toml(saved)
        values.update({name: getattr(cfg, name) for name in explicit})
        values.update({"resume": str(run_dir), "run_dir": str(run_dir)})
        return cfgmod.from_dict(TrainConfig, values, source=str(saved))
    if cfg.run_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        cfg = dataclasses.replace(cfg, run_dir=f"runs/train/{cfg.env.replace('/', '_')}-{stamp}")
    return resolve_defaults(cfg)


def _resume_after_restart(cfg: TrainConfig) -> TrainConfig:
    """``torchrun --max-restarts`` starts the ranks again with the same flags: a ``--run-dir`` that
    holds a checkpoint by then is resumed from it."""
    if cfg.resume or not cfg.run_dir or not distributed.restarted():
        return cfg
    return dataclasses.replace(cfg, resume=cfg.run_dir) if checkpoint.list_checkpoints(cfg.run_dir) else cfg


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: bad input prints ``error: ...`` and exits 2; a run stopped by non-finite losses
    exits 1."""
    from agents.models import ModelLoadError

    def _main() -> int:
        cfg, given = cfgmod.parse_known(TrainConfig, argv, "python -m memopd.train", __doc__)
        cfg = _resume_after_restart(cfg)
        if not cfg.resume:
            _check_env(cfg.env)
        cfg = prepare(cfg, given - {"resume", "config"})
        if distributed.launched_size() > 1:  # every rank uses rank 0's run directory (its name holds a time)
            world = distributed.setup(cfg.device, cfg.dist_timeout)
            cfg = dataclasses.replace(cfg, run_dir=distributed.from_rank0(cfg.run_dir, world))
        if distributed.launched_rank() == 0:
            print("config:\n" + cfgmod.dump_toml(cfg), file=sys.stderr)
        try:
            Trainer(cfg, log=lambda m: print(m, file=sys.stderr, flush=True)).fit()
        except TrainingError as exc:
            return fail(str(exc), code=1)
        finally:
            distributed.shutdown()  # under torchrun: leave the process group cleanly
        return 0

    return run_main(_main, errors=(ConfigError, ModelLoadError, checkpoint.CheckpointError, LoggingSetupError,
                                   distributed.DistributedError, ValueError))


if __name__ == "__main__":
    sys.exit(main())
