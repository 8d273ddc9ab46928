"""TurnOPD's loss budgeting (``--opd-weighting token|turn|progressive``) and Prune-OPD's reliability
weights against hand computations, the loss's normaliser (weights a plugin lowered stay lowered),
and the trainer's distillation loss against the per-token divergences it wrote, averaged by hand."""

import json
import math

import pytest
import torch

from memopd import losses, train
from memopd.plugins import prune_opd, turn_opd
from memopd.learn.plugin import LossWeights

# trajectory 0: call 0 has 3 supervised tokens, call 1 one (and one unsupervised); trajectory 1:
# call 0 has 2 supervised tokens
TOKENS = torch.tensor([[0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [1, 0, 0], [1, 0, 1]])
SUP = torch.tensor([True, True, True, True, False, True, True])


@pytest.mark.parametrize("alpha, want", [
    # w = ((1 - a) / N_e + a / (T_e * n_et)) / E, E = 2; trajectory 0: N = 4, T = 2; trajectory 1: N = 2, T = 1
    (0.0, [1 / 8, 1 / 8, 1 / 8, 1 / 8, 0, 1 / 4, 1 / 4]),          # each trajectory's token mean
    (1.0, [1 / 12, 1 / 12, 1 / 12, 1 / 4, 0, 1 / 4, 1 / 4]),       # each turn alike within its trajectory
    (0.5, [(0.5 / 4 + 0.5 / 6) / 2] * 3 + [(0.5 / 4 + 0.5 / 2) / 2, 0, 1 / 4, 1 / 4]),
])
def test_turnopd_blends_token_and_turn_shares_within_each_trajectory(alpha, want):
    w = turn_opd.turn_blend_weights(TOKENS, SUP, alpha)
    assert w.tolist() == pytest.approx(want) and float(w.sum()) == pytest.approx(1.0)
    div = torch.tensor([1.0, 2.0, 3.0, 10.0, 99.0, 4.0, 6.0])
    if alpha == 1.0:  # the mean within a turn, over the turns of a trajectory, over trajectories
        assert float((div * w).sum()) == pytest.approx(((2.0 + 10.0) / 2 + 5.0) / 2)
    # one rank's share of a step with 4 trajectories: E comes from the whole step
    assert turn_opd.turn_blend_weights(TOKENS, SUP, alpha, trajectories=4.0).tolist() == pytest.approx(
        [x / 2 for x in want])
    assert turn_opd.turn_blend_weights(TOKENS, torch.zeros(7, dtype=torch.bool), alpha).sum() == 0


def test_progressive_schedule():
    share = lambda p, shape="linear": turn_opd.turn_share("progressive", p, 0.2, 0.6, shape)  # noqa: E731
    assert [share(p) for p in (0.0, 0.2, 0.3, 0.4, 0.6, 0.9)] == pytest.approx([0, 0, 0.25, 0.5, 1, 1])
    assert share(0.3, "cosine") == pytest.approx(0.5 * (1 - math.cos(math.pi * 0.25)))
    assert turn_opd.turn_share("progressive", 0.37) == pytest.approx(0.37)  # the paper's s = 0, e = 1: alpha = k / K
    assert turn_opd.turn_share("token", 0.9) == 0.0 and turn_opd.turn_share("turn", 0.0) == 1.0
    with pytest.raises(ValueError, match="weighting"):
        turn_opd.turn_share("calls", 0.5)


def test_a_progressive_ramp_that_ends_before_it_starts_is_refused():
    with pytest.raises(train.ConfigError, match="opd-turn-start"):
        train.cfgmod.parse_args(train.TrainConfig, ["--opd-weighting", "progressive", "--opd-turn-start", "0.5",
                                                    "--opd-turn-end", "0.5"], "t", "")


def test_the_loss_divides_by_the_weights_before_any_plugin():
    w = LossWeights(torch.ones(4), torch.tensor([1.0, 1.0, 0.0, 1.0]))
    w.opd = w.opd * 0.5  # a plugin halves every weight: the loss halves (it would not under sum(w))
    div = torch.tensor([2.0, 4.0, 100.0, 6.0])
    assert float(losses.masked_mean(div, w.opd, w.opd_base)) == pytest.approx(0.5 * 12.0 / 3)
    assert float(losses.masked_mean(div, w.opd)) == pytest.approx(12.0 / 3)  # no normaliser given: self-normalised
    w.redistribute_opd(torch.tensor([3.0, 1.0, 0.0, 0.0]))  # moves the weight, keeps the sum it had
    assert w.opd.tolist() == pytest.approx([1.125, 0.375, 0.0, 0.0])


FAST = ["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=2", "--questions-per-step", "2", "--group-size",
        "2", "--max-new-tokens", "12", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "1024", "--threads", "1", "--ppo-epochs", "1",
        "--sample-episodes", "4", "--reward", "none"]


@pytest.mark.parametrize("weighting", ["token", "turn", "progressive"])
def test_the_trainers_distillation_loss_is_the_hand_average_of_its_per_token_divergences(tmp_path, weighting):
    """``opd_loss`` of a step (one epoch, one minibatch: the loss at the forward before the update)
    against the per-token divergences written with the sample episodes, averaged by hand."""
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(tmp_path / "run"),
                                                             "--opd-weighting", weighting], "t", "")
    trainer = train.Trainer(train.prepare(cfg), log=lambda m: None)
    rolled = trainer.rollout()
    for e, keep in zip(rolled, (1, 2)):  # trajectories of unequal lengths (an untrained student never stops)
        inv = e.invocations[0]
        cut = len(inv.response_ids) - keep
        inv.response_ids, inv.logprobs = inv.response_ids[:keep], inv.logprobs[:keep]
        inv.position_ids = inv.position_ids[:len(inv.position_ids) - cut]
    metrics = trainer.learn(rolled)
    lines = (tmp_path / "run" / "episodes" / "step-000001.jsonl").read_text().splitlines()
    episodes = [[[v for v in inv["meta"]["teacher_kl"] if v is not None] for inv in json.loads(line)["invocations"]]
                for line in lines]
    episodes = [[c for c in calls if c] for calls in episodes]
    assert sum(map(len, episodes)) == 4 * 3 and len({len(c) for e in episodes for c in e}) > 1  # unequal calls
    tokens = [v for e in episodes for c in e for v in c]
    by_token = sum(tokens) / len(tokens)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    by_turn = mean([mean([mean(c) for c in e]) for e in episodes])  # alpha 1
    by_trajectory = mean([mean([v for c in e for v in c]) for e in episodes])  # alpha 0 (progressive at step 0)
    assert abs(by_token - by_turn) > 2e-5 * by_token and abs(by_token - by_trajectory) > 2e-5 * by_token
    want = {"token": by_token, "turn": by_turn, "progressive": by_trajectory}[weighting]
    assert metrics["opd_loss"] == pytest.approx(want, rel=2e-6)
    assert ("opd/turn_share" in metrics) == (weighting != "token")


