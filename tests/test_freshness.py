"""f-OPD's pieces without Ray: sample freshness (both terms), its weights and their effective
sample size against hand computations, the simulated-staleness mode (a synchronous trainer fed
the rollouts of S steps before), freshness weights on each episode's loss terms, a uniformly
stale step's smaller loss, and a resume that keeps the queue of batches."""

import math

import pytest
import torch

from memopd import train
from memopd.plugins import freshness as fopd
from memopd.plugins.freshness import fresh_weights


def test_episode_drift_is_the_mean_k3_of_its_tokens():
    trainer_lp = torch.tensor([-1.0, -2.0, -0.5, -0.5])
    behaviour = torch.tensor([-1.0, -1.0, -0.5, -1.5])
    episode = torch.tensor([0, 0, 1, 1])
    k3 = lambda lr: math.expm1(lr) - lr  # noqa: E731  log r = trainer - behaviour
    want = [(k3(0.0) + k3(-1.0)) / 2, (k3(0.0) + k3(1.0)) / 2]
    assert fopd.episode_drift(trainer_lp, behaviour, episode, 2).tolist() == pytest.approx(want)
    assert fopd.episode_drift(behaviour, behaviour, episode, 2).tolist() == [0.0, 0.0]  # on-policy: no drift


def test_context_drift_is_the_mean_over_calls_of_the_k3_summed_before_each():
    # episode 0: calls 0, 1, 2 (tokens 2, 1, 1); episode 1: one call; log r = trainer - behaviour
    token_map = torch.tensor([[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 2, 0], [1, 0, 0]])
    log_r = [0.5, -0.5, 1.0, 2.0, 3.0]
    behaviour = torch.zeros(5)
    k3 = [math.expm1(x) - x for x in log_r]
    # call 0 sees no earlier action, call 1 sees call 0's two tokens, call 2 sees calls 0 and 1
    want0 = (0.0 + (k3[0] + k3[1]) + (k3[0] + k3[1] + k3[2])) / 3
    got = fopd.context_drift(torch.tensor(log_r), behaviour, token_map, 2)
    assert got.tolist() == pytest.approx([want0, 0.0])  # a single call's context is the task's alone
    assert fopd.context_drift(behaviour, behaviour, token_map, 2).tolist() == [0.0, 0.0]  # on-policy
    # calls missing from the batch (cut, or unsupervised) are not averaged over; a gap still counts
    gap = torch.tensor([[0, 0, 0], [0, 2, 0]])
    assert fopd.context_drift(torch.tensor([1.0, 0.0]), torch.zeros(2), gap, 1).tolist() == pytest.approx(
        [(0.0 + (math.e - 2)) / 2])


def test_freshness_is_eq_11_with_both_terms():
    lag, roll = torch.tensor([0.0, 1.0, 3.0]), torch.tensor([0.0, 0.04, 0.25])
    # f = exp(-(alpha sqrt(D_roll) + beta sqrt(D_sup))) / (lag + 1), alpha = 2
    assert fopd.freshness(lag, roll, 2.0).tolist() == pytest.approx(
        [1.0, math.exp(-0.4) / 2, math.exp(-1.0) / 4])
    sup = torch.tensor([0.09, 0.0, 0.01])  # beta = 1: exponents 0.3, 0.4, 1.1
    assert fopd.freshness(lag, roll, 2.0, 1.0, sup).tolist() == pytest.approx(
        [math.exp(-0.3), math.exp(-0.4) / 2, math.exp(-1.1) / 4])
    assert fopd.freshness(lag, roll, 0.0).tolist() == pytest.approx([1.0, 0.5, 0.25])  # the lag alone


