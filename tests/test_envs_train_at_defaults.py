"""Every generated env trains at its defaults, in the student's tokens; a setting that cannot work
for the model is refused before any model work with the --env-kwarg value to pass.

The trainer counts chunk_size and memory_budget in the tiny preset's tokens, which split words
outside LongQA's vocabulary into several tokens: NeedleQA's needle document is 84 tokens, more than
half of its 128-token chunk, which the document planner once refused although gym.make worked."""

import os
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest

import memgym
from agents.models import load_tokenizer
from agents.oracle import supporting_texts
from memgym.chunking import TokenCounter, iter_chunks
from memopd import train

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_TASKS = REPO / "examples" / "tasks"
# small trainer settings; the env settings are the task's own
FAST = ["--steps", "1", "--questions-per-step", "2", "--group-size", "2", "--max-new-tokens", "8",
        "--eval-episodes", "2", "--eval-every", "0", "--teacher", "tiny-teacher", "--no-progress",
        "--pack-tokens", "1024", "--audit-every", "0", "--threads", "1"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


@pytest.fixture
def example_tasks(monkeypatch):
    """memgym/Visits-v0 registered from examples/tasks, as MEMGYM_TASKS=examples/tasks does."""
    monkeypatch.setenv("MEMGYM_TASKS", str(EXAMPLE_TASKS))
    memgym.register_tasks()
    return "memgym/Visits-v0"


def test_needleqa_plans_its_chunks_exactly_in_tiny_tokens(tok):
    env = gym.make("memgym/NeedleQA-v0", tokenizer=tok)
    source, counter = env.unwrapped.source, TokenCounter(tok)
    for i in range(40):
        sample = source[i]
        chunks = list(iter_chunks(sample.documents, env.unwrapped.chunk_size, counter))
        fact = sample.supporting_facts[0]
        assert len(chunks) == 8 and fact["text"] in chunks[fact["chunk"]].text
        assert counter.count(fact["text"]) <= env.unwrapped.memory_budget  # the oracle can keep it


@pytest.mark.parametrize("env_id", ["memgym/LongQA-v0", "memgym/NeedleQA-v0", "custom"])
def test_env_trains_one_step_at_its_defaults(env_id, example_tasks, tmp_path, capsys):
    env_id = example_tasks if env_id == "custom" else env_id
    run = tmp_path / "run"
    # one warm-start step: the warm start plays 1000 oracle episodes of the env, as the auto teacher does
    assert train.main(["--env", env_id, "--student-warmup-steps", "1", "--run-dir", str(run)] + FAST) == 0, \
        capsys.readouterr().err
    rows = [r for r in train.read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1] and rows[0]["action_tokens"] > 0


def test_the_oracle_trajectories_keep_the_facts_at_defaults(tok, example_tasks):
    """What the auto teacher and the warm start learn from: the oracle's memory holds the fact."""
    for env_id in ("memgym/LongQA-v0", "memgym/NeedleQA-v0", example_tasks):
        cfg = train.TrainConfig(env=env_id)
        train.check_env_settings(cfg, tok)
        env = gym.make(env_id, tokenizer=tok)
        sample = env.unwrapped.source[0]
        assert max(env.unwrapped.counter.count(f) for f in supporting_texts(sample)) <= env.unwrapped.memory_budget


@pytest.mark.parametrize("kwargs, says", [
    ({"memory_budget": 32}, "pass --env-kwarg memory_budget=40 or more"),
    ({"chunk_size": 40}, "pass chunk_size=92 or more"),
])
def test_a_setting_that_cannot_work_names_the_value_to_pass(kwargs, says, tmp_path, capsys):
    args = ["--env", "memgym/NeedleQA-v0", "--run-dir", str(tmp_path / "run")] + FAST
    for k, v in kwargs.items():
        args += ["--env-kwarg", f"{k}={v}"]
    assert train.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --env memgym/NeedleQA-v0") and says in err[-1]
    assert not (tmp_path / "run").exists()
    # with the value it names, the check passes
    value = int(says.split("=")[1].split()[0])
    key = next(iter(kwargs))
    train.check_env_settings(train.TrainConfig(env="memgym/NeedleQA-v0", env_kwargs={key: value}),
                             load_tokenizer("tiny"))


def test_memory_budget_check_applies_only_when_the_run_learns_from_the_oracle(tok):
    cfg = train.TrainConfig(env="memgym/NeedleQA-v0", env_kwargs={"memory_budget": 32}, teacher="tiny-teacher",
                            student_warmup_steps=0)
    assert not train.needs_oracle(cfg)
    train.check_env_settings(cfg, tok)  # a model may still compress the needle


def test_hotpotqa_offline_says_to_pass_its_files(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "memopd.train", "--env", "memgym/HotpotQA-v0",
                          "--run-dir", str(tmp_path / "run")] + FAST,
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False)
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --env memgym/HotpotQA-v0") and "--env-kwarg path=" in last
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()
