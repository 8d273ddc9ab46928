"""End-to-end trainer tests on tiny models: steps run, kill-and-resume is exact (also for a kill
at either side of a metrics row), NaN losses are handled, bad input is refused like a tool (no run
directory left behind), the trained model is usable (run dir, checkpoint, export), and OPD lowers
the student's KL to its teacher."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memopd import checkpoint, train
from memopd.runlog import read_metrics

FAST = ["--env-kwarg", "num_chunks=2", "--questions-per-step", "2", "--group-size", "2",
        "--max-new-tokens", "12", "--eval-episodes", "4", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "1024"]
TIMING = {"tokens_per_s", "rollout_s", "step_s", "train_clock_s", "prune/monitor_s", "prune/rollout_saved_s"}


def _timing(key: str) -> bool:
    return key in TIMING or key.startswith("time/")  # time/<phase>_s: the step's profile


def _cfg(tmp_path, *extra):
    cfg = train.TrainConfig()
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(tmp_path)] + list(extra), "t", "")
    return train.prepare(cfg)


def test_training_steps_write_a_complete_run_dir(tmp_path):
    cfg = _cfg(tmp_path / "run", "--steps", "2", "--save-every", "1", "--audit-every", "2")
    summary = train.Trainer(cfg, log=lambda m: None).fit()
    run = tmp_path / "run"
    rows = read_metrics(run)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["packing_efficiency"] > 0.5 and r["action_tokens"] > 0
        assert r["kl/all"] >= 0 and r["entropy"] > 0
    assert "audit/max_abs_diff" not in steps[0]  # audited every 2 steps
    assert steps[1]["audit/max_abs_diff"] < 1e-4 and steps[1]["audit/passed"] is True  # RCE holds
    assert (run / "config.toml").is_file() and (run / "curves.png").stat().st_size > 1000
    assert sorted(p.name for p in (run / "episodes").iterdir()) == ["step-000001.jsonl", "step-000002.jsonl"]
    assert checkpoint.list_checkpoints(run)[0].name == "step-000002"
    assert set(summary) >= {"eval_before", "eval_after", "eval_teacher"}
    assert 0.0 <= summary["eval_teacher"]["f1"] <= 1.0  # the teacher is measured on the same test episodes


def test_gae_critic_persistent_teacher_and_reference_penalty_run(tmp_path):
    cfg = _cfg(tmp_path / "run", "--steps", "2", "--advantage", "gae", "--teacher-context", "persistent",
               "--ref-beta", "0.1", "--teacher-mask", "memory", "--opd-divergence", "jsd")
    trainer = train.Trainer(cfg, log=lambda m: None)
    trainer.fit()
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 2 and all(r["value_loss"] >= 0 for r in rows)
    assert all(r["kl/answer"] is None and r["kl/memory"] >= 0 for r in rows)  # answers unsupervised: no KL
    assert {"student", "critic", "ref"} <= set(trainer.modules())


def _run_cli(args, env):
    # SIGINT at its default in the child, as in a terminal: a runner started in the background (a
    # shell's `cmd &`) ignores SIGINT, the child would inherit that, and Python then installs no
    # KeyboardInterrupt handler, so a test's Ctrl-C would be lost.
    return subprocess.Popen([sys.executable, "-m", "memopd.train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.slow
def test_kill_and_resume_reproduces_the_uninterrupted_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = FAST + ["--steps", "3", "--save-every", "1", "--threads", "1"]
    full = _run_cli(common + ["--run-dir", str(tmp_path / "full")], env)
    out, _ = full.communicate(timeout=900)
    assert full.returncode == 0, out

    killed = _run_cli(common + ["--run-dir", str(tmp_path / "killed")], env)
    ckpt = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 900
    while time.time() < deadline and killed.poll() is None:  # kill once step 2 is saved
        if (ckpt / "latest").is_file() and (ckpt / "latest").read_text() == "step-000002":
            break
        time.sleep(0.05)
    assert killed.poll() is None, "the run ended before it could be killed"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    resumed = _run_cli(["--resume", str(tmp_path / "killed"), "--no-progress"], env)
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out
    assert "resumed from" in out

    def steps(run):
        return {r["step"]: {k: v for k, v in r.items() if not _timing(k)}
                for r in read_metrics(tmp_path / run) if "loss" in r}

    a, b = steps("full"), steps("killed")
    assert sorted(b) == [1, 2, 3]
    for s in (1, 2, 3):
        for k, v in a[s].items():
            assert b[s][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (s, k)
    assert json.loads((tmp_path / "killed" / "summary.json").read_text())["steps"] == 3


@pytest.mark.slow
def test_ctrl_c_names_the_kept_checkpoint_and_the_resume_command(tmp_path):
    """Ctrl-C (SIGINT) during training: exit 130, and a line of its own, below the progress bar,
    naming the last checkpoint and the command that continues; that command then runs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = tmp_path / "run"
    proc = _run_cli(FAST + ["--steps", "50", "--save-every", "1", "--threads", "1", "--run-dir", str(run)], env)
    latest = run / "checkpoints" / "latest"
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None and not latest.is_file():
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out
    last = checkpoint.list_checkpoints(run)[0]
    line = out.strip().splitlines()[-1]
    assert line == (f"interrupted: the last checkpoint is kept, {last}; continue from it with: "
                    f"python -m memopd.train --resume {run}")
    step = json.loads((last / "meta.json").read_text())["step"]
    resumed = _run_cli(["--resume", str(run), "--steps", str(step + 1), "--no-progress"], env)
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0 and "resumed from" in out, out


