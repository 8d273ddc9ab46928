"""The memory tasks (KnowledgeUpdate, MultiValue, VariableTracking, Counting): hand-worked episodes,
an independent solver over many samples, the oracle from its own memory at three lengths,
check_env, laziness, the budget in the question and in the sampling cap."""

from __future__ import annotations

import re
import time
import tracemalloc

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import memgym  # noqa: F401
from memgym.chunking import iter_chunks
from memgym.generators import counting, knowledge_update, multi_value, variable_tracking

TASKS = ("KnowledgeUpdate", "MultiValue", "VariableTracking", "Counting")
MODULES = {"KnowledgeUpdate": knowledge_update, "MultiValue": multi_value, "VariableTracking": variable_tracking,
           "Counting": counting}
FACT = re.compile(r"(?<!\w)(\w+) (\w+) \.")
ASSIGN = re.compile(r"(?<!\w)(\w+) = (\w+) \.")


def chunks_of(sample, size=64):
    return [c.text for c in iter_chunks(sample.documents, size)]


def oracle_memories(sample, chunks):
    memory, out = "", []
    for chunk in chunks:
        memory = " ".join(sample.oracle.update(memory, chunk))
        out.append(memory)
    return out


# --- hand-worked episodes: sample 0 of the test split, seed 0, the defaults (words, chunks of 64) ---------
HAND = {
    "KnowledgeUpdate": dict(kw={"updates": 2}, question="where does petra live now ? ( memory : 16 tokens )",
                            answer="osaka", chunks=[0, 1, 2],
                            facts=["petra austin .", "petra perth .", "petra osaka ."],
                            memories=["petra austin .", "petra perth .", "petra osaka .", "petra osaka ."]),
    "MultiValue": dict(kw={"values": 3}, question="which cities does igor visit ? ( memory : 16 tokens )",
                       answer="chicago perth manila", chunks=[1, 2, 3],
                       facts=["igor chicago .", "igor perth .", "igor manila ."],
                       memories=["", "igor chicago .", "igor chicago . igor perth .",
                                 "igor chicago . igor perth . igor manila ."]),
    "VariableTracking": dict(kw={}, question="which variables hold 8368 ? ( memory : 16 tokens )", answer="nut yam",
                             chunks=[0, 1], facts=["nut = 8368 .", "yam = nut ."],
                             memories=["nut", "nut yam", "nut yam", "nut yam"]),
    "Counting": dict(kw={}, question="how many times does mila visit seville ? ( memory : 16 tokens )", answer="3",
                     chunks=[0, 1, 2], facts=["mila seville ."] * 3,
                     memories=["mila seville 1", "mila seville 2", "mila seville 3", "mila seville 3"]),
}


@pytest.mark.parametrize("task", TASKS)
def test_hand_worked_episode(task):
    want = HAND[task]
    sample = MODULES[task].make_source("test", 0, **want["kw"])[0]
    chunks = chunks_of(sample)
    assert len(chunks) == 4
    assert (sample.question, sample.answers) == (want["question"], [want["answer"]])
    assert [f["chunk"] for f in sample.supporting_facts] == want["chunks"]  # supporting chunks, in reading order
    assert [f["text"] for f in sample.supporting_facts] == want["facts"]
    for fact in sample.supporting_facts:
        assert fact["text"] in chunks[fact["chunk"]]
    memories = oracle_memories(sample, chunks)
    assert memories == want["memories"]
    assert sample.oracle.answer(memories[-1]) == want["answer"] and sample.oracle.missing(memories[-1]) == []
    assert sample.oracle.answer("") in ("", "0")  # nothing in memory, no answer


def test_the_hand_worked_distractor_chain_does_not_count():
    sample = variable_tracking.make_source("test", 0)[0]
    assert sample.metadata["distractor_chains"] == [["urn", "cod"]]
    assert "urn = 7955 ." in chunks_of(sample)[2] and "cod = urn ." in chunks_of(sample)[3]


# --- an independent solver over many samples, with distractors ---------------------------------------------
def solve(task: str, sample) -> str:
    """Answer from the whole input text, without the generator's plan or the oracle."""
    text = " ".join(chunks_of(sample, sample.metadata["chunk_size"]))
    q = sample.question
    if task == "KnowledgeUpdate":  # one person or several: `where do A and B live now ?`
        people = re.search(r"where do(?:es)? (.+) live", q).group(1).split(" and ")
        return " ".join([o for s, o in FACT.findall(text) if s == person][-1] for person in people)
    if task == "MultiValue":
        person = re.search(r"which cities does (\w+) visit", q).group(1)
        return " ".join(o for s, o in FACT.findall(text) if s == person)
    if task == "VariableTracking":
        value = re.search(r"which variables hold (\d+)", q).group(1)
        holds: dict[str, str] = {}
        for lhs, rhs in ASSIGN.findall(text):
            holds[lhs] = holds.get(rhs, rhs)
        return " ".join(v for v, x in holds.items() if x == value)
    keys = re.findall(r"(\w+) visit (\w+)", q.split("does", 1)[1])  # one or more: `A visit X and B visit Y`
    return " ".join(str(sum(1 for s, o in FACT.findall(text) if (s, o) == key)) for key in keys)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("kw", [{}, {"distractor_similarity": 1.0, "num_chunks": 9}])
