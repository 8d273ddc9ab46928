"""agents.rag: BM25 retrieval of the supporting chunk on LongQA, and the rag-memagent agent
(MemAgent calls over the retrieved chunks only) through rollouts, the registry and the eval CLI."""

from __future__ import annotations

import gymnasium as gym
import pytest

import memgym  # noqa: F401  (registers the envs)
from agents.backends.base import SamplingParams
from agents.backends.hf import HFBackend
from agents.models import load
from agents.policy import strip_stop
from agents.baselines import bm25_rank
from agents.rag import RAGMemAgent
from agents.registry import build_agent, registered_agents, resolve_agent
from agents.rollout import rollout
from memopd.contexts import check_contract

ENV = "memgym/LongQA-v0"
LADDER = {"chunk_size": 48, "memory_budget": 16}


@pytest.fixture(scope="module")
def tiny():
    return load("tiny")


@pytest.fixture(scope="module")
def backend(tiny):
    return HFBackend(*tiny, seed=0)


def make_env(tokenizer=None, **kwargs):
    kw = {"tokenizer": tokenizer} if tokenizer is not None else {}
    return gym.make(ENV, split="test", **kw, **kwargs)


def read_episode(env, seed):
    """The question, the chunks and the sample of one episode, stepping the env with empty memories."""
    _, info = env.reset(seed=seed)
    question, chunks = info["question"], []
    while info["phase"] == "memory":
        chunks.append(info["chunk"])
        _, _, _, _, info = env.step("")
    source = env.unwrapped.source
    return question, chunks, source[source.index_of(info["sample_id"])]


# ------------------------------------------------------------------------------------------ BM25
@pytest.mark.parametrize("num_chunks", [6, 24])
def test_bm25_retrieves_the_supporting_chunk_on_longqa(tiny, num_chunks):
    _, tokenizer = tiny
    env = make_env(tokenizer, num_chunks=num_chunks, distractor_similarity=0.0, **LADDER)
    where = set()
    for seed in range(25):
        question, chunks, sample = read_episode(env, seed)
        assert len(chunks) == num_chunks
        (fact,) = sample.supporting_facts
        assert bm25_rank(question, chunks)[:1] == [fact["chunk"]]
        assert fact["text"] in chunks[fact["chunk"]]
        where.add(fact["chunk"])
    assert len(where) > 3  # the fact moves around: retrieval is not reading order


# ------------------------------------------------------------------------------------------ the agent
def test_rollout_makes_one_memory_call_per_retrieved_chunk(tiny, backend):
    _, tokenizer = tiny
    envs = [make_env(tokenizer, num_chunks=12, distractor_similarity=0.0, **LADDER) for _ in range(4)]
    agent = RAGMemAgent(backend, SamplingParams(temperature=1.0, max_new_tokens=48))
    episodes = rollout(envs, agent, 8, seed=100, progress=False)
    source = envs[0].unwrapped.source
    for ep in episodes:
        assert ep.agent == "rag-memagent" and ep.meta["num_chunks"] == 12 and ep.meta["steps"] == 13
        assert [i.role for i in ep.invocations] == ["memory", "answer"]  # 2 calls, not 13
        assert [i.turn for i in ep.invocations] == [0, 1]
        memory_call, answer_call = ep.invocations
        (fact,) = source[source.index_of(ep.sample_id)].supporting_facts
        assert memory_call.meta["chunk_index"] == fact["chunk"] and memory_call.meta["retrieved"] == [fact["chunk"]]
        chunk = tokenizer.decode(memory_call.prompt_ids[slice(*memory_call.spans["chunk"])])
        assert " ".join(fact["text"].split()) in " ".join(chunk.split())
        # MemAgent's calls: the first from the empty memory, the answer from exactly the ids written
        assert memory_call.prompt_ids[slice(*memory_call.spans["memory"])] == []
        assert len(memory_call.response_ids) <= LADDER["memory_budget"]
        assert answer_call.prompt_ids[slice(*answer_call.spans["memory"])] == strip_stop(memory_call)
        assert answer_call.prompt_ids[:answer_call.prefix_len] == memory_call.prompt_ids[:memory_call.prefix_len]
    check_contract(episodes)
    check_contract(episodes, "persistent", teacher_roles=("memory", "answer"), reward="f1")


