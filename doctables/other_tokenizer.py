"""RESULTS.md, "A teacher with another tokenizer, and a served one": docs/data/other_tokenizer/.

results.json is the study with the fixed first-piece map; results-old-map.json its two
other-tokenizer arms rerun from the same start and teachers with the map before the fix;
results-before-map-fix.json the first run (another warm start and other-tokenizer teacher, the map
before the fix, and the served teacher's arm).
"""

from __future__ import annotations

from doctables.core import Data, bold, diff_se, f, listed, md, mean, mean_sd, pm, table

RESULTS = "other_tokenizer/results.json"
OLD_MAP = "other_tokenizer/results-old-map.json"
BEFORE_FIX = "other_tokenizer/results-before-map-fix.json"
ARMS = {"same-full": "full vocabulary, reverse KL", "same-topk": "top-20 + tail, reverse KL",
        "served-topk": "top-20 + tail from `vllm serve`, reverse KL",
        "other-topk": "top-20 + tail, teacher with another tokenizer (first pieces)",
        "same-sampled-fkl": "sampled forward KL, one PPO epoch",
        "other-sampled-fkl": "the same, teacher with another tokenizer"}


def auc(curve: dict) -> float:
    """Mean held-out F1 over the steps (trapezoids)."""
    xs, ys = curve["step"], curve["f1"]
    area = sum((x1 - x0) * (y0 + y1) / 2 for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]))
    return area / (xs[-1] - xs[0])


def per_seed(res: dict, arm: str) -> dict[str, list[float]]:
    runs = [r for _, r in sorted(res["runs"][arm].items())]
    return {"after": [r["after"] for r in runs], "last3": [mean(r["curve"]["f1"][-3:]) for r in runs],
            "auc": [auc(r["curve"]) for r in runs]}


def last_step(res: dict) -> int:
    """The training steps every arm ran (the last evaluation's step)."""
    ends = {r["curve"]["step"][-1] for per in res["runs"].values() for r in per.values()}
    if len(ends) != 1:
        raise ValueError(f"arms of unequal length: {sorted(ends)}")
    return ends.pop()


def teacher_f1(res: dict, arm: str) -> str:
    """The teacher's held-out F1 (a served teacher is not evaluated: its local copy is the auto one)."""
    scores = {r["teacher"] for r in res["runs"][arm].values()}
    return "–" if scores == {None} else "/".join(f(s) for s in sorted(scores))


def arm_table(res: dict, main: str = "other-topk") -> str:
    rows = []
    for arm in [a for a in ARMS if a in res["runs"]]:
        s = per_seed(res, arm)
        n = len(s["after"])
        cells = [mean_sd(s["after"]), mean_sd(s["last3"])] if n > 1 else [f(s["after"][0]), f(s["last3"][0])]
        on = arm == main
        rows.append([bold(arm, on), bold(ARMS[arm], on), teacher_f1(res, arm), n, bold(cells[0], on), cells[1],
                     listed(s["after"])])
    return md(["arm", "estimator", "teacher's F1", "seeds", f"F1 after {last_step(res)} steps (mean ± sd)",
               "mean of the last 3 evals (mean ± sd)", "each seed (after)"], rows)


@table("other_tokenizer.arms")
def arms(d: Data) -> str:
    return arm_table(d(RESULTS))


@table("other_tokenizer.before_fix")
def before_fix(d: Data) -> str:
    return arm_table(d(BEFORE_FIX))


@table("other_tokenizer.cost")
def cost(d: Data) -> str:
    """What the other tokenizer costs the top-k: other-topk minus same-topk, mean ± the standard error
    of the difference of two independent 3-seed means."""
    res = d(RESULTS)
    a, b = per_seed(res, "other-topk"), per_seed(res, "same-topk")
    steps = last_step(res)
    names = {"after": f"F1 after {steps} steps", "last3": "mean of the last 3 evaluations",
             "auc": f"AUC over {steps} steps"}
    rows = []
    for key, name in names.items():
        gap = mean(a[key]) - mean(b[key])
        err = diff_se(a[key], b[key])
        rows.append([name, f(mean(b[key])), f(mean(a[key])), pm(gap, err, sign=True), f(abs(gap) / err, 1)])
    return md(["measure", "same-topk", "other-topk", "difference ± se", "standard errors"], rows)


@table("other_tokenizer.map_fix")
def map_fix(d: Data) -> str:
    """What the map fix changed: the other-tokenizer arms with the fixed map minus the old map, from
    the same start and teachers; final F1 and AUC, ± the standard error of the difference."""
    new, old = d(RESULTS), d(OLD_MAP)
    rows = []
    for arm in [a for a in ARMS if a in old["runs"]]:
        a, b = per_seed(new, arm), per_seed(old, arm)
        for key, name in (("after", f"F1 after {last_step(new)} steps"), ("auc", "AUC")):
            gap = mean(a[key]) - mean(b[key])
            err = diff_se(a[key], b[key])
            rows.append([arm, name, mean_sd(b[key]), listed(b[key]), mean_sd(a[key]), listed(a[key]),
                         pm(gap, err, sign=True), f(abs(gap) / err, 1)])
    return md(["arm", "measure", "old map (mean ± sd)", "each seed", "fixed map (mean ± sd)", "each seed",
               "fixed - old ± se", "standard errors"], rows)
