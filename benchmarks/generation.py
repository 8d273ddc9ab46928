"""Batched generation throughput of HFBackend: generated tokens per second, batch 1 vs batch B.

Every row generates exactly ``--new-tokens`` tokens (no early stop), so runs are comparable.
Timings include the prefill. Run:

    python benchmarks/generation.py                      # tiny (1 vs 32) and smollm2 (1 vs 8)
    python benchmarks/generation.py --models tiny --threads 2
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from agents import models
from agents.backends import GenerationRequest, HFBackend, SamplingParams

DEFAULT_BATCHES = {"tiny": 32, "tiny-teacher": 32, "smollm2": 8}


def make_prompts(tokenizer, n: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """Chat prompts of exactly ``prompt_tokens`` tokens: a user message of random words."""
    rng = random.Random(seed)
    words = [w.lstrip("Ġ") for w in tokenizer.get_vocab() if w.isalpha() or (w[1:].isalpha() and w[0] == "Ġ")]
    prompts = []
    for _ in range(n):
        text = " ".join(rng.choice(words) for _ in range(prompt_tokens))
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_dict=False)
        prompts.append(ids[-prompt_tokens:])
    return prompts


def measure(backend: HFBackend, prompts: list[list[int]], batch: int, new_tokens: int, repeats: int) -> float:
    """Best-of-``repeats`` generated tokens/s for ``batch`` rows generated together."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=[], seed=0)
    reqs = [GenerationRequest(prompt_ids=p, prefix_len=0) for p in prompts[:batch]]
    backend.max_batch_size = batch
    backend.generate(reqs[:1], SamplingParams(max_new_tokens=2, seed=0))  # warm-up
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        invs = backend.generate(reqs, sp)
        dt = time.perf_counter() - t0
        best = max(best, sum(len(i.response_ids) for i in invs) / dt)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2"], help="model specs")
    ap.add_argument("--batch", type=int, default=None, help="large batch size (default: 32 tiny, 8 smollm2)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 = stable on shared CPUs)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, {args.threads} thread(s), prompt {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens per row, best of {args.repeats}\n")
    print("| model | params | batch 1 tok/s | batch B | batch B tok/s | speed-up |")
    print("|---|---|---|---|---|---|")
    for spec in args.models:
        model, tok = models.load(spec)
        backend = HFBackend(model, tok)
        big = args.batch or DEFAULT_BATCHES.get(spec, 8)
        prompts = make_prompts(tok, big, args.prompt_tokens)
        one = measure(backend, prompts, 1, args.new_tokens, args.repeats)
        many = measure(backend, prompts, big, args.new_tokens, args.repeats)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"| {spec} | {params:.2f}M | {one:.0f} | {big} | {many:.0f} | {many / one:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