def test_top_k_chunks_in_document_order_and_memory_chained(tiny, backend):
    _, tokenizer = tiny
    env = make_env(tokenizer, num_chunks=6, distractor_similarity=0.5, **LADDER)
    agent = RAGMemAgent(backend, SamplingParams(temperature=1.0, max_new_tokens=48), top_k=3)
    (ep,) = rollout([env], agent, 1, seed=7, progress=False)
    question, chunks, _ = read_episode(env, 7)
    want = sorted(bm25_rank(question, chunks)[:3])
    invs = ep.invocations
    assert [i.role for i in invs] == ["memory"] * 3 + ["answer"]
    assert [i.meta["chunk_index"] for i in invs[:3]] == want == sorted(want)
    for prev, nxt in zip(invs, invs[1:]):
        assert nxt.prompt_ids[slice(*nxt.spans["memory"])] == strip_stop(prev)
    check_contract([ep])
    # more retrieved than there are chunks: every chunk, once
    agent = RAGMemAgent(backend, SamplingParams(temperature=1.0, max_new_tokens=48), top_k=10)
    (ep,) = rollout([make_env(tokenizer, num_chunks=3, **LADDER)], agent, 1, seed=7, progress=False)
    assert [i.meta.get("chunk_index") for i in ep.invocations] == [0, 1, 2, None]


def test_memory_cut_to_a_word_budget_as_the_env_would(tiny, backend):
    _, tokenizer = tiny
    env = make_env(num_chunks=4, memory_budget=3)  # words, and uncapped sampling: the model writes past it
    agent = RAGMemAgent(backend, SamplingParams(temperature=1.0, max_new_tokens=24), top_k=4, cap_memory_sampling=False)
    cuts = 0
    for ep in rollout([env], agent, 6, seed=0, progress=False):
        invs = ep.invocations
        assert len(invs) == 5
        for prev, nxt in zip(invs, invs[1:]):
            memory = nxt.prompt_ids[slice(*nxt.spans["memory"])]
            sampled = strip_stop(prev)
            assert memory == sampled[:len(memory)]  # a prefix of what was sampled
            kept, _, cut = env.unwrapped.counter.cut(tokenizer.decode(sampled, skip_special_tokens=True), 3)
            assert len(tokenizer.decode(memory, skip_special_tokens=True).split()) <= 3
            assert (len(memory) < len(sampled)) == (cut > 0)
            cuts += cut > 0
    assert cuts > 0


def test_registered_as_rag_memagent_and_built_by_the_convention(tiny, backend):
    assert resolve_agent("rag-memagent") is RAGMemAgent
    assert registered_agents()["rag-memagent"].target == "agents.rag:RAGMemAgent"
    sp = SamplingParams(temperature=1.0, max_new_tokens=8)
    agent = build_agent("rag-memagent", {"backend": backend, "sampling": sp}, {"answer_max_new_tokens": 4, "top_k": 2})
    assert isinstance(agent, RAGMemAgent) and agent.top_k == 2 and agent.answer_sampling.max_new_tokens == 4
    with pytest.raises(ValueError, match="top_k must be an int >= 1"):
        build_agent("rag-memagent", {"backend": backend, "sampling": sp}, options={"top_k": 0})


def test_eval_cli_runs_rag_bm25(tmp_path):
    from agents.records import load_episodes
    from memopd.eval import main as evaluate

    assert evaluate(["--agent", "rag-memagent", "--model", "tiny", "--episodes", "2", "--env-kwarg", "num_chunks=6",
                     "--top-k", "1", "--out", str(tmp_path), "--no-progress", "--threads", "1"]) == 0
    episodes = load_episodes(tmp_path / "episodes.jsonl").episodes
    assert [e.agent for e in episodes] == ["rag-memagent"] * 2
    assert all([i.role for i in e.invocations] == ["memory", "answer"] for e in episodes)
