"""Evaluation at length: model calls per second of ``memopd.eval`` at 192 chunks, an older commit's
path against this checkout's, side by side in one run.

    python benchmarks/eval_speed.py --base b130929                      # ~20 minutes on 2 busy cores
    python benchmarks/eval_speed.py --base b130929 --chunks 24 --episodes 16 --models tiny   # a minute

The base commit is checked out as a detached ``git worktree``; each arm runs ``memopd.eval`` as a
subprocess with its tree on ``PYTHONPATH`` (so that tree's ``memgym``, ``agents`` and ``memopd`` are
imported), one at a time, one torch thread, the same model cache, greedy decoding, the same env
(``memgym/LongQA-v0``, ``--chunks`` chunks of 48 tokens, a 16-token memory: the length ladder's
task) and the same ``--episodes`` test episodes. Arms, per model:

    base     the base commit at its default --batch-size (8): today's path
    head@8   this checkout at the same --batch-size 8 (what the code changes alone give)
    head     this checkout at its default --batch-size (64)

Models: ``tiny`` (the untrained preset: every memory call samples the whole 16-token budget, the
decode-heavy case) and ``student`` (``tiny`` after ``memopd.sft`` on oracle trajectories of the same
task at 6 chunks, built once into ``--work``: it writes short memories and keeps them from call to
call, as trained students do).

Per arm: calls per second over the rollout's wall time (``summary.json``'s ``wall_s``; model
loading excluded) and over its CPU time (the rollout's ``time.process_time``, less sensitive to
other jobs on shared cores), and the F1. The records of ``head`` are compared with those of
``base`` call by call (greedy: the same sampled ids; the largest log-prob difference). Writes
``--out`` (JSON) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ENV_KWARGS = {"num_chunks": None, "chunk_size": 48, "memory_budget": 16}
STUDENT_SFT = ["--env-kwarg", "num_chunks=6", "--env-kwarg", "chunk_size=48", "--env-kwarg", "memory_budget=16",
               "--steps", "300", "--num-episodes", "2000", "--seed", "0"]
DRIVER = """
import json, sys, time
import agents.rollout as R
spent = {}
rollout = R.rollout
def timed(*a, **k):
    c0 = time.process_time()
    try:
        return rollout(*a, **k)
    finally:
        spent["cpu_s"] = time.process_time() - c0
