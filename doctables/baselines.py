"""RESULTS.md, "To convergence, and baselines that can win": docs/data/baselines/."""

from __future__ import annotations

from doctables.core import (Data, at_step, bold, f, listed, md, mean, mean_sd, mean_se, pm, sd, se, signed,
                            table)

B = "baselines/"
FAIR = B + "results-fair120-fkl.json"
ARM_NAMES = {"ppo+opd-persist": "(b) persistent-history teacher", "ppo+memopd": "(c) MemOPD (aligned)"}


def seeds_at(curves: dict, step: int) -> list[float]:
    return [at_step(c, step) for _, c in sorted(curves.items())]


@table("baselines.fair120")
def fair120(d: Data) -> str:
    fair, off = d(FAIR), d(B + "offpolicy.json")
    b, c = "ppo+opd-persist", "ppo+memopd"
    s40 = {a: seeds_at(fair["curves"][a], 40) for a in (b, c)}
    fin = {a: fair["table"][a]["per_seed"] for a in (b, c)}
    auc = {a: off["table"][a]["auc"][2] for a in (b, c)}

    def gap(xs: dict) -> list[float]:
        return [x - y for x, y in zip(xs[c], xs[b])]

    rel = mean(fin[c]) / mean(fin[b]) - 1
    rows = [[ARM_NAMES[a], f(mean(s40[a])), bold(mean_sd(fin[a]), a == c), bold(mean_sd(auc[a]), a == c),
             listed(fin[a])] for a in (b, c)]
    rows.append(["gap (c) - (b)", mean_se(gap(s40), sign=True), bold(mean_se(gap(fin), sign=True)) + f" ({rel:+.1%})",
                 bold(mean_se(gap(auc), sign=True)), ""])
    return md(["arm", "F1 at step 40", "F1 at step 120", "AUC over 120 steps", "per seed at 120"], rows)


@table("baselines.offpolicy")
def offpolicy(d: Data) -> str:
    t = d(B + "offpolicy.json")["table"]
    names = {"sft-oracle": "`sft-oracle`", "sft-teacher": "`sft-teacher`", "ppo+memopd": "(c) PPO + MemOPD",
             "ppo+opd-persist": "(b) persistent"}
    drawn = {"sft-oracle": "(oracle)", "sft-teacher": "(teacher sampling)"}
    rows = []
    for arm, name in names.items():
        r = t[arm]
        best = arm == "sft-oracle"
        per_seed = r["final"][2]
        seeds = f"{f(per_seed[0])} x {len(per_seed)}" if len(set(per_seed)) == 1 else listed(per_seed)
        step = f(r["s_per_step"], 2) + (" (rollout, scoring and update)" if arm == "ppo+memopd" else "")
        draw = f"{f(r['episodes_s_per_step'], 2)} {drawn[arm]}" if r["episodes_s_per_step"] is not None else "in the step"
        rows.append([name, bold(pm(r["final"][0], r["final"][1]), best), bold(pm(r["auc"][0], r["auc"][1]), best),
                     seeds, step, draw])
    return md(["arm", "F1 at 120", "AUC over 120 steps", "per seed at 120", "train s/step",
               "drawing the episodes, s/step"], rows)
