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

    def gap(xs: dict) -> str:
        return mean_se([x - y for x, y in zip(xs[c], xs[b])], sign=True)

    def rel(xs: dict) -> str:
        return f"({mean(xs[c]) / mean(xs[b]) - 1:+.1%})"

    rows = [[ARM_NAMES[a], mean_sd(s40[a]), bold(mean_sd(fin[a]), a == c), bold(mean_sd(auc[a]), a == c),
             listed(fin[a])] for a in (b, c)]
    rows.append(["gap (c) - (b), mean ± se", f"{gap(s40)} {rel(s40)}", f"{gap(fin)} {rel(fin)}", gap(auc), ""])
    return md(["arm (mean ± sd over 5 seeds)", "F1 at step 40", "F1 at step 120", "AUC over 120 steps",
               "per seed at 120"], rows)


@table("baselines.offpolicy")
def offpolicy(d: Data) -> str:
    off = d(B + "offpolicy.json")
    t = off["table"]
    names = {"sft-oracle": "`sft-oracle`", "sft-teacher": "`sft-teacher`", "ppo+memopd": "(c) PPO + MemOPD",
             "ppo+opd-persist": "(b) persistent"}
    drawn = {"sft-oracle": "oracle", "sft-teacher": "teacher sampling"}
    rows = []
    for arm, name in names.items():
        r = t[arm]
        best = arm == "sft-oracle"
        per_seed = r["final"][2]
        seeds = f"{f(per_seed[0])} x {len(per_seed)}" if len(set(per_seed)) == 1 else listed(per_seed)
        draw = r["episodes_s_per_step"]
        rows.append([name, f(mean(seeds_at(off["curves"][arm], 20))), bold(pm(r["final"][0], r["final"][1]), best),
                     bold(pm(r["auc"][0], r["auc"][1]), best), seeds,
                     f"{f(r['s_per_step'], 2)} + {f(draw, 2)} ({drawn[arm]})" if draw is not None
                     else f"{f(r['s_per_step'], 2)} (rollout, scoring and update)",
                     f(r["s_per_step"] + (draw or 0.0), 2)])
    return md(["arm (5 seeds)", "F1 at 20 (mean)", "F1 at 120 (mean ± sd)", "AUC over 120 steps (mean ± sd)",
               "per seed at 120", "s/step: training + drawing the episodes", "s/step in all"], rows)


SIGNAL = {"2e-3": B + "results-signal-fkl.json", "2e-4": B + "results-signal-lr2e-4-fkl.json"}
SIGNAL_ARMS = {"ppo": "PPO alone", "ppo+memopd": "PPO + MemOPD", "opd-only": "OPD only"}


@table("baselines.signal")
def signal(d: Data) -> str:
    rows = []
    for lr, path in SIGNAL.items():
        t = d(path)["table"]
        best = max(t, key=lambda a: t[a]["f1"][0])
        for arm, name in SIGNAL_ARMS.items():
            r = t[arm]
            rows.append([name, lr, bold(pm(*r["f1"]), arm == best or (lr == "2e-4" and arm == "ppo")),
                         listed(r["per_seed"])])
    return md(["arm (from the mid-plateau start)", "lr", "F1 at 40 (mean ± sd over 5 seeds)", "per seed"], rows)


PPO_SEARCH = {"lr 2e-3": B + "results-signal-fkl.json", "lr 5e-4": B + "results-signal-lr5e-4-fkl.json",
              "lr 5e-4, KL penalty to the start (`--ref-beta 0.1`)": B + "results-signal-lr5e-4-kl0.1-fkl.json",
              "lr 2e-4": B + "results-signal-lr2e-4-fkl.json", "lr 1e-4": B + "results-signal-lr1e-4-fkl.json"}


def curve_means(curves: dict, steps: list[int]) -> list[float]:
    return [mean(at_step(c, s) for c in curves.values()) for s in steps]


@table("baselines.ppo_search")
def ppo_search(d: Data) -> str:
    rows, best = [], None
    runs = {name: d(path) for name, path in PPO_SEARCH.items()}
    best = max(runs, key=lambda n: runs[n]["table"]["ppo"]["f1"][0])
    for name, res in runs.items():
        curves = res["curves"]["ppo"]
        n = len(curves)
        label = name + (f" ({n} seeds)" if n != 5 else "")
        means = " / ".join(f(x) for x in curve_means(curves, [10, 20, 30, 40]))
        rows.append([bold(label, name == best), means, bold(pm(*res["table"]["ppo"]["f1"]), name == best)])
    return md(["PPO alone", "F1 at 10 / 20 / 30 / 40 (mean)", "F1 at 40 (mean ± sd)"], rows)


