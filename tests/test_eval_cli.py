"""The evaluation CLI: `python -m memopd.eval`."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest

import memgym  # noqa: F401  (registers the envs)
from agents.records import load_episodes
from memopd.config import DEFAULT_THREADS, THREADS_HELP
from memopd.eval import evaluate, format_table, main, parse_args, summarize


def test_oracle_scores_f1_one_on_longqa(tmp_path, capsys):
    summary = evaluate(["--env", "memgym/LongQA-v0", "--agent", "oracle", "--episodes", "20", "--out", str(tmp_path),
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
    summary = evaluate(["--agent", "memagent", "--model", "tiny", "--episodes", "4", "--batch-size", "2",
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
    summary = evaluate(["--agent", agent, "--model", "tiny", "--episodes", "2", "--env-kwarg", "num_chunks=3",
                    "--answer-max-new-tokens", "3", "--out", str(tmp_path), "--no-progress"])
    assert summary["calls"] == 1.0 and summary["memory_tokens"] == 0.0 and summary["n"] == 2


def fails(argv, capsys) -> str:
    """Run the CLI expecting a usage error: exit 2, one ``error:`` line on stderr, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_errors_name_the_choices(tmp_path, capsys):
    out = ["--out", str(tmp_path / "out"), "--no-progress"]
    err = fails(["--env", "memgym/Nope-v0", "--agent", "oracle", *out], capsys)
    assert "unknown env 'memgym/Nope-v0'; available envs: " in err
    assert "--agent memagent needs --model" in fails(["--agent", "memagent", *out], capsys)
    err = fails(["--agent", "oracle", "--episodes", "1", "--env-kwarg", "colour=blue", *out], capsys)
    assert "unknown option(s) ['colour']" in err and "was raised from" not in err and "AddedToken" not in err
    assert "is not KEY=VALUE" in fails(["--agent", "oracle", "--env-kwarg", "num_chunks", *out], capsys)
    assert "--episodes must be >= 1" in fails(["--agent", "oracle", "--episodes", "0", *out], capsys)
    err = fails(["--agent", "gpt", *out], capsys)  # the registered names are listed
    assert "--agent gpt: unknown agent 'gpt'; available agents: fullcontext, memagent, oracle, rag, rag-memagent; or give " \
           "module:Class" in err
    assert not (tmp_path / "out").exists()  # nothing made for a run that never started


@pytest.mark.parametrize("spec, says", [("nope", "unknown model spec 'nope'"),
                                        ("./no/such/model", "model path not found")])
@pytest.mark.parametrize("agent", ["oracle", "memagent"])
def test_bad_model_is_one_error_line(tmp_path, capsys, spec, says, agent):
    err = fails(["--agent", agent, "--model", spec, "--episodes", "1", "--out", str(tmp_path / "o" / "out"),
                 "--no-progress"], capsys)
    assert err.startswith(f"error: --model {spec}: ") and says in err
    assert not (tmp_path / "o").exists()  # the output directory (and the parent it made) are gone


def test_indices_past_the_split(tmp_path, capsys):
    out = tmp_path / "out"
    err = fails(["--agent", "oracle", "--start-index", "999", "--episodes", "3", "--out", str(out), "--no-progress"],
                capsys)
    assert "--start-index 999 with 3 questions needs samples 999..1001" in err and "has 1000 (indices 0..999)" in err
    err = fails(["--agent", "oracle", "--start-index", "-1", "--out", str(out)], capsys)
    assert "--start-index must be >= 0" in err
    assert not out.exists()


def test_read_only_output(tmp_path, capsys, monkeypatch):
    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    err = fails(["--agent", "oracle", "--episodes", "1", "--out", str(tmp_path / "ro"), "--no-progress"], capsys)
    assert f"--out {tmp_path / 'ro'}: " in err and "Read-only file system; choose a writable output directory" in err
    monkeypatch.undo()
    (tmp_path / "file").write_text("x")
    err = fails(["--agent", "oracle", "--episodes", "1", "--out", str(tmp_path / "file"), "--no-progress"], capsys)
    assert "is a file, not a directory" in err and (tmp_path / "file").read_text() == "x"


def test_full_disk_mid_run_leaves_nothing(tmp_path, capsys, monkeypatch):
    import agents.rollout

    def full(*args, out=None, **kwargs):
        Path(out).write_text('{"half": ')
        raise OSError(errno.ENOSPC, "No space left on device", str(out))

    monkeypatch.setattr(agents.rollout, "rollout", full)
    out = tmp_path / "a" / "b"
    err = fails(["--agent", "oracle", "--episodes", "1", "--out", str(out), "--no-progress"], capsys)
    assert "No space left on device; free some disk space" in err
    assert not (tmp_path / "a").exists()
    kept = tmp_path / "kept"  # a directory that was there before keeps existing, without results
    (kept / "notes.txt").parent.mkdir()
    (kept / "notes.txt").write_text("mine")
    fails(["--agent", "oracle", "--episodes", "1", "--out", str(kept), "--no-progress"], capsys)
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]


def test_binary_data_file_is_named(tmp_path, capsys):
    data = tmp_path / "hotpot.json"
    data.write_bytes(bytes(range(256)) * 8)
    err = fails(["--agent", "oracle", "--env", "memgym/HotpotQA-v0", "--env-kwarg", f"path={data}", "--episodes", "1",
                 "--out", str(tmp_path / "out"), "--no-progress"], capsys)
    assert err.startswith("error: memgym/HotpotQA-v0: ") and str(data) in err and "not UTF-8" in err
    assert not (tmp_path / "out").exists()


