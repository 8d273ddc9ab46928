"""Agents on the real LongQA env with the real tiny preset model (and the oracle, no model)."""

from __future__ import annotations

import gymnasium as gym
import pytest

import memgym  # noqa: F401  (registers the envs)
from agent_fixtures import CountingBackend, assert_memory_is_exact, run_recorded_episode
from agents.backends.base import SamplingParams
from agents.backends.hf import HFBackend
from agents.baselines import FullContextAgent, RAGAgent, bm25_rank
from agents.memagent import MemAgent
from agents.models import load
from agents.oracle import OracleAgent, supporting_texts
from agents.policy import AgentError, strip_stop
from agents.registry import make_agent
from agents.records import Invocation
from agents.rollout import run_episode


def same_text(a: str, b: str) -> bool:
    """Equal up to whitespace: the tiny preset's tokenizer decodes a word at a line start with
    the leading space of a mid-line word (one token per word wherever it stands)."""
    return a.split() == b.split()


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load("tiny")
    return model, tokenizer


@pytest.fixture(scope="module")
def backend(tiny):
    return HFBackend(*tiny, seed=0)


def make_env(tokenizer, **kwargs):
    return gym.make("memgym/LongQA-v0", split="test", tokenizer=tokenizer, **kwargs)


# ------------------------------------------------------------------------------------------ MemAgent
def test_memagent_episode_records(tiny, backend):
    model, tokenizer = tiny
    env = make_env(tokenizer, num_chunks=3)
    agent = MemAgent(backend, SamplingParams(temperature=1.0, max_new_tokens=40))
    episode, infos = run_recorded_episode(env, agent, seed=5)
    invs = episode.invocations
    assert [i.role for i in invs] == ["memory"] * 3 + ["answer"]
    assert [i.turn for i in invs] == [0, 1, 2, 3]
    assert all(i.meta["episode_id"] == episode.episode_id for i in invs)
    assert_memory_is_exact(episode, infos, tokenizer)
    budget = infos[0]["memory_budget"]
    assert all(len(i.response_ids) <= budget for i in invs[:3])  # memory calls capped at the budget
    assert len(invs[3].response_ids) <= agent.answer_sampling.max_new_tokens
    # Chunk segments are the env's chunks, encoded once; the question sits in the prefix.
    for inv, info in zip(invs[:3], infos):
        chunk_ids = inv.prompt_ids[slice(*inv.spans["chunk"])]
        assert chunk_ids == tokenizer(info["chunk"], add_special_tokens=False)["input_ids"]
        assert inv.meta["chunk_index"] == info["chunk_index"]
    assert info["question"] in tokenizer.decode(invs[0].prompt_ids[:invs[0].prefix_len])
    # The episode record carries the env's final outcome.
    assert episode.sample_id == infos[0]["sample_id"] and episode.task_id == "memgym/LongQA-v0"
    assert episode.prediction == tokenizer.decode(strip_stop(invs[3]), skip_special_tokens=True).strip()
    assert episode.reward == episode.metrics["f1"] and set(episode.metrics) == {"em", "f1", "sub_em"}
    assert episode.answers == [a for a in episode.answers if a] and episode.question == infos[0]["question"]
    assert episode.agent == "memagent" and "agent" not in episode.meta and episode.meta["num_chunks"] == 3


def test_act_batch_batches_all_slots_in_one_generate(tiny):
    model, tokenizer = tiny
    counting = CountingBackend(model, tokenizer, seed=0)
    agent = MemAgent(counting, SamplingParams(temperature=1.0, max_new_tokens=8))
    envs = [make_env(tokenizer, num_chunks=2) for _ in range(3)]
    steps = [env.reset(seed=s) for s, env in enumerate(envs)]
    for _ in range(3):  # two memory rounds and the answer round
        actions = agent.act_batch(steps)
        steps = [env.step(a) for env, a in zip(envs, actions)]
        steps = [(obs, info) for obs, _, _, _, info in steps]
    assert counting.batches == [3, 3, 3]
    episodes = [agent.end_episode(info, slot=i) for i, (_, info) in enumerate(steps)]
    assert len({e.episode_id for e in episodes}) == 3
    for e, (_, info) in zip(episodes, steps):  # each slot kept its own episode
        assert e.sample_id == info["sample_id"]
        assert all(i.meta["episode_id"] == e.episode_id for i in e.invocations)


