"""TurnOPD, Prune-OPD and f-OPD, each in a setting that has the problem it targets, first shown by a
positive control, then against vanilla OPD at equal compute.

    python examples/seed_methods.py --study turnopd        # one study of docs/RESULTS.md, 5 seeds
    python examples/seed_methods.py                        # all of them (but turnopd-own)
    python examples/seed_methods.py --smoke --out DIR      # every arm for a step or two (CI)

Every arm (but TurnOPD's, below) starts from one warm student (the embedded default's run,
``memopd.train`` with no flags, stopped at step 25: held-out F1 about 0.3 on LongQA's default,
mid-way up the plateau; built here once, or ``--student``) and learns from one teacher (the
default task's auto teacher, held-out F1 1.0 there). Each arm is its own
``python -m memopd.train``, one torch thread, ``--jobs`` at a time; equal compute is
``--time-budget`` on ``--budget-clock cpu`` (the process's CPU seconds of the steps; evaluations
not counted), so an arm that cuts rollouts runs more steps. Held-out F1 on 128 test episodes
(greedy) through training.

turnopd   12 chunks with the fact always in the first three (``fact_window=3``): the answer is
          decided by call 3, nine memory-copying calls follow before the answer. OPD only
          (``--reward none``: a cut episode has no answer, so no reward, in any arm).
            full      vanilla: token-weighted KL over full rollouts
            cut-4     the positive control: every rollout between probes cut at 4 calls (the depth
                      the fact needs), the depth an oracle would pick. If it does not beat full at
                      equal compute, the late turns are not a waste here and TurnOPD cannot help
            turnopd   TurnOPD: adaptive depth from the probes' KL centroid (``--depth-coverage 0``:
                      on MemAgent every successful trajectory reads every chunk, so the paper's
                      coverage floor would keep the full depth) and progressive loss budgeting
turnopd-own  the same arms with a teacher and a student fine-tuned on this task (:data:`OWN_TEACHER`,
          :data:`OWN_STUDENT`: the auto teacher's recipe, held-out F1 1.0 here, and the tiny
          preset's warm-up), the forward KL (the tiny student's default), lr 2e-3: the shared
          teacher, trained on 3 chunks, reaches only F1 0.73 on 12
pruneopd  LongQA's default (3 chunks); most of the warm student's episodes lose the fact, and the
          aligned teacher then scores an answer from a memory without it: a guess. OPD only.
            vanilla     token-weighted KL on everything
            oracle-drop the positive control: the answer call's distillation dropped where the
                        student's memory lacks the answer (:class:`LostFactDrop`, which also logs
                        how often that is). If it does not beat vanilla, the drift does not hurt
            prune-opd   Prune-OPD at its defaults (top-16 overlap drift events, reliability
                        down-weighting, the call window that grows while episodes stay reliable)
fopd      LongQA's default, PPO + MemOPD, each step trained on the rollouts of S steps before
          (``--simulated-staleness S``), the same steps for every arm
            sync        on-policy (the positive control's reference)
            stale-S     S in {4, 8, 16}, no regulation (the positive control: staleness must hurt)
            fopd-S      the same with f-OPD's freshness weights (``--freshness weight``)
fopd-sampled  the same arms with the sampled-token estimator the paper trains with (its forward
          KL, one PPO epoch a step: docs/teacher.md), where a stale sample's signal rests on the
          importance weight between the current and the behaviour policy

The turnopd and pruneopd studies run at lr 1e-3 (at 2e-3, on 12 chunks, vanilla swung between
held-out F1 0.6 and 0.0 from one evaluation to the next).

Everything lands in --out: warm/ (the warm student), turnopd-own/teacher and turnopd-own/student,
<study>/runs/<arm>/seed-<s>/ (run directories, each log beside it), <study>/results.json (every
number and curve), results.md and curves.png. A rerun skips finished runs and resumes an
unfinished one from its last checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from memopd.learn.plugin import LossWeights, Plugin, WeighContext

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class Study:
    """One study: its task, the flags every arm shares, the arms' own flags, and its budget."""

    title: str
    env_kwargs: dict[str, Any]
    flags: list[str]
    arms: dict[str, list[str]]
    lr: float = 2e-3
    budget_s: float = 0.0  # CPU seconds of training per arm (0: --steps)
    steps: int = 40
    eval_every: int = 10
    own_models: bool = False  # a teacher and a student fine-tuned on the study's own task (else the shared ones)


def stale(s: int, fresh: bool) -> list[str]:
    return ["--simulated-staleness", str(s)] + (["--freshness", "weight"] if fresh else [])


