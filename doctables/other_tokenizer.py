"""RESULTS.md, "A teacher with another tokenizer, and a served one": docs/data/other_tokenizer/."""

from __future__ import annotations

from doctables.core import Data, bold, diff_se, f, listed, md, mean, mean_sd, pm, table

RESULTS = "other_tokenizer/results.json"
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


@table("other_tokenizer.arms")
def arms(d: Data) -> str:
    res = d(RESULTS)
    rows = []
    for arm, estimator in ARMS.items():
        s = per_seed(res, arm)
        n = len(s["after"])
        cells = [mean_sd(s["after"]), mean_sd(s["last3"])] if n > 1 else [f(s["after"][0]), f(s["last3"][0])]
        main = arm == "other-topk"
        rows.append([bold(arm, main), bold(estimator, main), n, bold(cells[0], main), cells[1], listed(s["after"])])
    return md(["arm", "estimator", "seeds", "F1 after 80 steps (mean ± sd)", "mean of the last 3 evals",
               "each seed (after)"], rows)


@table("other_tokenizer.cost")
def cost(d: Data) -> str:
    """What the other tokenizer costs the top-k: other-topk minus same-topk, mean ± the standard error
    of the difference of two independent 3-seed means."""
    res = d(RESULTS)
    a, b = per_seed(res, "other-topk"), per_seed(res, "same-topk")
    names = {"after": "F1 after 80 steps", "last3": "mean of the last 3 evaluations", "auc": "AUC over 80 steps"}
    rows = []
    for key, name in names.items():
        gap = mean(a[key]) - mean(b[key])
        err = diff_se(a[key], b[key])
        rows.append([name, f(mean(b[key])), f(mean(a[key])), pm(gap, err, sign=True), f(abs(gap) / err, 1)])
    return md(["measure", "same-topk", "other-topk", "difference ± se", "standard errors"], rows)