def test_answers_agree_with_an_independent_solver(task, kw):
    answers_agree(task, kw)


@pytest.mark.parametrize("kw", [{"keys": 2},
                                {"keys": 4, "max_count": 5, "distractor_similarity": 1.0, "num_chunks": 9}])
def test_several_counts_agree_with_an_independent_solver(kw):
    answers_agree("Counting", kw)


@pytest.mark.parametrize("kw", [{"people": 2}, {"people": 5, "updates": 3, "distractor_similarity": 1.0,
                                                "num_chunks": 9}])
def test_several_people_agree_with_an_independent_solver(kw):
    answers_agree("KnowledgeUpdate", kw)


def answers_agree(task, kw):
    source = MODULES[task].make_source("train", 5, **kw)
    for i in range(40):
        sample = source[i]
        assert solve(task, sample) == sample.answers[0], (task, i)
        chunks = chunks_of(sample, sample.metadata["chunk_size"])
        assert len(chunks) == sample.metadata["num_chunks"]
        order = [f["chunk"] for f in sample.supporting_facts]
        assert order == sorted(order)  # supporting facts (updates, values, the chain) in reading order
        for fact in sample.supporting_facts:
            assert fact["text"] in chunks[fact["chunk"]]


def test_two_counts_by_hand():
    """keys=2, sample 0 of the test split: mila/seville 3 times (chunks 0, 1, 2) and george/dhaka 3
    times (1, 2, 3); a chunk holding both states them in the question's order, in one document."""
    sample = counting.make_source("test", 0, keys=2)[0]
    assert sample.question == "how many times does mila visit seville and george visit dhaka ? ( memory : 16 tokens )"
    assert sample.answers == ["3 3"]
    assert [(f["person"], f["chunk"]) for f in sample.supporting_facts] == [
        ("mila", 0), ("mila", 1), ("george", 1), ("mila", 2), ("george", 2), ("george", 3)]
    chunks = chunks_of(sample)
    assert "mila seville . george dhaka ." in chunks[1] and "mila seville . george dhaka ." in chunks[2]
    memories = oracle_memories(sample, chunks)
    assert memories == ["mila seville 1", "mila seville 2 george dhaka 1", "mila seville 3 george dhaka 2",
                        "mila seville 3 george dhaka 3"]
    assert sample.oracle.answer(memories[-1]) == "3 3" and sample.oracle.missing(memories[-1]) == []
    # a memory that lost a count answers the one it holds, and says what it lacks
    assert sample.oracle.answer("george dhaka 3") == "3"
    assert sample.oracle.missing("george dhaka 3") == ["mila seville 3"]


def test_two_people_by_hand():
    """people=2, sample 0 of the test split: zane athens (chunk 0) -> riyadh (3), petra austin (2) ->
    perth (3); the oracle keeps the latest of each, in the question's order, and overwrites both."""
    sample = knowledge_update.make_source("test", 0, people=2)[0]
    assert sample.question == "where do petra and zane live now ? ( memory : 16 tokens )"
    assert sample.answers == ["perth riyadh"]
    assert [(f["person"], f["update"], f["chunk"]) for f in sample.supporting_facts] == [
        ("zane", 0, 0), ("petra", 0, 2), ("petra", 1, 3), ("zane", 1, 3)]
    chunks = chunks_of(sample)
    assert "petra perth . zane riyadh ." in chunks[3]  # one chunk, one document, the question's order
    memories = oracle_memories(sample, chunks)
    assert memories == ["zane athens .", "zane athens .", "petra austin . zane athens .",
                        "petra perth . zane riyadh ."]
    assert sample.oracle.answer(memories[-1]) == "perth riyadh" and sample.oracle.missing(memories[-1]) == []
    assert sample.oracle.answer("zane riyadh .") == "riyadh"  # a lost person is left out, not guessed
    assert sample.oracle.missing("petra austin . zane riyadh .") == ["petra perth ."]  # a stale fact is missing


@pytest.mark.parametrize("module,kw,digest", [
    (counting, {"max_count": 5}, "6a4ca08f9e55f335"), (knowledge_update, {"updates": 3}, "9ef2295207a37797")])
def test_one_key_draws_the_samples_it_drew_before_the_option(module, kw, digest):
    """keys=1 / people=1 (the modules' default) consume the random stream as the tasks did before
    the option: the hash of 100 samples' text, answers, facts and metadata is the one recorded then."""
    import hashlib
    import json

    h = hashlib.sha256()
    for extra in ({}, {"distractor_similarity": 0.5, "num_chunks": 9, **kw}):
        source = module.make_source("train", 3, **extra)
        for i in range(50):
            s = source[i]
            h.update(json.dumps([s.id, s.question, s.answers, s.supporting_facts, s.metadata, chunks_of(s)],
                                sort_keys=True).encode())
    assert h.hexdigest()[:16] == digest