TURN_ARMS = {"full": [],
             "cut-4": ["--adaptive-depth", "--depth-min", "4", "--depth-max", "4"],
             "turnopd": ["--adaptive-depth", "--depth-coverage", "0", "--opd-weighting", "progressive"]}

STUDIES: dict[str, Study] = {
    "turnopd": Study(
        "TurnOPD: 12 chunks, the fact in the first three", {"num_chunks": 12, "fact_window": 3},
        ["--reward", "none", "--questions-per-step", "4", "--steps", "400"], TURN_ARMS,
        lr=1e-3, budget_s=60.0, eval_every=3),
    "turnopd-own": Study(
        "TurnOPD, its own teacher and student: 12 chunks, the fact in the first three",
        {"num_chunks": 12, "fact_window": 3},
        ["--reward", "none", "--questions-per-step", "4", "--steps", "400", "--opd-divergence", "fkl"], TURN_ARMS,
        budget_s=60.0, eval_every=3, own_models=True),
    "pruneopd": Study(
        "Prune-OPD: students whose memory lost the fact", {}, ["--reward", "none", "--steps", "400"],
        {"vanilla": [],
         "oracle-drop": ["--plugin", "examples.seed_methods:LostFactDrop"],
         "prune-opd": ["--prune-opd"]},
        lr=1e-3, budget_s=60.0, eval_every=5),
    "fopd": Study(
        "f-OPD: rollouts S steps stale", {}, [],
        {"sync": [], **{f"stale-{s}": stale(s, False) for s in (4, 8, 16)},
         **{f"fopd-{s}": stale(s, True) for s in (4, 8, 16)}},
        steps=40, eval_every=5),
    "fopd-sampled": Study(
        "f-OPD with the sampled-token estimator: rollouts S steps stale", {},
        ["--opd-estimator", "sampled", "--opd-divergence", "fkl", "--ppo-epochs", "1"],
        {"sync": [], **{f"stale-{s}": stale(s, False) for s in (4, 8, 16)},
         **{f"fopd-{s}": stale(s, True) for s in (4, 8, 16)}},
        steps=40, eval_every=5),
}

DEFAULT_STUDIES = ("turnopd", "pruneopd", "fopd", "fopd-sampled")
"""The studies of docs/RESULTS.md at 5 seeds; turnopd-own ran seed 0 only (``--study turnopd-own --seeds 0``)."""

WARM_STEPS = 25
"""The warm student: the embedded default's run stopped here (held-out F1 about 0.3)."""


class LostFactDrop(Plugin):
    """The Prune-OPD study's positive control: no distillation on the answer call of an episode whose
    final memory lacks every gold answer (the teacher, scoring that state, can only guess). The
    weights are zeroed, not redistributed, so the dropped tokens lower the loss as Prune-OPD's do.
    Logs ``oracle/lost_fact``: the share of episodes whose memory lost (or never had) the fact."""

    name = "lost_fact_drop"

    def weigh(self, weights: LossWeights, ctx: WeighContext) -> dict[str, float]:
        import torch

        lost = [not any(a.lower() in last_memory(e).lower() for a in e.answers) for e in ctx.episodes]
        tm = ctx.batch.token_map
        answer_calls = torch.tensor([next((j for j, inv in enumerate(e.invocations) if inv.role == "answer"), -1)
                                     for e in ctx.episodes], dtype=torch.long)
        lost_t = torch.tensor(lost, dtype=torch.bool)
        drop = lost_t[tm[:, 0]] & (tm[:, 1] == answer_calls[tm[:, 0]])
        weights.opd = weights.opd * (~drop).to(weights.opd.dtype)
        return {"oracle/lost_fact": sum(lost) / max(len(lost), 1),
                "oracle/dropped_tokens": float(drop.sum()) / max(int(tm.shape[0]), 1)}


