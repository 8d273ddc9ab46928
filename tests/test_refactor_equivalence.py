"""The comparison of benchmarks/refactor_equivalence.py: a non-timing difference is reported, a
timing difference is not."""

import importlib.util
import json
import sys
from pathlib import Path

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "refactor_equivalence.py"
_spec = importlib.util.spec_from_file_location("refactor_equivalence", _path)
eq = importlib.util.module_from_spec(_spec)
sys.modules.setdefault(_spec.name, eq)  # its dataclasses look their module up
_spec.loader.exec_module(eq)

ROWS = [
    {"step": 0, "eval/f1": 0.25, "eval/em": 0.0},
    {"step": 1, "loss": 1.5, "kl/all": 0.75, "action_tokens": 40, "audit/passed": True, "reward": None,
     "step_s": 2.0, "rollout_s": 1.0, "tokens_per_s": 300.0, "train_clock_s": 2.0, "prune/monitor_s": 0.1},
    {"step": 2, "loss": 1.25, "kl/all": 0.5, "action_tokens": 44, "audit/passed": True, "reward": 0.5,
     "step_s": 2.5, "rollout_s": 1.5, "tokens_per_s": 280.0, "train_clock_s": 4.5, "prune/monitor_s": 0.2},
]


def _copy(rows):
    return json.loads(json.dumps(rows))


def test_identical_rows_are_equal():
    c = eq.compare_rows(ROWS, _copy(ROWS))
    assert c.equal and c.max_abs_diff == 0.0 and c.steps == [0, 1, 2]
    assert c.keys == {"step", "eval/f1", "eval/em", "loss", "kl/all", "action_tokens", "audit/passed", "reward"}
    assert c.timing_keys == {"step_s", "rollout_s", "tokens_per_s", "train_clock_s", "prune/monitor_s"}


def test_a_timing_difference_is_ignored():
    other = _copy(ROWS)
    for r in other[1:]:
        r.update(step_s=r["step_s"] * 3, rollout_s=9.0, tokens_per_s=1.0, train_clock_s=99.0, **{"prune/monitor_s": 5})
    assert eq.compare_rows(ROWS, other).equal


def test_one_non_timing_difference_is_reported():
    other = _copy(ROWS)
    other[2]["kl/all"] = 0.5 + 1e-12  # exact by default: float noise counts
    c = eq.compare_rows(ROWS, other)
    assert not c.equal and c.ndiffs == 1 and "step 2 kl/all" in c.diffs[0]
    assert 0 < c.max_abs_diff < 1e-11
    assert eq.compare_rows(ROWS, other, rtol=1e-9).equal  # within a stated tolerance


def test_missing_keys_rows_and_kinds_are_differences():
    fewer = _copy(ROWS)
    del fewer[1]["step_s"]  # a timing key, but the key sets must match
    assert not eq.compare_rows(ROWS, fewer).equal
    assert not eq.compare_rows(ROWS, _copy(ROWS)[:2]).equal
    flipped = _copy(ROWS)
    flipped[1]["audit/passed"] = False
    assert not eq.compare_rows(ROWS, flipped).equal
    nan = _copy(ROWS)
    nan[1]["reward"] = 0.0  # None (a NaN in the log) against a number
    assert not eq.compare_rows(ROWS, nan).equal
    shifted = _copy(ROWS)
    shifted[2]["step"] = 3
    assert not eq.compare_rows(ROWS, shifted).equal


def test_episode_timing_is_ignored_and_token_ids_are_not(tmp_path):
    inv = {"prompt_ids": [1, 2], "response_ids": [3], "logprobs": [-0.5], "timing": {"start": 1.0, "latency_s": 0.1}}
    for name, timing, resp in [("a", 1.0, 3), ("b", 7.0, 3), ("c", 1.0, 4)]:
        d = tmp_path / name / "episodes"
        d.mkdir(parents=True)
        rec = {"episode_id": "e0", "invocations": [{**inv, "response_ids": [resp], "timing": {"start": timing}}]}
        (d / "step-000001.jsonl").write_text(json.dumps(rec) + "\n")
    assert eq.compare_episodes(tmp_path / "a", tmp_path / "b").equal
    c = eq.compare_episodes(tmp_path / "a", tmp_path / "c")
    assert not c.equal and "response_ids" in c.diffs[0]
