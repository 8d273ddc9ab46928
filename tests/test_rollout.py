"""Rollouts: lockstep batching, groups, seeds, JSONL output, lists of envs and vector envs."""

from __future__ import annotations

import gymnasium as gym
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import memgym  # noqa: F401  (registers the envs)
from agent_fixtures import CountingBackend, train_tokenizer
from agents.backends.base import SamplingParams
from agents.memagent import MemAgent
from agents.models import load
from agents.oracle import OracleAgent
from agents.records import load_episodes
from agents.rollout import info_at, plan_episodes, rollout


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


def make_env(tokenizer=None, **kwargs):
    return gym.make("memgym/LongQA-v0", split="test", tokenizer=tokenizer, **kwargs)


def comparable(episode):
    """An episode's dict without wall-clock timing (the only field that may differ between runs)."""
    d = episode.to_dict()
    for inv in d["invocations"]:
        inv["timing"] = {}
    return d


def test_plan_groups_share_seed_and_sample():
    plans = plan_episodes(7, group_size=3, seed=10, indices=[4, 9, 2])
    assert [(p.group, p.member, p.seed) for p in plans] == [(0, 0, 10), (0, 1, 10), (0, 2, 10), (1, 0, 11),
                                                            (1, 1, 11), (1, 2, 11), (2, 0, 12)]
    assert [p.options for p in plans][::3] == [{"index": 4}, {"index": 9}, {"index": 2}]
    assert len({p.episode_id for p in plans}) == 7 and plans[4].group_id == "seed10/1"
    with pytest.raises(ValueError, match="need 3 sample indices"):
        plan_episodes(7, group_size=3, indices=[1])
    with pytest.raises(ValueError, match="group_size"):
        plan_episodes(2, group_size=0)


def test_rollout_groups_indices_and_jsonl(tok, tmp_path):
    envs = [make_env(tok) for _ in range(3)]
    oracle = OracleAgent.for_env(envs[0], tokenizer=tok)
    out = tmp_path / "eps.jsonl"
    episodes = rollout(envs, oracle, 8, group_size=2, seed=3, indices=[5, 6, 7, 8], out=out, progress=False)
    source = envs[0].unwrapped.source
    assert [e.sample_id for e in episodes] == [source[i].id for i in (5, 5, 6, 6, 7, 7, 8, 8)]
    assert [e.group_id for e in episodes] == [f"seed3/{g}" for g in (0, 0, 1, 1, 2, 2, 3, 3)]
    assert [e.seed for e in episodes] == [3, 3, 4, 4, 5, 5, 6, 6]
    assert all(e.metrics["f1"] == 1.0 for e in episodes)
    saved = load_episodes(out)
    assert saved.errors == [] and sorted(e.episode_id for e in saved.episodes) == sorted(e.episode_id for e in episodes)
    by_id = {e.episode_id: e for e in saved.episodes}
    assert all(by_id[e.episode_id] == e for e in episodes)  # lossless


def test_same_seed_same_episodes_and_seeded_sample_choice(tok):
    oracle = OracleAgent.for_env(make_env(tok), tokenizer=tok)
    a = rollout([make_env(tok), make_env(tok)], oracle, 4, seed=7, progress=False)
    b = rollout([make_env(tok)], oracle, 4, seed=7, progress=False)  # one env: same episodes
    assert [comparable(x) for x in a] == [comparable(x) for x in b]
    c = rollout([make_env(tok)], oracle, 4, seed=8, progress=False)
    assert [x.sample_id for x in c][:3] == [x.sample_id for x in a][1:]  # group g resets with seed + g


def test_episodes_of_different_lengths_refill_slots(tok):
    envs = [make_env(tok, num_chunks=1), make_env(tok, num_chunks=4)]
    oracle = OracleAgent.for_env(envs[0], tokenizer=tok)
    episodes = rollout(envs, oracle, 6, seed=0, indices=range(6), progress=False)
    lengths = sorted(len(e.invocations) for e in episodes)
    assert all(e.metrics["f1"] == 1.0 for e in episodes)
    assert lengths.count(2) >= 3 and 5 in lengths  # the short env took more episodes meanwhile


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED])
def test_vector_env_matches_list_of_envs(tok, mode):
    oracle = OracleAgent.for_env(make_env(tok), tokenizer=tok)
    reference = rollout([make_env(tok) for _ in range(3)], oracle, 7, seed=1, indices=range(7), progress=False)
    vec = SyncVectorEnv([lambda: make_env(tok) for _ in range(3)], autoreset_mode=mode)
    episodes = rollout(vec, oracle, 7, seed=1, indices=range(7), progress=False)
    assert [comparable(e) for e in episodes] == [comparable(e) for e in reference]


def test_info_at_unbatches_vector_infos():
    infos = {"a": [1, 2], "_a": [True, False], "m": {"f1": [0.5, 1.0], "_f1": [True, True]}, "_m": [True, True]}
    import numpy as np

    infos = {k: (np.array(v) if isinstance(v, list) else {kk: np.array(vv) for kk, vv in v.items()})
             for k, v in infos.items()}
    assert info_at(infos, 0) == {"a": 1, "m": {"f1": 0.5}}
    assert info_at(infos, 1) == {"m": {"f1": 1.0}}
    assert type(info_at(infos, 0)["a"]) is int


def test_model_calls_of_all_envs_are_batched_per_step():
    model, tokenizer = load("tiny")
    backend = CountingBackend(model, tokenizer, seed=0)
    agent = MemAgent(backend, SamplingParams(temperature=1.0, max_new_tokens=6))
    envs = [make_env(tokenizer, num_chunks=2) for _ in range(4)]
    episodes = rollout(envs, agent, 8, seed=0, progress=False)
    # 8 episodes of 3 calls on 4 envs in lockstep: 2 waves of 3 rounds, 4 requests each.
    assert backend.batches == [4] * 6
    assert all(len(e.invocations) == 3 for e in episodes)
    assert len({e.episode_id for e in episodes}) == 8


def test_bad_envs():
    with pytest.raises(ValueError, match="at least one environment"):
        rollout([], None, 1)
    with pytest.raises(TypeError, match="not a gymnasium.Env"):
        rollout([object()], None, 1)
