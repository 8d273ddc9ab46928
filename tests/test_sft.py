"""memopd.sft: shared options with the trainer, one atomic save with normal permissions, and
bad input reported as one error line."""

import json

import pytest

from memopd import sft

FAST = ["--model", "tiny", "--env-kwarg", "num_chunks=2", "--num-episodes", "4", "--steps", "1",
        "--batch-episodes", "2", "--no-progress", "--threads", "1"]


def test_sft_cli_writes_a_loadable_model_with_normal_permissions(tmp_path):
    from agents import models

    out = tmp_path / "out"
    assert sft.main(FAST + ["--out", str(out), "--lr-schedule", "linear"]) == 0
    assert oct(out.stat().st_mode & 0o777) == "0o755"
    assert {oct(f.stat().st_mode & 0o777) for f in out.iterdir()} == {"0o644"}  # weights readable like the rest
    saved = json.loads((out / "sft_config.json").read_text())
    assert saved["env_kwargs"] == {"num_chunks": 2} and saved["lr_schedule"] == "linear"
    assert len((out / "sft_metrics.jsonl").read_text().splitlines()) == 1
    models.load(out)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing left aside


def test_a_failed_save_leaves_nothing_and_keeps_the_old_output(tmp_path, monkeypatch):
    from agents import models

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    model, tok = models.load("tiny")

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(tok), "save_pretrained", broken)
    with pytest.raises(OSError):
        models.save_pretrained(out, model, tok)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "old.txt").read_text() == "old"


@pytest.mark.parametrize("args, says", [
    (["--model", "no-such-model"], "unknown model spec"),
    (["--episodes", "missing.jsonl"], "missing.jsonl"),
    (["--env-kwarg", "num_chunkz=2"], "unknown option(s) ['num_chunkz']"),
    (["--attn", "flesh"], "choose one of ['sdpa', 'eager', 'blocks', 'flex', 'flash']"),
])
def test_bad_input_is_one_error_line(tmp_path, capsys, args, says):
    code = sft.main(FAST + ["--out", str(tmp_path / "out")] + args)
    err = capsys.readouterr().err
    assert code == 2 and "error: " in err and says in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_bool_options_are_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        sft.main(FAST + ["--progress", "false"])  # --progress / --no-progress take no value
    assert exit_.value.code == 2 and "unrecognized arguments: false" in capsys.readouterr().err


def test_unwritable_output_fails_before_training(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("")

    def no_training(*args, **kwargs):
        raise AssertionError("trained before checking the output directory")

    monkeypatch.setattr(sft, "train_sft", no_training)
    assert sft.main(FAST + ["--out", str(tmp_path / "file" / "out")]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: --out: ") and "is a file, not a directory" in err


def test_bfloat16_computes_under_autocast_and_keeps_fp32_weights(tmp_path, capsys):
    """--dtype bfloat16: the passes run in bf16, the saved weights (the fp32 master copy) stay fp32;
    without progress bars the SFT still says how it goes."""
    import torch

    from agents import models
    from memopd.runtime import compute_dtype

    out = tmp_path / "out"
    assert sft.main(FAST + ["--out", str(out), "--dtype", "bfloat16", "--steps", "2"]) == 0
    assert json.loads((out / "sft_config.json").read_text())["dtype"] == "bfloat16"
    assert "sft step 2/2: loss" in capsys.readouterr().err
    model, _ = models.load(out)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with compute_dtype("bfloat16", "cpu"):
        assert model(torch.tensor([[1, 2, 3]])).logits.dtype == torch.bfloat16
    with pytest.raises(Exception, match="dtype"):
        sft.SFTConfig(dtype="float16")


def test_gradient_checkpointing_trains_the_same(tmp_path):
    """--gradient-checkpointing recomputes the layers in the backward: the same losses as without."""
    losses = {}
    for flag in ("--no-gradient-checkpointing", "--gradient-checkpointing"):
        out = tmp_path / flag
        assert sft.main(FAST + ["--out", str(out), "--steps", "3", flag]) == 0
        losses[flag] = [json.loads(line)["loss"] for line in (out / "sft_metrics.jsonl").read_text().splitlines()]
    assert losses["--gradient-checkpointing"] == pytest.approx(losses["--no-gradient-checkpointing"], abs=1e-5)


def test_a_killed_fine_tuning_resumes_and_ends_where_an_uninterrupted_one_does(tmp_path, cache):
    """``--checkpoint-every``: a ``kill -9`` after a saved state, then the same command again,
    resumes there (not from zero) and ends with the weights and history of a run never killed;
    the state directory is gone once the model is saved. This is how the auto teacher is built."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import torch

    from agents import models

    argv = ["--model", "tiny", "--env-kwarg", "num_chunks=2", "--num-episodes", "16", "--steps", "80",
            "--batch-episodes", "4", "--no-progress", "--threads", "1"]
    env = {**os.environ, "MEMOPD_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "memopd.sft", *argv, "--checkpoint-every", "5", "--out", str(tmp_path / "killed")]
    state = tmp_path / "killed.partial" / sft.STATE_FILE
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not state.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved_at = torch.load(state, weights_only=False)["step"]
    assert 0 < saved_at < 80 and not (tmp_path / "killed").exists()
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "resuming from step" in again.stderr
    assert sft.main(argv + ["--out", str(tmp_path / "whole")]) == 0
    a, _ = models.load(tmp_path / "killed")
    b, _ = models.load(tmp_path / "whole")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    hist = [(tmp_path / d / "sft_metrics.jsonl").read_text().splitlines() for d in ("killed", "whole")]
    assert [json.loads(r)["loss"] for r in hist[0]] == [json.loads(r)["loss"] for r in hist[1]]
    assert not (tmp_path / "killed.partial").exists()
