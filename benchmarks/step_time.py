"""Wall time of one training step of the embedded default, and where it goes; optionally of
several checkouts of this project side by side in one run (e.g. before and after a change).

    python benchmarks/step_time.py                               # this checkout
    git worktree add /tmp/before <commit>
    python benchmarks/step_time.py --trees /tmp/before .         # before vs after, interleaved
    python benchmarks/step_time.py --attn sdpa                   # other memopd.train flags: for every run

Each measurement is a fresh process (``PYTHONPATH`` = the checkout) running ``memopd.train``'s
``Trainer.fit`` with the embedded default's shape (LongQA, 8 questions x 4 samples, 4 PPO epochs,
tiny presets; the untrained ``tiny-teacher`` preset stands in for the auto teacher, whose build
would dominate: a step's compute does not depend on the teacher's weights), one torch thread.
A step's wall time is the time between the starts of consecutive steps, so it includes what the
loop does after the update (metrics, curves, checkpoints at their interval); reported: the
median over steps 2.., then the median over ``--repeats`` (checkouts interleaved, so a noisy
neighbour hits all of them alike), and the ratio to the first checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER_ARGS = ["--env", "memgym/LongQA-v0", "--teacher", "tiny-teacher", "--student-warmup-steps", "0",
               "--eval-episodes", "4", "--no-progress", "--threads", "1"]


def worker(steps: int, run_dir: str, out: str, extra: list[str]) -> None:
    """In the checkout on ``sys.path``: time ``steps`` steps of a fresh run."""
    from memopd import train

    cfg = train.cfgmod.parse_args(train.TrainConfig, WORKER_ARGS + ["--steps", str(steps), "--run-dir", run_dir]
                                  + extra, "step_time", "")
    trainer = train.Trainer(train.prepare(cfg), log=lambda m: None)
    starts, phases = [], []
    step = trainer.train_step

    def timed() -> dict:
        starts.append(time.perf_counter())
        metrics = step()
        phases.append({k: metrics[k] for k in ("rollout_s", "step_s") if k in metrics})
        return metrics

    trainer.train_step = timed
    trainer.fit()
    starts.append(time.perf_counter())  # the loop's end (final evaluation excluded below)
    walls = [b - a for a, b in zip(starts, starts[1:])][:-1]  # the last interval holds the final eval
    Path(out).write_text(json.dumps({"walls": walls, "phases": phases}))


def measure(tree: Path, steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, __file__, "--worker", str(steps), str(Path(tmp) / "run"), str(out),
                               *extra],
                              env=env, capture_output=True, text=True, cwd=tree)
        if done.returncode != 0:
            raise SystemExit(f"{tree}: the worker failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs="+", default=["."], help="checkouts to measure (the first is the baseline)")
    ap.add_argument("--steps", type=int, default=6, help="steps per measurement (the first is a warm-up)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args()  # anything else: memopd.train flags for every measurement
    if args.worker:
        worker(int(args.worker[0]), args.worker[1], args.worker[2], args.worker[3:] + extra)
        return
    trees = [Path(t) for t in args.trees]
    per_tree: dict[Path, list[dict]] = {t: [] for t in trees}
    for r in range(args.repeats):
        for t in trees:
            res = measure(t, args.steps, extra)
            per_tree[t].append(res)
            print(f"repeat {r + 1} {t}: step wall s {[round(w, 2) for w in res['walls']]}", flush=True)
    base = None
    print(f"\n| checkout | step wall (s), median of {args.repeats} | rollout (s) | update (s) | rest: metrics, "
          "curves, checkpoints (s) | speed-up |")
    print("|---|---|---|---|---|---|")
    for t in trees:
        runs = per_tree[t]
        wall = statistics.median(statistics.median(r["walls"][1:]) for r in runs)
        roll = statistics.median(statistics.median(p["rollout_s"] for p in r["phases"][1:]) for r in runs)
        step = statistics.median(statistics.median(p["step_s"] for p in r["phases"][1:]) for r in runs)
        base = base or wall
        print(f"| {t} | {wall:.3f} | {roll:.3f} | {step - roll:.3f} | {wall - step:.3f} | {base / wall:.2f}x |")


if __name__ == "__main__":
    main()
