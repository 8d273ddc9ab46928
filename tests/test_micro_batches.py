"""--micro-batch-rows: a minibatch's gradient accumulated over row groups is the gradient of the
whole minibatch (the same update at a lower peak memory)."""

from __future__ import annotations

import pytest
import torch

from memopd import train

FAST = ["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=3", "--questions-per-step", "2", "--group-size",
        "2", "--max-new-tokens", "8", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "256", "--threads", "1", "--ppo-epochs", "1",
        "--audit-every", "0", "--sample-episodes", "0"]


def _trainer(run_dir, *extra):
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(run_dir)] + list(extra), "t", "")
    return train.Trainer(train.prepare(cfg), log=lambda m: None)


def _learn_recording_grads(trainer, episodes):
    """The step's metrics and the gradients the optimizers stepped with."""
    grads = {}
    for name, opt in (("student", trainer.updater.opt), ("critic", trainer.updater.critic_opt)):
        if opt is None:
            continue
        real = opt.step

        def step(*a, _real=real, _opt=opt, _name=name, **k):
            grads[_name] = [p.grad.detach().clone() for g in _opt.param_groups for p in g["params"]
                            if p.grad is not None]
            return _real(*a, **k)
        opt.step = step
    return trainer.learn(episodes), grads


@pytest.mark.parametrize("extra", [[], ["--advantage", "gae"]])
def test_accumulated_row_groups_give_the_minibatchs_gradient(tmp_path, extra):
    whole = _trainer(tmp_path / "whole", *extra)
    episodes = whole.rollout()
    for e, f1 in zip(episodes, [0.0, 1.0, 0.5, 0.25]):  # rewards that differ within a group: PPO acts
        e.metrics["f1"] = f1
    accumulated = _trainer(tmp_path / "acc", "--micro-batch-rows", "1", *extra)
    from memopd.packing import pack_episodes

    assert pack_episodes(episodes, 256).num_rows >= 3  # several row groups to accumulate over
    a, ga = _learn_recording_grads(whole, episodes)
    b, gb = _learn_recording_grads(accumulated, episodes)
    for k in ("loss", "pg_loss", "opd_loss", "entropy", "grad_norm", "kl/all", "clip_frac") + (
            ("value_loss",) if extra else ()):
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
    assert a["pg_loss"] != 0.0 and set(ga) == set(gb) == ({"student", "critic"} if extra else {"student"})
    for name in ga:
        for x, y in zip(ga[name], gb[name], strict=True):
            assert torch.allclose(x, y, rtol=1e-4, atol=1e-7), name


def test_micro_batches_change_nothing_when_off(tmp_path):
    """0 (the default) keeps one forward per minibatch."""
    t = _trainer(tmp_path / "r")
    assert t.cfg.micro_batch_rows == 0
