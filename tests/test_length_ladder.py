"""Smoke test of examples/length_ladder.py: a tiny experiment built by reproduce_memopd --smoke (arms
ppo and ppo+memopd, the fair teacher), then a ladder of 3 and 6 chunks on 4 episodes, and a rerun
that reuses every cached evaluation. It checks the pipeline, not the result."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "length_ladder.py"
SEEDS = [0, 1]


@pytest.fixture(scope="module")
def ladder():
    spec = importlib.util.spec_from_file_location("length_ladder", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(ladder, tmp_path_factory):
    exp = tmp_path_factory.mktemp("ladder")
    argv = ["--smoke", "--exp", str(exp), "--seeds", ",".join(map(str, SEEDS)), "--threads", "1", "--no-progress"]
    assert ladder.main(argv) == 0
    out = exp / "length-ladder"
    return exp, out, argv, json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_smoke_writes_tables_plot_and_every_number(ladder, smoke):
    exp, out, _, res = smoke
    assert (exp / "teacher-both" / "config.json").is_file()
    for arm in ("ppo", "ppo+memopd"):
        assert all((exp / "runs-fair" / "fkl" / arm / f"seed-{s}" / "summary.json").is_file() for s in SEEDS)
    assert (out / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res["lengths"] == [3, 6] and res["seeds"] == SEEDS and res["eval_episodes"] == 4
    rows = [row for row, _, _ in ladder.ROWS.values()]
    assert list(res["table"]) == rows
    for row in rows:
        assert set(res["table"][row]) == {"3", "6"}
        for cell in res["table"][row].values():
            assert 0.0 <= cell["f1"][0] <= 1.0 and cell["f1"][1] >= 0.0
            assert len(cell["per_seed"]) == (len(SEEDS) if "student" in row else 1)
    assert set(res["context_tokens"]) == {"3", "6"}
    # the label split: the 6-chunk test episodes number their documents past 6; every episode is
    # counted once, and at the training length every fact's document number is a seen one
    split = res["label_split"]
    assert split["seen"] >= 6 and set(split["by_length"]) == {"3", "6"}
    for cell in split["by_length"].values():
        assert sum(cell[k]["n"] for k in ("seen", "unseen", "unmatched")) == 4
    assert split["by_length"]["6"]["unseen"]["n"] == 0
    assert res["context_tokens"]["6"]["nominal"] == 288 and 0 < res["context_tokens"]["3"]["mean"] <= 144
    # the policies: each student seed, the teacher, RAG with each student and with the teacher
    assert set(res["policies"]) == {f"{k}-seed-{s}" for k in ("memopd", "ppo", "rag-memopd") for s in SEEDS} \
        | {"teacher", "rag-teacher"}
    assert res["policies"]["rag-memopd-seed-1"]["agent"] == "rag-memagent"
    assert "ppo+memopd/seed-1/checkpoints" in res["policies"]["memopd-seed-1"]["weights"]
    assert res["policies"]["rag-teacher"]["weights"].endswith("teacher-both")
    for p in res["policies"].values():
        assert set(p["by_length"]) == {"3", "6"}
        assert all(e["settings"]["env_kwargs"]["memory_budget"] == 16 for e in p["by_length"].values())
    # the teacher shift: both lengths fit; turn 0 has no history, every turn up to the answer is there
    shift = res["teacher_shift"]
    assert set(shift["by_length"]) == {"3", "6"} and shift["max_positions"] > 0
    for n, r in shift["by_length"].items():
        assert r["fits"] and [t["turn"] for t in r["turns"]] == list(range(int(n) + 1))
        assert r["turns"][0]["mean_gap"] < 1e-5 and r["turns"][-1]["mean_gap"] > r["turns"][0]["mean_gap"]
    md = (out / "results.md").read_text()
    assert all(f"| {row} |" in md for row in rows)
    assert "| 3 (144) | 6 (288) |" in md and "teacher KL(aligned ‖ persistent)" in md
    assert "Wall-clock of this invocation" in md and "torch" in md


@pytest.mark.slow
def test_rerun_reuses_every_cached_evaluation(ladder, smoke):
    exp, out, argv, res = smoke
    files = sorted((out / "cache").rglob("*.json"))
    keys = {f"{k}/chunks-{n:04d}.json" for k in res["policies"] for n in (3, 6)}
    assert keys <= {str(f.relative_to(out / "cache")) for f in files}
    assert {f.parent.name for f in files} >= {"context", "shift"}
    stamps = {f: f.stat().st_mtime_ns for f in files}
    assert ladder.main(argv) == 0
    assert {f: f.stat().st_mtime_ns for f in files} == stamps  # nothing evaluated again
    again = json.loads((out / "results.json").read_text())
    assert "smoke experiment" in again["reused"] and len(again["reused"]) == len(files) + 1
    assert again["evaluated_s"] == 0 and again["table"] == res["table"]
    assert "reused" in (out / "results.md").read_text()
