"""bf16 vs fp32 for SmolLM2-135M-Instruct on this CPU: one SFT step and batched generation.

Three ways to run the model, each timed in the same process, one after another:

  fp32           fp32 weights, fp32 compute (the default)
  bf16-autocast  fp32 master weights and optimizer state, forward/backward under
                 torch.autocast(bfloat16) (what ``--dtype bfloat16`` of memopd.train / memopd.sft does)
  bf16-weights   the model cast to bf16 (weights, gradients and AdamW state in bf16)

The SFT step is memopd.sft's (packed, state-aligned NLL on the action tokens, backward, AdamW) on
oracle trajectories of LongQA (natural facts, 2 chunks of 64 tokens); generation is HFBackend
sampling exactly ``--new-tokens`` tokens for ``--batch`` prompts of one such episode's first call.
Figures are best-of-``--repeats``; read them as ratios to fp32 from one run.

    python benchmarks/dtype.py [--threads 1] [--batch-episodes 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import time

import torch

ENV_KWARGS = {"fact_style": "natural", "num_chunks": 2, "chunk_size": 64, "memory_budget": 24}
MODES = ("fp32", "bf16-autocast", "bf16-weights")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-episodes", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="generation batch")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from agents.backends import GenerationRequest, HFBackend, SamplingParams
    from agents.models import load
    from memopd.sft import nll_loss, oracle_episodes

    base, tok = load("smollm2")
    eps = oracle_episodes("memgym/LongQA-v0", ENV_KWARGS, tok, args.batch_episodes, 0, progress=False)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    first = eps[0].invocations[0]
    reqs = [GenerationRequest(prompt_ids=list(first.prompt_ids), prefix_len=first.prefix_len)
            for _ in range(args.batch)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=[], seed=0)
    results = {}
    for mode in args.modes.split(","):
        model = copy.deepcopy(base)
        if mode == "bf16-weights":
            model = model.to(torch.bfloat16)
        ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if mode == "bf16-autocast" \
            else contextlib.nullcontext
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
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
        model.eval()
        backend = HFBackend(model, tok, seed=0, max_batch_size=args.batch)
        gen = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            with ctx():
                backend.generate(reqs, sp)
            gen.append(args.batch * args.new_tokens / (time.perf_counter() - t0))
        results[mode] = {"sft_step_s": min(sft), "gen_tokens_per_s": max(gen), "sft_losses": losses}
        print(mode, json.dumps(results[mode]), flush=True)
        del model, opt, backend
    ref = results.get("fp32")
    print(f"\nSmolLM2-135M-Instruct, {args.threads} thread(s), SFT step of {args.batch_episodes} episodes, "
          f"generation batch {args.batch} x {args.new_tokens} tokens (best of {args.repeats})")
    print("| mode | SFT step (s) | vs fp32 | generation (tokens/s) | vs fp32 |\n|---|---|---|---|---|")
    for mode, r in results.items():
        sr = ref["sft_step_s"] / r["sft_step_s"] if ref else float("nan")
        gr = r["gen_tokens_per_s"] / ref["gen_tokens_per_s"] if ref else float("nan")
        print(f"| {mode} | {r['sft_step_s']:.1f} | {sr:.2f}x | {r['gen_tokens_per_s']:.1f} | {gr:.2f}x |")


if __name__ == "__main__":
    main()