# ------------------------------------------------------------------------------------------------
# Prune-OPD: top-k overlap, drift events and the decay after them
# ------------------------------------------------------------------------------------------------

def test_topk_overlap_counts_shared_candidates():
    logp_s = torch.log_softmax(torch.tensor([[5.0, 4.0, 3.0, 0.0, 0.0], [5.0, 4.0, 3.0, 0.0, 0.0]]), -1)
    logp_t = torch.log_softmax(torch.tensor([[3.0, 5.0, 4.0, 0.0, 0.0], [0.0, 0.0, 3.0, 4.0, 5.0]]), -1)
    # row 0: the same top-3 set {0, 1, 2}; row 1: teacher's {2, 3, 4} shares only token 2
    assert prune_opd.topk_overlap(logp_s, logp_t, 3).tolist() == pytest.approx([1.0, 1 / 3])
    assert prune_opd.topk_overlap(logp_s, logp_t, 1).tolist() == [0.0, 0.0]


def test_reliability_falls_with_the_episodes_drift_events_so_far():
    # episode 0: 5 tokens in call order, events at 1, 2 and 4; episode 1: an event at its first token
    low = torch.tensor([False, True, True, False, True, True, False])
    episode = torch.tensor([0, 0, 0, 0, 0, 1, 1])
    w = prune_opd.reliability(low, episode, drop=0.4)  # 1 - 0.4 N_t, at least 0
    assert w.tolist() == pytest.approx([1.0, 0.6, 0.2, 0.2, 0.0, 0.6, 0.6])
    omega = (w + 0.5) / 1.5  # the weight with floor 0.5
    assert omega.tolist() == pytest.approx([1.0, 1.1 / 1.5, 0.7 / 1.5, 0.7 / 1.5, 1 / 3, 1.1 / 1.5, 1.1 / 1.5])

