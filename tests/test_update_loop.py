"""The update loop's shortcuts change no number: the student's output head applied once for its
log-probs, entropy and divergence (against the separate functions), and the teacher's
log-distribution kept across PPO epochs (against projecting it again every epoch)."""

import pytest
import torch

from memopd import losses, train
from memopd.learn.estimators.full import teacher_logprobs
from memopd.scoring import ActionStates, token_logprobs


def _states(seed: int, n: int = 37, hidden: int = 16, vocab: int = 50) -> ActionStates:
    torch.manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    temps = torch.where(torch.arange(n) % 3 == 0, 1.0, 0.7)
    return ActionStates(torch.randn(n, hidden, requires_grad=True), head, temps)


@pytest.mark.parametrize("kind", losses.DIVERGENCES)
@pytest.mark.parametrize("cached", [False, True])
def test_one_projection_gives_the_separate_functions_values_and_gradients(kind, cached):
    student, teacher = _states(0), _states(1)
    targets = torch.randint(0, 50, (37,))
    w = torch.rand(37)
    # reference: the scoring and distillation functions, each projecting the student itself
    lp_ref, ent_ref, _ = token_logprobs(student, targets, chunk_size=8)
    div_ref = losses.divergence_from_states(student, teacher, kind, chunk_size=8)
    (lp_ref * w).sum().add((ent_ref * w).sum()).add((div_ref * w).sum()).backward()
    grad_ref = student.hidden.grad.clone()
    head_grad_ref = student.head.lm_head.weight.grad.clone()
    student.hidden.grad = None
    student.head.lm_head.weight.grad = None
    t_logp = losses.teacher_logprobs(teacher, chunk_size=5) if cached else None
    lp, ent, div = losses.student_terms(student, targets, None if cached else teacher, kind, 8, t_logp)
    (lp * w).sum().add((ent * w).sum()).add((div * w).sum()).backward()
    for got, want in [(lp, lp_ref), (ent, ent_ref), (div, div_ref), (student.hidden.grad, grad_ref),
                      (student.head.lm_head.weight.grad, head_grad_ref)]:
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-6)
    assert teacher.hidden.grad is None  # the teacher is never differentiated
    lp2, ent2, none = losses.student_terms(student, targets)  # no teacher: no divergence
    assert none is None and torch.allclose(lp2, lp_ref, atol=1e-6)


def test_student_terms_refuse_mismatched_teachers():
    with pytest.raises(ValueError, match="teacher"):
        losses.student_terms(_states(0, n=4), torch.zeros(4, dtype=torch.long), _states(1, n=5))
    with pytest.raises(ValueError, match="vocabularies"):
        losses.student_terms(_states(0, n=4), torch.zeros(4, dtype=torch.long), _states(1, n=4, vocab=51))


FAST = ["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=2", "--questions-per-step", "2", "--group-size",
        "2", "--max-new-tokens", "12", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "1024", "--threads", "1", "--ppo-epochs", "3",
        "--sample-episodes", "0"]


def test_keeping_the_teachers_distribution_across_epochs_changes_no_update(tmp_path):
    runs = {}
    for name, extra in [("kept", []), ("recomputed", ["--teacher-cache-mb", "0"])]:
        cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(tmp_path / name)] + extra, "t", "")
        trainer = train.Trainer(train.prepare(cfg), log=lambda m: None)
        if name == "kept":
            episodes = trainer.rollout()
            for e, f1 in zip(episodes, [0.0, 1.0, 0.5, 0.25]):
                e.metrics["f1"] = f1
            assert teacher_logprobs(None, trainer.cfg) is None
        metrics = trainer.learn(episodes)
        runs[name] = (metrics, {k: v.detach().clone() for k, v in trainer.student.state_dict().items()})
    (m1, w1), (m2, w2) = runs["kept"], runs["recomputed"]
    for k in ("loss", "pg_loss", "opd_loss", "entropy", "kl/all", "grad_norm"):
        assert m1[k] == pytest.approx(m2[k], rel=1e-6, abs=1e-8), k
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-6
    assert m1["opd_loss"] > 0 and m1["pg_loss"] != 0
