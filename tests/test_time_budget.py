"""``--time-budget``: training stops after the step at which the steps' cumulative time reaches
the budget, checkpoints there, and still evaluates and exports; ``train_clock_s`` is logged."""

from __future__ import annotations

import json

import pytest

from memopd import checkpoint, train

FAST = ["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=2", "--questions-per-step", "2", "--group-size",
        "2", "--max-new-tokens", "6", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "1024", "--threads", "1", "--ppo-epochs", "1",
        "--steps", "50", "--save-every", "20"]


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_training_stops_at_the_time_budget(tmp_path, clock):
    run = tmp_path / "run"
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(run), "--time-budget", "1e-6",
                                                             "--budget-clock", clock], "t", "")
    summary = train.Trainer(train.prepare(cfg), log=lambda m: None).fit()
    assert summary["steps"] == 1  # any step outlasts a microsecond
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train_clock_s" in r] == [1] and rows[1]["train_clock_s"] > 0
    assert checkpoint.list_checkpoints(run)[0].name == "step-000001"  # saved where it stopped
    assert (run / "summary.json").is_file() and (run / "model" / "config.json").is_file()


def test_without_a_budget_every_step_runs(tmp_path):
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST[:-4] + ["--steps", "2", "--run-dir", str(tmp_path / "r")],
                                  "t", "")
    assert train.Trainer(train.prepare(cfg), log=lambda m: None).fit()["steps"] == 2


def test_progressive_weighting_follows_the_time_budget(tmp_path):
    """With a time budget the progressive ramp is a share of the budget spent (the steps it allows
    are not known in advance), else of --steps."""
    def trainer(name, *extra):
        args = FAST[:-4] + ["--steps", "10", "--run-dir", str(tmp_path / name), "--opd-weighting", "progressive"]
        return train.Trainer(train.prepare(train.cfgmod.parse_args(train.TrainConfig, args + list(extra), "t", "")),
                             log=lambda m: None)

    budgeted = trainer("b", "--time-budget", "8")
    budgeted.step, budgeted.state.train_clock = 5, 2.0
    assert budgeted._progress() == 0.25
    budgeted.state.train_clock = 20.0
    assert budgeted._progress() == 1.0
    plain = trainer("p")
    plain.step = 5
    assert plain._progress() == 0.5
