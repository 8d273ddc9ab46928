"""The example estimator (examples/gkd.py, GKD's generalized JSD) against a hand computation and
TRL's ``generalized_jsd_loss``, in the trainer against the built-in estimator at the betas where
the two agree, and from the command line."""

from __future__ import annotations

import math

import pytest
import torch

from examples.gkd import generalized_jsd
from memopd import train
from memopd.runlog import read_metrics


def _kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_the_generalized_jsd_by_hand(beta):
    s, t = [0.5, 0.3, 0.2], [0.2, 0.2, 0.6]
    m = [beta * b + (1 - beta) * a for a, b in zip(s, t)]
    want = {0.0: _kl(t, s), 1.0: _kl(s, t)}.get(beta, beta * _kl(t, m) + (1 - beta) * _kl(s, m))
    got = generalized_jsd(torch.tensor([s]).log(), torch.tensor([t]).log(), beta)
    assert got.item() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_the_generalized_jsd_is_trls(beta):
    trl = pytest.importorskip("trl.experimental.gkd", reason="TRL (the bench extra) is not installed")
    torch.manual_seed(0)
    zs, zt = torch.randn(2, 5, 11) * 2, torch.randn(2, 5, 11) * 2
    want = trl.GKDTrainer.generalized_jsd_loss(zs, zt, beta=beta, reduction="none").sum(-1)
    got = generalized_jsd(torch.log_softmax(zs, -1).view(10, 11), torch.log_softmax(zt, -1).view(10, 11), beta)
    assert torch.allclose(got, want.view(10), atol=1e-6, rtol=1e-5)


FAST = ["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=3", "--questions-per-step", "2", "--group-size",
        "2", "--max-new-tokens", "8", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "1024", "--threads", "1", "--ppo-epochs", "2",
        "--audit-every", "0", "--sample-episodes", "0"]
GKD = ["--opd-estimator", "examples.gkd:GeneralizedJSD"]


def _trainer(run_dir, *extra):
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(run_dir)] + list(extra), "t", "")
    return train.Trainer(train.prepare(cfg), log=lambda m: None)


def test_gkd_at_its_ends_and_middle_is_the_full_estimators_divergence(tmp_path):
    """beta 0, 0.5 and 1 are the forward KL, the JSD and the reverse KL: the same update as the
    full estimator with that --opd-divergence, on the same episodes."""
    episodes = None
    for beta, divergence in [(0.0, "fkl"), (0.5, "jsd"), (1.0, "rkl")]:
        full = _trainer(tmp_path / f"full-{beta}", "--opd-divergence", divergence)
        episodes = episodes or full.rollout()
        gkd = _trainer(tmp_path / f"gkd-{beta}", *GKD, "--opd-estimator-kwarg", f"beta={beta}")
        a, b = full.learn(episodes), gkd.learn(episodes)
        for k in ("loss", "opd_loss", "kl/all", "grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), (beta, k)
        assert a["opd_loss"] > 0


def test_the_example_estimator_trains_from_the_command_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert train.main(FAST + ["--run-dir", str(run), "--steps", "1", *GKD, "--opd-estimator-kwarg", "beta=0.3"]) == 0
    (row,) = [r for r in read_metrics(run) if "loss" in r]
    assert row["opd_loss"] > 0 and math.isfinite(row["kl/all"])
    text = (run / "config.toml").read_text()
    assert 'opd_estimator = "examples.gkd:GeneralizedJSD"' in text and "beta = 0.3" in text


@pytest.mark.parametrize("extra, says", [
    (GKD + ["--opd-estimator-kwarg", "gamma=1"], "error: --opd-estimator-kwarg gamma: --opd-estimator "
                                                  "examples.gkd:GeneralizedJSD does not take it (its options: beta)"),
    (GKD + ["--opd-estimator-kwarg", "beta=2"], "--opd-estimator-kwarg beta=2"),
    (["--opd-estimator", "examples.gkd:GKDOptions"], "is not a memopd.learn.estimators.base.Estimator subclass"),
    (["--opd-estimator", "topk", "--opd-estimator-kwarg", "opd_topk=3"], "takes its options as flags"),
])
def test_a_bad_estimator_spec_is_one_error_line(tmp_path, capsys, extra, says):
    assert train.main(FAST + ["--run-dir", str(tmp_path / "run")] + extra) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("error:") == 1 and "Traceback" not in err
