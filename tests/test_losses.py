"""Each loss term against a hand or independent computation on small tensors."""

import math

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from memopd import losses


def test_ppo_clip_matches_hand_computation():
    logp_old = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    # ratios 1.5 (clipped above for A>0), 0.5 (clipped below for A<0), 1.1 (inside), 1.5 with A<0
    logp = torch.log(torch.tensor([0.75, 0.25, 0.55, 0.75]))
    adv = torch.tensor([1.0, -2.0, 3.0, -1.0])
    w = torch.ones(4)
    loss, stats = losses.ppo_policy_loss(logp, logp_old, adv, w, clip_eps=0.2)
    # token-wise -min(r*A, clip(r)*A)
    expected = [-min(1.5 * 1, 1.2 * 1), -min(0.5 * -2, 0.8 * -2), -min(1.1 * 3, 1.1 * 3), -min(1.5 * -1, 1.2 * -1)]
    assert loss.item() == pytest.approx(sum(expected) / 4, rel=1e-6)
    assert stats["clip_frac"] == pytest.approx(3 / 4)


def test_ppo_loss_respects_weights_and_gradient_sign():
    logp_old = torch.zeros(3) - 1.0
    logp = (torch.zeros(3) - 1.0).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0])
    w = torch.tensor([1.0, 0.0, 1.0])
    loss, _ = losses.ppo_policy_loss(logp, logp_old, adv, w)
    loss.backward()
    # at ratio 1 the gradient is -A * w / sum(w)
    assert torch.allclose(logp.grad, torch.tensor([-0.5, 0.0, 0.5]))


def test_gae_matches_recursive_definition():
    torch.manual_seed(0)
    r = torch.randn(6)
    v = torch.randn(6)
    gamma, lam = 0.9, 0.8
    adv, ret = losses.gae(r, v, gamma, lam)
    # independent: sum_k (gamma*lam)^k delta_{t+k}
    deltas = [r[t] + gamma * (v[t + 1] if t + 1 < 6 else 0.0) - v[t] for t in range(6)]
    for t in range(6):
        want = sum((gamma * lam) ** k * deltas[t + k] for k in range(6 - t))
        assert adv[t].item() == pytest.approx(float(want), abs=1e-5)
    assert torch.allclose(ret, adv + v)


def test_gae_with_gamma_lambda_one_is_return_minus_value():
    r = torch.tensor([0.0, 0.0, 0.0, 1.0])
    v = torch.tensor([0.2, 0.4, 0.6, 0.8])
    adv, ret = losses.gae(r, v, 1.0, 1.0)
    assert torch.allclose(ret, torch.ones(4))
    assert torch.allclose(adv, 1.0 - v)


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.3])
    adv = losses.group_advantages(r, ["a", "a", "b", "b", "c"])
    assert adv[0].item() == pytest.approx(1.0, abs=1e-4)
    assert adv[1].item() == pytest.approx(-1.0, abs=1e-4)
    assert adv[2].item() == 0.0 and adv[3].item() == 0.0  # no spread, no signal
    assert adv[4].item() == 0.0  # singleton group
    unscaled = losses.group_advantages(r, ["a", "a", "b", "b", "c"], scale=False)
    assert unscaled[0].item() == pytest.approx(0.5)


def test_reward_penalty_is_one_sided():
    pen = losses.penalised_rewards(torch.zeros(3), torch.tensor([-1.0, -2.0, -3.0]),
                                   torch.tensor([-2.0, -2.0, -1.0]), beta=0.5)
    assert torch.allclose(pen, torch.tensor([-0.5, 0.0, 0.0]))


def _reference_divergence(ps: Categorical, pt: Categorical, kind: str) -> torch.Tensor:
    """The divergence from torch.distributions, independent of memopd.losses."""
    if kind == "rkl":
        return kl_divergence(ps, pt)
    if kind == "fkl":
        return kl_divergence(pt, ps)
    m = Categorical(probs=0.5 * (ps.probs + pt.probs))
    return 0.5 * (kl_divergence(ps, m) + kl_divergence(pt, m))


