"""The distillation estimators (memopd.learn.estimators) against hand computations, the full-vocabulary
divergence they approximate, and Monte Carlo expectations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from memopd.learn import estimators as est
from memopd import losses
from memopd.scoring import ActionStates


def _logits(n=6, v=11, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * scale, torch.randn(n, v, generator=g) * scale


@pytest.mark.parametrize("kind", ["rkl", "fkl", "jsd"])
def test_topk_with_k_the_vocabulary_is_the_full_divergence_and_gradient(kind):
    zs, zt = _logits()
    zs.requires_grad_(True)
    logp_s, logp_t = F.log_softmax(zs, -1), F.log_softmax(zt, -1)
    full = losses.divergence_from_logprobs(logp_s, logp_t, kind)
    (g_full,) = torch.autograd.grad(full.sum(), zs)
    top = est.teacher_topk(logp_t, zt.shape[-1])
    approx = est.topk_divergence(F.log_softmax(zs, -1), top, kind)
    (g_top,) = torch.autograd.grad(approx.sum(), zs)
    assert torch.allclose(approx, full, atol=1e-6) and torch.allclose(g_top, g_full, atol=1e-6)


def test_topk_with_a_tail_bucket_by_hand():
    s = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    t = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log()
    top = est.teacher_topk(t, 2)  # the teacher's top-2: tokens 3 (0.4) and 2 (0.3); tail 0.3
    assert top.ids.tolist() == [[3, 2]]
    # the student on the same buckets: 0.1, 0.2 and its tail 0.7
    rkl = 0.1 * math.log(0.1 / 0.4) + 0.2 * math.log(0.2 / 0.3) + 0.7 * math.log(0.7 / 0.3)
    fkl = 0.4 * math.log(0.4 / 0.1) + 0.3 * math.log(0.3 / 0.2) + 0.3 * math.log(0.3 / 0.7)
    assert est.topk_divergence(s, top, "rkl").item() == pytest.approx(rkl, rel=1e-5)
    assert est.topk_divergence(s, top, "fkl").item() == pytest.approx(fkl, rel=1e-5)
    # the data-processing inequality: merging buckets never raises the divergence
    full = losses.divergence_from_logprobs(s, t, "rkl").item()
    assert rkl < full


@pytest.mark.parametrize("k", [1, 3, 8])
def test_topk_is_a_lower_bound_of_the_full_divergence(k):
    zs, zt = _logits(n=64, v=20, seed=k)
    logp_s, logp_t = F.log_softmax(zs, -1), F.log_softmax(zt, -1)
    for kind in ("rkl", "fkl", "jsd"):
        approx = est.topk_divergence(logp_s, est.teacher_topk(logp_t, k), kind)
        full = losses.divergence_from_logprobs(logp_s, logp_t, kind)
        assert bool((approx <= full + 1e-6).all()) and bool((approx >= -1e-6).all()), kind


def test_the_sampled_estimators_by_hand():
    s, t = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])  # r = s / t = 2
    assert est.sampled_estimate(s, t, "k1").item() == pytest.approx(math.log(2))
    assert est.sampled_estimate(s, t, "k3").item() == pytest.approx((0.5 - 1) + math.log(2))
    assert est.sampled_advantage(s, t).item() == pytest.approx(-math.log(2))
    # the forward KL: r = t / s = 1/2; r log r - (r - 1) = 0.5 log 0.5 + 0.5; advantage r - 1
    assert est.sampled_estimate(s, t, divergence="fkl").item() == pytest.approx(0.5 * math.log(0.5) + 0.5)
    assert est.sampled_advantage(s, t, "fkl").item() == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="rkl or fkl"):
        est.sampled_estimate(s, t, divergence="jsd")


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_the_sampled_estimators_expectation_is_the_reverse_kl(kind):
    """Monte Carlo over a ~ s: the mean of k1 / k3 is KL(s || t) within 4 standard errors."""
    zs, zt = _logits(n=3, v=7, seed=5, scale=1.0)
    logp_s, logp_t = F.log_softmax(zs, -1), F.log_softmax(zt, -1)
    exact = losses.divergence_from_logprobs(logp_s, logp_t, "rkl")
    n = 200_000
    a = torch.multinomial(logp_s.exp(), n, replacement=True, generator=torch.Generator().manual_seed(1))  # [3, n]
    values = est.sampled_estimate(logp_s.gather(-1, a), logp_t.gather(-1, a), kind).double()
    mean, se = values.mean(-1), values.std(-1) / math.sqrt(n)
    assert bool(((mean - exact.double()).abs() <= 4 * se).all()), (mean, exact, se)


def test_the_sampled_forward_kl_estimate_and_gradient_are_unbiased():
    """Monte Carlo over a ~ s: the mean of r log r - (r - 1) (r = t / s) is KL(t || s), and the
    loss's gradient, -sg(r - 1) grad log s(a) averaged, the gradient of KL(t || s), each within 4
    standard errors; the per-sample gradient is computed here by hand, not through the loss."""
    zs, zt = _logits(n=1, v=5, seed=7, scale=1.0)
    zs.requires_grad_(True)
    logp_t = F.log_softmax(zt, -1)
    exact = losses.divergence_from_logprobs(F.log_softmax(zs, -1), logp_t, "fkl")
    (g_exact,) = torch.autograd.grad(exact.sum(), zs)
    n = 200_000
    a = torch.multinomial(F.log_softmax(zs, -1).exp().detach(), n, replacement=True,
                          generator=torch.Generator().manual_seed(4))[0]
    logp_s = F.log_softmax(zs, -1)[0, a]
    loss = est.sampled_loss(logp_s, logp_t[0, a], divergence="fkl")
    values = loss.detach().double()
    assert abs(values.mean() - exact.double()[0]) <= 4 * values.std() / math.sqrt(n)
    r = (logp_t[0, a] - logp_s).detach().double().exp()
    per_sample = -(r - 1)[:, None] * (F.one_hot(a, 5).double() - F.softmax(zs, -1).detach().double()[0])
    (g_mc,) = torch.autograd.grad(loss.mean(), zs)
    assert torch.allclose(g_mc.double()[0], per_sample.mean(0), atol=1e-3)
    se = per_sample.std(0) / math.sqrt(n)
    assert bool(((g_mc.double()[0] - g_exact.double()[0]).abs() <= 4 * se + 1e-9).all()), (g_mc, g_exact, se)
    # and not the reverse KL's: the two gradients differ here by far more than the noise
    (g_rkl,) = torch.autograd.grad(losses.divergence_from_logprobs(F.log_softmax(zs, -1), logp_t, "rkl").sum(), zs)
    assert float((g_rkl - g_exact).abs().max()) > 20 * float(se.max())


@pytest.mark.parametrize("divergence", ["rkl", "fkl"])
def test_after_an_update_the_sampled_gradient_is_weighted_by_current_over_behaviour(divergence):
    """d loss / d log s(a) is the estimator's coefficient times s(a) / s_behaviour(a), by hand."""
    logp_s = torch.tensor([-0.5, -2.0, -1.0], requires_grad=True)
    logp_t = torch.tensor([-1.0, -0.2, -3.0])
    behaviour = torch.tensor([-0.7, -2.0, -0.4])
    (grad,) = torch.autograd.grad(est.sampled_loss(logp_s, logp_t, divergence=divergence,
                                                   behaviour_logp=behaviour).sum(), logp_s)
    s, t, b = logp_s.detach(), logp_t, behaviour
    coef = (s - t) if divergence == "rkl" else -(torch.exp(t - s) - 1)
    assert grad.tolist() == pytest.approx((coef * torch.exp(s - b)).tolist(), rel=1e-6)
    (plain,) = torch.autograd.grad(est.sampled_loss(logp_s, logp_t, divergence=divergence).sum(), logp_s)
    assert plain.tolist() == pytest.approx(coef.tolist(), rel=1e-6)  # no behaviour given: samples of s itself


