"""Prune-OPD's rollout side (``--prune-opd``, ``memopd.plugins.prune_opd.DriftMonitor``): the drift rule run
call by call against hand computations, the rollout stopping a drifted episode after the call it
drifted in, and the trainer's stops agreeing with the learner's drift events."""

from __future__ import annotations

import gymnasium as gym
import pytest
import torch

import memgym  # noqa: F401
from agents import HFBackend, MemAgent, SamplingParams
from agents.records import Invocation
from agents.rollout import rollout
from memopd import train
from memopd.plugins.prune_opd import DriftMonitor
from memopd.scoring import ActionStates

V = 6  # vocabulary of the hand-made distributions; k = 2


def call(n: int) -> Invocation:
    """A call of n response tokens (the content does not matter to the rule: the states do)."""
    prompt = [1, 2, 3]
    return Invocation(prompt_ids=prompt, response_ids=[4] * n, logprobs=[0.0] * n,
                      position_ids=list(range(len(prompt) + n)), prefix_len=0)


def states(low: dict[int, list[bool]], who: str):
    """States whose top-2 sets are {0, 1} for the student, and for the teacher {0, 1} (overlap 1)
    or {4, 5} (overlap 0) where ``low[e][t]``: action t of packed episode e is a low-overlap token."""
    def fn(batch) -> ActionStates:
        rows = []
        for e, _, t in batch.token_map.tolist():
            z = torch.zeros(V)
            top = [0, 1] if who == "student" or not low[e][t] else [4, 5]
            z[top] = torch.tensor([3.0, 2.0])
            rows.append(z)
        head = torch.nn.Linear(V, V, bias=False)
        head.weight.data = torch.eye(V)  # the hidden states are the logits
        return ActionStates(torch.stack(rows), head, torch.ones(len(rows)))
    return fn


def monitor_for(rounds: list[dict[int, list[bool]]], patience: int) -> tuple[DriftMonitor, list]:
    plan = {"low": {}}
    mon = DriftMonitor(lambda b: states(plan["low"], "student")(b), lambda b: states(plan["low"], "teacher")(b),
                       k=2, threshold=0.5, patience=patience, pack_tokens=64)
    out = []
    for r in rounds:  # slot -> the low flags of its call this round (slot s runs episode "ep<s>")
        plan["low"] = {i: flags for i, flags in enumerate(r.values())}
        out.append(mon({s: (f"ep{s}", call(len(flags))) for s, flags in r.items()}))
    return mon, out


def test_a_run_across_calls_reaching_the_patience_stops_the_episode_after_that_call():
    # slot 0: calls of 3 tokens, low at (0, 2), (1, 0), (1, 1): a run of 3 that crosses the boundary
    # slot 1: low tokens never 3 in a row (a high token breaks each run)
    rounds = [{0: [False, False, True], 1: [True, True, False]},
              {0: [True, True, False], 1: [True, False, True]},
              {0: [False, False, False], 1: [True, False, False]}]
    mon, stops = monitor_for(rounds, patience=3)
    assert stops == [set(), {0}, set()]
    assert mon.events == {"ep0": 1}  # drifted in its second call (index 1)
    # the episode that drifted is not looked at again; the other keeps its run: 1 after round 3
    assert mon.runs["ep1"] == 0


def test_patience_one_stops_at_the_first_low_token_and_none_without_one():
    _, stops = monitor_for([{0: [False, True], 1: [False, False], 2: [True]}], patience=1)
    assert stops == [{0, 2}]
    _, stops = monitor_for([{0: [False] * 4}, {0: [False] * 2}], patience=1)
    assert stops == [set(), set()]  # no drift: the window stays the whole episode


def test_the_rollout_cuts_what_the_monitor_names_after_that_call(tiny):
    model, tok = tiny
    envs = [gym.make("memgym/LongQA-v0", split="train", tokenizer=tok, num_chunks=4) for _ in range(2)]
    seen: dict[str, int] = {}

    def stop_second_call_of_member_0(new):  # a monitor: episode member 0 drifts in its second call
        out = set()
        for slot, (episode_id, inv) in new.items():
            seen[episode_id] = seen.get(episode_id, 0) + 1
            if episode_id.endswith("/0") and seen[episode_id] == 2:
                out.add(slot)
        return out

    agent = MemAgent(HFBackend(model, tok, seed=0), SamplingParams(max_new_tokens=6), answer_max_new_tokens=4)
    eps = rollout(envs, agent, 4, group_size=2, seed=3, progress=False, monitor=stop_second_call_of_member_0)
    for e in eps:
        if e.episode_id.endswith("/0"):
            assert len(e.invocations) == 2 and e.meta["cut"] == 2 and e.metrics == {} and e.meta["turns"] == 5
        else:
            assert len(e.invocations) == 5 and "cut" not in e.meta and "f1" in e.metrics
    assert all(seen[e.episode_id] == len(e.invocations) for e in eps)  # every call was shown once


FAST = ["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=3", "--questions-per-step", "2", "--group-size",
        "2", "--max-new-tokens", "10", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "1024", "--threads", "1", "--ppo-epochs", "1",
        "--prune-opd", "--prune-patience", "1"]


def _trainer(tmp_path, *extra):
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(tmp_path / "run"), *extra], "t", "")
    return train.Trainer(train.prepare(cfg), log=lambda m: None)


def test_the_trainer_stops_drifting_rollouts_and_the_learner_finds_the_same_events(tmp_path):
    # untrained student and teacher: top-8 sets barely meet, so with threshold 1.0 every call's first
    # token is low and every episode stops after its first call
    m = _trainer(tmp_path, "--prune-threshold", "1.0").train_step()
    assert m["prune/stopped_episodes"] == 1.0 and m["calls_per_episode"] == 1.0
    assert m["prune/drift_episodes"] == 1.0  # the learner's detector, recomputed: the same episodes
    assert m["prune/calls_skipped"] == 4 * 3  # 4 episodes of 4 turns (3 chunks and the answer) made 1 call each
    assert m["prune/rollout_saved_s"] > 0
    assert m["prune/monitor_s"] > 0 and m["pg_loss"] == 0.0  # cut episodes carry no reward: no PPO term


def test_without_drift_and_with_no_prune_stop_rollouts_run_in_full(tmp_path):
    m = _trainer(tmp_path / "a", "--prune-threshold", "0.0").train_step()  # overlap < 0 never happens
    assert m["prune/stopped_episodes"] == 0.0 and m["calls_per_episode"] == 4.0 and m["prune/drift_episodes"] == 0
    m = _trainer(tmp_path / "b", "--prune-threshold", "1.0", "--no-prune-stop").train_step()
    assert "prune/stopped_episodes" not in m and m["calls_per_episode"] == 4.0 and m["prune/drift_episodes"] == 1.0


def test_prune_stop_is_refused_where_it_cannot_score_calls(tmp_path):
    with pytest.raises(train.ConfigError, match="no-prune-stop"):
        train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(tmp_path / "r"), "--teacher-context",
                                                           "persistent"], "t", "")
