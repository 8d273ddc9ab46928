"""examples/turn_prune_opd.py end to end on a tiny budget: the teacher, the warm student and the
drift teacher are built, every arm of both settings trains under the same CPU-time budget, and the
report (table, curves, plot) is written. It checks the pipeline, not the result."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tpo():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import turn_prune_opd
        yield turn_prune_opd
    finally:
        sys.path.remove(str(ROOT / "examples"))
        sys.modules.pop("turn_prune_opd", None)


def test_reverse_fact(tpo):
    assert tpo.reverse_fact("alice acme .") == "acme alice ."
    assert tpo.reverse_fact("zane works at planetex") == "planetex at works zane"


def test_drift_oracle_switches_format_at_the_turn(tpo):
    from agents.models import load_tokenizer

    tok = load_tokenizer("tiny")
    kw = {"num_chunks": 6, "chunk_size": 24, "memory_budget": 16}
    plain = tpo.oracle_episodes(kw, tok, 8, seed=3)
    drift = tpo.oracle_episodes(kw, tok, 8, seed=3, switch_turn=2)
    changed = 0
    for p, d in zip(plain, drift):
        for ip, idr in zip(p.invocations, d.invocations):
            if ip.role == "answer":
                assert idr.response_text == ip.response_text  # the same answer, read from either memory
            elif ip.turn < 2 or not ip.response_text:
                assert idr.response_text == ip.response_text
            else:
                assert idr.response_text == tpo.reverse_fact(ip.response_text)
                changed += 1
    assert changed > 0


@pytest.mark.slow
def test_smoke(tpo, tmp_path):
    args = ["--smoke", "--out", str(tmp_path), "--seeds", "0", "--jobs", "2"]
    assert tpo.main(args) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res["settings"]) == {"main", "drift"}
    assert list(res["settings"]["main"]["arms"]) == [a for a in tpo.ARMS if a != "prune-opd-strong"]
    assert list(res["settings"]["drift"]["arms"]) == ["vanilla", "prune-opd", "prune-opd-strong"]
    flags = {}
    for setting, res_s in res["settings"].items():
        for arm, row in res_s["arms"].items():
            run = row["runs"][0]
            assert 0.0 <= run["f1_after"] <= 1.0 and run["steps"] >= 1 and run["tokens_trained"] > 0
            assert run["curve"]["clock_s"][0] == 0.0 and run["curve"]["step"][-1] == run["steps"]
            cfg = (tmp_path / "runs" / setting / arm / "seed-0" / "config.toml").read_text()
            assert "time_budget = 1.0" in cfg and 'budget_clock = "cpu"' in cfg and 'reward = "none"' in cfg
            assert ("drift-teacher" in cfg) == (setting == "drift")
            flags[arm] = cfg
    assert "adaptive_depth = true" in flags["turnopd-both"] and 'opd_weighting = "progressive"' in flags["turnopd-both"]
    assert "prune_opd = true" in flags["prune-opd"] and "prune_opd = false" in flags["vanilla"]
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "results.md").read_text()
    assert "| Prune-OPD |" in md and "| TurnOPD, both |" in md and "torch" in md
    # a rerun reuses everything
    assert tpo.main(args) == 0
    again = json.loads((tmp_path / "results.json").read_text())
    assert "teacher" in again["reused"] and "drift/prune-opd/seed-0" in again["reused"]
