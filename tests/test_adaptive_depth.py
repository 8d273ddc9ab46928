"""TurnOPD's adaptive rollout depth (``--adaptive-depth``): episodes cut at a call budget keep
their calls and carry no outcome; the paper's depth controller (survivor-weighted KL centroid,
coverage floor, moving average, clip) against hand computations; probes and cut steps in the
trainer."""

import gymnasium as gym
import pytest

import memgym  # noqa: F401
from agents import HFBackend, MemAgent, SamplingParams
from agents.rollout import rollout
from memopd import train


def _agent(tiny):
    model, tok = tiny
    return MemAgent(HFBackend(model, tok, seed=0), SamplingParams(max_new_tokens=6), answer_max_new_tokens=4), tok


def test_a_call_budget_cuts_episodes_and_keeps_their_calls(tiny):
    agent, tok = _agent(tiny)
    envs = [gym.make("memgym/LongQA-v0", split="train", tokenizer=tok, num_chunks=4) for _ in range(3)]
    full = rollout(envs, agent, 4, group_size=2, seed=1, progress=False)
    assert all(len(e.invocations) == 5 and "f1" in e.metrics for e in full)
    agent, _ = _agent(tiny)
    cut = rollout(envs, agent, 4, group_size=2, seed=1, progress=False, max_calls=2)
    for e, f in zip(cut, full):
        assert len(e.invocations) == 2 and e.meta["cut"] == 2 and e.metrics == {} and e.prediction == ""
        assert e.group_id == f.group_id and [i.role for i in e.invocations] == ["memory", "memory"]
        assert e.invocations[0].prompt_ids == f.invocations[0].prompt_ids  # the same question and chunk
    agent, _ = _agent(tiny)
    assert all("cut" not in e.meta for e in rollout(envs, agent, 2, seed=1, progress=False, max_calls=5))


from memopd.plugins.turn_opd import DepthController, Probe  # noqa: E402


def test_the_centroid_of_the_survivor_weighted_kl():
    # m_t = K_t * n_t / n_0 = [0.9, 0.5, 0.15, 0.0125]; sum 1.5625; sum t * m_t = 0.8375 -> 0.536 -> 1
    assert DepthController.centroid([0.9, 0.5, 0.3, 0.05], [8, 8, 4, 2]) == 1
    # negative and missing K_t count 0: m = [0.1, 0, 0, 0.7] -> 2.1 / 0.8 = 2.625 -> 3
    assert DepthController.centroid([0.1, -0.3, float("nan"), 0.7], [4, 4, 4, 4]) == 3
    # the same late KL reached by a quarter of the trajectories: m = [0.1, 0, 0, 0.175] -> 0.525 / 0.275 -> 2
    assert DepthController.centroid([0.1, -0.3, float("nan"), 0.7], [4, 4, 4, 1]) == 2


def test_the_coverage_quantile_is_the_least_depth_whose_cdf_reaches_p():
    depths = [3, 3, 4, 5, 5, 5, 5, 6, 7, 9]
    assert DepthController.quantile_depth(depths, 0.8) == 6  # F(6) = 0.8
    assert DepthController.quantile_depth(depths, 0.81) == 7 and DepthController.quantile_depth(depths, 0.1) == 3


def test_the_controller_takes_the_larger_of_both_then_a_moving_average_then_clips():
    c = DepthController(ema=0.3, coverage=0.8, min_successes=3, least=2, most=6)
    assert c.cap() is None  # no probe yet
    # probe 1: centroid 1; two successes are too few for a floor: H_ctrl = 1, H_bar = 1, cap = 2
    assert c.update(Probe([0.9, 0.5, 0.3, 0.05], [8, 8, 4, 2], success_depths=[4, 4])) == 2 and c.h_cov is None
    # probe 2: the floor is the 0.8 quantile of [3, 4, 4, 5] = 5 > centroid: H_bar = 0.7 * 1 + 0.3 * 5 = 2.2 -> 3
    assert c.update(Probe([0.9, 0.5, 0.3, 0.05], [8, 8, 4, 2], success_depths=[3, 4, 4, 5])) == 3 and c.h_cov == 5
    # probe 3: no new successes: the floor stays 5; H_bar = 0.7 * 2.2 + 0.3 * 5 = 3.04 -> 4
    assert c.update(Probe([1.0], [8], success_depths=[])) == 4 and c.h_bar == pytest.approx(3.04)
    for _ in range(10):  # towards 5: cap 6, never above --depth-max 6
        c.update(Probe([1.0], [8], success_depths=[9] * 3))
    assert c.cap() == 6
    again = DepthController(ema=0.3, coverage=0.8, min_successes=3, least=2, most=6)
    again.load_state_dict(c.state_dict())
    assert again.cap() == c.cap() and again.h_cov == c.h_cov
    # without a floor (--depth-coverage 0) the centroid alone: H_bar 0 -> cap at --depth-min
    bare = DepthController(ema=0.3, coverage=0.0, min_successes=1, least=2)
    assert bare.update(Probe([1.0, 0.1, 0.1], [8, 8, 8], success_depths=[2] * 8)) == 2 and bare.h_cov is None


FAST = ["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=3", "--questions-per-step", "2", "--group-size",
        "2", "--max-new-tokens", "8", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "1024", "--threads", "1", "--ppo-epochs", "1",
        "--adaptive-depth", "--depth-probe-every", "2", "--depth-warmup", "1"]


def test_probe_steps_roll_out_in_full_and_the_others_are_cut_and_distilled_only(tmp_path):
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(tmp_path / "run")], "t", "")
    trainer = train.Trainer(train.prepare(cfg), log=lambda m: None)
    turn = trainer.plugin("turn_opd")
    probe = trainer.train_step()  # step 0: a probe (the warm-up's, and no depth chosen yet)
    assert probe["depth/probe"] == 1.0 and probe["calls_per_episode"] == 4.0 and probe["depth/cut_episodes"] == 0
    assert len(turn.last_probe.kl) == 4 and all(k > 0 for k in turn.last_probe.kl)
    assert turn.last_probe.alive == [4.0] * 4 and probe["depth/h_eff"] == DepthController.centroid(
        turn.last_probe.kl, turn.last_probe.alive)
    assert 2 <= turn.depth <= 4
    trainer.step = 1
    turn.controller.h_bar = 1.0  # as a probe could leave it: cap max(2, 1 + 1) = 2; what a cut step does with it
    cut = trainer.train_step()
    assert cut["depth/probe"] == 0.0 and cut["depth/limit"] == 2.0 and cut["depth/cut_episodes"] == 1.0
    assert cut["calls_per_episode"] == 2.0 and all(len(e.invocations) == 2 for e in trainer.last_episodes)
    assert cut["pg_loss"] == 0.0 and cut["entropy"] == 0.0 and cut["opd_loss"] > 0  # no reward: distillation only
    assert cut["f1"] != cut["f1"]  # no episode reached its answer: no F1 (a gap in the curve)
    assert turn.controller.h_bar == 1.0  # a cut step does not move the controller
    trainer.step = 2
    assert trainer.train_step()["depth/probe"] == 1.0  # every --depth-probe-every 2 steps
