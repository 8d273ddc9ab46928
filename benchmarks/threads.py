"""Which ``--threads`` makes the first run fastest, on a quiet machine and on a busy one.

    python benchmarks/threads.py                         # threads 0, 1 and the core count; quiet and busy
    python benchmarks/threads.py --threads 1,2 --loads busy --out docs/data/threads.json

The workload is the first run's, shortened: the auto teacher's SFT (``memopd.sft`` of
``tiny-teacher`` on oracle trajectories, ``--sft-steps`` steps) then ``memopd.train`` with that
teacher (the student's warm start, ``--train-steps`` steps of PPO + MemOPD, the held-out
evaluations), each a fresh process, timed from start to exit. ``busy`` runs it beside
``--busy-procs`` processes that spin the CPU (a ``stress``-style load: what other work on a
shared machine does); ``quiet`` beside nothing. Every (load, threads) pair runs once per repeat,
interleaved, so drift in the machine hits them alike; ``0`` is torch's default (one thread per
core). A run past ``--cap`` seconds is stopped and reported as at least the cap.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def spin() -> None:
    while True:
        pass


def run(cmd: list[str], cap: float, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        _, err = proc.communicate(timeout=cap)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return float("inf")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {err.decode()[-2000:]}")
    return time.perf_counter() - t0


def first_run(threads: int, args: argparse.Namespace, env: dict[str, str]) -> dict[str, float]:
    """The shortened first run at ``threads``: seconds of the teacher's SFT and of the training."""
    with tempfile.TemporaryDirectory() as tmp:
        teacher = Path(tmp) / "teacher"
        sft = run([sys.executable, "-m", "memopd.sft", "--model", "tiny-teacher", "--env", "memgym/LongQA-v0",
                   "--steps", str(args.sft_steps), "--num-episodes", str(args.sft_episodes), "--threads", str(threads),
                   "--no-progress", "--out", str(teacher)], args.cap, env)
        if sft == float("inf"):
            return {"sft_s": sft, "train_s": sft, "total_s": sft}
        train = run([sys.executable, "-m", "memopd.train", "--env", "memgym/LongQA-v0", "--teacher", str(teacher),
                     "--steps", str(args.train_steps), "--eval-episodes", "16", "--eval-every", "0",
                     "--threads", str(threads), "--no-progress", "--run-dir", str(Path(tmp) / "run")],
                    args.cap, env)
    return {"sft_s": sft, "train_s": train, "total_s": sft + train}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default=f"0,1,{os.cpu_count()}", help="comma-separated --threads values")
    ap.add_argument("--loads", default="quiet,busy", help="comma-separated: quiet, busy")
    ap.add_argument("--busy-procs", type=int, default=2, help="spinning processes of the busy load")
    ap.add_argument("--sft-steps", type=int, default=40, help="teacher SFT steps (the auto teacher has 250)")
    ap.add_argument("--sft-episodes", type=int, default=256, help="oracle trajectories of the teacher's SFT")
    ap.add_argument("--train-steps", type=int, default=8, help="training steps (the embedded default has 80)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--cap", type=float, default=1200.0, help="seconds a run may take before it is stopped")
    ap.add_argument("--out", default=None, help="write the results JSON here")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    loads = args.loads.split(",")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MEMOPD_CACHE": tempfile.mkdtemp(prefix="memopd-threads-")}
    # the presets are built once, before any timing (every run then finds them in the cache)
    run([sys.executable, "-c", "from agents.models import load; load('tiny'); load('tiny-teacher')"], args.cap, env)
    results: dict[str, dict[str, list[dict[str, float]]]] = {load: {str(t): [] for t in threads} for load in loads}
    for rep in range(args.repeats):
        for load in loads:
            spinners = [mp.Process(target=spin, daemon=True) for _ in range(args.busy_procs if load == "busy" else 0)]
            for p in spinners:
                p.start()
            try:
                for t in threads:
                    r = first_run(t, args, env)
                    results[load][str(t)].append(r)
                    print(f"repeat {rep} load {load} threads {t}: {json.dumps({k: round(v, 1) for k, v in r.items()})}",
                          flush=True)
            finally:
                for p in spinners:
                    p.terminate()
    default = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                             capture_output=True, text=True, check=True, env=env).stdout.strip()
    report = {"command": "python benchmarks/threads.py " + " ".join(sys.argv[1:]), "cores": os.cpu_count(),
              "torch_default_threads": int(default),  # what --threads 0 gives
              "sft_steps": args.sft_steps, "sft_episodes": args.sft_episodes, "train_steps": args.train_steps,
              "busy_procs": args.busy_procs, "cap_s": args.cap, "results": results}
    text = json.dumps(report, indent=2).replace("Infinity", "null")  # null: stopped at the cap
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
