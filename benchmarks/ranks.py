"""Step time against ranks on this machine: ``torchrun --nproc-per-node 2`` with one thread per
rank against one process with two threads (and with one), on the same small training run (tiny
presets).

Each arm trains a few steps from the same start; the first step (warm-up: lowering checks, first
allocations) is dropped and the median of the others is reported, split into rollout (sampling
with the whole-weight twin) and learning (packing, teacher, PPO epochs, gathers). A 2-core CPU
can show the cost of the collectives and of the rollout split, not GPU scaling: run it on a GPU
machine with ``--device cuda`` for that.

    python benchmarks/ranks.py                 # ~6 minutes on 2 CPU cores
    python benchmarks/ranks.py --steps 6 --questions 8
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_args(args: argparse.Namespace, run_dir: Path, threads: int) -> list[str]:
    return ["-m", "memopd.train", "--env", "memgym/LongQA-v0", "--env-kwarg", f"num_chunks={args.chunks}",
            "--questions-per-step", str(args.questions), "--group-size", str(args.group), "--steps", str(args.steps),
            "--max-new-tokens", "24", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
            "--teacher", "tiny-teacher", "--audit-every", "0", "--save-every", str(args.steps), "--no-progress",
            "--threads", str(threads), "--device", args.device, "--parallel", args.parallel, "--run-dir",
            str(run_dir)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def arm(name: str, ranks: int, threads: int, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    run_dir = tmp / name
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
               str(free_port())] if ranks > 1 else [sys.executable])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(launch + run_args(args, run_dir, threads), env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step_s" in r][1:]  # the first step warms up
    med = lambda k: statistics.median(r[k] for r in steps)  # noqa: E731
    return {"step_s": med("step_s"), "rollout_s": med("rollout_s"), "learn_s": med("step_s") - med("rollout_s"),
            "tokens_per_s": med("tokens_per_s"), "action_tokens": med("action_tokens")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--parallel", default="fsdp", choices=("fsdp", "ddp"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        arms = {"1 rank x 1 thread": arm("1x1", 1, 1, args, Path(tmp)),
                "1 rank x 2 threads": arm("1x2", 1, 2, args, Path(tmp)),
                "2 ranks x 1 thread": arm("2x1", 2, 1, args, Path(tmp))}
    print(f"{args.questions} questions x {args.group} samples, {args.chunks} chunks, {args.steps - 1} timed steps, "
          f"--parallel {args.parallel}, {args.device}")
    print(f"{'arm':<22}{'step s':>9}{'rollout s':>11}{'learn s':>9}{'learn tok/s':>13}   (medians)")
    base = arms["1 rank x 1 thread"]["step_s"]
    for name, r in arms.items():
        print(f"{name:<22}{r['step_s']:>9.2f}{r['rollout_s']:>11.2f}{r['learn_s']:>9.2f}{r['tokens_per_s']:>13.0f}"
              f"   {r['step_s'] / base:.2f}x the 1 x 1 step time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
