"""Does the memory bind? The memory tasks at a ladder of budgets: the oracle, the teacher recipe, the student.

    python examples/memory_binds.py                               # every part (docs/RESULTS.md, "Tasks where the memory binds")
    python examples/memory_binds.py --parts ladder,teacher        # what docs/RESULTS.md reports
    python examples/memory_binds.py --smoke --out DIR             # the pipeline in a few minutes (tests/test_length_memory_studies.py)

KnowledgeUpdate, MultiValue, VariableTracking and Counting at their defaults (their task.toml: 4 chunks
of 32 tokens), in the digit presets' tokens, and LongQA's default for contrast. The parts (`--parts`):

  ladder    the oracle's F1 at each budget of ``LADDER`` (no model): what the budget lets an agent
            that keeps exactly what is needed score. On LongQA one fact of 3 tokens is all it needs.
  teacher   the auto teacher of a tiny-digits student (``memopd.learn.models.TEACHER_SFT``: 250 SFT
            steps of 32 oracle trajectories, from 1,000, on tiny-teacher-digits) at the default size and
            each budget of ``BUDGETS``, built where `memopd.train --teacher auto` finds it, and its
            held-out F1 (greedy): does the embedded recipe learn the task?
  students  the embedded default run on the digit presets at a large and a small budget (``BUDGETS``),
            ``python -m memopd.train --env memgym/<Task>-v0 --model tiny-digits --env-kwarg memory_budget=B``
            (the auto teacher at that budget, the warm start its task.toml recommends, 80 steps of PPO +
            MemOPD), with the student's held-out F1 before and after and again by memopd.eval (F1 ± its standard error,
            mean memory write). The question states the budget, so each budget is its own run.

Everything lands in --out (default runs/memory-binds): oracle/, teacher-eval/, <task>-<budget>/ (the
student runs) and rows/ (one file per teacher or student cell, so two processes can share a study:
`--budgets large` in one, `--budgets small` in the other), results.json (the parts of this
invocation, each cell read from rows/ when there).
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
CONTROL = "LongQA"
LADDER = (16, 8, 6, 4, 3, 2, 1)
BUDGETS = {  # task -> (large, small) for the students: the small one holds less than the oracle keeps
    "MultiValue": (16, 3),  # 2 facts of 3 tokens: 3 holds one
    "VariableTracking": (16, 1),  # a chain of 2 names: 1 holds one
    "KnowledgeUpdate": (16, 3),  # two people's latest facts (people=2) of 3-4 tokens: 3 hold one
    "Counting": (16, 4),  # two counts (keys=2) of 4 tokens (`mila seville 3`): 4 hold one
}
"""A budget below one item holds nothing the oracle keeps (KnowledgeUpdate's items are one fact each,
Counting's one count each): memopd.train refuses it (no memory in the teacher's data)."""
PARTS = ("ladder", "teacher", "students")
SMOKE_TRAIN = ["--steps", "2", "--questions-per-step", "2", "--group-size", "2", "--eval-episodes", "4",
               "--student-warmup-steps", "2", "--teacher", "tiny-teacher-digits", "--eval-every", "0"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python examples/memory_binds.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/memory-binds", help="the study's directory (reused by a rerun)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated parts of {list(PARTS)}")
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated tasks")
    p.add_argument("--budgets", default="large,small", help="which of each task's BUDGETS (teacher, students)")
    p.add_argument("--episodes", type=int, default=64, help="test episodes per evaluation")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared machine)")
    p.add_argument("--cached-only", action="store_true",
                   help="compute nothing: results.json from the cells already done (a study shared by two processes)")
    p.add_argument("--smoke", action="store_true", help="tiny runs: the pipeline, not the result")
    args = p.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.parts = [x for x in args.parts.split(",") if x]
    args.budgets = [x for x in args.budgets.split(",") if x]
    if ([t for t in args.tasks if t not in BUDGETS] or [x for x in args.parts if x not in PARTS]
            or [x for x in args.budgets if x not in ("large", "small")]):
        p.error(f"--tasks takes {list(TASKS)}, --parts {list(PARTS)}, --budgets large,small")
    if args.smoke:
        args.episodes = 4
    return args


def evaluate(out: Path, env: str, argv: list[str]) -> tuple[dict[str, Any], list[float]]:
    """memopd.eval into ``out`` (read back when already there): its summary and per-episode F1."""
    from agents.records import load_episodes
    from memopd.eval import evaluate as run_eval

    if not (out / "summary.json").is_file():
        run_eval(["--env", f"memgym/{env}-v0", "--no-progress", "--out", str(out), *argv])
    f1 = [e.metrics.get("f1", 0.0) for e in load_episodes(out / "episodes.jsonl").episodes]
    return json.loads((out / "summary.json").read_text()), f1


def mean_se(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((x - mean) ** 2 for x in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, sd / math.sqrt(len(values))


def ladder(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The oracle's F1 at each budget of LADDER (digit presets' tokens), each task and LongQA."""
    rows = []
    for task in [*args.tasks, CONTROL]:
        for budget in LADDER:
            summary, _ = evaluate(Path(args.out) / "oracle" / f"{task}-{budget}", task,
                                  ["--agent", "oracle", "--model", "tiny-digits", "--episodes", str(args.episodes),
                                   "--env-kwarg", f"memory_budget={budget}"])
            rows.append({"task": task, "budget": budget, "oracle_f1": summary["f1"]})
    return rows


