"""Smoke test of examples/async_fopd.py on a tiny budget, one seed: the shared teacher and warm
student, three of the simulated-staleness configs (sync, S = 2 with and without the freshness
weight) and the report; then (with Ray) the system side, a synchronous and an asynchronous run.
It checks the pipeline, not the result."""

import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import pytest

from memopd.plugins import async_ray as async_rollouts

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "async_fopd.py"


def ray_processes(exclude: set[int]) -> list[str]:
    """Command lines of Ray processes (raylet, GCS, workers) whose pid is not in ``exclude``."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in exclude:
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "ray::" in cmd or "/ray/" in cmd or "raylet" in cmd or "gcs_server" in cmd:
            found.append(cmd[:200])
    return found


@pytest.fixture(scope="module")
def fopd():
    spec = importlib.util.spec_from_file_location("async_fopd", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(fopd, tmp_path_factory):
    out = tmp_path_factory.mktemp("async-fopd")
    assert fopd.main(["--smoke", "--parts", "sim", "--seeds", "0", "--out", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_simulated_configs_share_everything_but_staleness_and_freshness(fopd, smoke):
    out, res = smoke
    assert list(res["sim"]["arms"]) == fopd.SMOKE_SIM_ARMS
    configs = {}
    for arm in fopd.SMOKE_SIM_ARMS:
        staleness, freshness = fopd.SIM_ARMS[arm]
        run_dir = out / "runs" / "sim" / arm / "seed-0"
        assert (run_dir / "summary.json").is_file()
        text = (run_dir / "config.toml").read_text()
        assert f"simulated_staleness = {staleness}\n" in text and f'freshness = "{freshness}"' in text
        assert 'budget_clock = "cpu"' in text and "time_budget = 600.0" in text
        configs[arm] = {line for line in text.splitlines()
                        if not line.startswith(("run_dir", "simulated_staleness", "freshness ="))}
        row = res["sim"]["arms"][arm]
        assert 0.0 <= row["f1"][0] <= 1.0 and row["runs"][0]["episodes"] == row["runs"][0]["steps"] * 4
        assert row["runs"][0]["steps"] == 2
        # the measured lag (0 then 1: the queue starts with S batches of the initial policy); drift and
        # freshness only where the weight computes them
        assert row["lag"][0] == 0.5 if staleness else math.isnan(row["lag"][0])  # sync logs none
        assert (0 < row["score"][0] <= 1) == (freshness == "weight")
    assert all(c == configs["sync"] for c in configs.values())
    assert any(line.startswith("model = ") and line.rstrip().endswith('student"') for line in configs["sync"])


@pytest.mark.slow
def test_report_and_rerun(fopd, smoke, capsys):
    out, res = smoke
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "results.md").read_text()
    assert "| S2+fresh |" in md and "fresh/score" in md and "torch" in md
    mtime = (out / "runs" / "sim" / "sync" / "seed-0" / "summary.json").stat().st_mtime
    assert fopd.main(["--smoke", "--parts", "sim", "--sim-arms", "sync", "--seeds", "0", "--out", str(out)]) == 0
    assert "teacher: reusing" in capsys.readouterr().err
    assert (out / "runs" / "sim" / "sync" / "seed-0" / "summary.json").stat().st_mtime == mtime
    rerun = json.loads((out / "results.json").read_text())
    assert rerun["reused"] == ["teacher", "student", "sim/sync/seed-0"]
    assert rerun["sim"]["arms"]["sync"]["f1"] == res["sim"]["arms"]["sync"]["f1"]


@pytest.mark.slow
@pytest.mark.skipif(not async_rollouts.ray_available(),
                    reason=f"Ray is not installed ({async_rollouts.RAY_HINT})")
def test_async_side_runs_on_ray(fopd, smoke):
    out, _ = smoke
    before = {int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()}
    argv = ["--smoke", "--parts", "async", "--out", str(out)]
    assert fopd.main(argv) == 0
    deadline = time.time() + 10
    while ray_processes(before) and time.time() < deadline:
        time.sleep(0.2)
    assert not ray_processes(before)  # every run shut its Ray instance down
    res = json.loads((out / "results.json").read_text())
    rows = res["async"]["arms"]
    assert math.isnan(rows["sync"]["async_lag_mean"][0]) and rows["sync"]["steps"][0] == 3
    assert rows["async-S2"]["steps"][0] == 3 and 0 <= rows["async-S2"]["async_lag_mean"][0] <= 2
    assert rows["async-S2"]["episodes_per_s"][0] > 0 and rows["async-S2"]["process_wall_s"][0] > 0
    text = (out / "runs" / "async" / "async-S2" / "seed-0" / "config.toml").read_text()
    assert "async_rollouts = true" in text and "max_staleness = 2" in text and 'freshness = "weight"' in text
    assert "| async-S2 |" in (out / "results.md").read_text()


def test_unknown_config_is_refused(fopd, capsys):
    with pytest.raises(SystemExit):
        fopd.main(["--sim-arms", "sync,S3"])
    assert "unknown value(s) ['S3']" in capsys.readouterr().err
