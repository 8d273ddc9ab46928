"""Turn-normalised distillation (``--opd-weighting token|turn|progressive``, TurnOPD's loss
budgeting): the weights against hand computations, the schedule, and the trainer's loss against
the per-token divergences it wrote, averaged by hand."""

import json
import math

import pytest
import torch

from memopd import losses, train
from memopd.plugins import prune_opd

# three calls: call 0 has 3 supervised tokens, call 1 has 1 (and one unsupervised), call 2 none
CALLS = torch.tensor([0, 0, 0, 1, 1, 2])
SUP = torch.tensor([True, True, True, True, False, False])


def test_token_weighting_counts_every_supervised_token_alike():
    w = losses.opd_weights(CALLS, SUP, 0.0)
    assert w.tolist() == pytest.approx([0.25, 0.25, 0.25, 0.25, 0.0, 0.0])


def test_turn_weighting_counts_every_call_alike():
    # 2 calls have supervised tokens: 1/2 each, split over their 3 and 1 tokens
    w = losses.opd_weights(CALLS, SUP, 1.0)
    assert w.tolist() == pytest.approx([1 / 6, 1 / 6, 1 / 6, 0.5, 0.0, 0.0])
    div = torch.tensor([1.0, 2.0, 3.0, 10.0, 99.0, 99.0])
    # the mean within a call, then over calls: (mean(1, 2, 3) + 10) / 2
    assert float(losses.masked_mean(div, w)) == pytest.approx((2.0 + 10.0) / 2)
    assert float(losses.masked_mean(div, losses.opd_weights(CALLS, SUP, 0.0))) == pytest.approx(16.0 / 4)


def test_a_share_mixes_the_two_means_and_totals_come_from_the_whole_step():
    w = losses.opd_weights(CALLS, SUP, 0.25)
    assert w.tolist() == pytest.approx([0.75 * 0.25 + 0.25 / 6] * 3 + [0.75 * 0.25 + 0.25 * 0.5, 0.0, 0.0])
    assert float(w.sum()) == pytest.approx(1.0)
    # one rank's part of a step with 8 supervised tokens in 4 calls
    part = losses.opd_weights(CALLS, SUP, 1.0, totals=(8.0, 4.0))
    assert part.tolist() == pytest.approx([1 / 12, 1 / 12, 1 / 12, 0.25, 0.0, 0.0])
    assert losses.call_counts(CALLS, SUP) == (4.0, 2.0)
    assert losses.opd_weights(CALLS, torch.zeros(6, dtype=torch.bool), 1.0).sum() == 0  # nothing supervised


def test_progressive_schedule():
    share = lambda p, shape="linear": losses.turn_share("progressive", p, 0.2, 0.6, shape)  # noqa: E731
    assert [share(p) for p in (0.0, 0.2, 0.3, 0.4, 0.6, 0.9)] == pytest.approx([0, 0, 0.25, 0.5, 1, 1])
    assert share(0.3, "cosine") == pytest.approx(0.5 * (1 - math.cos(math.pi * 0.25)))
    assert losses.turn_share("token", 0.9) == 0.0 and losses.turn_share("turn", 0.0) == 1.0
    with pytest.raises(ValueError, match="weighting"):
        losses.turn_share("calls", 0.5)


def test_a_progressive_ramp_that_ends_before_it_starts_is_refused():
    with pytest.raises(train.ConfigError, match="opd-turn-start"):
        train.cfgmod.parse_args(train.TrainConfig, ["--opd-weighting", "progressive", "--opd-turn-start", "0.5",
                                                    "--opd-turn-end", "0.5"], "t", "")


FAST = ["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=2", "--questions-per-step", "2", "--group-size",
        "2", "--max-new-tokens", "12", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "1024", "--threads", "1", "--ppo-epochs", "1",
        "--sample-episodes", "4", "--reward", "none"]


@pytest.mark.parametrize("weighting", ["token", "turn"])
def test_the_trainers_distillation_loss_is_the_hand_average_of_its_per_token_divergences(tmp_path, weighting):
    """``opd_loss`` of a step (one epoch, one minibatch: the loss at the forward before the update)
    against the per-token divergences written with the sample episodes, averaged by hand."""
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(tmp_path / "run"),
                                                             "--opd-weighting", weighting], "t", "")
    trainer = train.Trainer(train.prepare(cfg), log=lambda m: None)
    metrics = trainer.learn(trainer.rollout())
    lines = (tmp_path / "run" / "episodes" / "step-000001.jsonl").read_text().splitlines()
    per_call = [[v for v in inv["meta"]["teacher_kl"] if v is not None]
                for line in lines for inv in json.loads(line)["invocations"]]
    per_call = [c for c in per_call if c]
    assert len(per_call) == 4 * 3 and len({len(c) for c in per_call}) > 1  # calls of unequal length
    tokens = [v for c in per_call for v in c]
    by_token, by_turn = sum(tokens) / len(tokens), sum(sum(c) / len(c) for c in per_call) / len(per_call)
    assert abs(by_token - by_turn) > 1e-3 * by_token  # the two weightings are told apart
    want = by_token if weighting == "token" else by_turn
    assert metrics["opd_loss"] == pytest.approx(want, rel=1e-5)
    assert ("opd/turn_share" in metrics) == (weighting != "token")