def test_help_lists_choices_and_defaults_once(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "{fullcontext,memagent,oracle,rag,rag-memagent}" in text and "data split: train or test" in text
    assert "memgym/LongQA-v0" in text.split("--env ENV", 1)[1]  # the env ids are listed
    assert "removes the output it started" in text  # the whole description, not just its first line
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: [])" not in text
    assert "of sampling (default: 0)" in text and "greedy (default: 0.0)" in text  # zero is a default too
    assert text.count("(default: 20)") == 1 and "default: tiny's" in text and text.count("(default:") >= 8
    threads = " ".join(THREADS_HELP.split())
    assert threads in text and not text.split(threads)[1].startswith(" (default")  # THREADS_HELP says its own
    assert parse_args([]).threads == DEFAULT_THREADS
    assert "--progress, --no-progress" in text and parse_args(["--no-progress"]).progress is False


def test_oracle_loads_only_a_tokenizer(tmp_path, capsys, monkeypatch):
    """--agent oracle --model X reads X's tokenizer and never builds or loads a model."""
    from transformers import AutoModelForCausalLM

    from agents.models import load

    preset_dir = Path(load("tiny")[0].name_or_path)  # make sure the preset's cache entry exists
    assert (preset_dir / "config.json").is_file()

    def no_model(*args, **kwargs):
        raise AssertionError("the oracle loaded a model")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_model)
    monkeypatch.setattr(AutoModelForCausalLM, "from_config", no_model)
    run = tmp_path / "run"  # a training run whose student started from tiny, before its final model
    (run / "checkpoints" / "step-000001").mkdir(parents=True)
    (run / "config.toml").write_text('model = "tiny"\nsteps = 2\n')
    for name in ("meta.json", "student.safetensors"):
        (run / "checkpoints" / "step-000001" / name).write_text("{}")
    runs = {}
    for spec in ("tiny", str(preset_dir), None, str(run), str(run / "checkpoints" / "step-000001")):
        out = tmp_path / str(len(runs))
        argv = ["--agent", "oracle", "--episodes", "3", "--env-kwarg", "num_chunks=2", "--out", str(out),
                "--no-progress"] + (["--model", spec] if spec else [])
        assert main(argv) == 0, capsys.readouterr().err
        runs[spec] = [(i.prompt_ids, i.response_ids) for e in load_episodes(out / "episodes.jsonl").episodes
                      for i in e.invocations]
    assert all(r == runs["tiny"] for r in runs.values()) and len(runs) == 5  # the same tokenizer each way


def test_counts_print_as_integers():
    summary = {"em": 1.0, "f1": 1.0, "sub_em": 1.0, "memory_tokens": 12.5, "calls": 4.0, "peak_context": 143.0,
               "generated_tokens": 30.0}
    rows = dict(line.rsplit("  ", 1) for line in format_table(summary, "h").splitlines()[3:])
    assert rows["calls / episode".ljust(26)] == "4" and rows["peak context / episode".ljust(26)] == "143"
    assert rows["memory tokens / write".ljust(26)] == "12.5" and rows["F1".ljust(26)] == "1.000"


def test_module_entry_point(tmp_path):
    res = subprocess.run([sys.executable, "-m", "memopd.eval", "--agent", "oracle", "--episodes", "2",
                          "--env-kwarg", "num_chunks=2", "--out", str(tmp_path / "run"), "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "F1" in res.stdout and (tmp_path / "run" / "summary.json").is_file()
    bad = subprocess.run([sys.executable, "-m", "memopd.eval", "--agent", "oracle", "--model", "nope",
                          "--out", str(tmp_path / "bad")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --model nope: unknown model spec")
    assert "Traceback" not in bad.stderr and not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_smollm2_memagent_through_the_cli(tmp_path, capsys):
    """SmolLM2-135M-Instruct answers LongQA questions for real (a couple of short episodes)."""
    summary = evaluate(["--agent", "memagent", "--model", "smollm2", "--episodes", "2", "--env-kwarg", "num_chunks=2",
                    "--env-kwarg", "fact_style='natural'", "--max-new-tokens", "16", "--answer-max-new-tokens", "8",
                    "--out", str(tmp_path), "--no-progress"])
    assert summary["n"] == 2 and summary["calls"] == 3.0 and summary["model"] == "smollm2"
    episodes = load_episodes(tmp_path / "episodes.jsonl").episodes
    for e in episodes:
        assert set(e.metrics) == {"em", "f1", "sub_em"} and e.prediction.strip()  # a real, scored answer
        assert e.invocations[-1].response_text.strip().startswith(e.prediction[:5])
        assert all(len(i.response_ids) <= 16 for i in e.invocations)
    assert "model=smollm2" in capsys.readouterr().out


def test_an_earlier_evaluation_is_kept_unless_overwrite(tmp_path, capsys):
    """A second evaluation into the same --out is refused with one error line and the first one's
    results are untouched; --overwrite replaces them."""
    out = tmp_path / "out"
    argv = ["--agent", "oracle", "--episodes", "2", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    before = {name: (out / name).read_bytes() for name in ("episodes.jsonl", "summary.json")}
    err = fails(argv[:3] + ["3"] + argv[4:], capsys)
    assert f"--out {out} already holds an evaluation" in err and "--overwrite" in err
    assert {name: (out / name).read_bytes() for name in before} == before
    assert main(argv[:3] + ["3"] + argv[4:] + ["--overwrite"]) == 0
    assert json.loads((out / "summary.json").read_text())["n"] == 3
