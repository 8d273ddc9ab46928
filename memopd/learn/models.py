"""The run's models: the student's defaults (learning rate, divergence), its warm start, the auto
teacher (an SFT teacher built and cached on first use) and the critic of GAE."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from memopd.packing import PackedBatch

# CoreConfig (memopd.learn.options) names the run's core options in the annotations; it is not imported,
# even for type checkers, because options imports this module (an import cycle otherwise).

TINY_LR = 2e-3
"""Default learning rate of a tiny-preset student: it must learn to copy within the default run."""
MODEL_LR = 1e-6
"""Default learning rate of any other (pretrained) student."""

# The auto teacher: sized so that building it fits the embedded default's 15-minute budget on 2 CPU cores.
TEACHER_SFT = {"model": "tiny-teacher", "num_episodes": 1000, "steps": 250, "batch_episodes": 32, "lr": 3e-3}
TEACHER_SEED = 1
"""The auto teacher's SFT seed: fixed, as the cache key (``default_teacher_dir``) leaves the run's seed
out, so that the cached teacher is one model whichever run builds it. It was the building run's
``--seed`` + 1 (1 for a seed-0 run, so those teachers are unchanged): a ``--seed 3`` run that found no
teacher built another one under the same key, and every later run of any seed read that one."""
TEACHER_CHECKPOINT_EVERY = 25
"""The auto teacher's build saves its state this often: a killed first run resumes it (not part of
the cache key: it does not change the teacher)."""


def teacher_recipe(cfg: CoreConfig) -> dict[str, Any]:
    """The auto teacher's SFT settings: :data:`TEACHER_SFT`, with the teacher preset that shares the
    student's tokenizer (``tiny-teacher-digits`` for ``tiny-digits``; else ``tiny-teacher``) and
    ``--teacher-sft-steps`` (its default is the recipe's, so the cache key of a default run is unchanged)."""
    from agents.presets import TEACHER_OF

    return {**TEACHER_SFT, "model": TEACHER_OF.get(cfg.model, TEACHER_SFT["model"]),
            "steps": getattr(cfg, "teacher_sft_steps", TEACHER_SFT["steps"])}


def default_teacher_dir(cfg: CoreConfig) -> Path:
    """Cache location of the auto teacher, keyed by everything that shapes it."""
    from agents.models import cache_dir
    from agents.presets import PRESET_FORMAT

    from memgym.registry import get_task

    # the task folder's files too: an edited custom task must not reuse a teacher of its old version
    task = get_task(cfg.env).fingerprint()
    key = json.dumps({"env": cfg.env, "env_kwargs": cfg.env_kwargs, "task": task, "preset_format": PRESET_FORMAT,
                      **teacher_recipe(cfg)}, sort_keys=True)
    return cache_dir() / "teachers" / hashlib.sha256(key.encode()).hexdigest()[:16]


def ensure_teacher(cfg: CoreConfig, log=print) -> str:
    """Resolve ``--teacher auto``: fine-tune the tiny-teacher preset on oracle trajectories once."""
    if cfg.teacher != "auto":
        return cfg.teacher
    out = default_teacher_dir(cfg)
    if (out / "config.json").is_file():
        log(f"teacher: cached SFT teacher {out}")
        return str(out)
    from memopd.sft import SFTConfig, run as run_sft

    recipe = teacher_recipe(cfg)
    log(f"teacher: none cached for {cfg.env}; building it now: SFT of {recipe['model']} on "
        f"{recipe['num_episodes']} oracle trajectories, {recipe['steps']} steps (cached at {out}; "
        "a killed build resumes where it stopped)")
    sft_cfg = SFTConfig(env=cfg.env, env_kwargs=cfg.env_kwargs, out=str(out), seed=TEACHER_SEED,
                        threads=cfg.threads, checkpoint_every=TEACHER_CHECKPOINT_EVERY, **recipe)
    run_sft(sft_cfg, progress=cfg.progress)
    return str(out)


def warm_start_student(model: torch.nn.Module, tokenizer: Any, cfg: CoreConfig, log=print) -> None:
    """A short SFT on oracle trajectories so a from-scratch tiny student knows the output format."""
    from memopd.sft import SFTConfig, oracle_episodes, train_sft

    log(f"student: warm start, {cfg.student_warmup_steps} SFT steps on oracle trajectories")
    from memopd.learn.mix import env_configs, env_mix, shares

    each = env_configs(cfg)  # a mix: 1,000 episodes split over its envs by weight
    eps = [e for c, n in zip(each, shares(1000, [s.weight for s in env_mix(cfg)]))
           for e in oracle_episodes(c.env, c.env_kwargs, tokenizer, n, seed=cfg.seed + 2, progress=False)]
    sft_cfg = SFTConfig(steps=cfg.student_warmup_steps, batch_episodes=32, lr=3e-3, warmup_steps=10,
                        seed=cfg.seed + 2)
    train_sft(model, eps, sft_cfg, pad_token_id=pad_id(tokenizer), progress=cfg.progress)


def resolve_defaults(cfg: CoreConfig) -> Any:
    """Fill the defaults that depend on the student: ``--lr`` and ``--opd-divergence auto``.

    A tiny preset learns from scratch: it needs a high learning rate, and the forward KL. Until it
    can tell which fact the question asks for, the reverse KL's best answer is the geometric mean of
    the teachers of the contexts it cannot tell apart (near uniform over names), and on LongQA it
    stayed on its copy plateau where the forward KL, like SFT on the teacher, crossed it (measured;
    see docs/training.md). A pretrained student gets MemOPD's reverse KL and a small learning rate."""
    from agents.presets import TINY_PRESETS

    tiny = cfg.model in TINY_PRESETS
    lr = cfg.lr if cfg.lr is not None else (TINY_LR if tiny else MODEL_LR)
    div = cfg.opd_divergence if cfg.opd_divergence != "auto" else ("fkl" if tiny else "rkl")
    return dataclasses.replace(cfg, lr=lr, opd_divergence=div)


KL_CHUNK_BYTES = 32 * 2**20
KL_CHUNK_MAX = 1024


def resolve_memory_defaults(cfg: CoreConfig, student: torch.nn.Module, world_size: int = 1) -> Any:
    """Fill the memory defaults that depend on the student's size (:func:`memopd.runtime.memory_saving`):
    ``--micro-batch-rows`` (1 for a large model in one process; under torchrun every rank would
    need the same number of row groups, so 0) and ``--gradient-checkpointing`` (on for a large
    model that supports it), and ``--kl-chunk`` (the action tokens whose ``[tokens, V]`` float32
    logits fit :data:`KL_CHUNK_BYTES`: a backward through a chunk holds several such tensors, about
    0.2 GiB each at SmolLM2's vocabulary and 1024 tokens). ``prepare_model`` applies the same
    checkpointing default (:func:`memopd.runtime.default_checkpointing`) for ``memopd.sft``."""
    from memopd.runtime import default_checkpointing, memory_saving

    large = memory_saving(student)
    rows = cfg.micro_batch_rows if cfg.micro_batch_rows is not None else (1 if large and world_size == 1 else 0)
    gc = cfg.gradient_checkpointing if cfg.gradient_checkpointing is not None else default_checkpointing(student)
    vocab = student.get_output_embeddings().weight.shape[0]
    chunk = cfg.kl_chunk if cfg.kl_chunk is not None else max(1, min(KL_CHUNK_MAX, KL_CHUNK_BYTES // (4 * vocab)))
    return dataclasses.replace(cfg, micro_batch_rows=rows, gradient_checkpointing=gc, kl_chunk=chunk)


def pad_id(tokenizer: Any) -> int:
    """The id packed rows are padded with (0 when the tokenizer has no pad token)."""
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


__all__ = ["MODEL_LR", "TEACHER_SFT", "TINY_LR", "Critic", "default_teacher_dir", "ensure_teacher", "pad_id",
           "resolve_defaults", "teacher_recipe", "warm_start_student"]
