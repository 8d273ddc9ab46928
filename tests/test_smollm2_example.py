"""Smoke test of examples/smollm2_memopd.py: the whole real-model path (teacher SFT, its held-out
F1, the RCE audit, both arms as `memopd.train` processes side by side, export, `memopd.eval
--model <export>`, report) for a couple of steps each. On the tiny presets (SmolLM2 takes minutes
per stage on a CI runner); `--student smollm2` runs the very same commands. It checks the
pipeline, not the result."""

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "smollm2_memopd.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("smollm2_memopd", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(example, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2")
    args = ["--smoke", "--student", "tiny", "--teacher-base", "tiny-teacher", "--out", str(out), "--threads", "1"]
    assert example.main(args) == 0
    return out, args, json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_both_arms_ran_the_same_budget_from_the_untouched_student(example, smoke):
    out, _, res = smoke
    assert list(res["table"]) == list(example.DEFAULT_ARMS)
    configs = {}
    for arm in example.DEFAULT_ARMS:
        run_dir = out / "runs" / arm / "seed-0"
        text = (run_dir / "config.toml").read_text()
        assert 'model = "tiny"' in text and "student_warmup_steps = 0" in text
        configs[arm] = {line for line in text.splitlines()
                        if not line.startswith(("run_dir", "opd_coef", "teacher_context"))}
        assert res["curves"][arm]["step"] == [0, 1, 2]  # before, and every step (smoke evaluates each)
        assert len(list((run_dir / "checkpoints").glob("step-*"))) == 1  # --keep-checkpoints 1
        assert res["table"][arm]["audit_max_abs_diff"] < 1e-4
    assert configs["ppo"] == configs["ppo+memopd"]
    assert "opd_coef = 0.0" in (out / "runs" / "ppo" / "seed-0" / "config.toml").read_text()


@pytest.mark.slow
def test_report_export_and_resume(example, smoke):
    out, args, res = smoke
    assert res["audit"]["aligned"]["passed"] and res["audit"]["persistent"]["max_abs_diff"] > 1e-3
    assert 0.0 <= res["teacher"]["f1"] <= 1.0
    e = res["export"]
    assert (Path(e["path"]) / "config.json").is_file() and e["episodes"] == 2 and 0.0 <= e["f1"] <= 1.0
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "results.md").read_text()
    assert "| ppo+memopd |" in md and "RCE audit" in md and "memopd.eval --model" in md
    assert set(res["timings"]) == {"teacher_sft", "teacher_eval", "audit", "arms", "sft_student", "export_eval"}
    # the SFT-only baseline: the untouched student on as many oracle trajectories as an arm samples
    sft = json.loads((out / "sft-student" / "sft_config.json").read_text())
    b = example.SMOKE
    assert sft["model"] == "tiny" and sft["steps"] == b.steps
    assert sft["num_episodes"] == b.steps * b.questions_per_step * b.group_size
    assert 0.0 <= res["sft_student"]["f1"] <= 1.0 and "SFT-only student" in md
    # a second invocation finds every stage done and only rewrites the report
    t0 = time.perf_counter()
    assert example.main(args) == 0
    assert time.perf_counter() - t0 < 30
    assert json.loads((out / "results.json").read_text())["timings"] == res["timings"]


@pytest.mark.slow
def test_a_second_seed_shares_the_stages_and_the_summary_reads_both(example, smoke):
    """--seed 1 writes results-seed-1.* beside seed 0's, reusing its teacher, audit and export (only
    its arms run); --summarise 0,1 tabulates both from their files."""
    out, args, res = smoke
    assert example.main(args + ["--seed", "1", "--arms", "ppo"]) == 0
    one = json.loads((out / "results-seed-1.json").read_text())
    assert one["seed"] == 1 and list(one["table"]) == ["ppo"] and (out / "curves-seed-1.png").is_file()
    assert one["teacher"] == res["teacher"] and "arms-seed-1" in one["timings"]
    assert "sft_student-seed-1" in one["timings"] and (out / "sft-student-seed-1" / "config.json").is_file()
    assert json.loads((out / "results.json").read_text())["seed"] == 0  # seed 0's report is untouched
    (out / "results-seed-1.json").write_text(json.dumps({**one, "table": res["table"], "curves": res["curves"]}))
    assert example.main(["--out", str(out), "--summarise", "0,1"]) == 0
    summary = json.loads((out / "results-seeds.json").read_text())
    f1 = summary["arms"]["ppo"]["f1_after"]
    assert f1["each"] == [res["table"]["ppo"]["after"]["f1"]] * 2 and f1["sd"] == 0.0
    assert summary["arms"]["sft-only"]["f1_after"]["each"] == [res["sft_student"]["f1"], one["sft_student"]["f1"]]
    assert summary["arms"]["ppo"]["checkpoint_bytes"]["mean"] > 0 and summary["arms"]["ppo"]["peak_rss_mb"]["mean"] > 0