def budgets(task: str, args: argparse.Namespace) -> list[int]:
    large, small = BUDGETS[task]
    return [b for which, b in (("large", large), ("small", small)) if which in args.budgets]


def cached_row(path: Path, compute, args: argparse.Namespace) -> dict[str, Any] | None:
    """One cell's row, computed once: separate files let two processes fill one study. With
    ``--cached-only`` a cell not computed yet is left out."""
    if not path.is_file():
        if args.cached_only:
            return None
        row = compute()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(row, indent=2) + "\n")
    return json.loads(path.read_text())


def teacher(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The auto teacher of a tiny-digits student at each task's default size and each budget: built
    where ``memopd.train --teacher auto`` looks for it (the students part reuses it), and evaluated."""
    rows = [cached_row(Path(args.out) / "rows" / f"teacher-{task}-{b}.json", lambda t=task, b=b: teacher_cell(t, b, args),
                       args) for task in args.tasks for b in budgets(task, args)]
    return [r for r in rows if r is not None]


def teacher_cell(task: str, budget: int, args: argparse.Namespace) -> dict[str, Any]:
    from memopd.learn.models import TEACHER_SFT, ensure_teacher
    from memopd.sft import SFTConfig, run as run_sft

    t0 = time.perf_counter()
    env, env_kwargs = f"memgym/{task}-v0", {"memory_budget": budget}
    if args.smoke:  # a few steps, outside the cache
        out = Path(args.out) / f"teacher-{task}-{budget}"
        if not (out / "config.json").is_file():
            run_sft(SFTConfig(env=env, env_kwargs=env_kwargs, out=str(out), seed=1, threads=args.threads,
                              progress=False, **{**TEACHER_SFT, "model": "tiny-teacher-digits", "steps": 2,
                                                 "num_episodes": 8, "batch_episodes": 4}), progress=False)
    else:  # the teacher memopd.train builds, its config resolved as memopd.train does (the task's [train] table)
        from memopd import train

        out = Path(ensure_teacher(train.prepare(train.TrainConfig(env=env, env_kwargs=env_kwargs, model="tiny-digits",
                                                                  threads=args.threads, progress=False))))
    losses = [json.loads(line)["loss"] for line in (out / "sft_metrics.jsonl").read_text().splitlines()]
    _, f1 = evaluate(Path(args.out) / "teacher-eval" / f"{task}-{budget}", task,
                     ["--model", str(out), "--episodes", str(args.episodes), "--threads", str(args.threads),
                      "--temperature", "0", "--top-k", "1", "--env-kwarg", f"memory_budget={budget}"])
    mean, se = mean_se(f1)
    print(f"teacher on {task} @ {budget}: F1 {mean:.3f} ± {se:.3f} (se, {len(f1)} episodes), SFT loss "
          f"{losses[0]:.2f} -> {losses[-1]:.2f}", flush=True)
    return {"task": task, "budget": budget, "teacher_f1": mean, "se": se, "episodes": len(f1), "steps": len(losses),
            "loss_first": losses[0], "loss_mid": losses[len(losses) // 2], "loss_last": losses[-1],
            "wall_s": time.perf_counter() - t0}


def students(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The embedded default run at each of BUDGETS (finished runs are read, unfinished ones resumed)."""
    rows = [cached_row(Path(args.out) / "rows" / f"students-{task}-{b}.json", lambda t=task, b=b: student_cell(t, b, args),
                       args) for task in args.tasks for b in budgets(task, args)]
    return [r for r in rows if r is not None]


def student_cell(task: str, budget: int, args: argparse.Namespace) -> dict[str, Any]:
    from memopd import train
    from memopd.checkpoint import list_checkpoints

    run = Path(args.out) / f"{task}-{budget}"
    t0 = time.perf_counter()
    if not (run / "summary.json").is_file():  # killed before its first checkpoint: it starts over
        argv = (["--resume", str(run)] if run.is_dir() and list_checkpoints(run) else
                ["--env", f"memgym/{task}-v0", "--model", "tiny-digits", "--env-kwarg", f"memory_budget={budget}",
                 "--threads", str(args.threads), "--no-progress", "--run-dir", str(run)]
                + (SMOKE_TRAIN if args.smoke else []))
        if train.main(argv) != 0:
            raise SystemExit(f"the run {run} failed")
    summary = json.loads((run / "summary.json").read_text())
    final, f1 = evaluate(run / "eval-final", task, ["--model", str(run), "--episodes", str(args.episodes),
                                                    "--threads", str(args.threads), "--temperature", "0",
                                                    "--top-k", "1", "--env-kwarg", f"memory_budget={budget}"])
    mean, se = mean_se(f1)
    row = {"task": task, "budget": budget, "teacher_f1": (summary.get("eval_teacher") or {}).get("f1"),
           "before_f1": summary["eval_before"]["f1"], "after_f1": summary["eval_after"]["f1"],
           "eval_f1": mean, "eval_se": se, "memory_tokens": final["memory_tokens"],
           "wall_s": time.perf_counter() - t0}
    print(f"student on {task} @ {budget}: {row['before_f1']:.3f} -> {row['after_f1']:.3f}; eval {mean:.3f} ± {se:.3f}",
          flush=True)
    return row


def ladder_table(rows: list[dict[str, Any]]) -> str:
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    budgets = list(dict.fromkeys(r["budget"] for r in rows))
    f1 = {(r["task"], r["budget"]): r["oracle_f1"] for r in rows}
    lines = ["| oracle F1 \\ budget (tokens) | " + " | ".join(map(str, budgets)) + " |",
             "|---" * (len(budgets) + 1) + "|"]
    lines += [f"| {t} | " + " | ".join(f"{f1[(t, b)]:.3f}" for b in budgets) + " |" for t in tasks]
    return "\n".join(lines)


def teacher_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| task (default size, 16-token budget) | teacher F1 ± se | SFT loss: first -> middle -> last |",
             "|---|---|---|"]
    lines += [f"| {r['task']} | {r['teacher_f1']:.3f} ± {r['se']:.3f} | {r['loss_first']:.2f} -> "
              f"{r['loss_mid']:.2f} -> {r['loss_last']:.2f} |" for r in rows]
    return "\n".join(lines)


