"""Config flags/TOML (validated dataclasses that round-trip), atomic checkpoints that load no
code, and metrics rewritten atomically."""

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from memopd import checkpoint, config, runtime


@dataclasses.dataclass
class Cfg(config.Config):
    lr: float = config.field(1e-3, help="learning rate", range=(0.0, 1.0))
    steps: int = config.field(10, help="steps", range=(1, None))
    mode: str = config.field("aligned", help="mode", choices=("aligned", "persistent"))
    use_x: bool = config.field(False, help="flag")
    name: str | None = config.field(None, help="optional name")


def test_flags_toml_and_override(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('lr = 0.01\nsteps = 5\nuse-x = true\n')
    cfg = config.parse_args(Cfg, ["--config", str(f), "--steps", "7", "--mode", "persistent"], "t", "")
    assert cfg == Cfg(lr=0.01, steps=7, mode="persistent", use_x=True, name=None)
    # the TOML we write reads back to the same config
    g = tmp_path / "d.toml"
    g.write_text(config.dump_toml(cfg))
    assert config.parse_args(Cfg, ["--config", str(g)], "t", "") == cfg


def test_out_of_range_and_bad_choice_say_what_is_allowed():
    with pytest.raises(config.ConfigError, match=r"allowed: \[0.0, 1.0\]"):
        config.parse_args(Cfg, ["--lr", "3"], "t", "")
    with pytest.raises(config.ConfigError, match=r"choose one of \['aligned', 'persistent'\]"):
        config.parse_args(Cfg, ["--mode", "x"], "t", "")
    with pytest.raises(config.ConfigError, match="--steps: expected an integer, got 'many'"):
        config.parse_args(Cfg, ["--steps", "many"], "t", "")


def test_unknown_toml_key(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("lrr = 1\n")
    with pytest.raises(config.ConfigError, match=r"unknown option\(s\) \['lrr'\]"):
        config.parse_args(Cfg, ["--config", str(f)], "t", "")


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def test_checkpoint_roundtrip_restores_weights_optimizer_rng(tmp_path):
    m = _model(0)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    torch.manual_seed(123)
    checkpoint.save(tmp_path, 3, {"model": m}, {"optimizer": opt.state_dict(), "rng": checkpoint.rng_state()})
    expected_next = torch.rand(3)
    m2 = _model(1)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.1)
    state, path = checkpoint.load_latest(tmp_path, {"model": m2})
    opt2.load_state_dict(state["optimizer"])
    checkpoint.set_rng_state(state["rng"])
    assert state["step"] == 3 and path.name == "step-000003"
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(torch.rand(3), expected_next)
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_corrupt_newest_checkpoint_falls_back_and_prunes(tmp_path):
    m = _model(0)
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, {"model": m}, {"x": step}, keep=2)
    names = [p.name for p in checkpoint.list_checkpoints(tmp_path)]
    assert names == ["step-000003", "step-000002"]
    # damage the newest: truncate its weights
    f = tmp_path / "checkpoints" / "step-000003" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:20])
    with pytest.warns(RuntimeWarning, match="skipped damaged checkpoint"):
        state, path = checkpoint.load_latest(tmp_path, {"model": _model(5)})
    assert path.name == "step-000002" and state["x"] == 2


@pytest.mark.parametrize("garbage", ["garbage{", "[1, 2]"])
def test_a_garbage_meta_json_is_named_in_the_fallback_and_in_the_error(tmp_path, garbage):
    """A damaged meta.json (not JSON, or not a checkpoint's) is skipped with a warning that names
    the file; with every checkpoint damaged the error names each file."""
    m = _model(0)
    for step in (1, 2):
        checkpoint.save(tmp_path, step, {"model": m}, {"x": step}, keep=2)
    newest = tmp_path / "checkpoints" / "step-000002" / "meta.json"
    newest.write_text(garbage)
    with pytest.warns(RuntimeWarning, match=f"{re.escape(str(newest))}: .*the checkpoint is damaged"):
        state, path = checkpoint.load_latest(tmp_path, {"model": _model(5)})
    assert path.name == "step-000001" and state["x"] == 1
    oldest = tmp_path / "checkpoints" / "step-000001" / "meta.json"
    oldest.write_text(garbage)
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(str(oldest))):
        checkpoint.load_latest(tmp_path, {"model": _model(5)})