@pytest.mark.parametrize("task,kw", [("KnowledgeUpdate", {"people": 2}), ("Counting", {})])
def test_two_items_bind_a_budget_of_one(task, kw):
    """In the digit presets' tokens one item (``petra perth .``, ``mila seville 3``) fits 4 tokens and
    two do not: two people, or two counts (Counting's default), and the oracle at 4 tokens answers one of two."""
    from agents.models import load_tokenizer

    tok = load_tokenizer("tiny-digits")
    big = oracle_f1(f"memgym/{task}-v0", 16, tokenizer=tok, memory_budget=16, **kw)
    with pytest.warns(UserWarning, match="cannot hold"):
        small = oracle_f1(f"memgym/{task}-v0", 16, tokenizer=tok, memory_budget=4, **kw)
    assert big == 1.0 and 0.5 < small < 0.9


def test_updates_sit_in_distinct_chunks_in_order():
    source = knowledge_update.make_source("train", 1, updates=3, num_chunks=6)
    for i in range(30):
        facts = source[i].supporting_facts
        assert [f["update"] for f in facts] == [0, 1, 2, 3]
        chunks = [f["chunk"] for f in facts]
        assert len(set(chunks)) == 4 and chunks == sorted(chunks)


# --- the oracle, from its own memory, through the env -------------------------------------------------------
def oracle_f1(env_id: str, episodes: int, **kw) -> float:
    from agents.oracle import OracleAgent
    from agents.rollout import run_episode

    env = gym.make(env_id, split="test", **kw)
    agent = OracleAgent.for_env(env, tokenizer=None if "tokenizer" not in kw else kw["tokenizer"])
    return sum(run_episode(env, agent, seed=s).reward for s in range(episodes)) / episodes


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("num_chunks", [4, 24, 96])
def test_the_oracle_scores_one_at_three_lengths(task, num_chunks):
    # chunks of 64: a random document label beside a VariableTracking fact overflows its default 32
    assert oracle_f1(f"memgym/{task}-v0", 16, num_chunks=num_chunks, chunk_size=64, distractor_similarity=0.5,
                     numbering="random") == 1.0


def test_a_small_budget_binds_the_oracle_on_multivalue():
    """Three facts of 3 tokens need 11 tokens; 7 hold two: the oracle answers two of three."""
    from agents.oracle import OracleAgent
    from agents.rollout import run_episode

    env = gym.make("memgym/MultiValue-v0", split="test", memory_budget=7, values=3)
    with pytest.warns(UserWarning, match="cannot hold"):
        episode = run_episode(env, OracleAgent.for_env(env), seed=0)
    assert len(episode.prediction.split()) == 2 and episode.reward == pytest.approx(0.8)
    assert len(episode.dropped_facts) == 1 and "( memory : 7 tokens )" in episode.question


@pytest.mark.parametrize("task", TASKS)
def test_check_env_is_clean(task):
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error")  # check_env warns on anything it dislikes
        check_env(gym.make(f"memgym/{task}-v0").unwrapped, skip_render_check=True)


@pytest.mark.parametrize("task", TASKS)
def test_any_length_streams_lazily(task):
    source = MODULES[task].make_source("train", 0, num_chunks=20_000)
    tracemalloc.start()
    t0 = time.perf_counter()
    sample = source[3]
    for k, _ in zip(range(30), iter_chunks(sample.documents, 64)):
        pass
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert time.perf_counter() - t0 < 5 and peak < 2 << 20  # 30 chunks of 20,000: nothing else is built


@pytest.mark.parametrize("task", TASKS)
def test_the_question_states_the_budget_and_memagent_caps_at_it(task):
    from agents.memagent import MemAgent
    from agents.models import load_tokenizer

    env = gym.make(f"memgym/{task}-v0", memory_budget=9)
    _, info = env.reset(seed=0)
    assert info["question"].endswith("( memory : 9 tokens )")
    agent = MemAgent(tokenizer=load_tokenizer("tiny"))
    assert agent.memory_sampling(info).max_new_tokens == 9
    quiet = gym.make(f"memgym/{task}-v0", state_budget=False)
    assert "memory" not in quiet.reset(seed=0)[1]["question"]


def test_bad_knobs_are_refused():
    with pytest.raises(ValueError, match="updates=4 is invalid"):
        gym.make("memgym/KnowledgeUpdate-v0", updates=4)  # 4 chunks hold at most 3 updates
    with pytest.raises(ValueError, match="max_count=9 is invalid"):
        gym.make("memgym/Counting-v0", max_count=9)
    with pytest.raises(ValueError, match="people=7 is invalid"):
        gym.make("memgym/KnowledgeUpdate-v0", people=7)
    with pytest.raises(ValueError, match="keys=7 is invalid"):
        gym.make("memgym/Counting-v0", keys=7)
    with pytest.raises(ValueError, match="keys=0 is invalid"):
        gym.make("memgym/Counting-v0", keys=0)
    with pytest.raises(ValueError, match="values=0 is invalid"):
        gym.make("memgym/MultiValue-v0", values=0)
    with pytest.raises(TypeError, match="unknown option"):
        gym.make("memgym/VariableTracking-v0", hopz=3)