# ------------------------------------------------------------------------------------------------
# Prune-OPD: top-k overlap, drift events and the decay after them
# ------------------------------------------------------------------------------------------------

def test_topk_overlap_counts_shared_candidates():
    logp_s = torch.log_softmax(torch.tensor([[5.0, 4.0, 3.0, 0.0, 0.0], [5.0, 4.0, 3.0, 0.0, 0.0]]), -1)
    logp_t = torch.log_softmax(torch.tensor([[3.0, 5.0, 4.0, 0.0, 0.0], [0.0, 0.0, 3.0, 4.0, 5.0]]), -1)
    # row 0: the same top-3 set {0, 1, 2}; row 1: teacher's {2, 3, 4} shares only token 2
    assert losses.topk_overlap(logp_s, logp_t, 3).tolist() == pytest.approx([1.0, 1 / 3])
    assert losses.topk_overlap(logp_s, logp_t, 1).tolist() == [0.0, 0.0]


def _tokens(calls: list[int], episode: int = 0) -> list[tuple[int, int, int]]:
    return [(episode, j, t) for j, n in enumerate(calls) for t in range(n)]


def test_drift_is_the_first_of_patience_low_tokens_and_later_calls_decay_further():
    # episode 0: calls of 3, 3 and 2 tokens; low overlap at tokens (1,1), (1,2), (2,0): a run of 3
    tm = torch.tensor(_tokens([3, 3, 2]) + _tokens([2, 2], episode=1))
    overlap = torch.tensor([0.9, 0.1, 0.9, 0.9, 0.1, 0.1, 0.1, 0.9] + [0.1, 0.1, 0.9, 0.1])
    w, events = prune_opd.drift_weights(overlap, tm, threshold=0.25, patience=3, decay=0.5)
    # the run of three starts at (1, 1); the single low token at (0, 1) is no drift; episode 1
    # has two low tokens in a row, then a high one: no drift with patience 3
    assert events == {0: (1, 1)}
    assert w.tolist() == [1, 1, 1, 1, 0.5, 0.5, 0.25, 0.25] + [1, 1, 1, 1]
    w2, events2 = prune_opd.drift_weights(overlap, tm, threshold=0.25, patience=2, decay=0.5)
    assert events2 == {0: (1, 1), 1: (0, 0)} and w2[8:].tolist() == [0.5, 0.5, 0.25, 0.25]


def test_a_run_does_not_continue_into_the_next_episode():
    tm = torch.tensor(_tokens([2]) + _tokens([2], episode=1))
    w, events = prune_opd.drift_weights(torch.tensor([0.9, 0.1, 0.1, 0.9]), tm, 0.25, 2, 0.5)
    assert events == {} and w.tolist() == [1, 1, 1, 1]


def test_the_trainer_logs_prune_opd_and_down_weights_after_drift(tmp_path):
    # an untrained student against an untrained teacher: their top-k sets barely meet, so every
    # episode drifts at once with a high threshold and patience 1
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(tmp_path / "run"), "--prune-opd",
                                                             "--prune-threshold", "1.0", "--prune-patience", "1",
                                                             "--prune-decay", "0.5"], "t", "")
    trainer = train.Trainer(train.prepare(cfg), log=lambda m: None)
    metrics = trainer.learn(trainer.rollout())
    assert metrics["prune/drift_episodes"] == 1.0 and metrics["prune/downweighted_tokens"] > 0.9
    assert 0.0 <= metrics["prune/overlap"] < 1.0
    # against the hand average: weights decay ** (1 + call index) from the first token on
    lines = (tmp_path / "run" / "episodes" / "step-000001.jsonl").read_text().splitlines()
    num = den = 0.0
    for line in lines:
        for c, inv in enumerate(json.loads(line)["invocations"]):
            for v in inv["meta"]["teacher_kl"]:
                if v is not None:
                    num, den = num + 0.5 ** (1 + c) * v, den + 0.5 ** (1 + c)
    assert metrics["opd_loss"] == pytest.approx(num / den, rel=1e-5)