def test_leftover_temp_dir_is_not_a_checkpoint(tmp_path):
    (tmp_path / "checkpoints" / ".tmp-abc").mkdir(parents=True)
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint"):
        checkpoint.load_latest(tmp_path, {"model": _model(0)})


def test_mismatched_model_is_refused(tmp_path):
    checkpoint.save(tmp_path, 1, {"model": _model(0)}, {})
    other = torch.nn.Sequential(torch.nn.Linear(4, 5))
    with pytest.raises(checkpoint.CheckpointError, match="does not match"):
        checkpoint.load_latest(tmp_path, {"model": other})


# --- configs validate themselves and round-trip through TOML ------------------------------------

def test_config_with_nested_env_kwargs_and_inf_round_trips(tmp_path):
    from memopd.train import TrainConfig

    cfg = TrainConfig(env="memgym/HotpotQA-v0", env_kwargs={"path": {"train": "a.jsonl", "test": "b.jsonl"},
                                                            "num_chunks": 3},
                      max_grad_norm=math.inf, lr=1e-4)
    f = tmp_path / "config.toml"
    config.save_toml(cfg, f, header=["a comment"])
    assert f.read_text().startswith("# a comment\n")
    back = config.from_dict(TrainConfig, config.load_toml(f), source=str(f))
    assert back == cfg and math.isinf(back.max_grad_norm)
    assert not list(tmp_path.glob(".*tmp*"))  # written aside and renamed


def test_dataclass_refuses_bad_values_when_made():
    from memopd.sft import SFTConfig
    from memopd.train import TrainConfig

    with pytest.raises(config.ConfigError, match=r"--advantage='gea' is not allowed; choose one of \['grpo', 'gae'\]"):
        TrainConfig(advantage="gea")
    with pytest.raises(config.ConfigError, match="--steps='10' is str; expected an integer"):
        TrainConfig(steps="10")
    with pytest.raises(config.ConfigError, match="--progress=1 is int; expected true or false"):
        SFTConfig(progress=1)
    with pytest.raises(config.ConfigError, match="--env-kwarg"):
        TrainConfig(env_kwargs=["num_chunks=2"])
    with pytest.raises(config.ConfigError, match="out of range"):
        dataclasses.replace(TrainConfig(), clip_eps=2.0)  # replace validates too
    assert TrainConfig(lr=1).lr == 1.0 and isinstance(TrainConfig(lr=1).lr, float)  # an int is a number


def test_wrong_type_in_toml_names_the_file_and_option(tmp_path):
    from memopd.train import TrainConfig

    f = tmp_path / "c.toml"
    f.write_text('steps = "ten"\n')
    with pytest.raises(config.ConfigError, match=r"c.toml: --steps='ten' is str; expected an integer"):
        config.parse_args(TrainConfig, ["--config", str(f)], "t", "")


def test_flags_kwargs_and_bools():
    from memopd.train import TrainConfig

    cfg, given = config.parse_known(TrainConfig, ["--env-kwarg", "num_chunks=2", "--env-kwarg", "fact_order=random",
                                                  "--no-progress", "--tensorboard"], "t", "")
    assert cfg.env_kwargs == {"num_chunks": 2, "fact_order": "random"}
    assert (cfg.progress, cfg.tensorboard) == (False, True)
    assert given == {"env_kwargs", "progress", "tensorboard"}
    with pytest.raises(config.ConfigError, match="--env-kwarg 'num_chunks' is not KEY=VALUE"):
        config.parse_args(TrainConfig, ["--env-kwarg", "num_chunks"], "t", "")
    with pytest.raises(SystemExit):  # the old JSON flag is gone
        config.parse_args(TrainConfig, ["--env-kwargs", '{"num_chunks": 2}'], "t", "")


def test_toml_env_kwargs_merge_with_flags(tmp_path):
    from memopd.train import TrainConfig

    f = tmp_path / "c.toml"
    f.write_text("steps = 3\n[env_kwargs]\nnum_chunks = 4\nhops = 1\n")
    cfg = config.parse_args(TrainConfig, ["--config", str(f), "--env-kwarg", "hops=2"], "t", "")
    assert cfg.steps == 3 and cfg.env_kwargs == {"num_chunks": 4, "hops": 2}


