"""End-to-end trainer tests on tiny models: steps run, kill-and-resume is exact, NaN losses are
handled, bad input is refused, and OPD lowers the student's KL to its teacher."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memopd import checkpoint, train
from memopd.runlog import read_metrics

FAST = ["--env-kwarg", "num_chunks=2", "--questions-per-step", "2", "--group-size", "2",
        "--max-new-tokens", "12", "--eval-episodes", "4", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "1024"]
TIMING = {"tokens_per_s", "rollout_s", "step_s"}


def _cfg(tmp_path, *extra):
    cfg = train.TrainConfig()
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(tmp_path)] + list(extra), "t", "")
    return train.prepare(cfg)


def test_training_steps_write_a_complete_run_dir(tmp_path):
    cfg = _cfg(tmp_path / "run", "--steps", "2", "--save-every", "1", "--audit-every", "2")
    summary = train.Trainer(cfg, log=lambda m: None).fit()
    run = tmp_path / "run"
    rows = read_metrics(run)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["packing_efficiency"] > 0.5 and r["action_tokens"] > 0
        assert r["kl/all"] >= 0 and r["entropy"] > 0
    assert "audit/max_abs_diff" not in steps[0]  # audited every 2 steps
    assert steps[1]["audit/max_abs_diff"] < 1e-4 and steps[1]["audit/passed"] is True  # RCE holds
    assert (run / "config.toml").is_file() and (run / "curves.png").stat().st_size > 1000
    assert sorted(p.name for p in (run / "episodes").iterdir()) == ["step-000001.jsonl", "step-000002.jsonl"]
    assert checkpoint.list_checkpoints(run)[0].name == "step-000002"
    assert set(summary) >= {"eval_before", "eval_after", "eval_teacher"}
    assert 0.0 <= summary["eval_teacher"]["f1"] <= 1.0  # the teacher is measured on the same test episodes


def test_gae_critic_persistent_teacher_and_reference_penalty_run(tmp_path):
    cfg = _cfg(tmp_path / "run", "--steps", "2", "--advantage", "gae", "--teacher-context", "persistent",
               "--ref-beta", "0.1", "--teacher-mask", "memory", "--opd-divergence", "jsd")
    trainer = train.Trainer(cfg, log=lambda m: None)
    trainer.fit()
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 2 and all(r["value_loss"] >= 0 for r in rows)
    assert all(r["kl/answer"] is None and r["kl/memory"] >= 0 for r in rows)  # answers unsupervised: no KL
    assert {"student", "critic", "ref"} <= set(trainer.modules())


def _run_cli(args, env):
    return subprocess.Popen([sys.executable, "-m", "memopd.train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_kill_and_resume_reproduces_the_uninterrupted_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = FAST + ["--steps", "3", "--save-every", "1", "--threads", "1"]
    full = _run_cli(common + ["--run-dir", str(tmp_path / "full")], env)
    out, _ = full.communicate(timeout=900)
    assert full.returncode == 0, out

    killed = _run_cli(common + ["--run-dir", str(tmp_path / "killed")], env)
    ckpt = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 900
    while time.time() < deadline and killed.poll() is None:  # kill once step 2 is saved
        if (ckpt / "latest").is_file() and (ckpt / "latest").read_text() == "step-000002":
            break
        time.sleep(0.05)
    assert killed.poll() is None, "the run ended before it could be killed"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    resumed = _run_cli(["--resume", str(tmp_path / "killed"), "--no-progress"], env)
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out
    assert "resumed from" in out

    def steps(run):
        return {r["step"]: {k: v for k, v in r.items() if k not in TIMING}
                for r in read_metrics(tmp_path / run) if "loss" in r}

    a, b = steps("full"), steps("killed")
    assert sorted(b) == [1, 2, 3]
    for s in (1, 2, 3):
        for k, v in a[s].items():
            assert b[s][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (s, k)
    assert json.loads((tmp_path / "killed" / "summary.json").read_text())["steps"] == 3


def test_nan_losses_skip_then_stop_with_checkpoint_intact(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path / "run", "--steps", "5", "--max-bad-steps", "2")

    def nan_loss(pg, entropy, opd, entropy_coef, opd_coef):
        return pg * float("nan")

    monkeypatch.setattr(train.losses, "actor_loss", nan_loss)
    trainer = train.Trainer(cfg, log=lambda m: None)
    before = {k: v.clone() for k, v in trainer.student.state_dict().items()}
    with pytest.warns(RuntimeWarning, match="non-finite loss"):
        with pytest.raises(train.TrainingError, match="2 steps in a row had a non-finite loss") as err:
            trainer.fit()
    assert "last good checkpoint is intact" in str(err.value)
    # weights were never updated with a NaN, and the saved checkpoint still loads
    for k, v in trainer.student.state_dict().items():
        assert (v == before[k]).all(), k
    state, path = checkpoint.load_latest(tmp_path / "run", trainer.modules())
    assert path.name == "step-000000"


def test_unknown_env_lists_envs(capsys):
    code = train.main(["--env", "memgym/Nope-v0", "--run-dir", "/nonexistent/never-made"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown memgym env" in err and "memgym/LongQA-v0" in err


def test_out_of_range_flag_says_the_range(capsys):
    assert train.main(["--clip-eps", "3"]) == 2
    assert "error: --clip-eps=3.0 is out of range; allowed: [0.0, 1.0]" in capsys.readouterr().err


def test_teacher_with_another_vocabulary_is_refused(tmp_path):
    from agents import presets

    tok = presets.build_tokenizer(["a small other corpus with other words entirely"] * 20, vocab_size=300)
    model = presets.build_model(presets.TINY_PRESETS["tiny"], tok)
    model.save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    cfg = _cfg(tmp_path / "run", "--teacher", str(tmp_path / "other"))
    with pytest.raises(ValueError, match="tokenizers differ"):
        train.Trainer(cfg, log=lambda m: None)


def test_opd_only_lowers_kl_to_the_teacher(tmp_path):
    cfg = _cfg(tmp_path / "run", "--steps", "24", "--reward", "none", "--lr", "3e-3", "--save-every", "100",
               "--sample-episodes", "0", "--threads", "2", "--opd-divergence", "rkl",  # MemOPD's own KL
               "--ppo-epochs", "1", "--minibatches", "2")
    train.Trainer(cfg, log=lambda m: None).fit()
    kl = [r["kl/all"] for r in read_metrics(tmp_path / "run") if "kl/all" in r]
    assert len(kl) == 24
    first, last = sum(kl[:4]) / 4, sum(kl[-4:]) / 4
    assert last < 0.7 * first, kl


def test_student_dependent_defaults_are_resolved_and_explicit_flags_win():
    tiny = train.resolve_defaults(train.TrainConfig())
    assert (tiny.lr, tiny.opd_divergence) == (train.TINY_LR, "fkl")  # a from-scratch tiny preset
    real = train.resolve_defaults(train.TrainConfig(model="org/some-model"))
    assert (real.lr, real.opd_divergence) == (train.MODEL_LR, "rkl")  # MemOPD's reverse KL
    given = train.resolve_defaults(train.TrainConfig(lr=1e-4, opd_divergence="jsd"))
    assert (given.lr, given.opd_divergence) == (1e-4, "jsd")
