"""Smoke test of examples/other_tokenizer.py: the other-tokenizer teacher's SFT, the five arms as
`memopd.train` processes, the report, for a couple of steps each (the path, not the result)."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "other_tokenizer.py"


def test_the_study_runs_end_to_end_and_resumes(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("MEMOPD_CACHE", str(cache))
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path), "--seeds", "0", "--threads", "1"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    res = json.loads((tmp_path / "results.json").read_text())
    assert list(res["table"]) == ["same-full", "same-sampled-fkl", "other-sampled-fkl", "same-topk", "other-topk"]
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cfg = (tmp_path / "runs" / "other-sampled-fkl" / "seed-0" / "config.toml").read_text()
    assert 'opd_divergence = "fkl"' in cfg and 'opd_estimator = "sampled"' in cfg and "ppo_epochs = 1" in cfg
    other, same = res["runs"]["other-sampled-fkl"]["0"], res["runs"]["same-sampled-fkl"]["0"]
    assert other["tokens_per_action"] > 1.0 and other["chunks_per_action"] < 1.0  # the teacher's tokens differ
    assert same["tokens_per_action"] == 1.0 and same["chunks_per_action"] == 1.0
    cfg = (tmp_path / "runs" / "other-topk" / "seed-0" / "config.toml").read_text()
    assert 'opd_estimator = "topk"' in cfg and "opd_topk = 20" in cfg
    assert 0.5 < res["runs"]["other-topk"]["0"]["supervised_share"] < 1.0
    assert res["runs"]["same-topk"]["0"]["supervised_share"] == 1.0
    assert all(len(r["0"]["curve"]["f1"]) >= 2 for r in res["runs"].values())
    again = subprocess.run(cmd, check=True, capture_output=True, text=True)  # finished runs are reused
    assert "memopd.train" not in again.stderr and "memopd.sft" not in again.stderr
