"""HFBackend vs VLLMBackend: generated tokens/s at batch 8 and 32, and a full training step's time.

Each (model, backend) is measured in a subprocess of its own (one in-process vLLM engine per
process; a freed engine tears down vLLM's process-wide state), all within one run of this
script, so the ratios compare like with like; vLLM's OpenMP threads are bound to one core
(``--vllm-cores``) as the transformers side runs one torch thread. Every generation row has a 128-token prompt and
generates exactly 64 tokens (no early stop, temperature 1, fp32, one torch thread). A training
step is ``memopd.train`` with 4 questions x 2 samples, 2-chunk LongQA episodes, 1 PPO epoch,
OPD against the same model (so both backends do identical learner work): the mean ``step_s`` of
steps 2-3 (step 1 warms up).

    python benchmarks/backends.py                     # tiny and smollm2, batch 8 and 32
    python benchmarks/backends.py --models tiny --no-train
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _generation(model_spec: str, backend: str, batches: list[int], new_tokens: int, repeats: int) -> dict:
    import torch

    from agents import models
    from agents.backends import GenerationRequest, SamplingParams
    from agents.backends.factory import EngineOptions, make_backend
    from benchmarks.generation import make_prompts

    torch.set_num_threads(1)
    model, tok = models.load(model_spec)
    b = make_backend(backend, model=model, tokenizer=tok, max_batch_size=max(batches),
                     options=EngineOptions(dtype="float32", max_model_len=512))
    prompts = make_prompts(tok, max(batches), 128)
    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=[], seed=0)
    out = {}
    for batch in batches:
        reqs = [GenerationRequest(prompt_ids=p, prefix_len=0) for p in prompts[:batch]]
        b.generate(reqs[:2], SamplingParams(max_new_tokens=4, seed=0))  # warm-up
        best = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            invs = b.generate(reqs, sp)
            best = max(best, sum(len(i.response_ids) for i in invs) / (time.perf_counter() - t0))
        out[f"tok_s_b{batch}"] = best
    return out


def _train_step(model_spec: str, backend: str) -> dict:
    from memopd import train
    from memopd.runlog import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        args = ["--model", model_spec, "--teacher", model_spec, "--env-kwarg", "num_chunks=2",
                "--questions-per-step", "4", "--group-size", "2", "--max-new-tokens", "16", "--ppo-epochs", "1",
                "--eval-episodes", "1", "--eval-every", "0", "--student-warmup-steps", "0", "--audit-every", "0",
                "--sample-episodes", "0", "--steps", "3", "--threads", "1", "--no-progress", "--pack-tokens", "2048",
                "--backend", backend, "--vllm-dtype", "float32", "--max-model-len", "1024", "--run-dir", f"{tmp}/run"]
        cfg = train.prepare(train.cfgmod.parse_args(train.TrainConfig, args, "bench", ""))
        train.Trainer(cfg, log=lambda m: None).fit()
        rows = [r for r in read_metrics(f"{tmp}/run") if "step_s" in r][1:]
    return {"step_s": sum(r["step_s"] for r in rows) / len(rows),
            "rollout_s": sum(r["rollout_s"] for r in rows) / len(rows)}


def _one(args: argparse.Namespace) -> None:
    res = _generation(args.one[0], args.one[1], args.batches, args.new_tokens, args.repeats)
    if args.train:
        res.update(_train_step(args.one[0], args.one[1]))
    import torch

    res["torch_threads"] = torch.get_num_threads()
    print("RESULT " + json.dumps(res), flush=True)


def _spawn(model_spec: str, backend: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.backends", "--one", model_spec, backend, "--new-tokens",
           str(args.new_tokens), "--repeats", str(args.repeats), "--batches", *map(str, args.batches),
           "--train" if model_spec in args.train_models and args.train else "--no-train"]
    # vLLM on CPU binds OpenMP threads to every allowed core and then blocks torch.set_num_threads
    # for the whole process (the trainer's too): bind it to one core, as the hf side runs one thread
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_OMP_THREADS_BIND": args.vllm_cores}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parent.parent)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{model_spec}/{backend} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    ap.add_argument("--batches", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--train", action=argparse.BooleanOptionalAction, default=True, help="also time training steps")
    ap.add_argument("--train-models", nargs="+", default=["tiny", "smollm2"])
    ap.add_argument("--vllm-cores", default="0", help="VLLM_CPU_OMP_THREADS_BIND of the vllm runs (0: one core, "
                                                      "like the hf runs' one thread; auto: every core)")
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "BACKEND"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        _one(args)
        return
    results = {(m, b): _spawn(m, b, args) for m in args.models for b in ("hf", "vllm")}
    print("| model | measure | hf | vllm | vllm / hf |")
    print("|---|---|---|---|---|")
    for m in args.models:
        hf, vl = results[(m, "hf")], results[(m, "vllm")]
        for key in [k for k in hf if k in vl and k != "torch_threads"]:
            ratio = vl[key] / hf[key] if "tok_s" in key else hf[key] / vl[key]  # >1: vllm faster
            print(f"| {m} | {key} | {hf[key]:.1f} | {vl[key]:.1f} | {ratio:.2f}x |")
    print(json.dumps({f"{m}/{b}": r for (m, b), r in results.items()}))


if __name__ == "__main__":
    main()