def test_train_and_sft_share_their_common_options():
    from memopd.attention import LOWERINGS
    from memopd.sft import SFTConfig
    from memopd.train import TrainConfig

    shared = {f.name for f in dataclasses.fields(config.TrainingOptions)}
    assert {"env", "env_kwargs", "model", "seed", "threads", "lr", "lr_schedule", "warmup_steps", "weight_decay",
            "max_grad_norm", "pack_tokens", "attn", "progress"} <= shared
    for cls in (TrainConfig, SFTConfig):
        assert issubclass(cls, config.TrainingOptions)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        assert fields["attn"].metadata["choices"] == LOWERINGS
        assert fields["threads"].default == config.DEFAULT_THREADS == 1  # as every CLI
    assert TrainConfig().audit_every == 20  # a cheap periodic RCE audit by default
    # one schedule: the SFT default (cosine to 10%) and the trainer's options are the same function
    f = runtime.lr_lambda("cosine", 2, 12, floor=0.1)
    assert [round(f(s), 4) for s in (0, 1, 2, 12)] == [0.5, 1.0, 1.0, 0.1]
    assert runtime.lr_lambda("linear", 0, 10)(5) == 0.5 and runtime.lr_lambda("constant", 0, 10)(9) == 1.0


# --- checkpoints trust nothing ------------------------------------------------------------------

class _Evil:
    """Pickles as a call that creates a file: loading it would run code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_checkpoint_with_pickled_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    checkpoint.save(tmp_path / "run", 1, {"model": _model(0)}, {"x": 1})
    torch.save({"x": _Evil(str(marker))}, tmp_path / "run" / "checkpoints" / "step-000001" / "trainer.pt")
    with pytest.raises(checkpoint.CheckpointError, match="refused"):
        checkpoint.load_latest(tmp_path / "run", {"model": _model(0)})
    assert not marker.exists()


def test_leftover_temp_folders_are_cleaned(tmp_path):
    left = tmp_path / "checkpoints" / ".tmp-killed"
    left.mkdir(parents=True)
    (left / "model.safetensors").write_bytes(b"half")
    (tmp_path / "checkpoints" / ".latest.tmp").write_text("step-000009")
    checkpoint.save(tmp_path, 1, {"model": _model(0)}, {})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-000001"]


def test_rng_state_is_plain_data():
    import random

    import numpy as np

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = checkpoint.rng_state()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    f = Path(os.environ.get("TMPDIR", "/tmp")) / f"rng-{os.getpid()}.pt"
    torch.save(state, f)
    try:
        checkpoint.set_rng_state(torch.load(f, weights_only=True))
    finally:
        f.unlink()
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


# --- metrics are rewritten atomically -----------------------------------------------------------

def test_metrics_rewrite_is_atomic(tmp_path, monkeypatch):
    from memopd import runlog

    logger = runlog.RunLogger(tmp_path)
    for step in range(4):
        logger.log(step, {"loss": float(step)})
    before = (tmp_path / "metrics.jsonl").read_text()
    calls = []

    def dying_dumps(obj, *a, **k):  # a kill in the middle of the rewrite
        calls.append(obj)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return json.JSONEncoder().encode(obj)

    monkeypatch.setattr(runlog.json, "dumps", dying_dumps)
    with pytest.raises(KeyboardInterrupt):
        logger.truncate_after(2)
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text() == before  # nothing lost
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temp file left
    logger.truncate_after(2)
    assert [r["step"] for r in runlog.read_metrics(tmp_path)] == [0, 1, 2]


def test_a_tied_output_head_is_saved_once_and_tied_again(tmp_path, tiny):
    from safetensors.torch import load_file

    from agents.models import load

    model, _ = tiny
    assert model.lm_head.weight is model.model.embed_tokens.weight
    path = checkpoint.save(tmp_path, 1, {"student": model}, {"history": {}})
    saved = load_file(str(path / "student.safetensors"))
    assert "lm_head.weight" not in saved and "model.embed_tokens.weight" in saved
    assert len(saved) == len({p for p in model.parameters()})  # each parameter once (buffers are not saved)
    other, _ = load("tiny")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    checkpoint.load_latest(tmp_path, {"student": other})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    assert other.lm_head.weight is other.model.embed_tokens.weight
