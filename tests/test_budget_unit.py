"""One memory-budget unit everywhere, and an oracle that answers only from what its memory holds.

The case users met: a task folder of their own with ``memory_budget = 8`` and a supporting fact of
12 tokens (6 words). ``env.step`` and ``memgym.play`` counted the budget in words, the eval path in
tokens; the oracle wrote an empty memory on every call and still scored F1 1.0. The budget is
counted in tokens (of the agent's tokenizer; an env made without one counts the default
tokenizer's, the tiny presets'), and the oracle answers from its memory alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import gymnasium as gym
import pytest

import memgym
from agents.records import load_episodes

REPO = Path(__file__).resolve().parent.parent
FACT = "Ada keeps her bike in Paris."
QUESTION = "Where does Ada keep her bike?"


def write_task(root: Path, budget: int = 8, facts: tuple[str, ...] = (FACT,), name: str = "BikeQA") -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "task.toml").write_text(f'name = "{name}"\nversion = 0\ndata = "data.jsonl"\n\n[env]\n'
                                      f'chunk_size = 64\nmemory_budget = {budget}\n')
    rows = [{"id": f"q{i}", "question": QUESTION, "answers": ["Paris"],
             "documents": [{"title": "Ada", "text": f"{' '.join(facts)} She likes tea."},
                           {"title": "Bob", "text": "Bob lives in Rome."}],
             "supporting_facts": list(facts)} for i in range(4)]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.fixture(scope="module")
def tokenizer():
    from agents.models import load_tokenizer

    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def bike(tmp_path_factory):
    root = write_task(tmp_path_factory.mktemp("tasks"))
    memgym.register_tasks([root])
    return root


def test_the_fact_is_longer_than_the_budget_in_tokens_not_in_words(tokenizer):
    assert len(FACT.split()) <= 8 < len(tokenizer(FACT, add_special_tokens=False)["input_ids"])


def test_a_bare_env_counts_the_budget_as_the_eval_path_does(bike, tokenizer):
    bare = gym.make("memgym/BikeQA-v0")
    bare.reset(seed=0)
    as_eval = gym.make("memgym/BikeQA-v0", tokenizer=tokenizer)  # what memopd.eval makes
    as_eval.reset(seed=0)
    got, want = bare.step(FACT)[-1], as_eval.step(FACT)[-1]
    assert got["budget_unit"] == want["budget_unit"] == "tokens"
    assert (got["memory"], got["memory_size"], got["memory_cut"]) == (want["memory"], want["memory_size"],
                                                                      want["memory_cut"])
    ids = tokenizer(FACT, add_special_tokens=False, return_offsets_mapping=True)
    assert got["memory_truncated"] and got["memory_size"] == 8
    assert got["memory"] == FACT[: ids["offset_mapping"][7][1]]  # the first 8 tokens, by the tokenizer's offsets


def test_play_counts_tokens_too(bike):
    env = {**os.environ, "MEMGYM_TASKS": str(bike)}
    out = subprocess.run([sys.executable, "-m", "memgym.play", "memgym/BikeQA-v0", "--index", "0"],
                         input=f"{FACT}\nParis\n", capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "memory 0/8 tokens" in out.stdout and "(memory cut to the budget: 4 tokens removed)" in out.stdout


def run_oracle(tmp_path: Path, *extra: str) -> tuple[dict, list]:
    from memopd.eval import evaluate

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = evaluate(["--env", "memgym/BikeQA-v0", "--agent", "oracle", "--episodes", "4", "--out",
                            str(tmp_path), "--no-progress", *extra])
    return summary, caught


def test_an_oracle_whose_budget_cannot_hold_the_fact_fails_and_says_so(bike, tmp_path, capsys):
    summary, caught = run_oracle(tmp_path / "short")
    assert summary["f1"] == 0.0
    episodes = load_episodes(tmp_path / "short" / "episodes.jsonl").episodes
    assert all(e.prediction == "" for e in episodes)
    assert all(e.dropped_facts == [FACT] for e in episodes)
    said = [str(w.message) for w in caught if "memory budget" in str(w.message)]
    assert said and "8 tokens" in said[0] and "12 tokens" in said[0] and FACT in said[0]
    assert "cannot hold" in capsys.readouterr().err


def test_an_oracle_with_room_for_the_fact_answers_from_it(bike, tmp_path):
    summary, caught = run_oracle(tmp_path / "room", "--env-kwarg", "memory_budget=16")
    assert summary["f1"] == 1.0
    episodes = load_episodes(tmp_path / "room" / "episodes.jsonl").episodes
    assert all(e.dropped_facts is None for e in episodes)
    assert not [w for w in caught if "memory budget" in str(w.message)]


def test_an_oracle_holding_only_some_facts_does_not_answer(tmp_path, tokenizer):
    """Two facts, a budget for one: the answer needs both, so the oracle gives none."""
    from agents.oracle import OracleAgent
    from agents.rollout import run_episode

    second = "Paris is in France."
    root = write_task(tmp_path, budget=14, facts=(FACT, second), name="BikeTwoQA")
    memgym.register_tasks([root])
    env = gym.make("memgym/BikeTwoQA-v0", tokenizer=tokenizer)
    agent = OracleAgent.for_env(env, tokenizer=tokenizer)
    with pytest.warns(UserWarning, match="cannot hold"):
        episode = run_episode(env, agent, seed=0)
    assert episode.prediction == "" and episode.reward == 0.0 and episode.dropped_facts == [second]
    memory = episode.invocations[0].response_text
    assert memory == FACT


def test_an_agent_must_count_with_the_env_tokenizer(bike):
    """Tokens of another tokenizer are another unit: the agent's records and the env's cut would disagree."""
    from agents.memagent import MemAgent
    from agents.policy import AgentError
    from agents.presets import build_tokenizer

    other = build_tokenizer(["Ada keeps her bike in Paris . Bob lives in Rome ."] * 20, vocab_size=300)
    env = gym.make("memgym/BikeQA-v0")
    obs, info = env.reset(seed=0)
    with pytest.raises(AgentError, match="tokenizer"):
        MemAgent(tokenizer=other).act(obs, info)


def test_the_default_tokenizer_is_the_tiny_presets(tokenizer):
    """memgym ships the tiny presets' tokenizer as its default (read without torch); if the preset's
    corpus changes, rebuild memgym/default_tokenizer.json from load_tokenizer("tiny")."""
    from memgym.chunking import default_tokenizer, tokenizer_fingerprint

    assert tokenizer_fingerprint(default_tokenizer()) == tokenizer_fingerprint(tokenizer)
    text = "Document 12: notes\nalice acme . the old river rests ."
    assert default_tokenizer().encode(text, add_special_tokens=False).ids == \
        tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_default_oracle_trajectories_are_those_of_before(tokenizer):
    """The SFT data of the embedded default (the auto teacher, the warm start) is unchanged: a hash of
    oracle episodes as the code before this change wrote them."""
    import hashlib

    from memopd.sft import oracle_episodes

    h = hashlib.sha256()
    for kw in ({}, {"num_chunks": 6, "chunk_size": 48, "memory_budget": 16}, {"hops": 2, "num_chunks": 4}):
        for e in oracle_episodes("memgym/LongQA-v0", kw, tokenizer, 64, seed=3, progress=False):
            for i in e.invocations:
                h.update(json.dumps([i.prompt_ids, i.response_ids, i.position_ids, i.prefix_len, i.role,
                                     i.spans]).encode())
            h.update(json.dumps([e.prediction, e.reward]).encode())
    assert h.hexdigest()[:16] == "0a885ab968c4b418"
