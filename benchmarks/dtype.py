"""bf16 vs fp32 for SmolLM2-135M-Instruct on this CPU: one SFT step and batched generation.

Four ways to run the model, each in a process of its own (so that its peak memory is its own),
one after another:

  fp32           fp32 weights, fp32 compute (the default)
  fp32-gc        fp32, with gradient checkpointing (``--gradient-checkpointing``)
  bf16-autocast  fp32 master weights and optimizer state, forward/backward under
                 torch.autocast(bfloat16) (what ``--dtype bfloat16`` of memopd.train / memopd.sft does)
  bf16-weights   the model cast to bf16 (weights, gradients and AdamW state in bf16)

The SFT step is memopd.sft's (packed, state-aligned NLL on the action tokens, backward, AdamW) on
oracle trajectories of LongQA (natural facts, 2 chunks of 64 tokens); generation is HFBackend
sampling exactly ``--new-tokens`` tokens for ``--batch`` prompts of one such episode's first call.
Figures are best-of-``--repeats``; read them as ratios to fp32 from one run. Peak memory is the
process's maximum resident set (model, AdamW state, activations of the step).

    python benchmarks/dtype.py [--threads 1] [--batch-episodes 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys
import time

import torch

ENV_KWARGS = {"fact_style": "natural", "num_chunks": 2, "chunk_size": 64, "memory_budget": 24}
MODES = ("fp32", "fp32-gc", "bf16-autocast", "bf16-weights")


def measure(mode: str, args: argparse.Namespace) -> dict:
    """One mode, in this process: best SFT step time, best generation tokens/s, peak RSS."""
    torch.set_num_threads(args.threads)
    from agents.backends import GenerationRequest, HFBackend, SamplingParams
    from agents.models import load
    from memopd.sft import nll_loss, oracle_episodes

    model, tok = load("smollm2")
    eps = oracle_episodes("memgym/LongQA-v0", ENV_KWARGS, tok, args.batch_episodes, 0, progress=False)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    first = eps[0].invocations[0]
    reqs = [GenerationRequest(prompt_ids=list(first.prompt_ids), prefix_len=first.prefix_len)
            for _ in range(args.batch)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=[], seed=0)
    if mode == "bf16-weights":
        model = model.to(torch.bfloat16)
    if mode == "fp32-gc":
        from memopd.attention import enable_activation_checkpointing

        enable_activation_checkpointing(model)
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if mode == "bf16-autocast" else contextlib.nullcontext
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sft, losses = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        model.train()
        with ctx():
            loss, _ = nll_loss(model, eps, 4096, pad)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sft.append(time.perf_counter() - t0)
        losses.append(round(loss.item(), 4))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model.eval()
    backend = HFBackend(model, tok, seed=0, max_batch_size=args.batch)
    gen = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        with ctx():
            backend.generate(reqs, sp)
        gen.append(args.batch * args.new_tokens / (time.perf_counter() - t0))
    return {"sft_step_s": min(sft), "gen_tokens_per_s": max(gen), "sft_losses": losses,
            "peak_rss_gib": peak / 2**20, "rss_before_sft_gib": rss0 / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-episodes", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="generation batch")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process: measure this mode
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args)))
        return
    results = {}
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--one", mode, *sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
        print(mode, json.dumps(results[mode]), flush=True)
    ref = results.get("fp32")
    print(f"\nSmolLM2-135M-Instruct, {args.threads} thread(s), SFT step of {args.batch_episodes} episodes, "
          f"generation batch {args.batch} x {args.new_tokens} tokens (best of {args.repeats})")
    print("| mode | SFT step (s) | vs fp32 | peak memory (GiB) | generation (tokens/s) | vs fp32 |\n"
          "|---|---|---|---|---|---|")
    for mode, r in results.items():
        sr = ref["sft_step_s"] / r["sft_step_s"] if ref else float("nan")
        gr = r["gen_tokens_per_s"] / ref["gen_tokens_per_s"] if ref else float("nan")
        print(f"| {mode} | {r['sft_step_s']:.1f} | {sr:.2f}x | {r['peak_rss_gib']:.1f} | "
              f"{r['gen_tokens_per_s']:.1f} | {gr:.2f}x |")


if __name__ == "__main__":
    main()
