"""DAgger's labels (memopd.relabel): each call keeps the student's state and gets the teacher's
greedy action there, checked against the teacher's own forward, one token at a time."""

from __future__ import annotations

import os
import subprocess
import sys

import gymnasium as gym
import pytest
import torch

import memgym  # noqa: F401
from agents.backends.base import SamplingParams
from agents.backends.hf import HFBackend
from agents.memagent import MemAgent
from agents.records import load_episodes
from agents.rollout import rollout
from memopd.relabel import relabel

MAX_NEW = 6


@pytest.fixture(scope="module")
def teacher(cache):
    from agents import models

    return models.load("tiny-teacher", cache_dir=cache)


@pytest.fixture(scope="module")
def student_episodes(tiny):
    model, tokenizer = tiny
    envs = [gym.make("memgym/LongQA-v0", split="test", tokenizer=tokenizer, num_chunks=3) for _ in range(2)]
    agent = MemAgent(HFBackend(model, tokenizer, seed=0), SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW))
    return rollout(envs, agent, 3, seed=5)


def greedy(model, prompt: list[int], eos: int, n: int) -> list[int]:
    """The teacher's greedy continuation by its plain forward on the whole sequence, token by token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt == eos:
                break
    return ids[len(prompt):]


def test_each_call_keeps_the_students_state_and_gets_the_teachers_greedy_action(teacher, student_episodes):
    model, tokenizer = teacher
    got = relabel(student_episodes, HFBackend(model, tokenizer), max_new_tokens=MAX_NEW, name="T")
    assert len(got) == len(student_episodes)
    for before, after in zip(student_episodes, got):
        assert len(after.invocations) == len(before.invocations) and after.reward == before.reward
        for b, a in zip(before.invocations, after.invocations):
            assert (a.prompt_ids, a.prefix_len, a.role, a.turn, a.spans) == (b.prompt_ids, b.prefix_len, b.role,
                                                                             b.turn, b.spans)
            assert a.response_ids == greedy(model, b.prompt_ids, tokenizer.eos_token_id, MAX_NEW)
            assert a.position_ids == b.position_ids[:len(b.prompt_ids)] + list(
                range(len(b.prompt_ids), len(b.prompt_ids) + len(a.response_ids)))
            assert len(a.logprobs) == len(a.response_ids) and a.meta["relabelled_by"] == "T"
        # the state stays the student's: each later call read the memory the student wrote
        for b, nxt in zip(before.invocations, after.invocations[1:]):
            memory = nxt.prompt_ids[slice(*nxt.spans["memory"])]
            assert memory == [t for t in b.response_ids if t != tokenizer.eos_token_id][:len(memory)]
    assert student_episodes[0].invocations[0].meta.get("relabelled_by") is None  # the input is left as it was


def test_the_cli_relabels_and_sft_trains_on_it(tmp_path, cache, student_episodes):
    from agents.records import save_episodes

    src, out = tmp_path / "student.jsonl", tmp_path / "dagger.jsonl"
    save_episodes(src, student_episodes)
    env = {**os.environ, "MEMOPD_CACHE": str(cache)}
    run = subprocess.run([sys.executable, "-m", "memopd.relabel", "--episodes", str(src), "--teacher", "tiny-teacher",
                          "--out", str(out), "--max-new-tokens", str(MAX_NEW), "--threads", "1"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert f"relabelled {sum(len(e.invocations) for e in student_episodes)} calls of 3 episodes" in run.stdout
    eps = load_episodes(out).episodes
    assert all(i.meta["relabelled_by"] == "tiny-teacher" for e in eps for i in e.invocations)
    sft = subprocess.run([sys.executable, "-m", "memopd.sft", "--model", "tiny", "--episodes", str(out), "--steps",
                          "1", "--batch-episodes", "2", "--threads", "1", "--out", str(tmp_path / "student")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert sft.returncode == 0, sft.stderr
    assert (tmp_path / "student" / "config.json").is_file()


@pytest.mark.parametrize("argv, says", [
    (["--episodes", "missing.jsonl", "--teacher", "tiny-teacher", "--out", "x.jsonl"],
     "--episodes missing.jsonl: no such file"),
    (["--episodes", "{src}", "--teacher", "no-such-model", "--out", "x.jsonl"], "no-such-model"),
    (["--episodes", "{src}", "--teacher", "tiny-teacher", "--out", "x.jsonl", "--max-new-tokens", "0"],
     "--max-new-tokens must be at least 1"),
])
def test_bad_input_is_one_error_line(argv, says, tmp_path, cache, student_episodes):
    from agents.records import save_episodes

    src = tmp_path / "student.jsonl"
    save_episodes(src, student_episodes[:1])
    run = subprocess.run([sys.executable, "-m", "memopd.relabel", *[a.format(src=src) for a in argv]],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env={**os.environ, "MEMOPD_CACHE": str(cache)})
    assert run.returncode == 2 and run.stderr.startswith("error: ") and says in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "x.jsonl").exists()