def test_the_sampled_loss_gradient_is_an_unbiased_gradient_of_the_reverse_kl():
    zs, zt = _logits(n=1, v=5, seed=3, scale=1.0)
    zs.requires_grad_(True)
    logp_t = F.log_softmax(zt, -1)
    (g_exact,) = torch.autograd.grad(losses.divergence_from_logprobs(F.log_softmax(zs, -1), logp_t, "rkl").sum(), zs)
    n = 100_000
    a = torch.multinomial(F.log_softmax(zs, -1).exp().detach(), n, replacement=True,
                          generator=torch.Generator().manual_seed(2))[0]
    logp_s = F.log_softmax(zs, -1)[0, a]
    loss = est.sampled_loss(logp_s, logp_t[0, a], "k3")
    # value: the estimate; gradient: per-sample score-function gradients, averaged
    assert torch.allclose(loss.detach(), est.sampled_estimate(logp_s, logp_t[0, a], "k3"))
    onehot = F.one_hot(a, 5).double()
    p = F.softmax(zs, -1).detach().double()[0]
    per_sample = (logp_s - logp_t[0, a]).detach().double()[:, None] * (onehot - p)  # d log s(a) / d z
    (g_mc,) = torch.autograd.grad(loss.mean(), zs)
    assert torch.allclose(g_mc.double()[0], per_sample.mean(0), atol=1e-3)  # float32 sums of 1e5 terms
    se = per_sample.std(0) / math.sqrt(n)
    assert bool(((g_mc.double()[0] - g_exact.double()[0]).abs() <= 4 * se + 1e-9).all()), (g_mc, g_exact, se)


def test_teacher_targets_from_states_are_the_full_distributions_topk_and_sampled_logprobs():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 13, bias=False)
    hidden, temps = torch.randn(10, 8), torch.full((10,), 0.7)
    states = ActionStates(hidden, head, temps)
    logp_t = F.log_softmax(head(hidden) / 0.7, -1)
    targets = torch.randint(0, 13, (10,))
    top = est.teacher_targets(states, targets, "topk", 4, chunk_size=3)
    want = est.teacher_topk(logp_t, 4)
    assert torch.equal(top.ids, want.ids) and torch.allclose(top.logp, want.logp, atol=1e-6)
    lp = est.teacher_targets(states, targets, "sampled", 4, chunk_size=3)
    assert torch.allclose(lp, logp_t.gather(-1, targets[:, None])[:, 0], atol=1e-6)


