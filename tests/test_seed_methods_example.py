"""examples/seed_methods.py: the three studies end to end on a smoke budget (every arm a
`memopd.train` process for two steps, the TurnOPD study's own SFT teacher and student, the
reports), the rerun that reuses finished work, and the report's arithmetic by hand."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "seed_methods.py"


def _module():
    spec = importlib.util.spec_from_file_location("seed_methods", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["seed_methods"] = mod  # its dataclasses resolve their annotations through it
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop("seed_methods", None)
    return mod


def test_auc_is_the_mean_f1_over_the_horizon_by_hand():
    auc = _module().auc
    curve = {"seconds": [0.0, 10.0, 30.0], "f1": [0.0, 0.5, 1.0]}
    # trapezoids: 10 * 0.25 + 20 * 0.75 = 17.5, then 1.0 held for 10 s: 27.5 / 40
    assert auc(curve, 40.0, "seconds") == pytest.approx(27.5 / 40)
    # cut at 20 s: 2.5 + 10 * (0.5 + 0.75) / 2 = 8.75 over 20
    assert auc(curve, 20.0, "seconds") == pytest.approx(8.75 / 20)


def test_the_studies_run_end_to_end_and_resume(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("MEMOPD_CACHE", str(cache))
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path), "--seeds", "0", "--jobs", "2",
           "--teacher", "tiny-teacher", "--study", "turnopd,turnopd-own,pruneopd,fopd,fopd-sampled"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    names = ("turnopd", "turnopd-own", "pruneopd", "fopd", "fopd-sampled")
    res = {name: json.loads((tmp_path / name / "results.json").read_text()) for name in names}
    assert list(res["turnopd"]["table"]) == ["full", "cut-4", "turnopd"]
    assert list(res["pruneopd"]["table"]) == ["vanilla", "oracle-drop", "prune-opd"]
    assert list(res["fopd"]["table"]) == ["sync", "stale-4", "stale-8", "stale-16", "fopd-4", "fopd-8", "fopd-16"]
    assert list(res["fopd-sampled"]["table"]) == list(res["fopd"]["table"])
    method = {name: {arm: t["method"] for arm, t in r["table"].items()} for name, r in res.items()}
    assert "depth/kl/0" in method["turnopd"]["turnopd"] and method["turnopd"]["full"] == {}
    oracle = method["pruneopd"]["oracle-drop"]
    assert 0.0 <= oracle["oracle/lost_fact"] <= 1.0
    assert (oracle["oracle/dropped_tokens"] > 0) == (oracle["oracle/lost_fact"] > 0)
    assert "prune/window" in method["pruneopd"]["prune-opd"]
    assert "fresh/sup_drift" in method["fopd"]["fopd-16"] and "fresh/weight" not in method["fopd"]["stale-16"]
    cfg = (tmp_path / "turnopd-own" / "runs" / "turnopd" / "seed-0" / "config.toml").read_text()
    assert 'opd_weighting = "progressive"' in cfg and "depth_coverage = 0.0" in cfg and "fact_window = 3" in cfg
    assert str((tmp_path / "turnopd-own" / "teacher").resolve()) in cfg  # its own SFT teacher
    cfg = (tmp_path / "fopd-sampled" / "runs" / "fopd-16" / "seed-0" / "config.toml").read_text()
    assert 'opd_estimator = "sampled"' in cfg and "simulated_staleness = 16" in cfg and 'freshness = "weight"' in cfg
    for name in res:
        assert (tmp_path / name / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = subprocess.run(cmd, check=True, capture_output=True, text=True)  # finished runs are reused
    assert "memopd.train" not in again.stderr and "memopd.sft" not in again.stderr