@pytest.mark.parametrize("kind", ["rkl", "fkl", "jsd"])
def test_divergences_match_torch_distributions(kind):
    torch.manual_seed(1)
    s, t = torch.randn(5, 37), torch.randn(5, 37)
    ps, pt = Categorical(logits=s), Categorical(logits=t)
    got = losses.divergence_from_logprobs(torch.log_softmax(s, -1), torch.log_softmax(t, -1), kind)
    want = _reference_divergence(ps, pt, kind)
    assert torch.allclose(got, want, atol=1e-5)


def test_divergence_zero_for_identical_distributions():
    s = torch.randn(4, 11)
    for kind in losses.DIVERGENCES:
        d = losses.divergence_from_logprobs(torch.log_softmax(s, -1), torch.log_softmax(s, -1), kind)
        assert d.abs().max().item() < 1e-6


def _States(hidden, head, temperature):
    """memopd.scoring.ActionStates over a bare LM head (no post-head steps) at one temperature."""
    from memopd.scoring import ActionStates

    return ActionStates(hidden, head, torch.full((hidden.shape[0],), temperature))


@pytest.mark.parametrize("kind", ["rkl", "fkl", "jsd"])
def test_chunked_divergence_equals_unchunked_with_gradients(kind):
    torch.manual_seed(2)
    n, hs, ht, V = 13, 8, 12, 50
    h_s = torch.randn(n, hs, requires_grad=True)
    head_s, head_t = torch.nn.Linear(hs, V, bias=False), torch.nn.Linear(ht, V, bias=False)
    h_t = torch.randn(n, ht)
    chunked = losses.divergence_from_states(_States(h_s, head_s, 0.7), _States(h_t, head_t, 0.7), kind, chunk_size=4)
    g_chunk = torch.autograd.grad(chunked.sum(), [h_s, head_s.weight])
    # independent: full projection, then torch.distributions
    ps, pt = Categorical(logits=head_s(h_s) / 0.7), Categorical(logits=head_t(h_t) / 0.7)
    full = _reference_divergence(ps, pt, kind)
    g_full = torch.autograd.grad(full.sum(), [h_s, head_s.weight])
    assert torch.allclose(chunked, full, atol=1e-5)
    for a, b in zip(g_chunk, g_full):
        assert torch.allclose(a, b, atol=1e-4)
    assert head_t.weight.grad is None  # the teacher is never trained


def test_vocab_mismatch_refused():
    a = _States(torch.randn(2, 4), torch.nn.Linear(4, 10), 1.0)
    b = _States(torch.randn(2, 4), torch.nn.Linear(4, 11), 1.0)
    with pytest.raises(ValueError, match="vocabularies differ"):
        losses.divergence_from_states(a, b)


def test_entropy_from_logits():
    x = torch.randn(3, 9)
    assert torch.allclose(losses.entropy_from_logits(x), Categorical(logits=x).entropy(), atol=1e-6)
    assert losses.entropy_from_logits(torch.zeros(1, 8)).item() == pytest.approx(math.log(8), rel=1e-6)


def test_value_loss_clipping():
    v = torch.tensor([1.0, 0.0])
    v_old = torch.tensor([0.0, 0.0])
    R = torch.tensor([0.0, 1.0])
    w = torch.ones(2)
    # token 0: unclipped err 1, clipped value 0.2 -> err 0.04 -> max 1; token 1: err 1
    assert losses.value_loss(v, v_old, R, w, 0.2).item() == pytest.approx(0.5 * (1 + 1) / 2)
    assert losses.value_loss(v, v_old, R, w, None).item() == pytest.approx(0.5)


def test_approx_kl_is_the_k3_estimate_of_kl_old_new():
    """Weighting every token by its old probability turns the sample mean into the expectation
    under the old policy, where k3 = (r - 1) - log r is exactly KL(old || new)."""
    torch.manual_seed(0)
    old = torch.log_softmax(torch.randn(50) * 2, -1)
    new = torch.log_softmax(torch.randn(50) * 2, -1)
    _, stats = losses.ppo_policy_loss(new, old, torch.zeros(50), old.exp())
    exact = float((old.exp() * (old - new)).sum())
    assert stats["approx_kl"] == pytest.approx(exact, rel=1e-5)
