"""Rollout/trainer mismatch: old log-probs recorded or recomputed by the trainer, the truncated
importance weight, and the per-step mismatch metrics (hf backend here; the vLLM run is in
tests/test_backend_vllm.py)."""

import pytest
import torch

from memopd import losses, train
from memopd.config import ConfigError
from memopd.runlog import read_metrics

FAST = ["--env-kwarg", "num_chunks=2", "--questions-per-step", "2", "--group-size", "2",
        "--max-new-tokens", "12", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "1024", "--ppo-epochs", "2", "--steps", "1"]


def _run(tmp_path, *extra):
    cfg = train.prepare(train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(tmp_path)] + list(extra),
                                                "t", ""))
    train.Trainer(cfg, log=lambda m: None).fit()
    return [r for r in read_metrics(tmp_path) if "loss" in r][0]


def test_truncated_is_weights_are_the_capped_ratio():
    trainer = torch.tensor([-1.0, -2.0, -0.1])
    rollout = torch.tensor([-1.0, -1.0, -3.0])
    w = losses.truncated_is_weights(trainer, rollout, cap=2.0)
    assert torch.allclose(w, torch.tensor([1.0, torch.e ** -1, 2.0]))


def test_is_weights_scale_each_token_not_the_normaliser():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    old = logp + 0.05
    adv, w = torch.tensor([1.0, -1.0, 0.5]), torch.ones(3)
    base, _ = losses.ppo_policy_loss(logp, old, adv, w)
    same, _ = losses.ppo_policy_loss(logp, old, adv, w, is_weights=torch.ones(3))
    double, _ = losses.ppo_policy_loss(logp, old, adv, w, is_weights=torch.full((3,), 2.0))
    assert same == base and torch.isclose(double, 2 * base)


def test_recorded_mode_logs_the_mismatch_of_the_hf_backend(tmp_path):
    row = _run(tmp_path / "run")
    # the hf backend samples with the trainer's own weights: only padded-vs-packed float noise
    assert 0 <= row["mismatch/mean_abs_logp"] <= row["mismatch/max_abs_logp"] <= 1e-4
    assert "mismatch/is_weight_mean" not in row


def test_recompute_mode_with_two_minibatches_logs_the_importance_weights(tmp_path):
    row = _run(tmp_path / "run", "--old-logprobs", "recompute", "--tis-cap", "1.5", "--minibatches", "2")
    assert row["mismatch/max_abs_logp"] <= 1e-4
    assert row["mismatch/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert row["mismatch/is_capped_frac"] == 0.0


def test_training_with_a_served_model_is_refused():
    with pytest.raises(ConfigError, match="openai cannot train.*weight-sync"):
        train.TrainConfig(backend="openai")