def test_weights_clear_the_threshold_and_their_effective_sample_size():
    f = torch.tensor([1.0, 0.5, 0.25, 0.1])
    assert fopd.freshness_weights(f, 0.2).tolist() == pytest.approx([0.8, 0.3, 0.05, 0.0])
    assert fopd.freshness_weights(f, 0.0).tolist() == pytest.approx(f.tolist())
    assert fopd.effective_sample_size(torch.tensor([1.0, 1.0, 0.0, 0.0])) == pytest.approx(2.0)
    assert fopd.effective_sample_size(torch.tensor([1.0, 0.5])) == pytest.approx(2.25 / 1.25)
    assert fopd.effective_sample_size(torch.zeros(3)) == 0.0


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
    trainer = _trainer(tmp_path / "run", "--freshness", "weight", "--fresh-alpha", "1", "--fresh-threshold", "0.1")
    episodes = trainer.rollout()
    from memopd.packing import pack_episodes

    batch = pack_episodes(episodes, 1024)
    weights = torch.ones(batch.num_actions)
    lags = torch.tensor([0.0, 1.0, 2.0, 3.0])
    w, opd, stats = fresh_weights(batch, lags, batch.old_logprobs.clone(), weights, batch.teacher.float(), trainer.cfg)
    ep = batch.token_map[:, 0]
    want = torch.tensor([0.9, 0.4, 1 / 3 - 0.1, 0.15])  # 1 / (lag + 1) - 0.1 (no drift: the same log-probs)
    assert torch.allclose(w, want[ep]) and torch.allclose(opd, batch.teacher.float() * want[ep])
    assert stats["fresh/lag"] == 1.5 and stats["fresh/drift"] == 0.0 and stats["fresh/sup_drift"] == 0.0
    assert stats["fresh/score"] == pytest.approx(float((1 / (lags + 1)).mean()))
    assert stats["fresh/ess"] == pytest.approx(fopd.effective_sample_size(want) / 4)
    # both terms, by hand: every student log-prob 0.1 below the behaviour's
    moved = batch.old_logprobs - 0.1
    w, _, stats = fresh_weights(batch, lags, moved, weights, batch.teacher.float(), trainer.cfg)
    k3 = math.expm1(-0.1) + 0.1
    for e in range(4):
        calls = batch.token_map[ep == e, 1]
        n_c = {int(c): int((calls == c).sum()) for c in calls.unique()}
        d_sup = sum(k3 * sum(n for c2, n in n_c.items() if c2 < c) for c in n_c) / len(n_c)
        f = math.exp(-(math.sqrt(k3) + math.sqrt(d_sup))) / (float(lags[e]) + 1)  # alpha = beta = 1
        assert torch.allclose(w[ep == e], torch.tensor(max(f - 0.1, 0.0)), atol=1e-6)
    assert stats["fresh/drift"] == pytest.approx(k3, rel=1e-4) and stats["fresh/sup_drift"] > stats["fresh/drift"]
    metrics = trainer.learn(episodes)  # on-policy: lag 0, and the drift is the trainer/engine mismatch alone
    assert metrics["fresh/lag"] == 0.0 and 0.0 <= metrics["fresh/drift"] < 1e-3 and metrics["fresh/score"] > 0.98


def test_a_uniformly_stale_step_moves_the_policy_less(tmp_path):
    """Every sample 3 versions old: each weight is 1 / 4, and the step's losses are a quarter of
    the same step's on-policy losses (a weighted mean divided by the weights would undo it)."""
    runs = {}
    for lag in (0, 3):
        trainer = _trainer(tmp_path / f"run{lag}", "--freshness", "weight", "--fresh-alpha", "0", "--fresh-beta", "0")
        episodes = trainer.rollout()  # sampled as policy version 0
        trainer.step = lag  # trained at version `lag`
        runs[lag] = trainer.learn(episodes)
    assert runs[3]["fresh/lag"] == 3.0 and runs[0]["fresh/lag"] == 0.0
    for term in ("opd_loss", "pg_loss", "entropy"):
        assert runs[3][term] == pytest.approx(runs[0][term] / 4, rel=1e-5, abs=1e-9)
    assert runs[3]["opd_loss"] > 0
