"""The hf backend's fast paths (prompt heads kept across calls, prefill in length groups, a KV
cache grown in place) give the records of the plain path: every token by a full forward over the
prompt and the tokens so far, no cache, no padding (tests/agent_fixtures.py NaiveBackend)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from transformers.cache_utils import DynamicLayer

import memgym
from agents import MemAgent, models
from agents.backends import GenerationRequest, HFBackend, SamplingParams
from agents.backends.hf_cache import GrowingLayer
from agents.backends.hf_prefill import GROUP_COST_TOKENS, head_cut, length_groups
from agents.rollout import rollout
from agent_fixtures import NaiveBackend, assert_same_records, rescore

GREEDY = SamplingParams(greedy=True, max_new_tokens=8)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)


def test_length_groups_is_the_cheapest_cut():
    """Against every way of cutting the sorted rows into runs (brute force)."""
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        lengths = [rng.choice([3, 40, 41, 45, 90, 92, 300]) + rng.randint(0, 5) for _ in range(n)]
        cost = rng.choice([0, 10, GROUP_COST_TOKENS, 1000])
        cap = rng.choice([100, 400, 10**9])
        runs = length_groups(lengths, cost, cap)
        assert sorted(i for run in runs for i in run) == list(range(n))

        def price(rs):
            if any(len(r) > 1 and len(r) * max(lengths[i] for i in r) > cap for r in rs):
                return float("inf")
            return sum(len(r) * max(lengths[i] for i in r) + cost for r in rs)

        order = sorted(range(n), key=lambda i: lengths[i])
        best = min(price([order[a:b] for a, b in zip((0, *cuts), (*cuts, n))])
                   for k in range(n) for cuts in itertools.combinations(range(1, n), k))
        assert price(runs) == best < float("inf")


def test_growing_layer_holds_what_the_dynamic_layer_holds():
    torch.manual_seed(0)
    grow, plain = GrowingLayer(room=2), DynamicLayer()
    steps = [7, 1, 1, 1, 4, 1]  # the 4 overflows the room: the buffer is reallocated
    rows = 3
    for i, s in enumerate(steps):
        k, v = torch.randn(rows, 2, s, 4), torch.randn(rows, 2, s, 4)
        a, b = grow.update(k, v), plain.update(k, v)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        if i == 2:  # a row finished: it leaves the cache
            for layer in (grow, plain):
                layer.batch_select_indices(torch.tensor([2, 0]))
            rows = 2
    assert grow.get_seq_length() == plain.get_seq_length() == sum(steps)
    assert torch.equal(grow.keys, plain.keys) and torch.equal(grow.values, plain.values)


def segment_calls(tokenizer, turn: int, memories: list[str]) -> list[GenerationRequest]:
    """One call per episode at ``turn``, built like MemAgent's: prefix (instructions + question),
    the memory between markers, then the chunk (the newest segment) and a closing line."""
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    reqs = []
    for e, memory in enumerate(memories):
        prefix = enc(f"read the chunks and answer . question {e} : who is carol ?")
        head = prefix + enc(" memory :") + enc(memory) + enc(" chunk :")
        chunk = enc(" alice works at the museum ." * (1 + (e + turn) % 3) + f" part {turn} .")
        m0 = len(prefix) + len(enc(" memory :"))
        spans = {"memory": [m0, m0 + len(enc(memory))], "chunk": [len(head), len(head) + len(chunk)]}
        reqs.append(GenerationRequest(prompt_ids=head + chunk + enc(" write the memory ."), prefix_len=len(prefix),
                                      turn=turn, spans=spans, position_offset=(0, 3, 0)[e],
                                      meta={"episode_id": f"ep{e}"}))
    return reqs


def recording_forward(model, widths: list[tuple[int, int]]):
    forward = model.forward
    model.forward = lambda *a, **kw: widths.append(tuple(kw["input_ids"].shape)) or forward(*a, **kw)


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
@pytest.mark.parametrize("sp", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_heads_are_reused_while_the_memory_stays(cache, preset, sp):
    """Episodes 0 and 1 keep their memory for three turns, episode 2 changes it every turn: from
    the second turn on, 0 and 1 prefill only their chunk and what follows it, 2 its memory too.
    Every call's record equals the plain path's."""
    model, tok = models.load(preset, cache_dir=cache)
    backend, naive = HFBackend(model, tok), NaiveBackend(model, tok)
    widths: list[tuple[int, int]] = []
    recording_forward(model, widths)
    try:
        with backend.prefix_scope():
            for turn in range(3):
                reqs = segment_calls(tok, turn, ["kevin works at acme .", "", f"note {turn} ."])
                widths.clear()
                got = backend.generate(reqs, sp)
                prefills = [w for w in widths if w[1] > 1]
                rest = [len(r.prompt_ids) - (head_cut(r) if turn and e < 2 else r.prefix_len)
                        for e, r in enumerate(reqs)]
                assert sum(n * w for n, w in prefills) >= sum(rest)  # what each row still had to prefill
                if turn:  # no prefix prefill; the kept heads spare each stable row its memory
                    assert max(w for _, w in prefills) < max(len(r.prompt_ids) - r.prefix_len for r in reqs)
                    assert sum(n for n, _ in prefills) == 3
                assert_same_records(got, naive.generate(reqs, sp))
    finally:
        del model.forward


def test_rows_of_very_different_lengths_prefill_in_groups(tiny):
    model, tok = tiny
    words = tok(" alice works at the museum .", add_special_tokens=False)["input_ids"]
    reqs = [GenerationRequest(prompt_ids=(words * n)[k: k + 5 * n], prefix_len=0)
            for k, n in enumerate((1, 1, 2, 40, 41, 60))]
    backend = HFBackend(model, tok)
    widths: list[tuple[int, int]] = []
    recording_forward(model, widths)
    try:
        got = backend.generate(reqs, GREEDY)
    finally:
        del model.forward
    prefills = [w for w in widths if w[1] > 1]
    assert len(prefills) >= 2 and sum(n for n, _ in prefills) == len(reqs)
    assert_same_records(got, NaiveBackend(model, tok).generate(reqs, GREEDY))
    for inv in got:
        assert (torch.tensor(inv.logprobs) - rescore(model, inv)).abs().max().item() <= 1e-5


class SteadyMemAgent(MemAgent):
    """MemAgent that keeps its first memory for good (every later call's head repeats)."""

    def sync_memory(self, state, info):
        keep = state.extra.setdefault("first", None)
        super().sync_memory(state, info)
        if keep is None:
            state.extra["first"] = list(state.memory_ids)
        else:
            state.memory_ids = list(keep)


@pytest.mark.parametrize("agent_cls", [MemAgent, SteadyMemAgent])
@pytest.mark.parametrize("sp", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_rollout_records_what_the_plain_path_records(tiny, agent_cls, sp):
    """A real rollout (LongQA, 8 chunks, 5 episodes over 3 envs): the fast backend and the plain
    path give the same records, call for call."""
    model, tok = tiny
    runs = []
    for backend in (HFBackend(model, tok, max_batch_size=64), NaiveBackend(model, tok)):
        envs = [memgym.make("memgym/LongQA-v0", num_chunks=8, chunk_size=32, memory_budget=12, tokenizer=tok)
                for _ in range(3)]
        runs.append(rollout(envs, agent_cls(backend, sp), 5, seed=3, progress=False))
    for fast, plain in zip(*runs):
        assert fast.prediction == plain.prediction and fast.reward == plain.reward
        assert_same_records(fast.invocations, plain.invocations)