def last_memory(episode: Any) -> str:
    """The memory the episode answered from: its last memory call's text ('' when it wrote none)."""
    writes = [inv.response_text for inv in episode.invocations if inv.role == "memory"]
    return writes[-1] if writes else ""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default="runs/seed-methods", help="experiment directory")
    ap.add_argument("--study", default=",".join(DEFAULT_STUDIES), help=f"comma-separated, out of {list(STUDIES)}")
    ap.add_argument("--arms", default=None, help="comma-separated arms to run (default: all of each study)")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated RL seeds")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (each a subprocess with one torch thread)")
    ap.add_argument("--eval-episodes", type=int, default=128, help="held-out episodes per evaluation")
    ap.add_argument("--student", default=None, help="the warm student (a model directory or checkpoint; default: "
                    f"built in --out/warm, the embedded default's run stopped at step {WARM_STEPS})")
    ap.add_argument("--teacher", default="auto", help="the teacher of every study (default: the default task's "
                    "auto teacher, also for the 12-chunk study)")
    ap.add_argument("--report-only", action="store_true", help="write the reports from the finished runs")
    ap.add_argument("--smoke", action="store_true", help="a step or two per arm: the path, not the result")
    args = ap.parse_args(argv)
    args.study_list = [s for s in args.study.split(",") if s]
    unknown = sorted(set(args.study_list) - set(STUDIES))
    if unknown:
        ap.error(f"--study: unknown study {unknown}; choose from {list(STUDIES)}")
    args.seed_list = [int(s) for s in args.seeds.split(",") if s]
    args.arm_list = None if args.arms is None else [a for a in args.arms.split(",") if a]
    if args.student is not None and not Path(args.student).exists():
        ap.error(f"--student: {args.student} does not exist (give a model directory or training checkpoint)")
    return args


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], logfile: Path) -> None:
    log("$ python " + " ".join(cmd))
    with logfile.open("a") as fh:  # from the repository root: --plugin examples.seed_methods:... imports
        code = subprocess.call([sys.executable, *cmd], stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    if code != 0:
        raise RuntimeError(f"error: `python {' '.join(cmd)}` failed (exit {code}); its output is in {logfile}")


SMOKE_FLAGS = ["--questions-per-step", "2", "--group-size", "2", "--max-new-tokens", "12", "--eval-every", "1",
               "--sample-episodes", "0"]


def warm_student(out: Path, args: argparse.Namespace) -> str:
    """The embedded default's run stopped at step WARM_STEPS; its checkpoint there."""
    if args.student is not None:
        return str(Path(args.student).resolve())
    steps = 2 if args.smoke else WARM_STEPS
    ckpt = out / "warm" / "checkpoints" / f"step-{steps:06d}"
    if not (out / "warm" / "summary.json").is_file():
        # the run the studies' student came from: 30 steps, checkpoints every 5, the one at 25 taken
        cmd = ["-m", "memopd.train", "--run-dir", str((out / "warm").resolve()), "--steps", str(steps + 5),
               "--save-every", "5", "--keep-checkpoints", "10", "--eval-every", "5", "--threads", "1",
               "--no-progress", "--teacher", args.teacher]
        if (out / "warm" / "checkpoints").is_dir():
            cmd = ["-m", "memopd.train", "--resume", str((out / "warm").resolve()), "--threads", "1", "--no-progress"]
        elif args.smoke:
            cmd += SMOKE_FLAGS + ["--steps", "2", "--save-every", "2", "--student-warmup-steps", "2",
                                  "--eval-episodes", "2"]
        run(cmd, out / "warm.log")
    return str(ckpt.resolve())


OWN_TEACHER = {"model": "tiny-teacher", "num_episodes": 1000, "steps": 250, "batch_episodes": 32, "lr": 3e-3,
               "seed": 1}
"""A study's own teacher: the auto teacher's recipe (``memopd.learn.models.TEACHER_SFT``) on its task."""
OWN_STUDENT = {"model": "tiny", "num_episodes": 1000, "steps": 100, "batch_episodes": 32, "lr": 3e-3,
               "warmup_steps": 10, "seed": 2}
"""A study's own student: the tiny preset's warm-up recipe (``memopd.learn.models.warm_start_student``)
on its task: it has learnt the format and to carry its memory, and seldom writes the fact."""


def sft_model(path: Path, recipe: dict[str, Any], env_kwargs: dict[str, Any], args: argparse.Namespace) -> str:
    """Fine-tune ``recipe`` on oracle trajectories of the study's task, once."""
    if not (path / "config.json").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        if args.smoke:
            recipe = {**recipe, "num_episodes": 4, "steps": 2, "batch_episodes": 2}
        cmd = ["-m", "memopd.sft", "--out", str(path.resolve()), "--threads", "1", "--no-progress"]
        for k, v in recipe.items():
            cmd += ["--" + k.replace("_", "-"), str(v)]
        for k, v in env_kwargs.items():
            cmd += ["--env-kwarg", f"{k}={v}"]
        run(cmd, path.parent / f"{path.name}.log")
    return str(path.resolve())


def teacher_path(args: argparse.Namespace) -> str:
    """The default task's teacher as a path: the 12-chunk study must not build an auto teacher of its own."""
    if args.teacher != "auto":
        return args.teacher
    from memopd.learn.models import ensure_teacher
    from memopd.train import TrainConfig

    return ensure_teacher(TrainConfig(teacher="auto", threads=1), log)


def arm_command(study: Study, arm: str, run_dir: Path, seed: int, student: str, teacher: str,
                args: argparse.Namespace) -> list[str]:
    from memopd.checkpoint import list_checkpoints

    if list_checkpoints(run_dir):
        return ["-m", "memopd.train", "--resume", str(run_dir.resolve()), "--threads", "1", "--no-progress"]
    cmd = ["-m", "memopd.train", "--run-dir", str(run_dir.resolve()), "--seed", str(seed), "--model", student,
           "--teacher", teacher, "--lr", str(study.lr), "--eval-every", str(study.eval_every),
           "--eval-episodes", str(args.eval_episodes), "--threads", "1", "--no-progress", "--save-every", "5",
           "--keep-checkpoints", "1", *study.flags, *study.arms[arm]]
    for k, v in study.env_kwargs.items():
        cmd += ["--env-kwarg", f"{k}={v}"]
    if study.budget_s:
        cmd += ["--time-budget", str(study.budget_s), "--budget-clock", "cpu"]
    else:
        cmd += ["--steps", str(study.steps)]
    if args.smoke:
        cmd += SMOKE_FLAGS + ["--steps", "2", "--time-budget", "0", "--eval-episodes", "2"]
    return cmd


def mean_sd(xs: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def run_record(d: Path) -> dict[str, Any]:
    """One finished run: its held-out curve against steps and training CPU seconds, its cost, and
    the method's own metrics (means over steps)."""
    from memopd.runlog import read_metrics

    rows = read_metrics(d)
    clock = {0: 0.0}
    for r in rows:
        if "train_clock_s" in r:
            clock[r["step"]] = r["train_clock_s"]
    evals = [r for r in rows if "eval/f1" in r]
    steps = [r for r in rows if "step_s" in r]
    s = json.loads((d / "summary.json").read_text())
    keys = sorted({k for r in steps for k in r if k.split("/")[0] in ("depth", "prune", "fresh", "oracle")})
    method = {k: statistics.fmean(r[k] for r in steps if k in r) for k in keys}
    curve = {"step": [r["step"] for r in evals], "seconds": [clock.get(r["step"], 0.0) for r in evals],
             "f1": [r["eval/f1"] for r in evals]}
    return {"before": s["eval_before"]["f1"], "after": s["eval_after"]["f1"],
            "teacher": (s.get("eval_teacher") or {}).get("f1"), "steps": s["steps"], "curve": curve,
            "cpu_s": max(clock.values()), "s_per_step": statistics.fmean(r["step_s"] for r in steps),
            "calls_per_episode": statistics.fmean(r.get("calls_per_episode", 0.0) for r in steps),
            "action_tokens": statistics.fmean(r.get("action_tokens", 0.0) for r in steps), "method": method}


def auc(curve: dict[str, list[float]], horizon: float, by: str) -> float:
    """Mean held-out F1 over [0, horizon] (trapezoids; the last value held to the horizon)."""
    xs, ys = list(curve[by]), list(curve["f1"])
    if not xs or horizon <= 0:
        return float("nan")
    if xs[-1] < horizon:
        xs, ys = xs + [horizon], ys + [ys[-1]]
    area = 0.0
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        hi = min(x1, horizon)
        if hi > x0:  # a segment past the horizon is cut there, at its interpolated value
            y_hi = y0 + (y1 - y0) * (hi - x0) / (x1 - x0)
            area += (hi - x0) * (y0 + y_hi) / 2
    return area / horizon


def report(name: str, out: Path, args: argparse.Namespace) -> dict[str, Any] | None:
    study = STUDIES[name]
    runs: dict[str, dict[str, Any]] = {}
    for arm in study.arms:
        for seed in args.seed_list:
            d = out / "runs" / arm / f"seed-{seed}"
            if (d / "summary.json").is_file():
                runs.setdefault(arm, {})[str(seed)] = run_record(d)
    if not runs:
        return None
    by = "seconds" if study.budget_s else "step"
    horizon = study.budget_s or float(study.steps)
    table = {}
    for arm, per in runs.items():
        rs = list(per.values())
        table[arm] = {"after": mean_sd([r["after"] for r in rs]),
                      "auc": mean_sd([auc(r["curve"], horizon, by) for r in rs]),
                      "steps": mean_sd([float(r["steps"]) for r in rs]),
                      "s_per_step": mean_sd([r["s_per_step"] for r in rs]),
                      "calls_per_episode": statistics.fmean(r["calls_per_episode"] for r in rs),
                      "before": rs[0]["before"], "teacher": rs[0]["teacher"],
                      "method": {k: statistics.fmean(r["method"].get(k, float("nan")) for r in rs)
                                 for k in rs[0]["method"]}}
    results = {"study": name, "title": study.title, "env_kwargs": study.env_kwargs, "flags": study.flags,
               "arms": study.arms, "lr": study.lr, "budget_cpu_s": study.budget_s, "steps": study.steps,
               "seeds": args.seed_list,
               "eval_episodes": args.eval_episodes, "smoke": args.smoke, "auc_by": by, "table": table, "runs": runs,
               "command": f"python examples/seed_methods.py --study {name}"}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    unit = "CPU seconds" if study.budget_s else "steps"
    lines = [f"{study.title}. Held-out F1 ({args.eval_episodes} test episodes, greedy), mean +- sd over seeds; "
             f"AUC: mean F1 over the first {horizon:g} {unit}.", "",
             "| arm | seeds | F1 before | F1 after | AUC | steps | s / step | calls / episode |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, t in table.items():
        lines.append(f"| {arm} | {t['after']['n']} | {t['before']:.3f} | "
                     f"{t['after']['mean']:.3f} +- {t['after']['sd']:.3f} | "
                     f"{t['auc']['mean']:.3f} +- {t['auc']['sd']:.3f} | {t['steps']['mean']:.1f} | "
                     f"{t['s_per_step']['mean']:.2f} | {t['calls_per_episode']:.2f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plot(runs, by, study.title, out / "curves.png")
    return results


def plot(runs: dict[str, dict[str, Any]], by: str, title: str, path: Path) -> None:
    """Held-out F1 by step or CPU seconds: each seed thin, the mean over seeds (where their
    evaluation points agree) thick, one colour per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (arm, per), colour in zip(runs.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        curves = [r["curve"] for r in per.values()]
        for c in curves:
            ax.plot(c[by], c["f1"], color=colour, alpha=0.25, linewidth=0.8)
        n = min(len(c["f1"]) for c in curves)
        xs = [statistics.fmean(c[by][i] for c in curves) for i in range(n)]
        ax.plot(xs, [statistics.fmean(c["f1"][i] for c in curves) for i in range(n)], color=colour, linewidth=2,
                label=f"{arm} ({len(curves)} seed{'s' * (len(curves) > 1)})")
    ax.set_xlabel("training CPU seconds" if by == "seconds" else "training step")
    ax.set_ylabel("held-out F1")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        own = [name for name in args.study_list if STUDIES[name].own_models]
        shared = [name for name in args.study_list if name not in own]
        student, teacher = (warm_student(out, args), teacher_path(args)) if shared else ("", "")
        models = {name: (student, teacher) for name in shared}
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:  # their teachers and students side by side
            built = {(name, who): pool.submit(sft_model, out / name / who, recipe, STUDIES[name].env_kwargs, args)
                     for name in own for who, recipe in (("teacher", OWN_TEACHER), ("student", OWN_STUDENT))}
            for name in own:
                models[name] = (built[name, "student"].result(), built[name, "teacher"].result())
        todo = [(name, arm, seed) for seed in args.seed_list for name in args.study_list  # whole seeds first
                for arm in STUDIES[name].arms if args.arm_list is None or arm in args.arm_list
                if not (out / name / "runs" / arm / f"seed-{seed}" / "summary.json").is_file()]
        lock, failed = threading.Lock(), []

        def one(name: str, arm: str, seed: int) -> None:
            d = out / name / "runs" / arm / f"seed-{seed}"
            d.parent.mkdir(parents=True, exist_ok=True)
            try:
                run(arm_command(STUDIES[name], arm, d, seed, *models[name], args), d.parent / f"seed-{seed}.log")
            except RuntimeError as exc:
                with lock:
                    failed.append(str(exc))
            with lock:  # the reports as runs finish, so a long study commits as it goes
                report(name, out / name, args)

        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for f in [pool.submit(one, *t) for t in todo]:
                f.result()
        if failed:
            for msg in failed:
                print(msg, file=sys.stderr)
            return 1
    for name in args.study_list:
        if report(name, out / name, args):
            print((out / name / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
