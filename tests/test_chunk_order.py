"""examples/chunk_order.py end to end on a tiny budget: both prompt orders build their own teacher
and warm student, train, and are reported (CI's smoke version of docs/RESULTS.md's comparison)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_chunk_order_smoke(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import chunk_order

    assert chunk_order.main(["--smoke", "--out", str(tmp_path), "--seeds", "0", "--jobs", "1"]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res["orders"]) == {"memagent", "memagent-chunk-first"}
    for order, r in res["orders"].items():
        run = r["runs"][0]
        assert 0.0 <= run["f1_after"] <= 1.0 and run["stored_tokens"] > 0
        # each order's records are in its own layout: the chunk-first prompts hold the section first
        eps = (tmp_path / order / "seed-0" / "episodes").glob("*.jsonl")
        assert any(True for _ in eps), f"{order}: the run saved no episodes"
    assert "| the chunk, then the memory |" in (tmp_path / "results.md").read_text()
    del sys.modules["chunk_order"]
