"""Where an evaluation's time goes: ``memopd.eval`` in this process with timers on its phases.

    python benchmarks/eval_profile.py --model tiny --chunks 24 --episodes 64            # this checkout
    PYTHONPATH=<tree of another commit> python benchmarks/eval_profile.py --batch-size 8  # that commit's code

Runs ``memopd.eval`` (``memagent``, ``memgym/LongQA-v0`` with ``--chunks`` chunks of 48 tokens and
a 16-token memory, greedy, one thread) and splits the rollout's CPU time (``time.process_time``:
other jobs on shared cores inflate wall time, not this) into:

    prefill      the model's forwards over more than one new token (prompts after cached heads)
    decode       the model's forwards over one new token per row
    generate     the rest of the backend's generate (padding, caches, sampling, records)
    env          the environments' steps (chunking, the memory cut, observations)
    save         writing the episodes' records (episodes.jsonl)
    agent        the rest (prompt building, the rollout loop)

Only names both old and new code have are patched (``agents.models.load``, the backends'
``generate``, ``agents.rollout``'s env adapter and ``save_episodes``), so the same script profiles
an older tree. Prints a table per call and writes ``--out`` (JSON) when given.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from typing import Any

CPU = collections.Counter()
COUNT = collections.Counter()


def timed(owner: Any, name: str, key: str) -> None:
    """Replace ``owner.name`` by a version that adds its CPU time to ``CPU[key]``."""
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            CPU[key] += time.process_time() - t0
            COUNT[key] += 1

    setattr(owner, name, wrapper)


def instrument() -> None:
    import agents.models as models
    import agents.rollout as rollout
    from agents.backends.hf import HFBackend

    load = models.load

    def load_timed(*args: Any, **kwargs: Any) -> Any:
        model, tok = load(*args, **kwargs)
        forward = model.forward

        def forward_timed(*a: Any, **kw: Any) -> Any:
            t0 = time.process_time()
            try:
                return forward(*a, **kw)
            finally:
                ids = kw.get("input_ids")
                key = "prefill" if ids is not None and ids.shape[1] > 1 else "decode"
                CPU[key] += time.process_time() - t0
                COUNT[key] += 1
                if key == "prefill":
                    COUNT["prefill_tokens"] += ids.numel()

        model.forward = forward_timed
        return model, tok

    models.load = load_timed
    timed(HFBackend, "generate", "generate+model")
    timed(rollout._EnvList, "step", "env")
    timed(rollout._EnvList, "reset", "env")
    timed(rollout, "save_episodes", "save")
    timed(rollout, "rollout", "rollout")


def code_commit() -> str:
    """The commit of the tree whose ``memopd`` was imported (``+`` when it has local changes)."""
    import subprocess
    from pathlib import Path

    import memopd

    tree = Path(memopd.__file__).resolve().parents[1]
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=None, help="default: the evaluated code's own default")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    instrument()
    from memopd.eval import evaluate

    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--agent", "memagent", "--model", args.model, "--episodes", str(args.episodes), "--threads", "1",
                "--env-kwarg", f"num_chunks={args.chunks}", "--env-kwarg", "chunk_size=48", "--env-kwarg",
                "memory_budget=16", "--out", tmp, "--no-progress"]
        if args.batch_size is not None:
            argv += ["--batch-size", str(args.batch_size)]
        summary = evaluate(argv)
    calls = summary["calls"] * summary["episodes"]
    model = CPU["prefill"] + CPU["decode"]
    phases = {"prefill": CPU["prefill"], "decode": CPU["decode"], "generate": CPU["generate+model"] - model,
              "env": CPU["env"], "save": CPU["save"],
              "agent": CPU["rollout"] - CPU["generate+model"] - CPU["env"] - CPU["save"]}
    report = {"commit": code_commit(), "model": args.model, "chunks": args.chunks, "episodes": args.episodes,
              "batch_size": args.batch_size, "calls": calls, "rollout_cpu_s": CPU["rollout"],
              "calls_per_cpu_s": calls / CPU["rollout"], "rollout_wall_s": summary["wall_s"],
              "ms_per_call": {k: 1e3 * v / calls for k, v in phases.items()},
              "forwards": {"prefill": COUNT["prefill"], "decode": COUNT["decode"],
                           "prefill_tokens": COUNT["prefill_tokens"]}, "f1": summary["f1"],
              "memory_tokens": summary["memory_tokens"]}
    print(f"\ncommit {report['commit']}: {calls} calls, {report['calls_per_cpu_s']:.1f} calls per CPU second")
    for k, v in report["ms_per_call"].items():
        print(f"  {k:9} {v:6.2f} ms/call  {100 * phases[k] / CPU['rollout']:5.1f}%")
    print(f"  forwards: {report['forwards']}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
