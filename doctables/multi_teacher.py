"""RESULTS.md, "Several teachers in one run": docs/data/multi_teacher/ (examples/multi_teacher.py)."""

from __future__ import annotations

from doctables.core import Data, f, md, mean, pm, sd, table

STUDY = "multi_teacher/results.json"


def _tasks(res: dict) -> list[str]:
    return [e.rsplit("/", 1)[-1] for e in res["envs"]]


@table("multi_teacher.teachers")
def teachers(d: Data) -> str:
    """Each teacher: what it was fine-tuned on, its SFT steps and last loss, its held-out F1 per task."""
    res = d(STUDY)
    tasks = _tasks(res)
    head = ["teacher", "fine-tuned on", "calls", "SFT steps", "last SFT loss",
            *[f"{t} F1 ({res['eval_episodes']} episodes)" for t in tasks]]
    rows = [[r["teacher"], " + ".join(e.rsplit("/", 1)[-1] for e in r["tasks"]), " + ".join(r["roles"]), r["steps"],
             f(r["loss_last"], 2), *[f(r["heldout"].get(f"{t}/f1")) for t in tasks]] for r in res["teachers"]]
    return md(head, rows)


@table("multi_teacher.students")
def students(d: Data) -> str:
    """Each student arm: its routes, the seeds that finished, and its held-out F1 per task before and
    after training (mean ± sd over those seeds; – where none finished)."""
    res = d(STUDY)
    tasks = _tasks(res)
    arms = list(dict.fromkeys(res.get("arms", []) + [r["arm"] for r in res["students"]]))
    rows = []
    for arm in arms:
        got = [r for r in res["students"] if r["arm"] == arm]
        cells = []
        for t in tasks:
            before = [r["before"][f"{t}/f1"] for r in got]
            after = [r["after"][f"{t}/f1"] for r in got]
            cells.append(f"{f(mean(before))} → {pm(mean(after), sd(after))}" if got else "–")
        teachers = " ".join(f"`--teacher {x}`" for x in res.get("routes", {}).get(arm, []))
        rows.append([arm, teachers, len(got), *cells])
    return md(["arm", "teachers", "seeds done",
               *[f"{t} F1 before → after ± sd ({res['eval_episodes']} episodes)" for t in tasks]], rows)
