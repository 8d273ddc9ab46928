"""The calls the distillation benchmarks score: one step of MemAgent episodes of the embedded
default's task (LongQA at its defaults) sampled at temperature 1 by its tiny student after a warm
start, with the embedded default's teacher (``--teacher auto``: tiny-teacher fine-tuned on oracle
trajectories, built and cached on first use)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class OPDCalls:
    student: Any
    tokenizer: Any
    teacher: Any
    teacher_dir: str
    episodes: list
    batch: Any  # the aligned PackedBatch of every episode, one row budget of 4096


def opd_calls(warmup_steps: int = 100, episodes: int = 32, max_new_tokens: int = 24) -> OPDCalls:
    import gymnasium as gym

    import memgym  # noqa: F401
    from agents.backends.base import SamplingParams
    from agents.backends.hf import HFBackend
    from agents.memagent import MemAgent
    from agents.models import load
    from agents.rollout import rollout
    from memopd.learn.models import ensure_teacher, warm_start_student
    from memopd.packing import pack_episodes
    from memopd.train import TrainConfig

    cfg = TrainConfig(student_warmup_steps=warmup_steps, threads=1, progress=False)
    student, tok = load("tiny")
    warm_start_student(student, tok, cfg, log=lambda m: None)
    teacher_dir = ensure_teacher(cfg, log=lambda m: None)
    teacher, _ = load(teacher_dir)
    teacher.eval().requires_grad_(False)
    student.eval()
    envs = [gym.make(cfg.env, split="train", tokenizer=tok) for _ in range(8)]
    agent = MemAgent(backend=HFBackend(student, tok, seed=0),
                     sampling=SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens))
    eps = rollout(envs, agent, episodes, seed=0, progress=False)
    return OPDCalls(student, tok, teacher, teacher_dir, eps, pack_episodes(eps, 4096, mode="aligned"))
