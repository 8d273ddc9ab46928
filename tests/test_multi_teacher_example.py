"""examples/multi_teacher.py at tiny sizes (--smoke): the five teachers, a routed student arm, the
rows a rerun reads back, and results.json as doctables/multi_teacher.py reads it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_smoke_study_writes_every_cell_and_a_rerun_reads_them_back(tmp_path):
    out = tmp_path / "study"
    cmd = [sys.executable, "examples/multi_teacher.py", "--smoke", "--out", str(out), "--seeds", "0", "--arms",
           "by-task,by-role", "--publish", str(tmp_path / "data" / "multi_teacher" / "results.json")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert [t["teacher"] for t in res["teachers"]] == sorted(["LongQA", "Counting", "both", "memory", "answer"])
    assert {(s["arm"], s["seed"]) for s in res["students"]} == {("by-task", 0), ("by-role", 0)}
    for s in res["students"]:
        assert {"LongQA-v0/f1", "Counting-v0/f1", "f1"} <= set(s["after"])
    config = (out / "students" / "by-role-s0" / "config.toml").read_text()
    assert f'"memory={out}/teachers/memory"' in config and f'"answer={out}/teachers/answer"' in config
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)  # every cell read back
    assert again.returncode == 0 and "warm start" not in again.stderr
    from doctables.core import Data
    from doctables.multi_teacher import students, teachers

    data = Data(tmp_path / "data")
    assert "| by-task |" in students(data) and "| memory |" in teachers(data)
