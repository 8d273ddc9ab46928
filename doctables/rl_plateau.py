"""RESULTS.md, "The RL objectives to a plateau": docs/data/rl_plateau/ (examples/rl_plateau.py)."""

from __future__ import annotations

from doctables.core import Data, diff_se, f, mean, mean_sd, md, table

P = "rl_plateau/"
ARMS = {"ppo": "PPO alone (lr 2e-4)", "dapo": "DAPO (lr 2e-4)", "gspo": "GSPO (lr 2e-4)",
        "memopd": "PPO + MemOPD (lr 2e-3)"}
AT = (0, 40, 120, 200, 400)
REACH = 0.8


def _runs(data: dict) -> list[tuple[dict[int, float], dict[int, float]]]:
    """Per run: held-out F1 by step, and training seconds by step (the study script's own curve)."""
    from doctables.figures import script

    curves = [script("rl_plateau").curve(run) for run in data["runs"].values()]
    return [({s: f1 for s, _, f1 in c}, {s: w for s, w, _ in c}) for c in curves]


def final(evals: dict[int, float], last: int = 3) -> float:
    """The plateau: the mean of a run's last ``last`` evaluations."""
    steps = sorted(evals)[-last:]
    return mean(evals[s] for s in steps)


def arm_results(d: Data) -> dict[str, dict]:
    """Each arm's results JSON that exists (the study writes them as its runs finish)."""
    return {arm: d(P + f"{arm}.json") for arm in ARMS if (d.root / P / f"{arm}.json").is_file()}


def spread(xs: list[float]) -> str:
    """Mean ± sd over seeds; the mean alone for one seed."""
    return mean_sd(xs) if len(xs) > 1 else f(mean(xs))


@table("rl_plateau.arms")
def arms(d: Data) -> str:
    """Each arm: held-out F1 along the run (mean ± sd over seeds), its plateau, the steps and training
    minutes to F1 0.8 (MemOPD's with its teacher's fine-tuning), and the plateau against MemOPD's."""
    got = arm_results(d)
    ref = [final(e) for e, _ in _runs(got["memopd"])] if "memopd" in got else None
    rows = []
    for arm, data in got.items():
        runs = _runs(data)
        fixed = data.get("teacher_sft_s") or 0.0
        along = " / ".join(spread([e[s] for e, _ in runs]) if all(s in e for e, _ in runs) else "–" for s in AT)
        plateau = [final(e) for e, _ in runs]
        reached = [min((s for s in sorted(e) if e[s] >= REACH), default=None) for e, _ in runs]
        hit = [(s, w) for s, (_, w) in zip(reached, runs) if s is not None]
        steps = f"{mean(s for s, _ in hit):.0f} ({len(hit)}/{len(runs)})" if hit else f"never (0/{len(runs)})"
        minutes = f((fixed + mean(w.get(s, max(w.values())) for s, w in hit)) / 60, 1) if hit else "–"
        versus = ("–" if ref is None or arm == "memopd" else f"{mean(plateau) - mean(ref):+.3f}"
                  + (f" ± {diff_se(plateau, ref):.3f}" if min(len(plateau), len(ref)) > 1 else ""))
        rows.append([ARMS[arm], len(runs), along, spread(plateau), steps, minutes,
                     f(fixed / 60, 1) if fixed else "0", versus])
    return md(["arm", "seeds", "held-out F1 at step " + " / ".join(map(str, AT)), "plateau (last 3 evaluations)",
               f"steps to F1 {REACH} (seeds that reach it)", f"minutes to F1 {REACH}, fixed cost in",
               "fixed cost, minutes", "plateau − MemOPD's (± se over seeds)"], rows)
