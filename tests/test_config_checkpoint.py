"""Config flags/TOML and atomic checkpoints."""

import dataclasses
import os

import pytest
import torch

from memopd import checkpoint, config


@dataclasses.dataclass
class Cfg:
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


def test_out_of_range_and_bad_choice_say_what_is_allowed(capsys):
    with pytest.raises(SystemExit):
        config.parse_args(Cfg, ["--lr", "3"], "t", "")
    assert "allowed: [0.0, 1.0]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        config.parse_args(Cfg, ["--mode", "x"], "t", "")
    assert "choose one of ['aligned', 'persistent']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        config.parse_args(Cfg, ["--steps", "many"], "t", "")
    assert "--steps" in capsys.readouterr().err


def test_unknown_toml_key(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("lrr = 1\n")
    with pytest.raises(SystemExit):
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
    state, path = checkpoint.load_latest(tmp_path, {"model": _model(5)})
    assert path.name == "step-000002" and state["x"] == 2


def test_leftover_temp_dir_is_not_a_checkpoint(tmp_path):
    (tmp_path / "checkpoints" / ".tmp-abc").mkdir(parents=True)
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint"):
        checkpoint.load_latest(tmp_path, {"model": _model(0)})


def test_mismatched_model_is_refused(tmp_path):
    checkpoint.save(tmp_path, 1, {"model": _model(0)}, {})
    other = torch.nn.Sequential(torch.nn.Linear(4, 5))
    with pytest.raises(checkpoint.CheckpointError, match="does not match"):
        checkpoint.load_latest(tmp_path, {"model": other})
