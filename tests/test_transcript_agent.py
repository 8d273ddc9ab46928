"""agents.memagent.TranscriptMemAgent acts in the persistent-history context: every call's prompt is
the flattened transcript that memopd.contexts' persistent mode scores that call's action in. The
reference is the packer's persistent transcript, built from MemAgent-format records of the same
actions, not the agent's own concatenation."""

import gymnasium as gym
import pytest

import memgym  # noqa: F401  (registers the envs)
from agents.backends.base import SamplingParams
from agents.backends.hf import HFBackend
from agents.memagent import MemAgent, TranscriptMemAgent
from agents.models import load
from agents.policy import strip_stop
from agents.records import Episode, Invocation
from agents.rollout import rollout
from memopd.contexts import persistent_units

SETTING = {"num_chunks": 4, "chunk_size": 48, "memory_budget": 16}


@pytest.fixture(scope="module")
def tiny():
    return load("tiny")


def chunks_of(env, seed):
    _, info = env.reset(seed=seed)
    question, chunks = info["question"], []
    while info["phase"] == "memory":
        chunks.append(info["chunk"])
        _, _, _, _, info = env.step("")
    return question, chunks


@pytest.mark.parametrize("seed", [3, 11])
def test_every_call_sees_the_persistent_transcript(tiny, seed):
    model, tok = tiny
    env = gym.make("memgym/LongQA-v0", split="test", tokenizer=tok, **SETTING)
    agent = TranscriptMemAgent(HFBackend(model, tok, seed=0), SamplingParams(temperature=1.0, max_new_tokens=16))
    (ep,) = rollout([env], agent, 1, seed=seed, progress=False)
    assert ep.agent == "memagent-transcript"
    assert [i.role for i in ep.invocations] == ["memory"] * 4 + ["answer"]

    # the same actions as MemAgent records: each call's own prompt, the memory the previous call wrote
    question, chunks = chunks_of(env, seed)
    builder = MemAgent(tokenizer=tok).prompts
    prefix = builder.prefix(question)
    memory: list[int] = []
    aligned = []
    for t, inv in enumerate(ep.invocations):
        if inv.role == "memory":
            p = builder.build("memory", prefix, memory=memory, chunk=builder.encode_text(chunks[t]))
        else:
            p = builder.build("answer", prefix, memory=memory)
        aligned.append(Invocation(prompt_ids=p.ids, response_ids=list(inv.response_ids),
                                  logprobs=list(inv.logprobs), position_ids=list(range(len(p.ids) + len(inv.response_ids))),
                                  prefix_len=p.prefix_len, role=inv.role, turn=t,
                                  spans={k: list(v) for k, v in p.spans.items()}))
        memory = strip_stop(inv)[:16]
    reference = Episode("e", "t", "s", aligned)
    (unit,) = persistent_units([reference])
    (block,) = unit.blocks
    for t, inv in enumerate(ep.invocations):
        first_action = block.action_idx[sum(len(i.response_ids) for i in ep.invocations[:t])]
        assert inv.prompt_ids == block.ids[:first_action], f"call {t}"
        assert inv.prompt_ids[:inv.prefix_len] == prefix
    # and the transcript grows call by call: each prompt extends the last prompt and its response
    for a, b in zip(ep.invocations, ep.invocations[1:]):
        assert b.prompt_ids[:len(a.prompt_ids) + len(a.response_ids)] == a.prompt_ids + a.response_ids


def test_the_first_call_is_memagents_without_the_empty_memory(tiny):
    model, tok = tiny
    env = gym.make("memgym/LongQA-v0", split="test", tokenizer=tok, **SETTING)
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, greedy=True)
    (mem,) = rollout([env], MemAgent(HFBackend(model, tok, seed=0), sp), 1, seed=5, progress=False)
    (tr,) = rollout([env], TranscriptMemAgent(HFBackend(model, tok, seed=0), sp), 1, seed=5, progress=False)
    first = mem.invocations[0]
    s, t = first.spans["memory"]
    assert tr.invocations[0].prompt_ids == first.prompt_ids[:s] + first.prompt_ids[t:]
    assert tr.invocations[0].response_ids == first.response_ids  # greedy: same first action