# --- in the trainer ---------------------------------------------------------------------------

FAST = ["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=3", "--questions-per-step", "2", "--group-size",
        "2", "--max-new-tokens", "8", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "1024", "--threads", "1", "--ppo-epochs", "2",
        "--audit-every", "0", "--sample-episodes", "0"]


def _trainer(run_dir, *extra):
    from memopd import train

    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(run_dir)] + list(extra), "t", "")
    return train.Trainer(train.prepare(cfg), log=lambda m: None)


def test_the_topk_estimator_with_k_the_vocabulary_makes_the_full_update(tmp_path):
    full = _trainer(tmp_path / "full", "--opd-divergence", "rkl")
    episodes = full.rollout()
    vocab = full.student.get_output_embeddings().weight.shape[0]
    topk = _trainer(tmp_path / "topk", "--opd-divergence", "rkl", "--opd-estimator", "topk", "--opd-topk", str(vocab))
    a, b = full.learn(episodes), topk.learn(episodes)
    for k in ("loss", "opd_loss", "kl/all", "grad_norm", "pg_loss"):
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
    small = _trainer(tmp_path / "small", "--opd-divergence", "rkl", "--opd-estimator", "topk", "--opd-topk", "4")
    c = small.learn(episodes)
    assert 0 <= c["kl/all"] <= a["kl/all"] + 1e-6 and c["opd_loss"] != pytest.approx(a["opd_loss"])  # a lower bound


def test_the_sampled_estimator_as_a_loss_and_as_an_advantage(tmp_path):
    loss_run = _trainer(tmp_path / "loss", "--opd-estimator", "sampled", "--reward", "none", "--opd-divergence", "rkl")
    episodes = loss_run.rollout()
    m = loss_run.learn(episodes)
    assert m["pg_loss"] == 0.0 and m["opd_loss"] != 0.0 and m["kl/all"] >= 0  # k3 is never negative
    adv_run = _trainer(tmp_path / "adv", "--opd-estimator", "sampled", "--opd-sampled-as", "advantage",
                       "--reward", "none", "--opd-divergence", "rkl")
    m = adv_run.learn(episodes)
    assert m["opd_loss"] == 0.0 and m["pg_loss"] != 0.0  # the KL is PPO's advantage now, not a loss term
    fkl_run = _trainer(tmp_path / "fkl", "--opd-estimator", "sampled", "--reward", "none")
    assert fkl_run.cfg.opd_divergence == "fkl"  # auto: the forward KL for a tiny preset, as with the full estimator
    m = fkl_run.learn(episodes)
    assert m["pg_loss"] == 0.0 and m["opd_loss"] != 0.0 and m["kl/all"] >= 0  # q log q - (q - 1) >= 0


def test_the_sampled_estimator_refuses_the_jsd(tmp_path, capsys):
    from memopd import train

    argv = FAST + ["--run-dir", str(tmp_path / "r"), "--opd-estimator", "sampled", "--opd-divergence", "jsd"]
    assert train.main(argv) == 2
    assert "error: --opd-estimator sampled estimates the reverse or the forward KL" in capsys.readouterr().err


def test_topk_with_a_projection_by_hand():
    """A teacher with another tokenizer: student tokens 0 and 1 belong to teacher token 0, student
    token 2 to teacher token 1, student token 3 to none. Student p = (0.1, 0.2, 0.3, 0.4) sums to
    (0.3, 0.3, 0) on the teacher's three tokens; the teacher's top-2 are tokens 0 and 2 at 0.5 and
    0.2. Buckets: student (0.3, ~0, 0.7), teacher (0.5, 0.2, 0.3)."""
    from memopd.learn.estimators import PROJECT_FLOOR, TopK, bucket_divergence, topk_buckets

    logp_s = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().requires_grad_(True)
    top = TopK(torch.tensor([[0, 2]]), torch.tensor([[0.5, 0.2]]).log(), project=torch.tensor([0, 0, 1, -1]))
    s_b, t_b = topk_buckets(logp_s, top)
    assert s_b.exp().tolist()[0] == pytest.approx([0.3, PROJECT_FLOOR, 0.7], abs=1e-6)
    assert t_b.exp().tolist()[0] == pytest.approx([0.5, 0.2, 0.3], abs=1e-6)
    rkl = bucket_divergence(s_b, t_b, "rkl")
    want = 0.3 * math.log(0.3 / 0.5) + 0.7 * math.log(0.7 / 0.3)
    assert rkl.item() == pytest.approx(want, abs=1e-5)
    fkl = bucket_divergence(s_b, t_b, "fkl")
    assert fkl.item() == pytest.approx(0.5 * math.log(0.5 / 0.3) + 0.2 * math.log(0.2 / PROJECT_FLOOR)
                                       + 0.3 * math.log(0.3 / 0.7), rel=1e-4)
    rkl.backward()
    assert torch.isfinite(logp_s.grad).all()
