"""Batched generation throughput of HFBackend: generated tokens per second, batch 1 vs batch B.

Every row generates exactly ``--new-tokens`` tokens (no early stop), so runs are comparable.
Timings include the prefill. Run:

    python benchmarks/generation.py                      # tiny (1 vs 32) and smollm2 (1 vs 8)
    python benchmarks/generation.py --models tiny --threads 2
    python benchmarks/generation.py --vs-generate        # against transformers' generate, batch 8 and 32

``--vs-generate`` times HFBackend (which records every token's log-prob) against transformers'
``model.generate`` (sampling, ``output_scores=True`` so that it too returns what a recorder needs)
on the same left-padded prompts, at batch 8 and 32, with distinct prompts and with groups of 4
identical prompts (a question's samples: HFBackend prefills each distinct prompt once).
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


def measure_generate(model, tokenizer, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    """Best-of-``repeats`` tokens/s of transformers' ``generate`` on left-padded prompts."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=new_tokens,
              min_new_tokens=new_tokens, output_scores=True, return_dict_in_generate=True, pad_token_id=pad)
    model.generate(ids[:1], **{**kw, "attention_mask": mask[:1], "max_new_tokens": 2, "min_new_tokens": 2})
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        dt = time.perf_counter() - t0
        best = max(best, (out.sequences.shape[1] - width) * len(prompts) / dt)
    return best


def vs_generate(specs: list[str], prompt_tokens: int, new_tokens: int, repeats: int) -> None:
    print("| model | batch | prompts | HFBackend tok/s | generate tok/s | ratio |")
    print("|---|---|---|---|---|---|")
    for spec in specs:
        model, tok = models.load(spec)
        backend = HFBackend(model, tok)
        for batch in (8, 32):
            distinct = make_prompts(tok, batch, prompt_tokens)
            grouped = [p for p in distinct[: batch // 4] for _ in range(4)]
            for name, prompts in (("distinct", distinct), ("groups of 4", grouped)):
                ours = measure(backend, prompts, batch, new_tokens, repeats)
                theirs = measure_generate(model, tok, prompts, new_tokens, repeats)
                print(f"| {spec} | {batch} | {name} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f}x |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2"], help="model specs")
    ap.add_argument("--batch", type=int, default=None, help="large batch size (default: 32 tiny, 8 smollm2)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 = stable on shared CPUs)")
    ap.add_argument("--vs-generate", action="store_true", help="HFBackend against transformers' generate")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.vs_generate:
        vs_generate(args.models, args.prompt_tokens, args.new_tokens, args.repeats)
        return

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
