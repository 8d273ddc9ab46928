"""LoRA training (--lora-r, through peft) on the tiny presets: a step equals a hand-built peft
model's step; the adapters-off reference is the base model; checkpoints hold the adapters only and
resume exactly; merged and adapter-only exports generate what the trained model generates; two
ranks (FSDP2, gloo) make the one-process update."""

import copy
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("peft")

from agents import lora  # noqa: E402
from agents.models import load  # noqa: E402
from memopd import checkpoint, distributed, train  # noqa: E402
from memopd.config import ConfigError  # noqa: E402
from memopd.runlog import read_metrics  # noqa: E402

FAST = ["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=2", "--questions-per-step", "2", "--group-size",
        "2", "--max-new-tokens", "12", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "1024", "--threads", "1",
        "--ppo-epochs", "1", "--audit-every", "1"]
LORA = ["--lora-r", "4", "--lora-alpha", "8", "--lr", "0.01"]


def _cfg(run_dir, *extra):
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(run_dir)] + list(extra), "t", "")
    return train.prepare(cfg)


def _trainer(run_dir, *extra):
    return train.Trainer(_cfg(run_dir, *extra), log=lambda m: None)


def _episodes(n=4):
    from memopd.sft import oracle_episodes

    tok = load("tiny")[1]
    return oracle_episodes("memgym/LongQA-v0", {"num_chunks": 2}, tok, n, seed=3, progress=False)


def _nudge(model, seed=0):
    """Nonzero adapters (peft starts B at zero: the adapted model would equal its base)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


# ------------------------------------------------------------------------------------------------
# options
# ------------------------------------------------------------------------------------------------

def test_options_default_off_and_bad_targets_are_one_config_error():
    from memopd.runtime import prepare_model
    from memopd.sft import SFTConfig

    assert train.TrainConfig().lora_r == 0 and SFTConfig().lora_r == 0
    assert train.TrainConfig().lora_targets == list(lora.DEFAULT_TARGETS)
    model = load("tiny")[0]
    with pytest.raises(ConfigError, match=r"--lora-targets qkv: Qwen2ForCausalLM has no linear layer of that name"):
        prepare_model(model, train.TrainConfig(lora_r=4, lora_targets=["q_proj", "qkv"]))
    assert not lora.has_adapters(model)
    prepare_model(model, SFTConfig(lora_r=2, lora_targets=["q_proj", "v_proj"]))
    names = lora.trainable_names(model)
    assert names and all("lora_" in n and (".q_proj." in n or ".v_proj." in n) for n in names)


# ------------------------------------------------------------------------------------------------
# a step equals a hand-built peft model's step
# ------------------------------------------------------------------------------------------------

def _hand_nll(model, episodes):
    """Mean NLL of every action token, one invocation at a time through the model's own forward."""
    total, n = 0.0, 0
    for e in episodes:
        for inv in e.invocations:
            ids = torch.tensor([list(inv.prompt_ids) + list(inv.response_ids)])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            k = len(inv.response_ids)
            tgt = ids[0, -k:]
            total = total + (-logp[-k:].gather(1, tgt[:, None])).sum()
            n += k
    return total / n


