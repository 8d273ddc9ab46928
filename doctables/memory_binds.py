"""RESULTS.md, "Tasks where the memory binds": docs/data/memory_binds/ (examples/memory_binds.py)."""

from __future__ import annotations

import math

from doctables.core import Data, f, md, pm, table

MEMORY = "memory_binds/results.json"


@table("memory_binds.oracle_ladder")
def oracle_ladder(d: Data) -> str:
    """The oracle's F1 at each memory budget (tokens of the digit presets)."""
    rows = d(MEMORY)["ladder"]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    budgets = list(dict.fromkeys(r["budget"] for r in rows))
    got = {(r["task"], r["budget"]): r["oracle_f1"] for r in rows}
    return md(["oracle F1 \\ memory budget (tokens)", *map(str, budgets)],
              [[t, *[f(got[(t, b)]) for b in budgets]] for t in tasks])


@table("memory_binds.teacher")
def teacher(d: Data) -> str:
    """The auto teacher's recipe per task and budget: its greedy held-out F1 ± se and its SFT loss."""
    res = d(MEMORY)
    return md(["task (default size)", "memory budget", "teacher F1 ± se (episodes)", "SFT loss: first → middle → last"],
              [[r["task"], r["budget"], f"{pm(r['teacher_f1'], r['se'])} ({r['episodes']})",
                f"{f(r['loss_first'], 2)} → {f(r['loss_mid'], 2)} → {f(r['loss_last'], 2)}"] for r in res["teacher"]])


@table("memory_binds.students")
def students(d: Data) -> str:
    """The default student per task and budget: held-out F1 before and after training (the run's
    own), the final evaluation ± se, its memory write; with both budgets of a task, large minus small
    ± the se of the difference."""
    res = d(MEMORY)
    oracle = {(r["task"], r["budget"]): r["oracle_f1"] for r in res.get("ladder", [])}
    by_task: dict[str, list[dict]] = {}
    for r in res["students"]:
        by_task.setdefault(r["task"], []).append(r)
    rows = []
    for task, cells in by_task.items():
        for i, r in enumerate(cells):
            gap = ""
            if len(cells) == 2 and i == 1:
                big, small = cells
                gap = pm(big["eval_f1"] - small["eval_f1"], math.hypot(big["eval_se"], small["eval_se"]), sign=True)
            rows.append([task, r["budget"], f(oracle.get((task, r["budget"]))), f(r["teacher_f1"]), f(r["before_f1"]),
                         f(r["after_f1"]), pm(r["eval_f1"], r["eval_se"]), f(r["memory_tokens"], 1), gap])
    return md(["task", "memory budget", "oracle", "teacher", "student before", "student after", "student, eval ± se",
               "memory write (tokens)", "large − small ± se"], rows)


SEARCH = "memory_binds/search.json"


@table("memory_binds.search")
def search(d: Data) -> str:
    """The sizes and warm starts tried before the defaults: the teacher recipe's F1 at each task size,
    and the default student's at each warm start (rows of examples/memory_binds.py, kept as measured)."""
    res = d(SEARCH)
    rows = [[r["task"], r["size"], "teacher", f"{pm(r['teacher_f1'], r['se'])} ({r['episodes']})",
             f"SFT loss {f(r['loss_first'], 2)} → {f(r['loss_mid'], 2)} → {f(r['loss_last'], 2)}"]
            for r in res["teacher"]]
    rows += [[r["task"], r["size"], f"student, {r['warmup']}-step warm start",
              f"{pm(r['eval_f1'], r['eval_se'])} (64)", f"held-out {f(r['before_f1'])} → {f(r['after_f1'])}"]
             for r in res["students"]]
    return md(["task", "size (memory budget 16)", "model", "F1 ± se (episodes)", "how it got there"], rows)
