"""Does the memory bind? The default student of each memory task at a large and a small memory budget.

    python examples/memory_binds.py                          # the study (docs/RESULTS.md, "Tasks where the memory binds")
    python examples/memory_binds.py --smoke --out DIR        # the pipeline in a few minutes (CI: tests/test_studies.py)

For each of KnowledgeUpdate, MultiValue, VariableTracking and Counting at its defaults (4 chunks
of 64 tokens) and each budget of ``BUDGETS`` (16 tokens, and a small one: less than the oracle's
memory needs at the default size, or for the one-item states of KnowledgeUpdate and Counting,
exactly one item), the embedded default run on the digit presets,
``python -m memopd.train --env memgym/<Task>-v0 --model tiny-digits --env-kwarg memory_budget=B``:
the auto teacher (tiny-teacher-digits, the auto teacher's SFT recipe on oracle trajectories at that
budget), the student's warm start, 80 steps of PPO + MemOPD. Recorded per cell, on the test split:
the oracle's F1 (what the budget allows an agent that keeps exactly what is needed), the teacher's
held-out F1 (does the recipe learn the task at this size?), the student's before and after training
(64 held-out episodes each, greedy, as the run's summary.json has them), and the trained student
again by memopd.eval (F1 with its standard error over ``--oracle-episodes`` episodes, and its mean
memory write). The question states the budget, so each budget is its own run.

Everything lands in --out (default runs/memory-binds): <task>-<budget>/ (the run directory,
reused by a rerun: a finished run is read, an unfinished one resumed), results.json.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

TASKS = ("MultiValue", "VariableTracking", "KnowledgeUpdate", "Counting")
BUDGETS = {  # task -> (large, small): the small one holds less than the oracle keeps at the default size
    "MultiValue": (16, 6),  # 3 facts of 3 tokens: 6 holds two
    "VariableTracking": (16, 1),  # a chain of 2 names: 1 holds one
    "KnowledgeUpdate": (16, 3),  # one fact of 3 tokens (the latest): 3 hold it, not a log of updates
    "Counting": (16, 4),  # `mila seville 3` is 4 tokens: 4 hold the count, not the facts counted
}
"""A budget below one item holds nothing the oracle keeps (KnowledgeUpdate's and Counting's state is
one item): memopd.train refuses it (no memory in the teacher's data). Their small budget holds the
item and nothing more: what binds there is overwriting, not capacity."""
SMOKE = ["--steps", "2", "--questions-per-step", "2", "--group-size", "2", "--eval-episodes", "4",
         "--student-warmup-steps", "2", "--teacher", "tiny-teacher-digits", "--eval-every", "0"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python examples/memory_binds.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/memory-binds", help="the study's directory (reused by a rerun)")
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated tasks")
    p.add_argument("--oracle-episodes", type=int, default=64, help="test episodes of the oracle per cell")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared machine)")
    p.add_argument("--smoke", action="store_true", help="tiny runs: the pipeline, not the result")
    args = p.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in args.tasks if t not in BUDGETS]
    if unknown:
        p.error(f"unknown task(s) {unknown}; choose from {list(TASKS)}")
    if args.smoke:
        args.oracle_episodes = 4
    return args


def oracle_f1(task: str, budget: int, args: argparse.Namespace) -> float:
    """The oracle's F1 at this budget, in the digit presets' tokens (no model)."""
    from memopd.eval import evaluate

    out = Path(args.out) / "oracle" / f"{task}-{budget}"
    summary = evaluate(["--env", f"memgym/{task}-v0", "--agent", "oracle", "--model", "tiny-digits", "--episodes",
                        str(args.oracle_episodes), "--env-kwarg", f"memory_budget={budget}", "--no-progress",
                        "--out", str(out)])
    return summary["f1"]


def train_cell(task: str, budget: int, args: argparse.Namespace) -> dict[str, Any]:
    """The embedded default run at this budget (finished runs are read, unfinished ones resumed)."""
    from memopd import train

    run = Path(args.out) / f"{task}-{budget}"
    if not (run / "summary.json").is_file():
        t0 = time.perf_counter()
        argv = (["--resume", str(run)] if (run / "config.toml").is_file() else
                ["--env", f"memgym/{task}-v0", "--model", "tiny-digits", "--env-kwarg", f"memory_budget={budget}",
                 "--threads", str(args.threads), "--no-progress", "--run-dir", str(run)] + (SMOKE if args.smoke else []))
        if train.main(argv) != 0:
            raise SystemExit(f"the run {run} failed")
        (run / "wall_s.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
    summary = json.loads((run / "summary.json").read_text())
    return {"teacher_f1": (summary.get("eval_teacher") or {}).get("f1"), "before_f1": summary["eval_before"]["f1"],
            "after_f1": summary["eval_after"]["f1"], "steps": summary["steps"], **student_eval(run, budget, args)}


def student_eval(run: Path, budget: int, args: argparse.Namespace) -> dict[str, Any]:
    """The trained student by memopd.eval (greedy, the first test samples): F1 with its standard
    error over episodes, and its mean memory write."""
    from agents.records import load_episodes
    from memopd.eval import evaluate

    out = run / "eval-final"
    summary = evaluate(["--env", f"memgym/{run.name.rsplit('-', 1)[0]}-v0", "--model", str(run), "--episodes",
                        str(args.oracle_episodes), "--env-kwarg", f"memory_budget={budget}", "--threads",
                        str(args.threads), "--no-progress", "--out", str(out)])
    f1 = [e.metrics.get("f1", 0.0) for e in load_episodes(out / "episodes.jsonl").episodes]
    mean = sum(f1) / len(f1)
    sd = math.sqrt(sum((x - mean) ** 2 for x in f1) / (len(f1) - 1)) if len(f1) > 1 else 0.0
    return {"eval_f1": mean, "eval_se": sd / math.sqrt(len(f1)), "eval_episodes": len(f1),
            "memory_tokens": summary["memory_tokens"]}


def table(results: dict[str, Any]) -> str:
    """The markdown table of docs/RESULTS.md, from results.json (tests/test_memory_binds.py rebuilds it)."""
    lines = ["| task | budget (tokens) | oracle | teacher | student before | student after | student, eval ± se "
             "| memory write (tokens) |", "|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        lines.append(f"| {row['task']} | {row['budget']} | {row['oracle_f1']:.3f} | {_f(row['teacher_f1'])} | "
                     f"{_f(row['before_f1'])} | {_f(row['after_f1'])} | {_f(row['eval_f1'])} ± {_f(row['eval_se'])} "
                     f"| {_f(row['memory_tokens'], 1)} |")
    return "\n".join(lines)


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import memgym  # noqa: F401  (registers the envs)

    t0 = time.perf_counter()
    rows = []
    for task in args.tasks:
        for budget in BUDGETS[task]:
            cell = train_cell(task, budget, args)
            row = {"task": task, "budget": budget, "oracle_f1": oracle_f1(task, budget, args), **cell}
            rows.append(row)
            print(f"{task} @ {budget} tokens: oracle {row['oracle_f1']:.3f}, teacher {_f(row['teacher_f1'])}, "
                  f"student {_f(row['before_f1'])} -> {_f(row['after_f1'])}", flush=True)
    import torch
    import transformers

    results = {"tasks": args.tasks, "budgets": {t: BUDGETS[t] for t in args.tasks}, "rows": rows,
               "command": "python examples/memory_binds.py" + (" --smoke" if args.smoke else ""),
               "wall_s_this_invocation": time.perf_counter() - t0,
               "versions": {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__}}
    out = Path(args.out) / "results.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
