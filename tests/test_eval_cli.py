"""The evaluation CLI: `python -m memopd.eval`."""

from __future__ import annotations

import json
import subprocess
import sys

import gymnasium as gym
import pytest

import memgym  # noqa: F401  (registers the envs)
from agents.records import load_episodes
from memopd.eval import main, parse_env_kwargs, summarize


def test_oracle_scores_f1_one_on_longqa(tmp_path, capsys):
    summary = main(["--env", "memgym/LongQA-v0", "--agent", "oracle", "--episodes", "20", "--out", str(tmp_path),
                    "--no-progress"])
    printed = capsys.readouterr().out
    assert summary["f1"] == summary["em"] == summary["sub_em"] == 1.0 and summary["n"] == 20
    assert "F1" in printed and "1.000" in printed and str(tmp_path / "episodes.jsonl") in printed
    report = load_episodes(tmp_path / "episodes.jsonl")
    assert report.errors == [] and len(report.episodes) == 20
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["f1"] == 1.0 and saved["agent"] == "oracle" and saved["episodes"] == 20
    # Episodes are the first 20 samples of the test split, one call per chunk + the answer.
    assert sorted(int(e.sample_id.rsplit("-", 1)[1]) for e in report.episodes) == list(range(20))
    num_chunks = gym.make("memgym/LongQA-v0").reset(seed=0)[1]["num_chunks"]
    assert saved["calls"] == num_chunks + 1
    # The table's figures are recomputed independently from the saved episodes.
    peak = [max(len(i.prompt_ids) + len(i.response_ids) for i in e.invocations) for e in report.episodes]
    assert saved["peak_context"] == pytest.approx(sum(peak) / 20)
    assert summarize(report.episodes)["memory_tokens"] == pytest.approx(saved["memory_tokens"])


def test_memagent_tiny_runs_and_scores(tmp_path, capsys):
    summary = main(["--agent", "memagent", "--model", "tiny", "--episodes", "4", "--batch-size", "2",
                    "--env-kwarg", "num_chunks=2", "--max-new-tokens", "16", "--answer-max-new-tokens", "4",
                    "--temperature", "1.0", "--out", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert summary["n"] == 4 and 0.0 <= summary["f1"] <= 1.0 and summary["calls"] == 3.0
    assert summary["generated_tokens"] > 0 and summary["env_kwargs"] == {"num_chunks": 2}
    assert "agent=memagent" in out and "model=tiny" in out
    episodes = load_episodes(tmp_path / "episodes.jsonl").episodes
    assert len(episodes) == 4 and all(len(e.invocations) == 3 for e in episodes)
    assert sum(e.metrics["f1"] for e in episodes) / 4 == pytest.approx(summary["f1"])


@pytest.mark.parametrize("agent", ["fullcontext", "rag"])
def test_baselines_run(tmp_path, agent, capsys):
    summary = main(["--agent", agent, "--model", "tiny", "--episodes", "2", "--env-kwarg", "num_chunks=3",
                    "--answer-max-new-tokens", "3", "--out", str(tmp_path), "--no-progress"])
    assert summary["calls"] == 1.0 and summary["memory_tokens"] == 0.0 and summary["n"] == 2


def test_errors_name_the_choices(tmp_path, capsys):
    with pytest.raises(SystemExit, match=r"unknown env 'memgym/Nope-v0'; available envs: .*memgym/LongQA-v0"):
        main(["--env", "memgym/Nope-v0", "--agent", "oracle"])
    with pytest.raises(SystemExit, match="unknown agent 'gpt'; available agents: fullcontext, memagent, oracle, rag"):
        main(["--agent", "gpt"])
    with pytest.raises(SystemExit, match="--agent memagent needs --model"):
        main(["--agent", "memagent"])
    with pytest.raises(SystemExit, match="unknown option"):
        main(["--agent", "oracle", "--episodes", "1", "--env-kwarg", "colour=blue", "--out", str(tmp_path)])


def test_parse_env_kwargs():
    assert parse_env_kwargs(["num_chunks=8", "fact_order=random", "x=0.5", "flag=True", "t=None", "s='a=b'"]) == {
        "num_chunks": 8, "fact_order": "random", "x": 0.5, "flag": True, "t": None, "s": "a=b"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_env_kwargs(["num_chunks"])


def test_module_entry_point(tmp_path):
    res = subprocess.run([sys.executable, "-m", "memopd.eval", "--agent", "oracle", "--episodes", "2",
                          "--env-kwarg", "num_chunks=2", "--out", str(tmp_path / "run"), "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "F1" in res.stdout and (tmp_path / "run" / "summary.json").is_file()


@pytest.mark.slow
def test_smollm2_memagent_through_the_cli(tmp_path, capsys):
    """SmolLM2-135M-Instruct answers LongQA questions for real (a couple of short episodes)."""
    summary = main(["--agent", "memagent", "--model", "smollm2", "--episodes", "2", "--env-kwarg", "num_chunks=2",
                    "--env-kwarg", "fact_style='natural'", "--max-new-tokens", "16", "--answer-max-new-tokens", "8",
                    "--out", str(tmp_path), "--no-progress"])
    assert summary["n"] == 2 and summary["calls"] == 3.0 and summary["model"] == "smollm2"
    episodes = load_episodes(tmp_path / "episodes.jsonl").episodes
    for e in episodes:
        assert set(e.metrics) == {"em", "f1", "sub_em"} and e.prediction.strip()  # a real, scored answer
        assert e.invocations[-1].response_text.strip().startswith(e.prediction[:5])
        assert all(len(i.response_ids) <= 16 for i in e.invocations)
    assert "model=smollm2" in capsys.readouterr().out
