"""RESULTS.md, "TurnOPD, Prune-OPD and f-OPD where they could act": docs/data/seed_methods/."""

from __future__ import annotations

from doctables.core import Data, f, md, mean, mean_sd, pm, table

S = "seed_methods/"


def last_three(runs: dict) -> list[float]:
    """Each seed's mean of its last three held-out evaluations."""
    return [mean(r["curve"]["f1"][-3:]) for _, r in sorted(runs.items())]


def auc(curve: dict, horizon: float, by: str) -> float:
    """Mean held-out F1 over [0, horizon] (examples/seed_methods.py's rule: trapezoids, the last value
    held to the horizon, a segment past it cut there)."""
    xs, ys = list(curve[by]), list(curve["f1"])
    if xs[-1] < horizon:
        xs, ys = xs + [horizon], ys + [ys[-1]]
    area = 0.0
    for x0, y0, x1, y1 in zip(xs, ys, xs[1:], ys[1:]):
        hi = min(x1, horizon)
        if hi > x0:
            area += (hi - x0) * (y0 + y0 + (y1 - y0) * (hi - x0) / (x1 - x0)) / 2
    return area / horizon


def aucs(res: dict, arm: str) -> list[float]:
    """Each seed's AUC, recomputed from its curve (the results JSON keeps only their mean and sd)."""
    return [auc(r["curve"], res["budget_cpu_s"] or float(res["steps"]), res["auc_by"])
            for _, r in sorted(res["runs"][arm].items())]


def common_cells(res: dict, arm: str) -> list[str]:
    t = res["table"][arm]
    return [pm(t["after"]["mean"], t["after"]["sd"]), mean_sd(last_three(res["runs"][arm])),
            pm(t["auc"]["mean"], t["auc"]["sd"])]


def flags(res: dict, arm: str) -> str:
    given = res["arms"][arm]
    return f"`{' '.join(given)}`" if given else ""


def budget_table(d: Data, study: str, names: dict[str, str]) -> str:
    res = d(S + f"{study}.json")
    rows = []
    for arm, name in names.items():
        t = res["table"][arm]
        rows.append([name, flags(res, arm), *common_cells(res, arm), f(t["steps"]["mean"], 1),
                     f(t["s_per_step"]["mean"], 2), f(t["calls_per_episode"], 2)])
    return md(["arm", "flags", "F1 after", "last three evaluations", "AUC", "steps", "s / step", "calls / episode"],
              rows)


@table("seed_methods.turnopd")
def turnopd(d: Data) -> str:
    return budget_table(d, "turnopd", {"full": "full (vanilla)", "cut-4": "cut-4 (positive control)",
                                       "turnopd": "TurnOPD"})


@table("seed_methods.turnopd_kl")
def turnopd_kl(d: Data) -> str:
    t = d(S + "turnopd.json")["table"]
    turns = sorted(int(k.rsplit("/", 1)[1]) for k in t["turnopd"]["method"] if k.startswith("depth/kl/"))
    kl = [mean(t[arm]["method"][f"depth/kl/{i}"] for arm in ("cut-4", "turnopd")) for i in turns]
    head = [str(i) if i < turns[-1] else f"{i} (answer)" for i in turns]
    return md(["turn", *head], [["KL", *(f(x, 2) for x in kl)]])


@table("seed_methods.pruneopd")
def pruneopd(d: Data) -> str:
    return budget_table(d, "pruneopd", {"vanilla": "vanilla", "oracle-drop": "oracle drop (positive control)",
                                        "prune-opd": "Prune-OPD"})


def fopd_table(d: Data, study: str) -> str:
    res = d(S + f"{study}.json")
    rows = []
    lags = sorted({int(a.rsplit("-", 1)[1]) for a in res["table"] if "-" in a})
    for arm in ["sync"] + [a for s in lags for a in (f"stale-{s}", f"fopd-{s}")]:
        t = res["table"][arm]
        m = t["method"]
        keys = ("fresh/weight", "fresh/ess", "fresh/drift", "fresh/sup_drift")
        fresh = [f(m[k], 2 if k == "fresh/ess" else 3) for k in keys] if "fresh/weight" in m else ["–"] * 4
        rows.append([arm, *common_cells(res, arm), f(t["s_per_step"]["mean"], 2), *fresh])
    return md(["arm", "F1 after", "last three evaluations", "AUC", "s / step", "mean weight", "ESS", "D_roll",
               "D_sup"], rows)


@table("seed_methods.fopd")
def fopd(d: Data) -> str:
    return fopd_table(d, "fopd")


@table("seed_methods.fopd_sampled")
def fopd_sampled(d: Data) -> str:
    return fopd_table(d, "fopd-sampled")