def test_nan_losses_skip_then_stop_with_checkpoint_intact(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path / "run", "--steps", "5", "--max-bad-steps", "2")

    def nan_loss(pg, entropy, opd, entropy_coef, opd_coef):
        return pg * float("nan")

    from memopd import losses

    monkeypatch.setattr(losses, "actor_loss", nan_loss)
    trainer = train.Trainer(cfg, log=lambda m: None)
    before = {k: v.clone() for k, v in trainer.student.state_dict().items()}
    with pytest.warns(RuntimeWarning, match="non-finite loss"):
        with pytest.raises(train.TrainingError, match="2 steps in a row had a non-finite loss") as err:
            trainer.fit()
    assert "last good checkpoint is intact" in str(err.value)
    # weights were never updated with a NaN, and the saved checkpoint still loads
    for k, v in trainer.student.state_dict().items():
        assert (v == before[k]).all(), k
    state, path = checkpoint.load_latest(tmp_path / "run", trainer.modules())
    assert path.name == "step-000000"


def test_unknown_env_lists_envs(capsys):
    code = train.main(["--env", "memgym/Nope-v0", "--run-dir", "/nonexistent/never-made"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown memgym env" in err and "memgym/LongQA-v0" in err


def test_out_of_range_flag_says_the_range(capsys):
    assert train.main(["--clip-eps", "3"]) == 2
    assert "error: --clip-eps=3.0 is out of range; allowed: [0.0, 1.0]" in capsys.readouterr().err


def test_teacher_with_another_vocabulary_is_refused_for_the_full_estimator(tmp_path):
    from agents import presets

    tok = presets.build_tokenizer(["a small other corpus with other words entirely"] * 20, vocab_size=300)
    model = presets.build_model(presets.TINY_PRESETS["tiny"], tok)
    model.save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    cfg = _cfg(tmp_path / "run", "--teacher", str(tmp_path / "other"))
    with pytest.raises(ValueError, match="tokenizers differ.*pass --opd-estimator topk or sampled"):
        train.Trainer(cfg, log=lambda m: None)


@pytest.mark.slow
def test_opd_only_lowers_kl_to_the_teacher(tmp_path):
    cfg = _cfg(tmp_path / "run", "--steps", "24", "--reward", "none", "--lr", "3e-3", "--save-every", "100",
               "--sample-episodes", "0", "--threads", "2", "--opd-divergence", "rkl",  # MemOPD's own KL
               "--ppo-epochs", "1", "--minibatches", "2")
    train.Trainer(cfg, log=lambda m: None).fit()
    kl = [r["kl/all"] for r in read_metrics(tmp_path / "run") if "kl/all" in r]
    assert len(kl) == 24
    first, last = sum(kl[:4]) / 4, sum(kl[-4:]) / 4
    assert last < 0.7 * first, kl


def test_student_dependent_defaults_are_resolved_and_explicit_flags_win():
    tiny = train.resolve_defaults(train.TrainConfig())
    assert (tiny.lr, tiny.opd_divergence) == (train.TINY_LR, "fkl")  # a from-scratch tiny preset
    real = train.resolve_defaults(train.TrainConfig(model="org/some-model"))
    assert (real.lr, real.opd_divergence) == (train.MODEL_LR, "rkl")  # MemOPD's reverse KL
    given = train.resolve_defaults(train.TrainConfig(lr=1e-4, opd_divergence="jsd"))
    assert (given.lr, given.opd_divergence) == (1e-4, "jsd")


# --- one short run, reused: the model it leaves is usable ----------------------------------------

RUN2 = ["--steps", "2", "--save-every", "1", "--sample-episodes", "2", "--audit-every", "0"]


def _rows(run):
    return [{k: v for k, v in r.items() if not _timing(k)} for r in read_metrics(run)]


def _same_rows(a, b):
    assert [(r["step"], sorted(r)) for r in a] == [(r["step"], sorted(r)) for r in b]
    for ra, rb in zip(a, b):
        for k, v in ra.items():
            assert rb[k] == (pytest.approx(v, rel=1e-5, abs=1e-6) if isinstance(v, float) else v), (ra["step"], k)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step run (checkpoint every step, 2 sample episodes per step) and its trainer."""
    run = tmp_path_factory.mktemp("trained") / "run"
    trainer = train.Trainer(_cfg(run, *RUN2), log=lambda m: None)
    trainer.fit()
    return run, trainer


def test_run_dir_and_checkpoints_load_as_models_and_export(trained, tmp_path):
    from agents import models
    from memopd import export

    run, trainer = trained
    want = trainer.student.state_dict()

    def same(model):
        got = model.state_dict()
        return got.keys() == want.keys() and all(torch_equal(got[k], want[k]) for k in want)

    assert (run / "model" / "config.json").is_file() and (run / "model" / "tokenizer.json").is_file()
    assert same(models.load(run)[0])  # the run directory: its final model
    assert same(models.load(run / "checkpoints" / "step-000002")[0])  # a checkpoint: base model + its weights
    out = export.export(run / "checkpoints" / "step-000002", tmp_path / "exported")
    assert same(models.load(out)[0]) and (out / "config.json").is_file()
    assert oct((out).stat().st_mode & 0o777) == "0o755"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # written aside, renamed


def test_export_cli_refuses_an_existing_output_and_a_non_model(trained, tmp_path, capsys):
    from memopd import export

    run, _ = trained
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep")
    assert export.main([str(run), "--out", str(tmp_path / "taken")]) == 2
    assert "error: " in capsys.readouterr().err and (tmp_path / "taken" / "x").read_text() == "keep"
    assert export.main([str(tmp_path / "taken"), "--out", str(tmp_path / "o")]) == 2
    assert "has no config.json" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_bf16_export_is_half_the_size_and_loads_back_as_fp32(trained, tmp_path):
    import torch

    from agents import models
    from memopd import export

    run, trainer = trained
    size = {}
    for dtype in ("float32", "bfloat16"):
        assert export.main([str(run), "--out", str(tmp_path / dtype), "--dtype", dtype]) == 0
        size[dtype] = sum(f.stat().st_size for f in (tmp_path / dtype).glob("*.safetensors"))
    assert 0.45 < size["bfloat16"] / size["float32"] < 0.55
    model, _ = models.load(tmp_path / "bfloat16")
    want = trainer.student.state_dict()
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, want[k].to(torch.bfloat16).float())


def test_evaluating_the_export_gives_the_in_process_greedy_outputs(trained, tmp_path):
    from agents import models
    from agents.backends import GenerationRequest, HFBackend, SamplingParams
    from memopd import eval as evalcli
    from memopd import export

    run, trainer = trained
    out = export.export(run, tmp_path / "exported")
    ids = trainer.tokenizer("question : where does the person work ?")["input_ids"]
    sp = SamplingParams(greedy=True, max_new_tokens=12, seed=0)
    req = [GenerationRequest(prompt_ids=ids, prefix_len=0, role="memory")]
    expect = HFBackend(trainer.student, trainer.tokenizer).generate(req, sp)[0].response_ids
    model, tok = models.load(out)
    assert HFBackend(model, tok).generate(req, sp)[0].response_ids == expect
    responses = []
    for spec in (out, run):  # the export and the run directory itself evaluate the same
        d = tmp_path / f"eval-{len(responses)}"
        assert evalcli.main(["--agent", "memagent", "--model", str(spec), "--episodes", "2", "--env-kwarg",
                             "num_chunks=2", "--max-new-tokens", "12", "--out", str(d), "--no-progress"]) == 0
        lines = (d / "episodes.jsonl").read_text().splitlines()
        responses.append([[i["response_ids"] for i in json.loads(line)["invocations"]] for line in lines])
    assert responses[0] == responses[1]


def torch_equal(a, b):
    import torch

    return torch.equal(a, b)


def test_sample_episodes_carry_the_teacher_kl_per_token(trained):
    from agents.records import load_episodes

    run, _ = trained
    eps = load_episodes(run / "episodes" / "step-000001.jsonl").episodes
    assert len(eps) == 2
    for inv in (i for e in eps for i in e.invocations):
        kl = inv.meta["teacher_kl"]
        assert len(kl) == len(inv.response_ids) and inv.meta["teacher_mode"] == "aligned"
        assert all(isinstance(x, float) and x >= -1e-6 for x in kl)  # --teacher-mask both: every token


def test_resume_keeps_settings_and_records_what_it_changes(trained, tmp_path):
    import shutil

    run, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    logs = []
    cfg = train.prepare(train.TrainConfig(resume=str(copy), steps=3), explicit={"steps"})
    assert cfg.questions_per_step == 2 and cfg.env_kwargs == {"num_chunks": 2}  # the saved settings
    train.Trainer(cfg, log=logs.append).fit()
    text = (copy / "config.toml").read_text()
    assert "steps = 3\n" in text and text.startswith("# resumed at step 2 on ")
    assert "steps 2 -> 3" in text and any("steps 2 -> 3" in m and "config.toml" in m for m in logs)
    assert "resume =" not in text  # the file still reads as the run's config
    assert [r["step"] for r in read_metrics(copy) if "loss" in r] == [1, 2, 3]


def test_update_does_not_write_into_the_packed_batch_and_reseeds_publicly(tmp_path, monkeypatch):
    from agents.backends.hf import HFBackend

    trainer = train.Trainer(_cfg(tmp_path / "run", "--steps", "1"), log=lambda m: None)
    packed, seeds = [], []
    from memopd.learn import trainer as trainer_module

    real_pack = trainer_module.pack_episodes

    def spy_pack(*args, **kwargs):
        batch = real_pack(*args, **kwargs)
        packed.append((batch, batch.advantages.clone()))
        return batch

    real_reseed = HFBackend.reseed
    monkeypatch.setattr(trainer_module, "pack_episodes", spy_pack)
    monkeypatch.setattr(HFBackend, "reseed", lambda self, seed: (seeds.append(seed), real_reseed(self, seed)))
    trainer.train_step()
    batch, before = packed[0]
    assert torch_equal(batch.advantages, before)  # the packer's output is read, never written
    assert seeds == [0]  # seed 0, step 0: the step's own seed, through the public API


# --- bad input fails like a tool ---------------------------------------------------------------

@pytest.mark.parametrize("args, says", [
    (["--model", "no-such-model"], "unknown model spec 'no-such-model'"),
    (["--model", "./missing/model-dir"], "model path not found"),
    (["--teacher", "./missing/teacher"], "model path not found"),
    (["--env-kwarg", "num_chunkz=3"], "unknown option(s) ['num_chunkz']"),
    (["--env", "memgym/Nope-v0"], "unknown memgym env"),
    (["--steps", "many"], "--steps: expected an integer, got 'many'"),
])
def test_bad_input_is_one_error_line_and_leaves_no_run_dir(tmp_path, capsys, args, says):
    code = train.main(FAST + ["--run-dir", str(tmp_path / "run")] + args)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "error: " in err and says in err, err
    assert not (tmp_path / "run").exists()


def test_wrong_type_in_toml_config_is_an_error_line(tmp_path, capsys):
    f = tmp_path / "c.toml"
    f.write_text("steps = 2\nclip_eps = \"big\"\n")
    assert train.main(["--config", str(f), "--run-dir", str(tmp_path / "run")]) == 2
    assert f"error: {f}: --clip-eps='big' is str; expected a number" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_unwritable_run_dir_is_an_error_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert train.main(FAST + ["--run-dir", str(tmp_path / "file" / "run")]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "Not a directory" in err and "Traceback" not in err


def test_a_start_that_fails_before_its_first_checkpoint_leaves_no_run_dir(tmp_path, capsys, monkeypatch):
    import errno

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "checkpoints"))

    monkeypatch.setattr(train.checkpoint, "save", full_disk)
    assert train.main(FAST + ["--run-dir", str(tmp_path / "run"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "No space left on device; free some disk space" in err
    assert not (tmp_path / "run").exists()


def test_a_run_dir_with_checkpoints_is_not_overwritten(trained, capsys):
    run, _ = trained
    assert train.main(FAST + ["--run-dir", str(run)]) == 2
    assert f"--resume {run}" in capsys.readouterr().err


def test_resume_without_a_usable_checkpoint_is_an_error_line(trained, tmp_path, capsys):
    import shutil

    run, _ = trained
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(run / "config.toml", empty / "config.toml")
    assert train.main(["--resume", str(empty)]) == 2
    assert "error: no checkpoint in" in capsys.readouterr().err
    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    for ck in checkpoint.list_checkpoints(broken):
        (ck / "trainer.pt").write_bytes(b"not a checkpoint")
    assert train.main(["--resume", str(broken)]) == 2
    assert "error: every checkpoint in" in capsys.readouterr().err
    assert train.main(["--resume", str(tmp_path / "nowhere")]) == 2
    assert "no config.toml there" in capsys.readouterr().err


def test_help_is_short_and_help_all_is_whole(capsys):
    """--help: the common options with their help and every group's flags by name, in a screenful
    or two; a mistyped flag is one error line that names the closest flag."""
    with pytest.raises(SystemExit) as exit_:
        train.main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and len(out.splitlines()) < 130 and "--help-all" in out
    assert "--opd-estimator {full,topk,sampled}" in out and "One step, top to bottom" not in out
    parser = train.cfgmod.build_parser(train.TrainConfig, "t", "")
    flags = [a.option_strings[0] for a in parser._actions if a.option_strings[0] not in ("-h", "--help-all")]
    assert [f for f in flags if f not in out.split()] == []
    with pytest.raises(SystemExit) as exit_:
        train.main(["--stpes", "3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("\n") == 1 and err.startswith("error: unrecognized arguments: --stpes 3 (did you mean --steps")


def test_help_lists_choices_defaults_once_and_the_description(capsys):
    with pytest.raises(SystemExit) as exit_:
        train.main(["--help-all"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert "--advantage {grpo,gae}" in out and "--attn {sdpa,eager,blocks,flex,flash}" in out
    assert "--progress, --no-progress" in out and "--tensorboard, --no-tensorboard" in out
    assert "--env-kwarg KEY=VALUE" in out and "One step, top to bottom" in out  # the full description
    clip = out[out.index("  --clip-eps CLIP_EPS "):].split("\n  --")[0]  # its help, up to the next option
    assert clip.count("(default: 0.2)") == 1 and "(default: 0.2) (default" not in out
    flat = " ".join(out.split())
    assert "may prefer) (default" not in flat  # THREADS_HELP says its default itself


# --- kills at either side of a metrics row lose and duplicate nothing ---------------------------

class Killed(BaseException):
    """Stands for SIGKILL at an exact point."""


@pytest.mark.parametrize("when", ["step-0 row", "final eval row"])
def test_kill_next_to_a_metrics_row_then_resume_matches_the_uninterrupted_run(trained, tmp_path, monkeypatch,
                                                                              when):
    from memopd.runlog import RunLogger

    real_log = RunLogger.log

    def log_then_die(self, step, metrics):
        real_log(self, step, metrics)  # the row is on disk ...
        if (when == "step-0 row" and step == 0) or (when == "final eval row" and step == 2 and "loss" not in metrics):
            raise Killed  # ... and the process dies before anything else

    monkeypatch.setattr(RunLogger, "log", log_then_die)
    run = tmp_path / "run"
    with pytest.raises(Killed):
        train.Trainer(_cfg(run, *RUN2), log=lambda m: None).fit()
    monkeypatch.undo()
    train.Trainer(train.prepare(train.TrainConfig(resume=str(run))), log=lambda m: None).fit()
    _same_rows(_rows(trained[0]), _rows(run))


def test_a_tasks_train_table_fills_the_options_not_given(tmp_path):
    """A task folder's [train] table (its recommended settings) sets the options the command line
    does not give; a flag given wins, and a task without the table keeps the global defaults."""
    import memgym.registry as registry

    folder = tmp_path / "TrainRec"
    folder.mkdir()
    (folder / "task.toml").write_text('name = "TrainRec"\nsource = "memgym.generators.knowledge_update:make_source"\n'
                                      '[train]\nstudent_warmup_steps = 7\nsteps = 3\n')
    registry.register_tasks([tmp_path])
    try:
        cfg = train.prepare(train.TrainConfig(env="memgym/TrainRec-v0", run_dir=str(tmp_path / "r")))
        assert (cfg.student_warmup_steps, cfg.steps) == (7, 3)
        given = train.prepare(train.TrainConfig(env="memgym/TrainRec-v0", run_dir=str(tmp_path / "r"), steps=5),
                              explicit={"steps"})
        assert (given.student_warmup_steps, given.steps) == (7, 5)
        plain = train.prepare(train.TrainConfig(env="memgym/LongQA-v0", run_dir=str(tmp_path / "r")))
        assert (plain.student_warmup_steps, plain.steps) == (100, 80)
        (folder / "task.toml").write_text('name = "TrainRec"\n'
                                          'source = "memgym.generators.knowledge_update:make_source"\n'
                                          '[train]\nwarm_steps = 7\n')
        registry.TASKS.pop("memgym/TrainRec-v0")
        registry.register_tasks([tmp_path])
        with pytest.raises(train.cfgmod.ConfigError, match=r"key 'train.warm_steps': not a memopd.train option"):
            train.prepare(train.TrainConfig(env="memgym/TrainRec-v0", run_dir=str(tmp_path / "r")))
    finally:
        registry.TASKS.pop("memgym/TrainRec-v0", None)


def test_a_mix_takes_every_tasks_train_table_and_refuses_a_disagreement(tmp_path):
    """With several envs, each task's [train] table applies; two tables that disagree on an option
    not given are one clear error naming both, and the flag given settles it."""
    import memgym.registry as registry

    for name, warm in (("MixRecA", 7), ("MixRecB", 9)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "task.toml").write_text(f'name = "{name}"\nsource = "memgym.generators.knowledge_update:make_source"\n'
                                          f'[train]\nstudent_warmup_steps = {warm}\n')
    registry.register_tasks([tmp_path])
    run = str(tmp_path / "r")
    try:
        one = train.prepare(train.TrainConfig(env="memgym/LongQA-v0", env_mix=["memgym/LongQA-v0", "memgym/MixRecA-v0"],
                                              run_dir=run))
        assert one.student_warmup_steps == 7
        both = ["memgym/MixRecA-v0", "memgym/MixRecB-v0"]
        with pytest.raises(train.cfgmod.ConfigError, match=r"recommend different values for 'student_warmup_steps'.*"
                                                           r"MixRecA.*7.*MixRecB.*9.*give --student-warmup-steps"):
            train.prepare(train.TrainConfig(env="memgym/MixRecA-v0", env_mix=both, run_dir=run))
        given = train.prepare(train.TrainConfig(env="memgym/MixRecA-v0", env_mix=both, run_dir=run,
                                                student_warmup_steps=3), explicit={"student_warmup_steps"})
        assert given.student_warmup_steps == 3
    finally:
        for name in ("MixRecA", "MixRecB"):
            registry.TASKS.pop(f"memgym/{name}-v0", None)


def test_the_auto_teacher_is_one_model_whichever_seed_builds_it(tmp_path, monkeypatch):
    """Its cache key has no seed, so the build must not depend on the run's: built by a seed-3 run in one
    cache and by a seed-0 run in another, the two teachers' weights are equal (the recipe shrunk to two
    steps on eight trajectories)."""
    import torch
    from safetensors.torch import load_file

    from memopd.learn import models

    monkeypatch.setitem(models.TEACHER_SFT, "num_episodes", 8)
    monkeypatch.setitem(models.TEACHER_SFT, "batch_episodes", 4)
    built = {}
    for seed in (3, 0):
        monkeypatch.setenv("MEMOPD_CACHE", str(tmp_path / f"cache-{seed}"))
        cfg = train.prepare(train.TrainConfig(env="memgym/LongQA-v0", env_kwargs={"num_chunks": 2}, seed=seed,
                                              teacher_sft_steps=2, progress=False), explicit={"teacher_sft_steps"})
        built[seed] = load_file(str(Path(models.ensure_teacher(cfg, log=lambda _: None)) / "model.safetensors"))
    assert built[3].keys() == built[0].keys()
    assert all(torch.equal(built[3][k], built[0][k]) for k in built[0])


def test_teacher_sft_steps_sets_the_auto_teachers_steps_and_its_cache_key():
    """--teacher-sft-steps is the auto teacher's SFT steps; at its default the cache key is the one of
    the recipe without the option (every cached teacher is found again), and other steps build
    another teacher. KnowledgeUpdate's task.toml recommends 750."""
    import hashlib
    import json

    from agents.presets import PRESET_FORMAT
    from memgym.registry import get_task
    from memopd.learn.models import TEACHER_SFT, default_teacher_dir, teacher_recipe

    cfg = train.prepare(train.TrainConfig(env="memgym/LongQA-v0", env_kwargs={"num_chunks": 3}))
    assert cfg.teacher_sft_steps == 250 and teacher_recipe(cfg) == {**TEACHER_SFT, "model": "tiny-teacher"}
    key = json.dumps({"env": cfg.env, "env_kwargs": {"num_chunks": 3}, "task": get_task(cfg.env).fingerprint(),
                      "preset_format": PRESET_FORMAT, **TEACHER_SFT}, sort_keys=True)
    assert default_teacher_dir(cfg).name == hashlib.sha256(key.encode()).hexdigest()[:16]
    longer = dataclasses.replace(cfg, teacher_sft_steps=750)
    assert teacher_recipe(longer)["steps"] == 750 and default_teacher_dir(longer) != default_teacher_dir(cfg)
    ku = train.prepare(train.TrainConfig(env="memgym/KnowledgeUpdate-v0"))
    assert ku.teacher_sft_steps == 750
    given = train.prepare(train.TrainConfig(env="memgym/KnowledgeUpdate-v0", teacher_sft_steps=100),
                          explicit={"teacher_sft_steps"})
    assert given.teacher_sft_steps == 100
