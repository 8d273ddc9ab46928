"""HFBackend: recorded log-probs equal one-pass re-scoring; batching, seeding and stopping."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from agents import models
from agents.backends import Backend, GenerationRequest, HFBackend, SamplingParams, default_stop_ids
from agents.backends.hf import filter_logits
from agents.records import Episode
from agent_fixtures import rescore


def make_requests(tokenizer, n: int = 6) -> list[GenerationRequest]:
    words = "alice bob works at the museum in paris . who is carol ?".split()
    reqs = []
    for i in range(n):
        text = " ".join(words[: 2 + (7 * i) % len(words)]) * (1 + i % 3)  # lengths differ
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        reqs.append(GenerationRequest(prompt_ids=ids, prefix_len=min(2, len(ids)), role=("memory", "answer")[i % 2],
                                      turn=i, position_offset=(0, 0, 5)[i % 3], meta={"i": i}))
    return reqs


SAMPLINGS = [
    SamplingParams(max_new_tokens=24, seed=1),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=40, max_new_tokens=24, seed=2),
    SamplingParams(greedy=True, max_new_tokens=24),
]


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
@pytest.mark.parametrize("sp", SAMPLINGS, ids=["T1", "T0.7-topp-topk", "greedy"])
def test_logprobs_match_one_pass_rescoring(cache, preset, sp):
    model, tok = models.load(preset, cache_dir=cache)
    backend = HFBackend(model, tok, max_batch_size=4)  # 6 requests -> two padded micro-batches
    invs = backend.generate(make_requests(tok), sp)
    assert len({inv.prompt_len for inv in invs}) > 2
    for inv in invs:
        recorded = torch.tensor(inv.logprobs)
        expected = rescore(model, inv, 1.0 if sp.greedy else sp.temperature)
        assert (recorded - expected).abs().max().item() <= 1e-4


def test_records_are_complete_and_roundtrip(tiny):
    model, tok = tiny
    backend = HFBackend(model, tok)
    backend.policy_version = 7
    reqs = make_requests(tok)
    sp = SamplingParams(temperature=0.8, max_new_tokens=10, seed=0)
    invs = backend.generate(reqs, sp)
    assert isinstance(backend, Backend)
    for req, inv in zip(reqs, invs):  # order of the requests is kept
        assert inv.prompt_ids == req.prompt_ids and inv.prefix_len == req.prefix_len
        assert (inv.role, inv.turn, inv.meta) == (req.role, req.turn, req.meta)
        start = req.position_offset
        assert inv.position_ids == list(range(start, start + inv.total_len))
        assert inv.policy_version == 7
        assert inv.sampling == sp.to_dict()
        assert set(inv.timing) == {"start", "latency_s"} and inv.timing["latency_s"] > 0
        assert 1 <= len(inv.response_ids) <= 10
        assert inv.finish_reason in ("eos", "length")
        assert inv.response_text == tok.decode(inv.response_ids, skip_special_tokens=True)
    ep = Episode(episode_id="e", task_id="t", sample_id="s", invocations=invs)
    assert Episode.from_json(ep.to_json()) == ep


def test_greedy_is_deterministic_and_batch_invariant(tiny):
    model, tok = tiny
    reqs = make_requests(tok, 7)
    sp = SamplingParams(greedy=True, max_new_tokens=16)
    batched = HFBackend(model, tok, max_batch_size=32).generate(reqs, sp)
    again = HFBackend(model, tok, max_batch_size=32).generate(reqs, sp)
    single = [HFBackend(model, tok).generate([r], sp)[0] for r in reqs]
    for a, b, c in zip(batched, again, single):
        assert a.response_ids == b.response_ids == c.response_ids
        assert a.logprobs == b.logprobs
        assert max(abs(x - y) for x, y in zip(a.logprobs, c.logprobs)) <= 1e-5
    # greedy picks the arg-max of the re-scored distribution at every step
    inv = batched[0]
    ids, pos = torch.tensor([inv.input_ids]), torch.tensor([inv.position_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos).logits[0]
    assert logits[inv.prompt_len - 1:-1].argmax(-1).tolist() == inv.response_ids


def test_seeded_sampling_reproducible_and_batch_invariant(tiny):
    model, tok = tiny
    reqs = make_requests(tok, 6)
    sp = SamplingParams(temperature=1.0, max_new_tokens=16, seed=123)
    a = HFBackend(model, tok, max_batch_size=32).generate(reqs, sp)
    b = HFBackend(model, tok, max_batch_size=1).generate(reqs, sp)
    assert [x.response_ids for x in a] == [x.response_ids for x in b]
    other = HFBackend(model, tok).generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=16, seed=124))
    assert [x.response_ids for x in a] != [x.response_ids for x in other]
    # Unseeded calls continue the backend's stream: two calls differ, a fresh backend repeats them.
    be1, be2 = HFBackend(model, tok, seed=5), HFBackend(model, tok, seed=5)
    sp0 = SamplingParams(max_new_tokens=8)
    first, second = be1.generate(reqs, sp0), be1.generate(reqs, sp0)
    assert [x.response_ids for x in first] != [x.response_ids for x in second]
    assert [x.response_ids for x in be2.generate(reqs, sp0)] == [x.response_ids for x in first]


def test_identical_prompts_are_prefilled_once_and_sample_as_if_alone(tiny):
    """A question's G samples start with one prompt: prefilled once, its keys/values copied to
    each row, every row sampling from its own stream exactly as it does alone; the records
    equal a fresh re-scoring."""
    model, tok = tiny
    base = make_requests(tok, 3)
    reqs = [base[0]] * 4 + [base[1], base[2], base[1]]
    sp = SamplingParams(temperature=1.0, max_new_tokens=16, seed=7)
    calls = []
    backend, forward = HFBackend(model, tok, max_batch_size=32), model.forward
    model.forward = lambda *a, **kw: calls.append(kw["input_ids"].shape) or forward(*a, **kw)
    try:
        together = backend.generate(reqs, sp)
    finally:
        del model.forward
    assert calls[0][0] == 3  # the prefill: three distinct prompts for seven rows
    alone = HFBackend(model, tok, max_batch_size=1).generate(reqs, sp)
    assert [x.response_ids for x in together] == [x.response_ids for x in alone]
    assert len({tuple(x.response_ids) for x in together[:4]}) > 1  # the samples differ after the prompt
    for inv in together:
        assert (torch.tensor(inv.logprobs) - rescore(model, inv, 1.0)).abs().max().item() <= 1e-4


def test_top_k_1_and_tiny_top_p_equal_greedy(tiny):
    model, tok = tiny
    reqs = make_requests(tok, 5)
    backend = HFBackend(model, tok)
    greedy = backend.generate(reqs, SamplingParams(greedy=True, max_new_tokens=12))
    k1 = backend.generate(reqs, SamplingParams(temperature=1.3, top_k=1, max_new_tokens=12, seed=9))
    p0 = backend.generate(reqs, SamplingParams(temperature=0.9, top_p=1e-6, max_new_tokens=12, seed=9))
    for g, a, b in zip(greedy, k1, p0):
        assert g.response_ids == a.response_ids == b.response_ids
        # truncation does not change what is recorded: full-vocabulary log-probs at T
        assert torch.allclose(torch.tensor(a.logprobs), rescore(model, a, 1.3), atol=1e-4)


def test_sampling_frequencies_follow_the_distribution(tiny):
    model, tok = tiny
    prompt = tok("alice works at", add_special_tokens=False)["input_ids"]
    n, temperature = 3000, 0.4
    reqs = [GenerationRequest(prompt_ids=prompt, prefix_len=0) for _ in range(n)]
    invs = HFBackend(model, tok, max_batch_size=n).generate(
        reqs, SamplingParams(temperature=temperature, max_new_tokens=1, seed=0, stop_token_ids=[]))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    probs = torch.softmax(logits / temperature, -1)
    counts = torch.bincount(torch.tensor([inv.response_ids[0] for inv in invs]), minlength=probs.numel())
    top = torch.topk(probs, 5).indices
    for t in top.tolist():
        p = probs[t].item()
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(counts[t].item() - n * p) <= 5 * sigma + 1


def test_filter_logits_matches_definition():
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]))
    kept = lambda x: torch.isfinite(x)[0].tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2, top_p=1.0)) == [False, True, False, True, False]
    # nucleus 0.69: 0.4 + 0.3 reaches it -> {1, 3}; 0.71 needs the 0.15 token as well
    assert kept(filter_logits(logits, top_k=0, top_p=0.69)) == [False, True, False, True, False]
    assert kept(filter_logits(logits, top_k=0, top_p=0.71)) == [False, True, False, True, True]
    # top-k first, then the nucleus of the renormalised rest: 0.4/0.85 + 0.3/0.85 = 0.82
    assert kept(filter_logits(logits, top_k=3, top_p=0.8)) == [False, True, False, True, False]
    assert kept(filter_logits(logits, top_k=3, top_p=0.85)) == [False, True, False, True, True]
    assert kept(filter_logits(logits, top_k=0, top_p=1e-9)) == [False, True, False, False, False]


def test_rows_stop_independently(tiny):
    model, tok = tiny
    reqs = make_requests(tok, 6)
    backend = HFBackend(model, tok, max_batch_size=6)
    free = backend.generate(reqs, SamplingParams(greedy=True, max_new_tokens=12, stop_token_ids=[]))
    assert all(inv.finish_reason == "length" and len(inv.response_ids) == 12 for inv in free)
    stop = free[0].response_ids[3]
    stopped = backend.generate(reqs, SamplingParams(greedy=True, max_new_tokens=12, stop_token_ids=[stop]))
    for f, s in zip(free, stopped):
        if stop in f.response_ids:
            cut = f.response_ids.index(stop) + 1
            assert s.response_ids == f.response_ids[:cut]
            assert s.finish_reason == "stop"
        else:
            assert s.response_ids == f.response_ids and s.finish_reason == "length"
        assert max(abs(x - y) for x, y in zip(s.logprobs, f.logprobs)) <= 1e-5


def test_eos_is_kept_with_its_logprob(tiny):
    model, tok = tiny
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert eos in default_stop_ids(tok)
    # A real model that wants to stop: lm_head with a bias towards <|im_end|>.
    eager = copy.deepcopy(model)
    head = torch.nn.Linear(eager.config.hidden_size, eager.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(eager.get_output_embeddings().weight)
        head.bias.zero_()
        head.bias[eos] = 30.0
    eager.lm_head = head
    invs = HFBackend(eager, tok).generate(make_requests(tok, 3), SamplingParams(max_new_tokens=8, seed=0))
    for inv in invs:
        assert inv.response_ids == [eos] and inv.finish_reason == "eos" and inv.response_text == ""
        assert inv.logprobs[0] > -1e-3
        assert abs(inv.logprobs[0] - rescore(eager, inv)[0].item()) <= 1e-4


def test_generation_stops_at_the_position_limit(cache):
    model, tok = models.load("tiny", cache_dir=cache)
    limit = model.config.max_position_embeddings
    backend = HFBackend(model, tok)
    req = GenerationRequest(prompt_ids=[5, 6, 7], prefix_len=0, position_offset=limit - 6)
    inv = backend.generate([req], SamplingParams(max_new_tokens=50, seed=0, stop_token_ids=[]))[0]
    assert len(inv.response_ids) == 3 and inv.finish_reason == "length"
    assert inv.position_ids[-1] == limit - 1
    with pytest.raises(ValueError, match="no room to generate"):
        backend.generate([GenerationRequest(prompt_ids=[5], prefix_len=0, position_offset=limit - 1)],
                         SamplingParams())


def test_bad_requests_have_clear_errors(tiny):
    model, tok = tiny
    backend = HFBackend(model, tok)
    with pytest.raises(ValueError, match="empty"):
        GenerationRequest(prompt_ids=[], prefix_len=0)
    with pytest.raises(ValueError, match="prefix_len"):
        GenerationRequest(prompt_ids=[1, 2], prefix_len=3)
    with pytest.raises(ValueError, match="role"):
        GenerationRequest(prompt_ids=[1], prefix_len=0, role="think")
    with pytest.raises(ValueError, match="outside the model vocabulary"):
        backend.generate([GenerationRequest(prompt_ids=[1, 10**6], prefix_len=0)], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    assert backend.generate([], SamplingParams()) == []


@pytest.mark.slow
def test_smollm2_logprobs_match_rescoring_and_answers():
    model, tok = models.load("smollm2")  # the user cache: converted once per machine
    backend = HFBackend(model, tok, max_batch_size=8)
    questions = ["What is the capital of France?", "Name a primary colour.",
                 "Write the word 'hello' in capital letters, please."]
    reqs = [GenerationRequest(prompt_ids=tok.apply_chat_template([{"role": "user", "content": q}],
                                                                 add_generation_prompt=True, return_dict=False),
                              prefix_len=0, role="answer") for q in questions]
    assert len({len(r.prompt_ids) for r in reqs}) == 3
    greedy = backend.generate(reqs, SamplingParams(greedy=True, max_new_tokens=24))
    assert "Paris" in greedy[0].response_text
    sampled = backend.generate(reqs, SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=24, seed=0))
    for inv, t in [(i, 1.0) for i in greedy] + [(i, 0.8) for i in sampled]:
        assert (torch.tensor(inv.logprobs) - rescore(model, inv, t)).abs().max().item() <= 1e-4
    single = backend.generate(reqs[:1], SamplingParams(greedy=True, max_new_tokens=24))[0]
    assert single.response_ids == greedy[0].response_ids


def episode_calls(tokenizer, turn: int) -> list[GenerationRequest]:
    """Three episodes' calls at one turn: each starts with its episode's prefix (instructions +
    question, shared by every turn), then a memory and a chunk that differ from turn to turn."""
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    reqs = []
    for e, question in enumerate(["who is carol ?", "where does bob work ?", "who is carol ?"]):
        prefix = enc("read the chunks and answer . " + question)
        rest = enc(f"memory {e} {turn} . " + "alice works at the museum . " * (1 + (e + turn) % 3))
        reqs.append(GenerationRequest(prompt_ids=prefix + rest, prefix_len=len(prefix), role="memory", turn=turn,
                                      position_offset=(0, 0, 3)[e]))
    return reqs


def counting_forward(model, widths: list[tuple[int, int]]):
    forward = model.forward
    model.forward = lambda *a, **kw: widths.append(tuple(kw["input_ids"].shape)) or forward(*a, **kw)


def test_episode_prefixes_are_prefilled_once_per_scope_and_records_equal_rescoring(tiny):
    """Within a prefix scope an episode's prefix is prefilled at its first call only: later calls
    prefill just the rest of their prompts. Episodes 0 and 2 share the question but not its
    positions, so they keep two prefixes. Every record equals a fresh one-pass re-scoring, and the
    samples equal those of a backend that keeps nothing."""
    model, tok = tiny
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    backend, plain = HFBackend(model, tok), HFBackend(model, tok, prefix_cache_mb=0)
    widths: list[tuple[int, int]] = []
    counting_forward(model, widths)
    try:
        with backend.prefix_scope():
            turns = []
            for turn in range(3):
                widths.clear()
                turns.append(backend.generate(episode_calls(tok, turn), sp))
                reqs = episode_calls(tok, turn)
                suffix = max(len(r.prompt_ids) - r.prefix_len for r in reqs)
                if turn == 0:  # three distinct prefixes prefilled, then the three rests after them
                    assert widths[0] == (3, max(r.prefix_len for r in reqs)) and widths[1] == (3, suffix)
                else:  # the prefixes come from the cache
                    assert widths[0] == (3, suffix)
        widths.clear()
        alone = [plain.generate(episode_calls(tok, turn), sp) for turn in range(3)]
        assert widths[0][1] == max(len(r.prompt_ids) for r in episode_calls(tok, 0))  # whole prompts
    finally:
        del model.forward
    for got, ref in zip(turns, alone):
        assert [x.response_ids for x in got] == [x.response_ids for x in ref]
        for inv in got:
            assert (torch.tensor(inv.logprobs) - rescore(model, inv, 1.0)).abs().max().item() <= 1e-4


def test_the_prefix_cache_empties_when_the_weights_or_the_policy_change(tiny):
    """Keys/values are only valid for the weights that made them: an in-place change of a
    parameter, a new ``policy_version`` or the scope's end drops them; records then equal a
    re-scoring by the new weights (stale prefixes would not)."""
    model, tok = tiny
    model = copy.deepcopy(model)
    backend = HFBackend(model, tok)
    sp = SamplingParams(greedy=True, max_new_tokens=6)
    weight = model.get_input_embeddings().weight

    def check() -> None:
        for inv in backend.generate(episode_calls(tok, 1), sp):
            assert (torch.tensor(inv.logprobs) - rescore(model, inv)).abs().max().item() <= 1e-4

    with backend.prefix_scope():
        backend.generate(episode_calls(tok, 0), sp)
        with torch.no_grad():
            weight.mul_(1.5)  # an update through autograd's view of the parameter
        check()
        with torch.no_grad():
            weight.data.mul_(1.5)  # unseen by the version counter: the policy version says it
        backend.policy_version += 1
        check()
    with torch.no_grad():
        weight.data.mul_(0.5)
    with backend.prefix_scope():
        check()
    assert backend._prefix_cache is None


def test_a_rollout_opens_a_prefix_scope(tiny):
    model, tok = tiny
    backend = HFBackend(model, tok)
    seen = []
    generate = backend.generate
    backend.generate = lambda reqs, sp: seen.append(backend._prefix_cache) or generate(reqs, sp)
    import memgym
    from agents import MemAgent
    from agents.rollout import rollout
    envs = [memgym.make("memgym/LongQA-v0", num_chunks=2, chunk_size=24) for _ in range(2)]
    rollout(envs, MemAgent(backend, SamplingParams(max_new_tokens=4, seed=0)), 2, progress=False)
    assert seen and all(c is not None for c in seen) and len({id(c) for c in seen}) == 1
    assert backend._prefix_cache is None
