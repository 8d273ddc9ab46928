"""--micro-batch-rows: a minibatch's gradient accumulated over row groups is the gradient of the
whole minibatch (the same update at a lower peak memory)."""

from __future__ import annotations

import pytest
import torch

from memopd import train

FAST = ["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=3", "--questions-per-step", "2", "--group-size",
        "2", "--max-new-tokens", "8", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "256", "--threads", "1", "--ppo-epochs", "1",
        "--audit-every", "0", "--sample-episodes", "0"]


def _trainer(run_dir, *extra):
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(run_dir)] + list(extra), "t", "")
    return train.Trainer(train.prepare(cfg), log=lambda m: None)


def _learn_recording_grads(trainer, episodes):
    """The step's metrics and the gradients the optimizers stepped with."""
    grads = {}
    for name, opt in (("student", trainer.updater.opt), ("critic", trainer.updater.critic_opt)):
        if opt is None:
            continue
        real = opt.step

        def step(*a, _real=real, _opt=opt, _name=name, **k):
            grads[_name] = [p.grad.detach().clone() for g in _opt.param_groups for p in g["params"]
                            if p.grad is not None]
            return _real(*a, **k)
        opt.step = step
    return trainer.learn(episodes), grads


@pytest.mark.parametrize("extra", [[], ["--advantage", "gae"]])
def test_accumulated_row_groups_give_the_minibatchs_gradient(tmp_path, extra):
    whole = _trainer(tmp_path / "whole", *extra)
    episodes = whole.rollout()
    for e, f1 in zip(episodes, [0.0, 1.0, 0.5, 0.25]):  # rewards that differ within a group: PPO acts
        e.metrics["f1"] = f1
    accumulated = _trainer(tmp_path / "acc", "--micro-batch-rows", "1", *extra)
    from memopd.packing import pack_episodes

    assert pack_episodes(episodes, 256).num_rows >= 3  # several row groups to accumulate over
    a, ga = _learn_recording_grads(whole, episodes)
    b, gb = _learn_recording_grads(accumulated, episodes)
    for k in ("loss", "pg_loss", "opd_loss", "entropy", "grad_norm", "kl/all", "clip_frac") + (
            ("value_loss",) if extra else ()):
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
    assert a["pg_loss"] != 0.0 and set(ga) == set(gb) == ({"student", "critic"} if extra else {"student"})
    for name in ga:
        for x, y in zip(ga[name], gb[name], strict=True):
            assert torch.allclose(x, y, rtol=1e-4, atol=1e-7), name


def test_micro_batches_change_nothing_when_off(tmp_path):
    """0 (the default) keeps one forward per minibatch."""
    t = _trainer(tmp_path / "r")
    assert t.cfg.micro_batch_rows == 0


def test_row_groups_give_the_teachers_states_and_the_old_logprobs_of_the_whole_batch(tmp_path):
    """The passes without a backward (the teacher's scoring, the trainer's log-probs) run one row
    group at a time under --micro-batch-rows and put the states back in the batch's action order:
    the same numbers as one forward over every row."""
    from memopd.packing import pack_episodes
    from memopd.scoring import action_states

    t = _trainer(tmp_path / "r", "--micro-batch-rows", "1")
    episodes = t.rollout()
    batch = pack_episodes(episodes, 256, mode="aligned")
    assert batch.num_rows >= 3
    assert t.teacher.rows_per_forward == 1
    grouped = t.teacher.action_states(batch)
    whole = action_states(t.teacher.model, batch).detach()  # every row in one forward
    assert grouped.hidden.shape == whole.hidden.shape
    assert torch.allclose(grouped.hidden, whole.hidden, atol=1e-5)
    assert torch.equal(grouped.temperatures, whole.temperatures)
    # a sub-batch (a minibatch's rows): its own action order, uids kept
    sub = batch.select_rows([2, 0])
    sub_states = t.teacher.action_states(sub)
    assert torch.allclose(sub_states.hidden, whole.hidden[sub.action_uid], atol=1e-5)

    from memopd.scoring import token_logprobs

    per_row = t.updater.trainer_logprobs([batch], batch.num_actions)
    ref, _, _ = token_logprobs(action_states(t.student, batch), batch.action_ids)
    assert torch.allclose(per_row, ref.detach().float(), atol=1e-5)


def test_the_memory_defaults_follow_the_students_size():
    """--micro-batch-rows and --gradient-checkpointing left at their defaults: one packed row per
    forward and checkpointed layers for a model of 10M parameters or more (in one process), every
    row at once without checkpointing for a tiny preset; a value given is kept."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agents.models import load
    from memopd.learn.models import resolve_memory_defaults
    from memopd.runtime import MEMORY_SAVING_PARAMS, memory_saving, prepare_model

    big = Qwen2ForCausalLM(Qwen2Config(vocab_size=2048, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=2))
    tiny = load("tiny")[0]
    assert sum(p.numel() for p in big.parameters()) >= MEMORY_SAVING_PARAMS > sum(p.numel() for p in tiny.parameters())
    assert memory_saving(big) and not memory_saving(tiny)
    cfg = train.TrainConfig()
    assert cfg.micro_batch_rows is None and cfg.gradient_checkpointing is None
    r = resolve_memory_defaults(cfg, big)
    assert (r.micro_batch_rows, r.gradient_checkpointing) == (1, True)
    r = resolve_memory_defaults(cfg, tiny)
    assert (r.micro_batch_rows, r.gradient_checkpointing) == (0, False)
    r = resolve_memory_defaults(cfg, big, world_size=2)  # torchrun: the same row groups on every rank
    assert (r.micro_batch_rows, r.gradient_checkpointing) == (0, True)
    given = train.TrainConfig(micro_batch_rows=0, gradient_checkpointing=False)
    r = resolve_memory_defaults(given, big)
    assert (r.micro_batch_rows, r.gradient_checkpointing) == (0, False)
    # the full-vocabulary chunk: one [chunk, V] float32 tensor within 32 MiB, at most 1024 tokens
    assert resolve_memory_defaults(cfg, tiny).kl_chunk == 1024
    wide = Qwen2ForCausalLM(Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))
    assert resolve_memory_defaults(cfg, wide).kl_chunk == 32 * 2**20 // (4 * 49152) == 170
    assert resolve_memory_defaults(train.TrainConfig(kl_chunk=7), wide).kl_chunk == 7
    from memopd.runtime import adamw

    assert adamw(big.parameters(), big, lr=1e-3).defaults["fused"] is True  # no per-tensor temporaries
    assert not adamw(tiny.parameters(), tiny, lr=1e-3).defaults["fused"]
    assert prepare_model(big, cfg).is_activation_checkpointing  # the default, by size
    assert not prepare_model(tiny, cfg).is_activation_checkpointing
