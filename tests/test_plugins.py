"""Learner plugins (``--plugin module:Class``): the example plugin trains, its weights act on the
loss as the equivalent built-in option does, its state survives a resume, and bad specs are one
``error:`` line."""

from __future__ import annotations

import pytest

from memopd import train
from memopd.learn.plugin import LossWeights, Plugin
from memopd.runlog import read_metrics

FAST = ["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=3", "--questions-per-step", "2", "--group-size",
        "2", "--max-new-tokens", "8", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "1024", "--threads", "1", "--ppo-epochs", "1",
        "--audit-every", "0", "--sample-episodes", "0"]
PLUGIN = ["--plugin", "examples.answer_weight:AnswerWeight"]


def _trainer(run_dir, *extra):
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(run_dir)] + list(extra), "t", "")
    return train.Trainer(train.prepare(cfg), log=lambda m: None)


def test_answer_weight_zero_is_the_memory_only_teacher_mask(tmp_path):
    """An independent reference: --teacher-mask memory leaves the answer tokens out of the
    distillation mean; the plugin at weight 0 must give the same update on the same episodes."""
    plugged = _trainer(tmp_path / "a", *PLUGIN, "--plugin-kwarg", "answer_weight=0")
    assert [p.name for p in plugged.plugins] == ["answer_weight"]
    episodes = plugged.rollout()
    assert {i.role for e in episodes for i in e.invocations} == {"memory", "answer"}
    masked = _trainer(tmp_path / "b", "--teacher-mask", "memory")
    got, want = plugged.learn(episodes), masked.learn(episodes)
    for k in ("opd_loss", "loss", "pg_loss", "grad_norm"):
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-9), k
    assert got["answer_weight/opd_share"] == 0.0
    plain = _trainer(tmp_path / "c").learn(episodes)  # the plugin changes what it should: with answers
    assert abs(plain["opd_loss"] - want["opd_loss"]) > 1e-6


def test_a_plugin_trains_from_the_cli_and_its_state_survives_a_resume(tmp_path):
    run = tmp_path / "run"
    args = FAST + ["--run-dir", str(run), "--save-every", "1"] + PLUGIN + ["--plugin-kwarg", "answer_weight=3"]
    assert train.main(args + ["--steps", "2"]) == 0
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["answer_weight/steps"] for r in rows] == [1.0, 2.0]
    assert all(0.0 < r["answer_weight/opd_share"] < 1.0 for r in rows)
    text = (run / "config.toml").read_text()
    assert '"examples.answer_weight:AnswerWeight",' in text and "answer_weight = 3" in text
    assert train.main(["--resume", str(run), "--steps", "3"]) == 0
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["answer_weight/steps"] for r in rows] == [1.0, 2.0, 3.0]  # counted on from the checkpoint


@pytest.mark.parametrize("extra, says", [
    (["--plugin", "nosuchpkg.mod:Thing"], "error: --plugin nosuchpkg.mod:Thing: cannot import 'nosuchpkg.mod'"),
    (["--plugin", "examples.answer_weight:AnswerWeightOptions"], "is not a memopd.learn.plugin.Plugin subclass"),
    (["--plugin", "nosuch-name"], "no such plugin; give module:Class"),
    (PLUGIN + ["--plugin-kwarg", "bogus=1"], "error: --plugin-kwarg bogus: no --plugin takes it"),
    (PLUGIN + ["--plugin-kwarg", "answer_weight=-1"], "--plugin-kwarg answer_weight=-1.0 is out of range"),
])
def test_a_bad_plugin_spec_is_one_error_line(tmp_path, capsys, extra, says):
    assert train.main(FAST + ["--run-dir", str(tmp_path / "run")] + extra) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("error:") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_the_plugin_interface_defaults_change_nothing():
    import torch

    w = LossWeights(torch.ones(3), torch.tensor([1.0, 0.0, 1.0]))
    p = Plugin(ctx=None)
    fn = lambda step, limits: None  # noqa: E731
    assert p.wrap_rollout(fn) is fn and p.weigh(w, ctx=None) == {} and p.state_dict() == {}
    assert torch.equal(w.opd, torch.tensor([1.0, 0.0, 1.0]))


def test_the_readme_plugin_command_runs_as_written(tmp_path):
    """The guide's command (docs/extend.md), with smaller sizes appended (a later flag overrides an earlier one;
    --env is left out of them, since a repeated --env adds an env to the mix rather than overriding)."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "extend.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- memopd:plugin-example -->\s*```bash\n(.*?)```", text, re.DOTALL)
    assert match, "docs/extend.md must hold the plugin command in a ```bash block after <!-- memopd:plugin-example -->"
    (command,) = [line for line in match.group(1).splitlines() if line.strip()]
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "memopd.train"] and "examples.answer_weight:AnswerWeight" in argv
    run = tmp_path / "run"
    assert argv[argv.index("--env") + 1] == FAST[1]
    assert train.main(argv[3:] + FAST[2:] + ["--run-dir", str(run)]) == 0
    assert [r["answer_weight/steps"] for r in read_metrics(run) if "loss" in r] == [1.0, 2.0]
