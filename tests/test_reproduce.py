"""Smoke test of examples/reproduce_memopd.py: the whole pipeline (teacher SFT, warm student, the
four arms, report, plot, state-alignment table) on a tiny budget, one seed. It checks the
pipeline, not the result."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "reproduce_memopd.py"


@pytest.fixture(scope="module")
def reproduce():
    spec = importlib.util.spec_from_file_location("reproduce_memopd", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(reproduce, tmp_path_factory):
    out = tmp_path_factory.mktemp("reproduce")
    assert reproduce.main(["--smoke", "--seeds", "0", "--out", str(out), "--no-progress", "--threads", "1"]) == 0
    return out, json.loads((out / "results-fkl.json").read_text())


@pytest.mark.slow
def test_every_arm_ran_with_the_same_budget(reproduce, smoke):
    out, res = smoke
    assert list(res["table"]) == list(reproduce.ARMS)
    configs = {}
    for arm in reproduce.ARMS:
        run_dir = out / "runs" / "fkl" / arm / "seed-0"
        assert (run_dir / "summary.json").is_file() and (run_dir / "metrics.jsonl").is_file()
        cfg = (run_dir / "config.toml").read_text().splitlines()
        configs[arm] = {line for line in cfg if not line.startswith(("run_dir", "opd_coef", "teacher_context",
                                                                      "reward"))}
        row = res["table"][arm]
        assert 0.0 <= row["f1"][0] <= 1.0 and row["per_seed"] == [row["f1"][0]]
        assert res["curves"][arm]["0"]["step"] == [0, 1, 2]  # before, every step (smoke evaluates each)
    # everything but what defines the arm is identical, and every arm started from the same student
    assert all(c == configs["ppo"] for c in configs.values())
    assert any(line.startswith("model = ") and line.rstrip().endswith('student"') for line in configs["ppo"])
    for arm, overrides in reproduce.ARMS.items():
        text = (out / "runs" / "fkl" / arm / "seed-0" / "config.toml").read_text()
        for key, value in overrides.items():
            assert f"{key} = {json.dumps(value)}" in text


@pytest.mark.slow
def test_report_holds_table_plot_and_alignment(smoke):
    out, res = smoke
    assert (out / "curves-fkl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "results-fkl.md").read_text()
    assert "| ppo+memopd |" in md and "teacher KL(aligned" in md and "torch" in md
    al = res["alignment"]
    turns = al["student"]["turns"]
    assert len(turns["aligned"]) == 7  # 6 memory writes + the answer
    # the sampler re-scoring its own actions: aligned reproduces them, persistent does not after turn 0
    assert max(t["max_gap"] for t in turns["aligned"]) <= 1e-4
    assert all(t["mean_gap"] > 1e-3 for t in turns["persistent"][1:])
    assert abs(al["teacher_shift"][0]["mean_gap"]) <= 1e-5
    # the command is the one this run was given, not the calling process's (a study run inside
    # another script once recorded its caller's flags)
    assert res["command"].startswith("python examples/reproduce_memopd.py --smoke --seeds 0 --out ")


@pytest.mark.slow
def test_rerun_reuses_finished_work(reproduce, smoke, capsys):
    out, res = smoke
    mtime = (out / "runs" / "fkl" / "ppo" / "seed-0" / "summary.json").stat().st_mtime
    assert reproduce.main(["--smoke", "--seeds", "0", "--arms", "ppo", "--out", str(out), "--no-progress"]) == 0
    assert "teacher: reusing" in capsys.readouterr().err
    assert (out / "runs" / "fkl" / "ppo" / "seed-0" / "summary.json").stat().st_mtime == mtime
    rerun = json.loads((out / "results-fkl.json").read_text())
    assert rerun["reused"] == ["teacher", "student", "ppo/seed-0"]
    assert rerun["table"]["ppo"] == res["table"]["ppo"]  # same numbers, read back from the run directory
    assert "reused 3 finished parts" in (out / "results-fkl.md").read_text()


def test_unknown_arm_is_refused(reproduce, capsys):
    with pytest.raises(SystemExit):
        reproduce.main(["--arms", "ppo,sft"])
    assert "unknown arm(s) ['sft']" in capsys.readouterr().err


@pytest.mark.slow
def test_fair_control_smoke(reproduce, tmp_path):
    """--teacher-sft-context both: a teacher fine-tuned on both kinds of state in teacher-both/, its
    runs in runs-fair/, its report in results-fair-*, both teachers' NLL in each context."""
    arms = ["ppo+opd-persist", "ppo+memopd"]
    assert reproduce.main(["--smoke", "--teacher-sft-context", "both", "--seeds", "0", "--arms", ",".join(arms),
                           "--out", str(tmp_path), "--no-progress", "--threads", "1"]) == 0
    assert json.loads((tmp_path / "teacher-both" / "sft_config.json").read_text())["context"] == "both"
    assert json.loads((tmp_path / "teacher" / "sft_config.json").read_text())["context"] == "aligned"
    assert not (tmp_path / "runs").exists()
    for arm in arms:
        run_dir = tmp_path / "runs-fair" / "fkl" / arm / "seed-0"
        assert (run_dir / "summary.json").is_file()
        assert 'teacher-both"' in (run_dir / "config.toml").read_text()
    res = json.loads((tmp_path / "results-fair-fkl.json").read_text())
    assert list(res["table"]) == arms
    assert set(res["teacher_nll"]) == {"teacher (aligned)", "teacher-both (both)"}
    assert all(row["aligned"] > 0 and row["persistent"] > 0 for row in res["teacher_nll"].values())
    assert "| teacher-both (both) |" in (tmp_path / "results-fair-fkl.md").read_text()
    assert (tmp_path / "curves-fair-fkl.png").is_file()