def test_protocol_errors(tiny, backend):
    _, tokenizer = tiny
    env = make_env(tokenizer, num_chunks=2)
    agent = MemAgent(backend, SamplingParams(temperature=1.0, max_new_tokens=4))
    obs, info = env.reset(seed=1)
    env.step(agent.act(obs, info))
    with pytest.raises(AgentError, match="end_episode needs the info of the terminating step"):
        agent.end_episode(info)
    obs, info = env.reset(seed=2)  # a new episode in the same slot without end_episode
    with pytest.raises(AgentError, match="start of another episode"):
        agent.act(obs, info)
    agent.abort_episode()
    agent.act(obs, info)  # fine after abort
    with pytest.raises(AgentError, match="no running episode"):
        agent.state(7)
    with pytest.raises(ValueError, match="slots must be distinct"):
        agent.act_batch([(obs, info), (obs, info)], [0, 0])
    with pytest.raises(ValueError, match="unknown agent 'mem'; available agents: fullcontext, memagent, oracle, rag"):
        make_agent("mem")


# ------------------------------------------------------------------------------------------ baselines
def test_fullcontext_reads_everything_then_answers_once(tiny, backend):
    _, tokenizer = tiny
    env = make_env(tokenizer, num_chunks=3)
    agent = FullContextAgent(backend, answer_max_new_tokens=5)
    episode, infos = run_recorded_episode(env, agent, seed=3)
    assert [i.role for i in episode.invocations] == ["answer"]
    inv = episode.invocations[0]
    context = inv.prompt_ids[slice(*inv.spans["context"])]
    expected = agent.prompts.join([agent.prompts.encode_text(i["chunk"]) for i in infos[:3]])
    assert context == expected and inv.meta["context_cut"] == 0
    assert same_text(tokenizer.decode(context), "\n\n".join(i["chunk"] for i in infos[:3]))


def test_fullcontext_truncates_to_the_context_length_keeping_recent_text(tiny, backend):
    _, tokenizer = tiny
    env = make_env(tokenizer, num_chunks=4, chunk_size=64)  # longer than the 300-token limit
    full = FullContextAgent(backend, answer_max_new_tokens=5)
    limit = 300
    short = FullContextAgent(backend, answer_max_new_tokens=5, context_length=limit)
    ep_full, _ = run_recorded_episode(env, full, seed=4)
    ep_short, _ = run_recorded_episode(env, short, seed=4)
    ctx_full = ep_full.invocations[0].prompt_ids[slice(*ep_full.invocations[0].spans["context"])]
    inv = ep_short.invocations[0]
    ctx_short = inv.prompt_ids[slice(*inv.spans["context"])]
    assert len(ctx_full) > len(ctx_short) > 0
    assert ctx_full[-len(ctx_short):] == ctx_short  # the most recent tokens are kept
    assert inv.meta["context_cut"] == len(ctx_full) - len(ctx_short)
    assert len(inv.prompt_ids) + 5 == limit  # filled exactly, room left for the answer
    with pytest.raises(ValueError, match="longer context"):
        run_recorded_episode(env, FullContextAgent(backend, context_length=50), seed=4)


def okapi_scores(query, docs, k1=1.5, b=0.75, eps=0.25):
    """BM25 Okapi written out (Robertson et al.; negative idf floored at eps * mean idf, as rank_bm25)."""
    import math

    toks = [d.lower().replace(".", " ").split() for d in docs]
    n, avgdl = len(toks), sum(map(len, toks)) / len(toks)
    vocab = {w for t in toks for w in t}
    idf = {w: math.log((n - sum(w in t for t in toks) + 0.5) / (sum(w in t for t in toks) + 0.5)) for w in vocab}
    floor = eps * sum(idf.values()) / len(idf)
    idf = {w: (v if v >= 0 else floor) for w, v in idf.items()}
    return [sum(idf.get(q, 0.0) * t.count(q) * (k1 + 1) / (t.count(q) + k1 * (1 - b + b * len(t) / avgdl))
                for q in query.lower().split()) for t in toks]


def test_bm25_rank_matches_okapi_written_out():
    docs = ["the old river rests .", "karl aperture . the river", "nina ecorp .", "karl karl aperture .",
            "the small meadow fades .", "zane initech . the tall tower"]
    query = "which company does karl work at"
    scores = okapi_scores(query, docs)
    assert bm25_rank(query, docs) == sorted(range(len(docs)), key=lambda i: (-scores[i], i))
    assert bm25_rank(query, docs)[:2] == [3, 1]  # two mentions beat one
    assert bm25_rank("zzz", docs) == list(range(6))  # no match anywhere: reading order
    assert bm25_rank("q", []) == []