def test_a_lora_sft_step_equals_a_hand_built_peft_models_step():
    import peft

    from memopd.runtime import prepare_model
    from memopd.sft import SFTConfig, train_sft

    episodes = _episodes(2)
    cfg = SFTConfig(lora_r=4, lora_alpha=8.0, steps=2, batch_episodes=2, lr=1e-2, warmup_steps=0,
                    lr_schedule="constant", max_grad_norm=1e9, threads=1)
    ours = prepare_model(load("tiny")[0], cfg)
    _nudge(ours)
    hand = peft.get_peft_model(load("tiny")[0], peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(
        lora.DEFAULT_TARGETS), lora_dropout=0.0, task_type="CAUSAL_LM"))
    hand.load_state_dict({("base_model.model." + k): v for k, v in ours.state_dict().items()}, strict=True)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    history = train_sft(ours, episodes, cfg, progress=False)
    opt = torch.optim.AdamW([p for p in hand.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    hand.train()
    losses = []
    for _ in range(2):
        loss = _hand_nll(hand, episodes)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert [h["loss"] for h in history] == pytest.approx(losses, abs=1e-5)  # the packed forward, adapted
    after_hand = hand.state_dict()
    moved = 0
    for k, v in ours.state_dict().items():
        # Adam's step is lr * m / sqrt(v): where a gradient is at float noise, so is its step (two
        # summation orders); real gradients give the same step to float precision
        assert float((v - after_hand["base_model.model." + k]).abs().max()) < 2e-4, k
        if "lora_" in k:
            moved += int(not torch.equal(v, before[k]))
        else:
            assert torch.equal(v, before[k]), k  # the base is frozen
    assert moved == len(lora.trainable_names(ours))


def test_the_trainer_optimises_the_adapters_only_and_the_audit_is_exact(tmp_path):
    trainer = _trainer(tmp_path / "run", *LORA)
    params = [p for g in trainer.updater.opt.param_groups for p in g["params"]]
    names = {id(p): n for n, p in trainer.student.named_parameters()}
    assert params and all("lora_" in names[id(p)] for p in params)
    assert len(params) == len(lora.trainable_names(trainer.student))
    _nudge(trainer.student)
    from memopd.audit import rce_audit

    eps = _episodes(2)
    res = rce_audit(trainer.twin, eps)["aligned"]
    assert res.passed and res.max_abs_diff < 1e-4  # packed vs per-invocation, through the adapted forward
    with lora.adapters_off(trainer.twin):
        base_logits = trainer.twin(torch.tensor([[1, 2, 3]])).logits
    assert not torch.allclose(trainer.twin(torch.tensor([[1, 2, 3]])).logits, base_logits)  # adapters act


def test_the_last_layer_shortcut_and_gradient_checkpointing_run_the_adapters():
    from memopd import attention, last_layer
    from memopd.packing import pack_episodes
    from memopd.runtime import prepare_model
    from memopd.sft import SFTConfig

    model = prepare_model(load("tiny")[0], SFTConfig(lora_r=4))
    _nudge(model)
    batch = pack_episodes(_episodes(2), 1024, mode="aligned")
    assert last_layer.supported(attention.base_model(model))  # the peft layers keep the decoder layer's shape
    windows = attention.effective_windows(model, batch)
    model.train()
    runs = []
    for gathered, ckpt in [(False, False), (True, False), (False, True)]:
        m = model
        if ckpt:
            m = prepare_model(load("tiny")[0], SFTConfig(lora_r=4, gradient_checkpointing=True))
            m.load_state_dict(model.state_dict())
            m.train()
        m.zero_grad()
        h = attention._packed_hidden(m, batch, "blocks", windows, gathered=gathered)
        (h.double().pow(2).sum() + h[::3].sum()).backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        runs.append((h.detach(), grads))
    (h0, g0) = runs[0]
    assert g0 and all("lora_" in n for n in g0)  # gradients reach the adapters only
    for h, g in runs[1:]:
        assert (h - h0).abs().max().item() <= 1e-4 and g.keys() == g0.keys()
        for n in g0:
            assert (g[n] - g0[n]).abs().max().item() <= 1e-5 * (1.0 + g0[n].abs().max().item()), n


# ------------------------------------------------------------------------------------------------
# the reference: the base with adapters off
# ------------------------------------------------------------------------------------------------

def test_the_adapters_off_reference_is_the_base_model(tmp_path, monkeypatch):
    from memopd.learn import advantage
    from memopd.packing import pack_episodes
    from memopd.scoring import action_states, token_logprobs

    trainer = _trainer(tmp_path / "run", *LORA, "--ref-beta", "0.5", "--reward", "f1")
    trainer._make_ref()
    assert trainer.ref is trainer.twin and "ref" not in trainer.modules()  # no second model
    _nudge(trainer.student)
    base = load("tiny")[0]
    eps = _episodes(4)
    for e, f1 in zip(eps, [0.0, 1.0, 0.5, 0.25]):
        e.metrics["f1"], e.group_id = f1, "g"  # one group: the penalty moves the group-relative advantages
    batch = pack_episodes(eps, 1024, mode="aligned")
    with torch.no_grad(), lora.adapters_off(trainer.ref):
        ref_lp, _, _ = token_logprobs(action_states(trainer.ref, batch), batch.action_ids)
    base_lp, _, _ = token_logprobs(action_states(base, batch), batch.action_ids)
    assert torch.allclose(ref_lp, base_lp.detach(), atol=1e-5)
    adapted_lp, _, _ = token_logprobs(action_states(trainer.ref, batch), batch.action_ids)
    assert not torch.allclose(adapted_lp, base_lp, atol=1e-3)
    # through the advantages: equal to a separate base model as the reference ...
    batch.old_logprobs = adapted_lp.detach()
    own = list(range(len(eps)))
    got = advantage.compute_advantages(trainer.cfg, batch, eps, own, distributed.SINGLE, trainer.ref)
    want = advantage.compute_advantages(trainer.cfg, batch, eps, own, distributed.SINGLE, base)
    assert torch.allclose(got.advantages, want.advantages, atol=1e-5)
    # ... and not what the adapted student (adapters left on) would give
    import contextlib

    monkeypatch.setattr(advantage, "adapters_off", lambda m: contextlib.nullcontext())
    wrong = advantage.compute_advantages(trainer.cfg, batch, eps, own, distributed.SINGLE, trainer.ref)
    assert not torch.allclose(wrong.advantages, want.advantages, atol=1e-4)
    assert all(p.requires_grad for n, p in trainer.student.named_parameters() if "lora_" in n)  # switch undone


# ------------------------------------------------------------------------------------------------
# a LoRA run: checkpoints, resume, export
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A 2-step LoRA run with a GAE critic and the reference penalty, checkpoint every step."""
    tmp = tmp_path_factory.mktemp("lora")
    run = tmp / "run"
    trainer = _trainer(run, *LORA, "--steps", "2", "--save-every", "1", "--advantage", "gae", "--ref-beta", "0.1")
    trainer.fit()
    return run, trainer


def test_checkpoints_hold_the_adapters_and_their_optimizer_state_only(lora_run):
    run, trainer = lora_run
    ck = checkpoint.list_checkpoints(run)[0]
    student = load_file(str(ck / "student.safetensors"))
    critic = load_file(str(ck / "critic.safetensors"))
    assert set(student) == set(lora.trainable_names(trainer.student))
    assert all("lora_" in k for k in student) and "v_head.weight" in critic
    assert not (ck / "ref.safetensors").exists()
    state = torch.load(ck / "trainer.pt", weights_only=True)
    assert len(state["optimizer"]["state"]) == len(student)  # Adam moments of the adapters only
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["audit/passed"] for r in rows)
    assert all(r["audit/max_abs_diff"] < 1e-4 for r in rows)


def test_resume_is_exact(lora_run, tmp_path):
    run, _ = lora_run
    copy_dir = tmp_path / "run"
    shutil.copytree(run, copy_dir)
    # back to step 1: drop the later checkpoint and final outputs
    for ck in checkpoint.list_checkpoints(copy_dir)[:1]:
        shutil.rmtree(ck)
    (copy_dir / "checkpoints" / "latest").write_text("step-000001")
    for name in ("model", "adapter", "summary.json"):
        p = copy_dir / name
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    cfg = train.prepare(train.TrainConfig(resume=str(copy_dir)))
    train.Trainer(cfg, log=lambda m: None).fit()
    a = load_file(str(checkpoint.step_dir(run, 2) / "student.safetensors"))
    b = load_file(str(checkpoint.step_dir(copy_dir, 2) / "student.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra = [r["loss"] for r in read_metrics(run) if "loss" in r]
    rb = [r["loss"] for r in read_metrics(copy_dir) if "loss" in r]
    assert ra == rb


def _greedy(model, prompt=(5, 17, 9, 30, 2, 11)):
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=10, do_sample=False,
                             pad_token_id=0)
    return out[0].tolist()


def test_merged_and_adapter_only_exports_generate_what_the_trained_model_generates(lora_run, tmp_path):
    import peft

    from memopd.export import export

    run, trainer = lora_run
    want = _greedy(trainer.twin)
    assert _greedy(load(run)[0]) == want  # the run's merged final model
    assert _greedy(load(checkpoint.list_checkpoints(run)[0])[0]) == want  # a checkpoint: base + adapters
    merged = export(run, tmp_path / "merged")
    assert (merged / "config.json").is_file()
    assert _greedy(load(merged)[0]) == want
    adapter = export(run, tmp_path / "adapter", adapter_only=True)
    assert lora.is_adapter_dir(adapter) and lora.adapter_base(adapter) == "tiny"
    assert _greedy(load(adapter)[0]) == want  # agents.models.load (memopd.eval --model) takes it
    hand = peft.PeftModel.from_pretrained(load("tiny")[0], str(adapter))  # and peft itself
    assert _greedy(hand) == want
    from_ckpt = export(checkpoint.list_checkpoints(run)[0], tmp_path / "adapter-ck", adapter_only=True)
    assert _greedy(load(from_ckpt)[0]) == want
    from memgym.cli import CLIError

    with pytest.raises(CLIError, match="holds no LoRA adapters"):
        export("tiny", tmp_path / "nope", adapter_only=True)


def test_vllm_sync_pushes_the_merged_weights(lora_run):
    """What the vLLM backend's load_weights sends: the merged weights under the base names."""
    _, trainer = lora_run
    sd = lora.merged_state_dict(trainer.twin)
    base_names = set(load("tiny")[0].state_dict())
    assert set(sd) == base_names
    plain = load("tiny")[0]
    plain.load_state_dict(sd)
    assert _greedy(plain) == _greedy(trainer.twin)


# ------------------------------------------------------------------------------------------------
# SFT with LoRA
# ------------------------------------------------------------------------------------------------

def test_sft_with_lora_writes_the_merged_model_and_its_adapters(tmp_path):
    from memopd.sft import SFTConfig, run as run_sft

    ep_file = tmp_path / "eps.jsonl"
    from agents.records import save_episodes

    save_episodes(ep_file, _episodes(4))
    out = run_sft(SFTConfig(model="tiny", episodes=str(ep_file), out=str(tmp_path / "sft"), steps=2,
                            batch_episodes=2, lora_r=4, threads=1, progress=False), progress=False)
    merged = load(out)[0]
    via_adapter = load(out / "adapter")[0]
    assert _greedy(merged) == _greedy(via_adapter)
    assert not lora.has_adapters(merged)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """An adapter directory as memopd.sft writes it (rank 4, nonzero adapters), and the greedy
    answers of the model it makes."""
    model = lora.apply_lora(load("tiny")[0], r=4, alpha=8)
    _nudge(model)
    path = tmp_path_factory.mktemp("adapters") / "adapter"
    lora.save_adapter_dir(path, model, "tiny")
    return path, _greedy(load(path)[0])


def _variant(adapter_dir, tmp_path, name):
    path = tmp_path / name
    shutil.copytree(adapter_dir[0], path)
    return path


def test_an_adapter_config_that_disagrees_with_its_weights_is_one_clear_error(adapter_dir, tmp_path):
    import json

    from agents.models import ModelLoadError

    path = _variant(adapter_dir, tmp_path, "r8")
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    with pytest.raises(ModelLoadError, match=r"adapter_config.json says r = 8, but its weights have rank 4"):
        load(path)


def test_adapters_in_a_pickled_bin_load_as_weights_only(adapter_dir, tmp_path):
    """peft's older adapter_model.bin (a pickled state dict) loads as the safetensors file does; a
    pickle that holds other objects is refused, not run."""
    from agents.models import ModelLoadError

    path = _variant(adapter_dir, tmp_path, "bin")
    state = load_file(str(path / "adapter_model.safetensors"))
    (path / "adapter_model.safetensors").unlink()
    torch.save(state, path / "adapter_model.bin")
    assert _greedy(load(path)[0]) == adapter_dir[1]
    torch.save({"weights": state, "code": Path("anything")}, path / "adapter_model.bin")
    with pytest.raises(ModelLoadError, match="adapter_model.bin: refused: it pickles objects other than tensors"):
        load(path)


# ------------------------------------------------------------------------------------------------
# torchrun: FSDP2 with a LoRA student, 2 ranks on gloo, equals one process
# ------------------------------------------------------------------------------------------------

DIST = LORA + ["--entropy-coef", "0.01", "--sample-episodes", "0", "--parallel", "fsdp", "--advantage", "gae",
               "--ref-beta", "0.1", "--audit-every", "0"]


def _snapshot(trainer, metrics):
    grads = {}
    for name, p in trainer.student.named_parameters():
        g = p.grad
        if g is not None and distributed._is_dtensor(g):
            g = g.full_tensor()
        grads[name] = None if g is None else g.detach().clone()
    return {"weights": distributed.full_state_dict(trainer.student), "grads": grads, "metrics": metrics}


def _rank_main(rank, world, port, tmp):
    from agents.records import load_episodes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        trainer = _trainer(Path(tmp) / "run-2", *DIST)
        trainer._make_ref()
        metrics = trainer.learn(load_episodes(Path(tmp) / "episodes.jsonl", strict=True).episodes)
        snap = _snapshot(trainer, metrics)
        if rank == 0:
            torch.save(snap, Path(tmp) / "two.pt")
    finally:
        distributed.shutdown()


@pytest.mark.slow
def test_two_ranks_fsdp_with_a_lora_student_make_the_one_process_update(tmp_path):
    import socket

    from agents.records import load_episodes, save_episodes

    seed_trainer = _trainer(tmp_path / "seed", *LORA)
    episodes = seed_trainer.rollout()
    for e, f1 in zip(episodes, [0.0, 1.0, 0.5, 0.25]):
        e.metrics["f1"] = f1
    save_episodes(tmp_path / "episodes.jsonl", episodes)
    one_trainer = _trainer(tmp_path / "run-1", *DIST)
    one_trainer._make_ref()
    one = _snapshot(one_trainer, one_trainer.learn(load_episodes(tmp_path / "episodes.jsonl", strict=True).episodes))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank_main, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    two = torch.load(tmp_path / "two.pt", weights_only=False)
    assert one["grads"].keys() == two["grads"].keys()
    real = [k for k, g in one["grads"].items() if g is not None]
    assert real and all("lora_" in k for k in real)  # the base got no gradient
    for k in real:
        assert float((one["grads"][k] - two["grads"][k]).abs().max()) < 1e-5, k
    for k, w in one["weights"].items():
        assert float((w - two["weights"][k]).abs().max()) <= 2 * 0.01 * (1 + 1e-4), k
        if "lora_" not in k:
            assert torch.equal(w, two["weights"][k]), k
    for k in ("pg_loss", "opd_loss", "value_loss", "entropy", "loss"):
        a, b = one["metrics"][k], two["metrics"][k]
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (k, a, b)


@pytest.mark.parametrize("family, fused", [("Phi3", {"qkv_proj", "gate_up_proj", "o_proj", "down_proj"}),
                                           ("GPTNeoX", {"query_key_value", "dense", "dense_h_to_4h",
                                                        "dense_4h_to_h"})])
def test_the_default_targets_serve_families_with_fused_projections(family, fused):
    """Phi3 and GPT-NeoX have no q_proj / gate_proj: the default targets become every linear layer
    but the output head there (the same coverage in their names), and the adapted model starts as
    its base. An explicit list that names absent layers is still refused."""
    import transformers as tf

    cfg = getattr(tf, f"{family}Config")(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    base = getattr(tf, f"{family}ForCausalLM")(cfg).eval()
    ids = torch.tensor([[3, 9, 4, 11, 5]])
    before = base(input_ids=ids).logits
    model = lora.apply_lora(copy.deepcopy(base), r=4, alpha=8)
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert adapted == fused
    assert torch.equal(model(input_ids=ids).logits, before)
    assert {n.split(".lora_A")[0].rsplit(".", 1)[-1]
            for n, _ in lora.apply_lora(copy.deepcopy(base), r=4, alpha=8, targets=["all-linear"]).named_parameters()
            if ".lora_A" in n} == fused
    with pytest.raises(lora.LoRAError, match="has no linear layer of that name"):
        lora.apply_lora(copy.deepcopy(base), r=4, alpha=8, targets=["q_proj", "v_proj"])