@table("baselines.ppo_long")
def ppo_long(d: Data) -> str:
    res = d(B + "results-signal-lr2e-4-long-fkl.json")
    curves = res["curves"]["ppo"]
    steps = [0, 20, 40, 80, 120, 160, 200]
    means = curve_means(curves, steps)
    cells = [f(x) for x in means[:-1]] + [bold(pm(*res["table"]["ppo"]["f1"]))]
    return md(["step", *map(str, steps)], [[f"PPO alone, lr 2e-4 (mean of {len(curves)})", *cells]])


@table("baselines.variance")
def variance(d: Data) -> str:
    v = d(B + "variance.json")
    rows = []
    for name, cell in v["cells"].items():
        b, c = (mean(cell["arms"][a].values()) for a in ("ppo+opd-persist", "ppo+memopd"))
        rows.append([name, f"{cell['teacher']} ({f(cell['teacher_f1'])})",
                     f"{cell['student']} ({f(cell['student_f1'])})", f(b), f(c), signed(c - b)])
    return md(["cell", "teacher (F1)", "warm student (F1)", "(b) persistent", "(c) MemOPD", "gap"], rows)


IMPERFECT = {"2e-3": B + "imperfect-0.1.json", "2e-4": B + "imperfect-0.1-lr2e-4.json"}
IMPERFECT_ARMS = {"ppo": "PPO", "ppo+memopd": "PPO + MemOPD", "opd-only": "OPD only"}


@table("baselines.imperfect_partial")
def imperfect_partial(d: Data) -> str:
    first = d(IMPERFECT["2e-3"])["table"]
    rows = [["teacher (partially blind)", "", *(f(first["teacher (blind)"][k][0]) for k in ("all", "seen", "blind"))],
            ["warm student", "", *(f(first["warm student"][k][0]) for k in ("all", "seen", "blind"))]]
    for lr, path in IMPERFECT.items():
        t = d(path)["table"]
        for arm, name in IMPERFECT_ARMS.items():
            r = t[arm]
            rows.append([name, lr, bold(pm(*r["all"]), (lr, arm) == ("2e-3", "ppo+memopd")), pm(*r["seen"]),
                         bold(pm(*r["blind"]), (lr, arm) == ("2e-4", "ppo"))])
    return md(["arm", "lr", "F1 all", "F1 seen companies", "F1 blind companies"], rows)


@table("baselines.teachers")
def teachers(d: Data) -> str:
    nll = d(FAIR)["teacher_nll"]
    names = {"teacher (aligned)": "`teacher/` (aligned only)", "teacher-both (both)": "`teacher-both/` (both)"}
    rows = [[names[k], bold(f(r["f1"]), k.startswith("teacher-both")), bold(f(r["f1_transcript"]),
             k.startswith("teacher-both")), f(r["aligned"]), f(r["persistent"])] for k, r in nll.items()]
    return md(["teacher (SFT context)", "F1 aligned", "F1 persistent", "NLL aligned", "NLL persistent"], rows)


@table("baselines.alignment")
def alignment(d: Data) -> str:
    al = d(FAIR)["alignment"]
    rows_of = {who: {m: {t["turn"]: t for t in al[who]["turns"][m]} for m in ("aligned", "persistent")}
               for who in ("student", "teacher")}
    shift = {t["turn"]: t for t in al["teacher_shift"]}
    rows = []
    for turn in sorted(rows_of["student"]["aligned"]):
        cells = [rows_of[w][m][turn] for w in ("student", "teacher") for m in ("aligned", "persistent")]
        cells.append(shift[turn])
        rows.append([turn, shift[turn]["tokens"], *(f"{c['mean_gap']:.2e} / {c['max_gap']:.2e}" for c in cells)])
    return md(["turn", "tokens", "student aligned", "student persistent", "teacher aligned", "teacher persistent",
               "teacher KL(aligned ‖ persistent)"], rows)
