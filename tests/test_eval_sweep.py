"""`memopd.eval --lengths` / `--sweep` / `--compare`: a run per value, one table and one plot."""

from __future__ import annotations

import json

import pytest

from agents.models import load_tokenizer
from agents.records import load_episodes
from memopd.eval import evaluate, main

PNG = b"\x89PNG\r\n\x1a\n"


def test_lengths_sweep_writes_runs_table_and_plot(tmp_path, capsys):
    """The oracle over 2 and 5 chunks, then a model-backed agent over the same lengths compared
    with it: each value's run is an ordinary evaluation; the table's F1 and input lengths are
    recomputed here from the saved episodes (the chunk spans of the oracle's memory calls count
    the same tokens as the env's counter)."""
    oracle, tiny = tmp_path / "oracle", tmp_path / "tiny"
    res = evaluate(["--agent", "oracle", "--episodes", "6", "--lengths", "2,5", "--out", str(oracle), "--no-progress"])
    assert [r["value"] for r in res["rows"]] == [2, 5] and res["key"] == "num_chunks"
    for r in res["rows"]:
        run = oracle / f"num_chunks-{r['value']}"
        summary = json.loads((run / "summary.json").read_text())
        episodes = load_episodes(run / "episodes.jsonl").episodes
        assert summary["env_kwargs"] == {"num_chunks": r["value"]} and len(episodes) == 6
        assert r["f1"] == summary["f1"] == 1.0 and r["f1_se"] == 0.0 and r["calls"] == r["value"] + 1
        chunk_tokens = [sum(i.spans["chunk"][1] - i.spans["chunk"][0] for i in e.invocations if i.role == "memory")
                        for e in episodes[:4]]
        assert r["input_tokens"] == pytest.approx(sum(chunk_tokens) / 4)
    assert res["rows"][1]["input_tokens"] > 2 * res["rows"][0]["input_tokens"]

    res2 = evaluate(["--agent", "memagent", "--model", "tiny", "--episodes", "3", "--lengths", "2,5",
                     "--max-new-tokens", "4", "--answer-max-new-tokens", "2", "--compare", str(oracle),
                     "--out", str(tiny), "--no-progress"])
    assert [r["input_tokens"] for r in res2["rows"]] == pytest.approx([r["input_tokens"] for r in res["rows"]], rel=0.3)
    saved = json.loads((tiny / "sweep.json").read_text())
    assert saved["policy"] == "memagent (tiny)" and [c["policy"] for c in saved["compared"]] == ["oracle"]
    for r in saved["rows"]:
        episodes = load_episodes(tiny / f"num_chunks-{r['value']}" / "episodes.jsonl").episodes
        f1 = [e.metrics["f1"] for e in episodes]
        assert r["f1"] == pytest.approx(sum(f1) / 3) and r["episodes"] == 3 and r["calls_per_s"] > 0
    md = (tiny / "sweep.md").read_text()
    assert "| memagent (tiny) |" in md and "| oracle | 1.000 ± 0.000 | 1.000 ± 0.000 |" in md
    assert (tiny / "sweep.png").read_bytes()[:8] == PNG
    assert "sweep.json" in capsys.readouterr().out


def test_sweep_any_env_option(tmp_path):
    res = evaluate(["--agent", "oracle", "--episodes", "2", "--sweep", "memory_budget=8,32", "--env-kwarg",
                    "num_chunks=2", "--out", str(tmp_path), "--no-progress"])
    assert res["key"] == "memory_budget" and [r["value"] for r in res["rows"]] == [8, 32]
    assert json.loads((tmp_path / "memory_budget-32" / "summary.json").read_text())["env_kwargs"] == \
        {"num_chunks": 2, "memory_budget": 32}


@pytest.mark.parametrize("argv, says", [
    (["--lengths", "3,,6"], "without gaps"),
    (["--lengths", "3,x"], "whole numbers"),
    (["--lengths", "0,3"], "whole numbers"),
    (["--lengths", "3,3"], "repeats"),
    (["--lengths", "3", "--sweep", "memory_budget=8"], "give one"),
    (["--sweep", "memory_budget"], "KEY=V1,V2"),
    (["--lengths", "3", "--env-kwarg", "num_chunks=4"], "both set num_chunks"),
    (["--sweep", "split=train,test"], "sweep an env option"),
    (["--compare", "nowhere"], "give --lengths or --sweep"),
    (["--lengths", "3", "--compare", "nowhere"], "no sweep.json"),
])
def test_bad_sweeps_are_one_error_line_before_any_run(tmp_path, capsys, argv, says):
    out = tmp_path / "out"
    assert main(["--agent", "oracle", "--episodes", "2", "--out", str(out), "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and err.count("\n") == 1
    assert not out.exists()


def test_compare_refuses_a_file_that_is_not_a_sweep(tmp_path, capsys):
    (tmp_path / "sweep.json").write_text("{\"rows\": 3}")
    assert main(["--agent", "oracle", "--episodes", "2", "--lengths", "2", "--compare", str(tmp_path),
                 "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "is not a sweep.json" in capsys.readouterr().err


def test_a_sweep_that_fails_leaves_nothing(tmp_path, capsys):
    """The second value is refused by the env (a chunk too small for a document): the first
    value's finished run is removed with the rest."""
    load_tokenizer("tiny")
    out = tmp_path / "out"
    assert main(["--agent", "oracle", "--episodes", "2", "--sweep", "chunk_size=48,1", "--out", str(out),
                 "--no-progress"]) == 2
    printed = capsys.readouterr()
    assert "saved" in printed.out and printed.err.startswith("error: ")  # the first value ran
    assert not out.exists()


def test_a_sweep_is_not_overwritten_unless_asked(tmp_path, capsys):
    argv = ["--agent", "oracle", "--episodes", "2", "--lengths", "2,3", "--out", str(tmp_path), "--no-progress"]
    evaluate(argv)
    before = (tmp_path / "num_chunks-3" / "episodes.jsonl").read_bytes()
    assert main(argv) == 2 and "already holds" in capsys.readouterr().err
    assert (tmp_path / "num_chunks-3" / "episodes.jsonl").read_bytes() == before
    for name in ("sweep.json", "sweep.md", "sweep.png"):  # a sweep stopped before its table: its runs still count
        (tmp_path / name).unlink()
    assert main(argv) == 2 and "num_chunks-2 already holds" in capsys.readouterr().err
    assert evaluate(argv + ["--overwrite"])["rows"][1]["f1"] == 1.0
