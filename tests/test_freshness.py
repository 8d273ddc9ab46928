"""f-OPD's pieces without Ray: sample freshness and drift against hand computations, the
simulated-staleness mode (a synchronous trainer fed the rollouts of S steps before), freshness
weights on each episode's loss terms, and a resume that keeps the queue of batches."""

import math

import pytest
import torch

from memopd import losses, train
from memopd.plugins.freshness import fresh_weights


def test_episode_drift_is_the_mean_k3_of_its_tokens():
    trainer_lp = torch.tensor([-1.0, -2.0, -0.5, -0.5])
    behaviour = torch.tensor([-1.0, -1.0, -0.5, -1.5])
    episode = torch.tensor([0, 0, 1, 1])
    k3 = lambda lr: math.expm1(lr) - lr  # noqa: E731  log r = trainer - behaviour
    want = [(k3(0.0) + k3(-1.0)) / 2, (k3(0.0) + k3(1.0)) / 2]
    assert losses.episode_drift(trainer_lp, behaviour, episode, 2).tolist() == pytest.approx(want)
    assert losses.episode_drift(behaviour, behaviour, episode, 2).tolist() == [0.0, 0.0]  # on-policy: no drift


def test_freshness_combines_lag_and_drift():
    lag, drift = torch.tensor([0.0, 2.0, 4.0]), torch.tensor([0.0, 0.1, 0.0])
    assert losses.freshness(lag, drift, 2.0, 0.05).tolist() == pytest.approx(
        [1.0, math.exp(-1.0 - 2.0), math.exp(-2.0)])
    assert losses.freshness(lag, drift, 0.0, 0.05).tolist() == pytest.approx([1.0, math.exp(-2.0), 1.0])
    assert losses.freshness(lag, drift, 0.0, 0.0).tolist() == [1.0, 1.0, 1.0]


FAST = ["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=2", "--questions-per-step", "2", "--group-size",
        "2", "--max-new-tokens", "8", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "1024", "--threads", "1", "--ppo-epochs", "1"]


def _trainer(run_dir, *extra):
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(run_dir), *extra], "t", "")
    return train.Trainer(train.prepare(cfg), log=lambda m: None)


def test_simulated_staleness_trains_on_the_batch_of_s_steps_before_and_resumes_with_its_queue(tmp_path):
    trainer = _trainer(tmp_path / "run", "--simulated-staleness", "2")
    lags, trained = [], []
    for step in range(4):
        trainer.step = step
        metrics = trainer.train_step()
        lags.append(metrics["fresh/lag"])
        trained.append({e.episode_id.split("/")[0] for e in trainer.last_episodes})
    # the queue starts with two batches of the initial policy (steps -2 and -1), then lags by 2
    assert lags == [0.0, 1.0, 2.0, 2.0]
    assert trained == [{"step-2"}, {"step-1"}, {"step0"}, {"step1"}]
    assert [{e.episode_id.split("/")[0] for e in b} for b in trainer.plugin("staleness").queue] == [{"step2"}, {"step3"}]
    trainer.step = 4
    trainer.save()
    again = _trainer(tmp_path / "other", "--simulated-staleness", "2")
    again.run_dir = trainer.run_dir
    again.restore()
    assert [[e.to_dict() for e in b] for b in again.plugin("staleness").queue] == [[e.to_dict() for e in b] for b in trainer.plugin("staleness").queue]


def test_freshness_weights_each_episodes_terms(tmp_path):
    trainer = _trainer(tmp_path / "run", "--freshness", "weight", "--fresh-lag-scale", "1", "--fresh-drift-scale", "0")
    episodes = trainer.rollout()
    from memopd.packing import pack_episodes

    batch = pack_episodes(episodes, 1024)
    weights = torch.ones(batch.num_actions)
    lags = torch.tensor([0.0, 1.0, 2.0, 3.0])
    w, opd, stats = fresh_weights(batch, lags, batch.old_logprobs.clone(), weights, batch.teacher.float(), trainer.cfg)
    ep = batch.token_map[:, 0]
    assert torch.allclose(w, torch.exp(-lags)[ep]) and torch.allclose(opd, batch.teacher.float() * torch.exp(-lags)[ep])
    assert stats["fresh/lag"] == 1.5 and stats["fresh/drift"] == 0.0
    assert stats["fresh/score"] == pytest.approx(float(torch.exp(-lags).mean()))
    metrics = trainer.learn(episodes)  # on-policy: lag 0, and the drift is the trainer/engine mismatch alone
    assert metrics["fresh/lag"] == 0.0 and 0.0 <= metrics["fresh/drift"] < 1e-3 and metrics["fresh/score"] > 0.98