def test_rag_retrieves_the_fact_chunk(tiny, backend):
    _, tokenizer = tiny
    env = make_env(tokenizer, num_chunks=5)
    agent = RAGAgent(backend, top_k=1, answer_max_new_tokens=4)
    source = env.unwrapped.source
    hits = 0
    for seed in range(4):
        episode, infos = run_recorded_episode(env, agent, seed=seed)
        inv = episode.invocations[0]
        assert [i.role for i in episode.invocations] == ["answer"]
        fact = supporting_texts(source[source.index_of(episode.sample_id)])[0]
        (k,) = inv.meta["retrieved"]
        context = tokenizer.decode(inv.prompt_ids[slice(*inv.spans["context"])])
        assert same_text(context, infos[k]["chunk"])
        hits += fact in context
    assert hits == 4  # the question's person only appears in its fact


# ------------------------------------------------------------------------------------------ oracle
def test_oracle_scores_f1_one_and_keeps_the_facts(tiny):
    _, tokenizer = tiny
    env = make_env(tokenizer)  # the default LongQA setting
    oracle = OracleAgent.for_env(env, tokenizer=tokenizer)
    source = env.unwrapped.source
    for seed in range(20):
        episode, infos = run_recorded_episode(env, oracle, seed=seed)
        assert episode.metrics == {"em": 1.0, "f1": 1.0, "sub_em": 1.0}
        assert_memory_is_exact(episode, infos, tokenizer)
        facts = supporting_texts(source[source.index_of(episode.sample_id)])
        answer_call = episode.invocations[-1]
        memory = tokenizer.decode(answer_call.prompt_ids[slice(*answer_call.spans["memory"])])
        assert same_text(memory, " ".join(facts))  # every supporting fact, verbatim, in reading order
        for inv in episode.invocations:
            assert isinstance(inv, Invocation) and inv.meta["oracle"] is True
            assert inv.response_ids[-1] == tokenizer.eos_token_id and inv.finish_reason == "eos"
            assert inv.logprobs == [0.0] * len(inv.response_ids)
            assert inv.position_ids == list(range(inv.total_len))
            assert same_text(tokenizer.decode(inv.response_ids[:-1]), inv.response_text)
        assert not any(i["memory_truncated"] for i in infos)


def test_oracle_memory_grows_with_facts_seen_and_respects_the_budget(tiny):
    _, tokenizer = tiny
    env = make_env(tokenizer, hops=2, num_chunks=4, memory_budget=64)
    oracle = OracleAgent.for_env(env, tokenizer=tokenizer)
    episode, infos = run_recorded_episode(env, oracle, seed=0)
    facts = supporting_texts(env.unwrapped.source[env.unwrapped.source.index_of(episode.sample_id)])
    for inv, info in zip(episode.invocations[:-1], infos):
        seen = [f for f in facts if any(f in i["chunk"] for i in infos[: info["chunk_index"] + 1])]
        assert inv.response_text == " ".join(seen)
    tight = make_env(tokenizer, hops=2, num_chunks=4, memory_budget=2)  # no whole fact fits
    with pytest.warns(UserWarning, match=r"memory budget \(2 tokens\) cannot hold"):
        episode, infos = run_recorded_episode(tight, OracleAgent.for_env(tight, tokenizer=tokenizer), seed=0)
    assert all(i.response_text == "" for i in episode.invocations[:-1])
    # It answers from its (empty) memory alone: no answer, and the record names what it lacked.
    assert episode.metrics["f1"] == 0.0 and episode.prediction == "" and episode.dropped_facts == facts


def test_oracle_errors(tiny):
    _, tokenizer = tiny
    with pytest.raises(TypeError, match="sample source"):
        OracleAgent(samples=42, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="calls no model"):
        OracleAgent(samples=lambda t, s: None, tokenizer=tokenizer, backend=object())


def test_run_episode_in_an_env_made_without_a_tokenizer(tiny, backend):
    _, tokenizer = tiny
    env = gym.make("memgym/LongQA-v0", split="test", num_chunks=2, memory_budget=3)  # the default tokenizer: tiny's
    agent = MemAgent(backend, SamplingParams(temperature=1.0, max_new_tokens=30))
    episode = run_episode(env, agent, seed=0)
    assert len(episode.invocations) == 3 and episode.meta["budget_unit"] == "tokens"
    # Memory calls sample at most the budget, and the next call's memory is what was sampled.
    first, second = episode.invocations[0], episode.invocations[1]
    assert first.sampling["max_new_tokens"] == 3
    memory = second.prompt_ids[slice(*second.spans["memory"])]
    assert len(memory) <= 3 and memory == first.response_ids[:len(memory)]
