"""The length positive control and the memory-binds study: their pipelines on a tiny budget (slow),
and docs/RESULTS.md's tables rebuilt from the committed results JSON."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_length_control_smoke_and_rerun(tmp_path):
    lc = load("length_control")
    assert lc.main(["--smoke", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["arms"] == ["before", "after"] and results["lengths"] == [6, 12]
    rows = {(r["arm"], r["agent"], r["chunks"]) for r in results["rows"]}
    assert rows == {(a, "memagent", 6) for a in ("before", "after")} | {
        (a, "rag-memagent", n) for a in ("before", "after") for n in (6, 12)}
    first = json.loads((tmp_path / "teacher-after" / "stage-0-3" / "sft_config.json").read_text())
    last = json.loads((tmp_path / "teacher-after" / "stage-1-6" / "sft_config.json").read_text())
    assert first["model"] == "tiny-teacher-digits" and first["env_kwargs"]["numbering"] == "random"
    assert last["model"] == str(tmp_path / "teacher-after" / "stage-0-3") and last["env_kwargs"]["num_chunks"] == 6
    cached = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert lc.main(["--smoke", "--out", str(tmp_path)]) == 0  # a rerun reuses every evaluation
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == cached
    assert "| before (tiny-teacher, sequential) |" in lc.table(results)


@pytest.mark.slow
def test_memory_binds_smoke(tmp_path):
    mb = load("memory_binds")
    assert mb.main(["--smoke", "--out", str(tmp_path), "--tasks", "MultiValue"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    oracle = {(r["task"], r["budget"]): r["oracle_f1"] for r in results["ladder"]}
    assert oracle[("MultiValue", 16)] == 1.0 and oracle[("MultiValue", 3)] == pytest.approx(2 / 3)  # 1 of 2 facts
    assert oracle[("LongQA", 3)] == 1.0 and oracle[("LongQA", 2)] == 0.0  # one fact of 3 tokens
    assert [(r["task"], r["budget"]) for r in results["teacher"]] == [("MultiValue", 16), ("MultiValue", 3)]
    assert [(r["task"], r["budget"]) for r in results["students"]] == [("MultiValue", 16), ("MultiValue", 3)]
    config = (tmp_path / "MultiValue-3" / "config.toml").read_text()
    assert 'model = "tiny-digits"' in config and "memory_budget = 3" in config
    for part, table in mb.TABLES.items():
        assert table(results[part]).count("\n") >= 2