def student_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| task | budget | teacher | student before | student after | eval ± se | memory write (tokens) |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['task']} | {r['budget']} | {_f(r['teacher_f1'])} | {_f(r['before_f1'])} | {_f(r['after_f1'])} "
              f"| {_f(r['eval_f1'])} ± {_f(r['eval_se'])} | {_f(r['memory_tokens'], 1)} |" for r in rows]
    return "\n".join(lines)


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


TABLES = {"ladder": ladder_table, "teacher": teacher_table, "students": student_table}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import memgym  # noqa: F401  (registers the envs)

    out = Path(args.out) / "results.json"
    results = json.loads(out.read_text()) if out.is_file() else {}
    t0 = time.perf_counter()
    for part in args.parts:
        results[part] = {"ladder": ladder, "teacher": teacher, "students": students}[part](args)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")  # each part as it finishes
    import torch
    import transformers

    results.update({"tasks": args.tasks, "ladder_budgets": list(LADDER), "student_budgets": BUDGETS,
                    "episodes": args.episodes,
                    "command": " ".join(["python examples/memory_binds.py", *(sys.argv[1:] if argv is None else argv)]),
                    "wall_s_this_invocation": time.perf_counter() - t0,
                    "versions": {"python": platform.python_version(), "torch": torch.__version__,
                                 "transformers": transformers.__version__}})
    out.write_text(json.dumps(results, indent=2) + "\n")
    for part in PARTS:
        if part in results:
            print(TABLES[part](results[part]))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