R.rollout = timed
from memopd.eval import evaluate
summary = evaluate(sys.argv[2:])
json.dump({"summary": summary, **spent}, open(sys.argv[1], "w"), default=str)
"""


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def base_tree(commit: str, work: Path) -> Path:
    path = work / "base-tree"
    if path.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], capture_output=True)
        shutil.rmtree(path, ignore_errors=True)
    git("worktree", "prune")
    git("worktree", "add", "--detach", str(path), git("rev-parse", "--verify", f"{commit}^{{commit}}"))
    return path


def tree_env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "0"}


def student(work: Path) -> Path:
    """``tiny`` fine-tuned on oracle trajectories (built once)."""
    out = work / "student"
    if not (out / "config.json").is_file():
        cmd = [sys.executable, "-m", "memopd.sft", "--model", "tiny", *STUDENT_SFT, "--threads", "1",
               "--out", str(out), "--no-progress"]
        print("building the student:", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, cwd=REPO, env=tree_env(REPO), check=True, stdout=subprocess.DEVNULL)
    return out


def run_arm(tree: Path, model: str, batch: int | None, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    kwargs = {**ENV_KWARGS, "num_chunks": args.chunks}
    argv = ["--agent", "memagent", "--model", model, "--episodes", str(args.episodes), "--seed", "0",
            "--threads", "1", "--out", str(out), "--no-progress"]
    argv += [a for k, v in kwargs.items() for a in ("--env-kwarg", f"{k}={v}")]
    if batch is not None:
        argv += ["--batch-size", str(batch)]
    result = out.with_suffix(".json")
    shutil.rmtree(out, ignore_errors=True)  # a rerun's arm starts afresh (either tree may refuse a full --out)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", DRIVER, str(result), *argv], cwd=tree, env=tree_env(tree),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {tree}: memopd.eval {' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    data = json.loads(result.read_text())
    s = data["summary"]
    calls = s["calls"] * s["episodes"]
    return {"batch_size": batch, "episodes": s["episodes"], "calls": calls, "f1": s["f1"],
            "memory_tokens": s["memory_tokens"], "rollout_wall_s": s["wall_s"], "rollout_cpu_s": data["cpu_s"],
            "calls_per_s": calls / s["wall_s"], "calls_per_cpu_s": calls / data["cpu_s"],
            "process_wall_s": time.perf_counter() - t0, "argv": argv}


def compare(a: Path, b: Path) -> dict[str, Any]:
    """Call-by-call comparison of two runs' episodes (same plan, greedy)."""
    sys.path.insert(0, str(REPO))
    from agents.records import load_episodes

    ea, eb = load_episodes(a / "episodes.jsonl").episodes, load_episodes(b / "episodes.jsonl").episodes
    same_ids, calls, worst = True, 0, 0.0
    for x, y in zip(ea, eb):
        same_ids &= len(x.invocations) == len(y.invocations)
        for i, j in zip(x.invocations, y.invocations):
            calls += 1
            same_ids &= (i.prompt_ids, i.position_ids, i.response_ids) == (j.prompt_ids, j.position_ids,
                                                                           j.response_ids)
            worst = max(worst, max((abs(p - q) for p, q in zip(i.logprobs, j.logprobs)), default=0.0))
    return {"episodes": len(ea), "calls": calls,
            "same_prompts_positions_and_ids": bool(same_ids and len(ea) == len(eb)), "max_abs_logprob_diff": worst}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="b130929", help="the commit whose evaluation path is today's")
    ap.add_argument("--chunks", type=int, default=192, help="chunks per episode (48 tokens each)")
    ap.add_argument("--episodes", type=int, default=64, help="test episodes per arm")
    ap.add_argument("--models", default="tiny,student", help="comma-separated: tiny, student")
    ap.add_argument("--work", default="runs/eval_speed", help="worktree, student and runs")
    ap.add_argument("--out", default="runs/eval_speed/eval_speed.json", help="the results JSON")
    args = ap.parse_args(argv)
    work = (REPO / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    base = base_tree(args.base, work)
    command = " ".join(["python benchmarks/eval_speed.py", *(sys.argv[1:] if argv is None else argv)])
    results: dict[str, Any] = {"command": command, "base_commit": git("rev-parse", args.base), "head_commit": git("rev-parse", "HEAD"),
                               "head_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
                               "chunks": args.chunks, "episodes": args.episodes, "env_kwargs": ENV_KWARGS | {
                                   "num_chunks": args.chunks}, "student_sft": STUDENT_SFT, "models": {},
                               "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                           "platform": platform.platform()}}
    t0 = time.perf_counter()
    try:
        for name in args.models.split(","):
            spec = {"tiny": "tiny", "student": None}[name]
            spec = spec or str(student(work))
            arms = {}
            for arm, tree, batch in (("base", base, None), ("head@8", REPO, 8), ("head", REPO, None)):
                print(f"{name} {arm} ...", flush=True)
                arms[arm] = run_arm(tree, spec, batch, args, work / "runs" / name / arm.replace("@", "-b"))
                arms[arm]["load_1min"] = os.getloadavg()[0]
                print(f"  {arms[arm]['calls_per_s']:.1f} calls/s, {arms[arm]['calls_per_cpu_s']:.1f} calls/cpu-s, "
                      f"F1 {arms[arm]['f1']:.3f}", flush=True)
            results["models"][name] = {
                "spec": spec, "arms": arms,
                "speedup_wall": arms["head"]["calls_per_s"] / arms["base"]["calls_per_s"],
                "speedup_cpu": arms["head"]["calls_per_cpu_s"] / arms["base"]["calls_per_cpu_s"],
                "records_head_vs_base": compare(work / "runs" / name / "base", work / "runs" / name / "head")}
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], capture_output=True)
    results["wall_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2).replace(f"{REPO}/", "") + "\n")  # paths from the repository root
    print(f"\n{'model':8} {'arm':7} {'batch':>5} {'calls/s':>8} {'calls/cpu-s':>11} {'F1':>6}")
    for name, m in results["models"].items():
        for arm, r in m["arms"].items():
            print(f"{name:8} {arm:7} {r['batch_size'] or 'dflt':>5} {r['calls_per_s']:8.1f} "
                  f"{r['calls_per_cpu_s']:11.1f} {r['f1']:6.3f}")
        print(f"{name:8} speed-up head/base: {m['speedup_wall']:.2f}x wall, {m['speedup_cpu']:.2f}x cpu; records: "
              f"{m['records_head_vs_base']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
