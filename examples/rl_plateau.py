"""The RL objectives to a plateau from the mid-plateau start, against PPO + MemOPD.

    python examples/rl_plateau.py --out runs/ppo-collapse          # resumable; the start is shared
    python examples/rl_plateau.py --out runs/ppo-collapse --seeds 0,1 --arms ppo,memopd

Arms (each from the start of examples/ppo_collapse.py, 4 questions x 8 samples a step, 2 epochs):

  ppo      PPO alone, the default objective, lr 2e-4 (the learning rate at which PPO learns)
  dapo     DAPO: token-mean aggregation, clip-higher 0.28, dynamic sampling, overlong shaping, lr 2e-4
  gspo     GSPO: the per-call sequence ratio, its clip (3e-4 / 4e-4), sequence-mean aggregation, lr 2e-4
  memopd   PPO + MemOPD at lr 2e-3 with the forward KL, as in the baselines study's "PPO with a
           signal"; its teacher is that study's fair teacher, rebuilt by its recipe: `tiny-teacher`
           fine-tuned on oracle calls of the 3-chunk task (250 steps of 32, lr 3e-3), then further on
           both kinds of state of the 6-chunk task (150 steps, lr 1e-3); the two fine-tunings'
           wall-clock is recorded as MemOPD's fixed cost. (Built from scratch in both contexts at once,
           as this script first did, the teacher stays on its copy plateau, F1 0.086, and MemOPD with
           it drives the student to 0.000.)

Seeds run in order, every arm of a seed before the next seed; each arm's results JSON
(docs/data/rl_plateau/<arm>.json by default; every step's ``KEPT`` metrics, to 6 significant digits)
is rewritten after every run, so a partial study has its finished runs on disk. A killed study
resumes where it stopped (finished runs are kept, an unfinished one resumes from its last
checkpoint).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ppo_collapse, beside this file

ARMS = {
    "ppo": ("2e-4", []),
    "dapo": ("2e-4", ["--loss-agg", "token", "--clip-eps-high", "0.28", "--dynamic-sampling", "--overlong-buffer", "8"]),
    "gspo": ("2e-4", ["--importance-level", "sequence", "--loss-agg", "sequence", "--clip-eps", "0.0003",
                      "--clip-eps-high", "0.0004"]),
    "memopd": ("2e-3", ["--opd-coef", "1", "--opd-divergence", "fkl"]),
}


KEPT = ("step", "reward", "entropy", "kl_to_start", "clip_frac", "step_s", "eval/f1")
"""The per-step metrics the results JSON keeps (the curves need step_s and eval/f1; the others read a
run's health: its reward, entropy, drift from the start and clipping)."""


def rounded(value: Any, digits: int = 6) -> Any:
    """``value`` with every float to ``digits`` significant digits (the tables print 3 decimals)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v, digits) for v in value]
    return value


def build_teacher(out: Path, threads: int) -> tuple[Path, float]:
    """The fair teacher (reused when it exists) and its two fine-tunings' wall-clock seconds."""
    from memopd.sft import SFTConfig, run as run_sft

    from ppo_collapse import ENV, ENV_KWARGS

    path, cost = out / "teacher-both", out / "teacher-both.json"
    if not (path / "config.json").is_file():
        t0 = time.perf_counter()
        aligned = out / "teacher-aligned"
        if not (aligned / "config.json").is_file():
            run_sft(SFTConfig(model="tiny-teacher", out=str(aligned), env=ENV,
                              env_kwargs={**ENV_KWARGS, "num_chunks": 3}, num_episodes=1000, steps=250,
                              batch_episodes=32, lr=3e-3, warmup_steps=20, seed=1000, threads=threads), progress=False)
        run_sft(SFTConfig(model=str(aligned), out=str(path), env=ENV, env_kwargs=ENV_KWARGS, num_episodes=1000,
                          steps=150, batch_episodes=32, lr=1e-3, warmup_steps=20, seed=1001, threads=threads,
                          context="both"), progress=False)
        cost.write_text(json.dumps({"sft_s": time.perf_counter() - t0}))
    return path, json.loads(cost.read_text())["sft_s"]


def curve(run: dict, offset_s: float = 0.0) -> list[tuple[int, float, float]]:
    """(step, wall-clock seconds, held-out F1) at each evaluation of a run: the seconds are the
    training steps' own (``step_s`` summed, evaluations not counted) after ``offset_s`` (MemOPD's
    teacher fine-tuning, its fixed cost)."""
    spent, walls = offset_s, {0: offset_s}
    for r in sorted((r for r in run["rows"] if "step_s" in r), key=lambda r: r["step"]):
        spent += r["step_s"]
        walls[r["step"]] = spent
    return [(r["step"], walls.get(r["step"], spent), r["eval/f1"]) for r in run["rows"] if "eval/f1" in r]


def mean_curve(data: dict) -> tuple[list[int], list[float], list[float], list[float]]:
    """An arm's steps evaluated in every run, mean wall-clock, mean F1 and F1's sd over the runs."""
    runs = [curve(run, data.get("teacher_sft_s") or 0.0) for run in data["runs"].values()]
    steps = sorted(set.intersection(*[{s for s, _, _ in c} for c in runs])) if runs else []
    walls, means, sds = [], [], []
    for step in steps:
        at = [next((w, f) for s, w, f in c if s == step) for c in runs]
        fs = [f for _, f in at]
        mu = sum(fs) / len(fs)
        walls.append(sum(w for w, _ in at) / len(at))
        means.append(mu)
        sds.append((sum((x - mu) ** 2 for x in fs) / (len(fs) - 1)) ** 0.5 if len(fs) > 1 else 0.0)
    return steps, walls, means, sds


def plot(arms: dict[str, dict], path: Path) -> None:
    """Held-out F1 of each arm (mean, ±sd band over seeds) against the step and against training
    wall-clock minutes (MemOPD's from its teacher's fine-tuning on)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_wall) = plt.subplots(1, 2, figsize=(11, 4))
    for arm, data in arms.items():
        steps, walls, means, sds = mean_curve(data)
        n = len(data["runs"])
        lo, hi = [m - s for m, s in zip(means, sds)], [m + s for m, s in zip(means, sds)]
        (line,) = by_step.plot(steps, means, marker=".", label=f"{arm} ({n} seed{'s' * (n > 1)})")
        by_step.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
        minutes = [w / 60 for w in walls]
        by_wall.plot(minutes, means, marker=".", color=line.get_color())
        by_wall.fill_between(minutes, lo, hi, color=line.get_color(), alpha=0.15)
    by_step.set_xlabel("step")
    by_wall.set_xlabel("training wall-clock, minutes (MemOPD's teacher fine-tuning counted)")
    for ax in (by_step, by_wall):
        ax.set_ylabel("held-out F1")
        ax.set_ylim(-0.02, 1.02)
    by_step.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/ppo-collapse", help="experiment directory (its start is shared)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms out of {list(ARMS)}")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated RL seeds")
    ap.add_argument("--steps", type=int, default=400, help="steps per run")
    ap.add_argument("--eval-every", type=int, default=20, help="held-out evaluation every N steps")
    ap.add_argument("--eval-episodes", type=int, default=128, help="held-out episodes per evaluation")
    ap.add_argument("--data", default="docs/data/rl_plateau", help="where each arm's results JSON goes")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)
    import ppo_collapse

    out, seeds = Path(args.out), [s for s in args.seeds.split(",")]
    for k in range(len(seeds)):
        for arm in args.arms.split(","):
            lr, flags = ARMS[arm]
            extra = list(flags)
            cost = None
            if arm == "memopd":
                teacher, cost = build_teacher(out, args.threads)
                extra += ["--teacher", str(teacher)]
            dest = Path(args.data) / f"{arm}.json"
            ppo_collapse.main(["--out", str(out), "--name", f"plateau-{arm}", "--lrs", lr,
                               "--seeds", ",".join(seeds[:k + 1]), "--steps", str(args.steps),
                               "--eval-every", str(args.eval_every), "--eval-episodes", str(args.eval_episodes),
                               "--threads", str(args.threads), "--results", str(dest), "--", *extra])
            data = json.loads(dest.read_text())
            data.update({"arm": arm, "teacher_sft_s": cost,
                         "command": "python examples/rl_plateau.py " + " ".join(sys.argv[1:])})
            for run in data["runs"].values():  # every step of every run, compactly (the run directories keep the rest)
                run["rows"] = [{k: v for k, v in row.items() if k in KEPT} for row in run["rows"]]
            dest.write_text(json.dumps(rounded(data), separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
