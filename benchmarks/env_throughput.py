"""Environment throughput and streaming memory.

1. Steps per second of the default ``memgym/LongQA-v0`` (and NeedleQA) with a trivial agent
   that copies its last memory forward and answers with the first word of its memory.
2. Peak memory of one fully stepped LongQA episode of ~1M words against a small one of the same
   chunk size: Python allocations (tracemalloc peak) and resident-set growth. Streaming keeps
   the peak flat: only the current chunk is held, never the whole input.

    python benchmarks/env_throughput.py [--episodes 300] [--context-length 1000000] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

import gymnasium as gym

import memgym  # noqa: F401  (registers the envs)


def trivial_agent(info: dict) -> str:
    if info["phase"] == "memory":
        return info["memory"]
    words = info["memory"].split()
    return words[0] if words else ""


def steps_per_second(env_id: str, episodes: int, **kwargs) -> dict:
    env = gym.make(env_id, **kwargs)
    steps, start = 0, time.perf_counter()
    for ep in range(episodes):
        _, info = env.reset(seed=ep)
        done = False
        while not done:
            _, _, done, _, info = env.step(trivial_agent(info))
            steps += 1
    elapsed = time.perf_counter() - start
    return {"env": env_id, "episodes": episodes, "steps": steps, "seconds": round(elapsed, 3),
            "steps_per_s": round(steps / elapsed, 1), "episodes_per_s": round(episodes / elapsed, 1)}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        import os

        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def episode_memory(context_length: int, chunk_size: int, trace: bool) -> dict:
    """Step one LongQA episode fully; peak tracemalloc bytes (if ``trace``) and RSS growth."""
    env = gym.make("memgym/LongQA-v0", context_length=context_length, chunk_size=chunk_size, memory_budget=64)
    base_rss = peak_rss = _rss_bytes()
    if trace:
        tracemalloc.start()
    start = time.perf_counter()
    _, info = env.reset(seed=0)
    done, steps = False, 0
    while not done:
        _, _, done, _, info = env.step(trivial_agent(info))
        steps += 1
        if steps % 8 == 0:
            peak_rss = max(peak_rss, _rss_bytes())
    elapsed = time.perf_counter() - start
    peak_traced = tracemalloc.get_traced_memory()[1] if trace else None
    if trace:
        tracemalloc.stop()
    return {"context_length": context_length, "chunk_size": chunk_size, "chunks": info["num_chunks"],
            "seconds": round(elapsed, 2), "words_per_s": round(context_length / elapsed),
            "tracemalloc_peak_kib": None if peak_traced is None else round(peak_traced / 1024),
            "rss_growth_kib": round((peak_rss - base_rss) / 1024)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=300)
    parser.add_argument("--context-length", type=int, default=1_000_000)
    parser.add_argument("--small-context-length", type=int, default=10_000)
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = parser.parse_args()

    results = {"throughput": [steps_per_second("memgym/LongQA-v0", args.episodes),
                              steps_per_second("memgym/NeedleQA-v0", max(1, args.episodes // 3))]}
    # Untraced runs first (speed and RSS), then traced runs (Python allocation peaks).
    small = episode_memory(args.small_context_length, args.chunk_size, trace=False)
    large = episode_memory(args.context_length, args.chunk_size, trace=False)
    small_t = episode_memory(args.small_context_length, args.chunk_size, trace=True)
    large_t = episode_memory(args.context_length, args.chunk_size, trace=True)
    for untraced, traced in ((small, small_t), (large, large_t)):
        untraced["tracemalloc_peak_kib"] = traced["tracemalloc_peak_kib"]
    results["memory"] = [small, large]
    results["ratio_large_to_small"] = {
        "context": round(args.context_length / args.small_context_length, 1),
        "tracemalloc_peak": round(large["tracemalloc_peak_kib"] / max(1, small["tracemalloc_peak_kib"]), 2),
    }
    results["command"] = "python benchmarks/env_throughput.py " + " ".join(sys.argv[1:])
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for r in results["throughput"]:
        print(f"{r['env']}: {r['steps_per_s']} steps/s, {r['episodes_per_s']} episodes/s "
              f"({r['steps']} steps in {r['seconds']} s)")
    for r in results["memory"]:
        print(f"LongQA {r['context_length']:>9} words ({r['chunks']} chunks of {r['chunk_size']}): "
              f"{r['seconds']} s, {r['words_per_s']} words/s, tracemalloc peak {r['tracemalloc_peak_kib']} KiB, "
              f"RSS growth {r['rss_growth_kib']} KiB")
    ratio = results["ratio_large_to_small"]
    print(f"context x{ratio['context']} -> tracemalloc peak x{ratio['tracemalloc_peak']}")


if __name__ == "__main__":
    main()
