"""TurnOPD's adaptive rollout depth (``--adaptive-depth``): episodes cut at a call budget keep
their calls and carry no outcome; the depth rule against hand computations; a cut step trains
the distillation terms only."""

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


@pytest.mark.parametrize("means, frac, least, want", [
    ([0.9, 0.5, 0.3, 0.05, 0.02], 0.2, 1, 3),   # turns 0-2 are at least 0.18; 3 and 4 are below
    ([0.9, 0.5, 0.3, 0.05, 0.02], 0.5, 1, 2),
    ([0.1, 0.9, 0.01], 0.2, 1, 2),
    ([0.9, 0.01, 0.5], 0.2, 1, 3),              # the last turn that counts, not the first that does not
    ([0.9, 0.01], 0.2, 2, 2),                   # never fewer than --depth-min calls
    ([0.0, 0.0], 0.2, 1, 2),                    # no signal: roll everything out
])
def test_the_depth_rule(tmp_path, means, frac, least, want):
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(tmp_path / "r"), "--depth-kl-frac",
                                                             str(frac), "--depth-min", str(least)], "t", "")
    trainer = train.Trainer(train.prepare(cfg), log=lambda m: None)
    assert trainer.plugin("turn_opd").choose_depth([(m, 0.0) for m in means]) == want


FAST = ["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=3", "--questions-per-step", "2", "--group-size",
        "2", "--max-new-tokens", "8", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "1024", "--threads", "1", "--ppo-epochs", "1",
        "--adaptive-depth", "--depth-probe-every", "2"]


def test_probe_steps_roll_out_in_full_and_the_others_are_cut_and_distilled_only(tmp_path):
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(tmp_path / "run")], "t", "")
    trainer = train.Trainer(train.prepare(cfg), log=lambda m: None)
    probe = trainer.train_step()  # step 0: a probe (no depth chosen yet)
    assert probe["depth/probe"] == 1.0 and probe["calls_per_episode"] == 4.0 and probe["depth/cut_episodes"] == 0
    depth = trainer.plugin("turn_opd").depth
    assert 1 <= depth <= 4 and len(trainer.plugin("turn_opd").last_turn_kl) == 4 and all(m > 0 for m, _ in trainer.plugin("turn_opd").last_turn_kl)
    trainer.step = 1
    trainer.plugin("turn_opd").depth = 2  # as a probe could choose; what a cut step does with it
    cut = trainer.train_step()
    assert cut["depth/probe"] == 0.0 and cut["depth/limit"] == 2.0 and cut["depth/cut_episodes"] == 1.0
    assert cut["calls_per_episode"] == 2.0 and all(len(e.invocations) == 2 for e in trainer.last_episodes)
    assert cut["pg_loss"] == 0.0 and cut["entropy"] == 0.0 and cut["opd_loss"] > 0  # no reward: distillation only
    assert cut["f1"] != cut["f1"]  # no episode reached its answer: no F1 (a gap in the curve)
