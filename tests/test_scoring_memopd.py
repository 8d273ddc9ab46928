"""Scoring of packed batches: log-probs, entropy, full-vocab distributions, RKL and gradients,
each checked against an independent computation on unpacked invocations."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Categorical, kl_divergence

from memopd.packing import pack_episodes
from memopd.losses import divergence_from_states
from memopd.scoring import action_states, episode_states, score, token_logprobs


def reverse_kl(student, teacher, chunk_size=1024):
    return divergence_from_states(student, teacher, "rkl", chunk_size)
from packing_fixtures import (HARD_CASE_BUDGET, hard_case_episodes, one_thread, sample_episode,  # noqa: F401
                              tiny_model)

TOL = 1e-4


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("qwen2", seed=1)
    eps = hard_case_episodes(model)
    eps.append(sample_episode(model, turns=2, seed=21, temperature=0.7))  # temperature-aware scoring
    return model, eps, pack_episodes(eps, HARD_CASE_BUDGET)


def alone_scaled_logits(model, eps, batch):
    """[N, V] logits / T of each action, from full forwards of each invocation alone (with grad)."""
    rows = []
    for e, j, k in batch.token_map.tolist():
        inv = eps[e].invocations[j]
        logits = model(torch.tensor([inv.input_ids]), position_ids=torch.tensor([inv.position_ids]),
                       use_cache=False).logits[0]
        rows.append(logits[inv.prompt_len - 1 + k] / inv.sampling.get("temperature", 1.0))
    return torch.stack(rows)


def test_logprobs_reproduce_the_recorded_ones(setup):
    model, eps, batch = setup
    with torch.no_grad():
        sc = score(model, batch)
    assert (sc.logprobs - batch.old_logprobs).abs().max() <= TOL
    assert (batch.temperatures != 1.0).any(), "the batch includes a temperature-0.7 episode"
    per = sc.per_invocation()
    for e, ep in enumerate(eps):
        for j, inv in enumerate(ep.invocations):
            assert per[(e, j)].tolist() == pytest.approx(inv.logprobs, abs=TOL)


def test_chunked_full_vocab_equals_unchunked_and_reference(setup):
    model, eps, batch = setup
    with torch.no_grad():
        ref_logits = alone_scaled_logits(model, eps, batch)
        ref = Categorical(logits=ref_logits)
        states = action_states(model, batch)
        big = token_logprobs(states, batch.action_ids, chunk_size=10**6, full_logdist=True)
        for chunk in (1, 7):
            lp, ent, dist = token_logprobs(states, batch.action_ids, chunk_size=chunk, full_logdist=True)
            assert torch.allclose(lp, big[0], atol=1e-6) and torch.allclose(dist, big[2], atol=1e-6)
            lp2, ent2, none = token_logprobs(states, batch.action_ids, chunk_size=chunk)
            assert none is None and torch.allclose(lp2, lp, atol=1e-6) and torch.allclose(ent2, ent, atol=1e-6)
        lp, ent, dist = big
    assert dist.shape == (batch.num_actions, model.config.vocab_size)
    assert (dist - F.log_softmax(ref_logits, -1)).abs().max() <= TOL
    assert (lp - ref.log_prob(batch.action_ids)).abs().max() <= TOL
    assert (ent - ref.entropy()).abs().max() <= TOL


@pytest.mark.parametrize("lowering", ["sdpa", "blocks"])
def test_gradient_of_packed_logprobs_equals_unpacked(setup, lowering):
    model, eps, batch = setup
    weights = torch.linspace(0.5, 1.5, batch.num_actions)  # a non-trivial per-token weighting
    model.zero_grad()
    (score(model, batch, chunk_size=5, lowering=lowering).logprobs * weights).sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logp = F.log_softmax(alone_scaled_logits(model, eps, batch), -1).gather(-1, batch.action_ids[:, None])[:, 0]
    (logp * weights).sum().backward()
    for n, p in model.named_parameters():
        assert torch.allclose(packed[n], p.grad, atol=1e-4, rtol=1e-4), n
    model.zero_grad()


def test_reverse_kl_matches_reference_value_and_gradient(setup):
    model, eps, batch = setup
    teacher = tiny_model("llama", seed=5)  # a different network with the same vocabulary
    t_states, t_batch = episode_states(teacher, eps, max_tokens=HARD_CASE_BUDGET)
    assert torch.equal(t_batch.token_map, batch.token_map)
    model.zero_grad()
    kl = reverse_kl(action_states(model, batch), t_states, chunk_size=4)
    kl.sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with torch.no_grad():
        t_ref = Categorical(logits=alone_scaled_logits(teacher, eps, batch))
    ref = kl_divergence(Categorical(logits=alone_scaled_logits(model, eps, batch)), t_ref)
    assert (kl.detach() - ref.detach()).abs().max() <= TOL and (kl > 0).all()
    ref.sum().backward()
    for n, p in model.named_parameters():
        assert torch.allclose(packed[n], p.grad, atol=1e-4, rtol=1e-4), n
    model.zero_grad()
    assert all(p.grad is None for p in teacher.parameters())
    with torch.no_grad():  # teacher = student: zero divergence
        assert reverse_kl(action_states(model, batch), action_states(model, batch)).abs().max() <= 1e-5


def test_micro_batch_states_line_up_with_the_teacher(setup):
    model, eps, batch = setup
    with torch.no_grad():
        full = action_states(model, batch)
        pers, pers_batch = episode_states(model, eps, mode="persistent")
        assert torch.equal(pers_batch.token_map, batch.token_map)
        for part in batch.micro_batches(2):
            st = action_states(model, part)
            assert torch.allclose(st.hidden, full.hidden[part.action_uid], atol=1e-5)
            assert len(reverse_kl(st, pers.select(part.action_uid))) == part.num_actions
