"""The example agent of "Bring your own agent": examples/notes_agent.py (NotesAgent, NotesOracle) on
the example task folder examples/tasks/Visits. Its records are exact (the memory a call receives is
its earlier notes, token for token), pass the RCE audit and the recorded-vs-rescored check in both
context modes, it trains through the CLI, and the guide's commands (docs/extend.md) run as written."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest

import memgym
from agents import HFBackend, SamplingParams, load_model
from agents.policy import strip_stop
from agents.records import load_episodes
from agents.rollout import rollout
from memopd import train
from memopd.alignment import state_alignment
from memopd.audit import rce_audit
from memopd.contexts import check_contract

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # examples.notes_agent, as `python -m` finds it from the repository root
from examples.notes_agent import SEPARATOR, NotesAgent, NotesOracle

ENV = "memgym/Visits-v0"


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.fixture(scope="module", autouse=True)
def example_tasks():
    """memgym/Visits-v0 from examples/tasks, as MEMGYM_TASKS=examples/tasks registers it."""
    memgym.register_tasks([REPO / "examples" / "tasks"])


@pytest.fixture(scope="module")
def episodes(tiny):
    model, tok = tiny
    envs = [gym.make(ENV, tokenizer=tok) for _ in range(4)]
    agent = NotesAgent(HFBackend(model, tok, seed=0), SamplingParams(temperature=1.0, max_new_tokens=16))
    return rollout(envs, agent, 8, group_size=2, seed=0, progress=False)


def test_each_call_receives_its_earlier_notes_exactly(episodes, tiny):
    _, tok = tiny
    sep = tok(SEPARATOR, add_special_tokens=False)["input_ids"]
    for ep in episodes:
        assert ep.agent == "notes"
        notes: list[list[int]] = []
        for inv in ep.invocations:
            start, end = inv.spans["memory"]
            expected = [t for i, n in enumerate(notes) for t in (sep if i else []) + n]
            assert inv.prompt_ids[start:end] == expected  # appended, never re-encoded or rewritten
            assert "<notes>" in tok.decode(inv.prompt_ids[inv.prefix_len:start])
            if inv.role == "memory":
                note = strip_stop(inv)
                assert len(note) <= 8  # note_tokens
                if note:
                    notes.append(note)
        assert len(expected) <= 24  # the notes never outgrow the task's memory budget


def test_a_full_memory_skips_the_call(tiny):
    model, tok = tiny
    env = gym.make(ENV, tokenizer=tok, memory_budget=8)
    agent = NotesAgent(HFBackend(model, tok, seed=1), SamplingParams(temperature=1.0, max_new_tokens=16))
    eps = rollout([env], agent, 6, seed=3, progress=False)
    for ep in eps:
        memory_calls = [inv for inv in ep.invocations if inv.role == "memory"]
        assert all(len(inv.response_ids) <= 8 for inv in memory_calls)
        assert len(memory_calls) <= ep.meta["num_chunks"]
    assert any(len([i for i in ep.invocations if i.role == "memory"]) < ep.meta["num_chunks"] for ep in eps)


def test_records_pass_the_rce_audit_and_the_rescoring_check_in_both_modes(episodes, tiny):
    model, _ = tiny
    for mode in ("aligned", "persistent"):
        check_contract(episodes, mode, teacher_roles=("memory", "answer"), reward="f1")
    audit = rce_audit(model, episodes, modes=("aligned", "persistent"))
    assert audit["aligned"].passed and audit["aligned"].max_abs_diff < 1e-4
    assert audit["persistent"].max_abs_diff > 1e-2  # the flattened history is another state, as it should be
    report = state_alignment(model, episodes)
    assert report.aligned_ok and report.max_gap("aligned") < 1e-4
    assert report.max_gap("persistent") > 1e-2


def test_the_oracle_writes_gold_notes_in_the_notes_layout(tiny):
    _, tok = tiny
    env = gym.make(ENV, tokenizer=tok, split="test")
    eps = rollout([env], NotesOracle(tokenizer=tok, samples=env.unwrapped.source), 8, seed=0, progress=False)
    for ep in eps:
        assert ep.reward == 1.0 and ep.agent == "notes-oracle"
        answer = ep.invocations[-1]
        memory = tok.decode(answer.prompt_ids[slice(*answer.spans["memory"])])
        sample = env.unwrapped.source[env.unwrapped.source.index_of(ep.sample_id)]
        assert memory.strip() == sample.supporting_facts[0]["text"] and ep.answers[0] in memory
        assert sum(1 for inv in ep.invocations if strip_stop(inv)) == 2  # one note with the fact, the answer
    check_contract(eps, "persistent")


def test_notes_agent_trains_two_steps_through_the_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    run = tmp_path / "run"
    argv = ["--env", ENV, "--agent", "examples.notes_agent:NotesAgent", "--steps", "2", "--questions-per-step",
            "2", "--group-size", "2", "--max-new-tokens", "8", "--eval-episodes", "2", "--eval-every", "0",
            "--student-warmup-steps", "0", "--teacher", "tiny-teacher", "--audit-every", "2", "--save-every", "2",
            "--no-progress", "--pack-tokens", "1024", "--threads", "1", "--run-dir", str(run)]
    assert train.main(argv) == 0, capsys.readouterr().err
    rows = [r for r in train.read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["audit/passed"] is True and rows[1]["audit/max_abs_diff"] < 1e-4
    saved = load_episodes(run / "episodes" / "step-000002.jsonl").episodes
    assert saved and all(ep.agent == "notes" for ep in saved)
    model, _ = load_model(str(run))
    assert rce_audit(model, saved)["aligned"].passed  # the saved records replay exactly on the trained student


def readme_commands() -> tuple[dict[str, str], list[str]]:
    """The environment and commands of the notes-agent example (docs/extend.md, "Bring your own agent")."""
    text = (REPO / "docs" / "extend.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- memopd:byo-agent -->\s*```bash\n(.*?)```", text, re.DOTALL)
    assert match, "docs/extend.md must hold the notes-agent commands in a ```bash block after <!-- memopd:byo-agent -->"
    env, commands = {}, []
    for line in match.group(1).splitlines():
        line = line.split("  #")[0].strip()
        if line.startswith("export "):
            key, value = line[len("export "):].split("=", 1)
            env[key] = value
        elif line:
            commands.append(line)
    return env, commands


# fewer episodes and steps than the guide's; a later flag overrides an earlier one
FASTER = {"memopd.eval": ["--episodes", "24"], "memopd.sft": ["--steps", "2"],
          "memopd.train": ["--steps", "2", "--questions-per-step", "2", "--group-size", "2", "--max-new-tokens", "8",
                           "--eval-episodes", "2", "--eval-every", "0", "--audit-every", "2"],
          "memopd.view": []}


def test_readme_names_the_example_and_its_three_commands():
    env, commands = readme_commands()
    assert env == {"MEMGYM_TASKS": "examples/tasks"}
    modules = [shlex.split(c)[2] for c in commands]
    assert modules[-3:] == ["memopd.train", "memopd.eval", "memopd.view"]
    assert all(c.startswith("python -m ") for c in commands)
    assert any("examples.notes_agent:NotesAgent" in c for c in commands)


@pytest.mark.slow
def test_readme_commands_run_as_written(tmp_path):
    env, commands = readme_commands()
    env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    for command in commands:
        args = shlex.split(command.replace("runs/notes", str(tmp_path / "notes")))
        module = args[2]
        out = subprocess.run([sys.executable, *args[1:], *FASTER[module], "--threads", "1"] if module != "memopd.view"
                             else [sys.executable, *args[1:]], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=600, check=False)
        assert out.returncode == 0, f"{command}\n{out.stderr[-3000:]}"
    summary = (tmp_path / "notes" / "eval" / "summary.json")
    assert summary.is_file() and (tmp_path / "notes" / "eval" / "report.html").stat().st_size > 1000
    assert (tmp_path / "notes" / "train" / "model").is_dir()
