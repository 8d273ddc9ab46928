"""Asynchronous rollouts and f-OPD at CPU scale: how stale samples change learning, and what Ray's overlap buys.

    python examples/async_fopd.py --async-seeds 0,1,2  # the experiment of docs/RESULTS.md
    python examples/async_fopd.py --smoke --out DIR    # the pipeline in well under a minute (CI)

One LongQA setting where memory matters and the tiny models learn in a minute of CPU (the one of
examples/reproduce_memopd.py): one fact hidden in one of 6 chunks of 48 tokens, a 16-token memory,
the answer written from the memory alone. Steps:

  1. teacher   `tiny-teacher` fine-tuned by memopd.sft on 1,000 oracle trajectories (250 steps of 32)
  2. student   the `tiny` preset warm-started by memopd.sft on oracle trajectories (200 steps of 32):
               the format and the person's name, not yet the fact. Both SFTs use the task with 3
               chunks (`sft_chunks`, see examples/reproduce_memopd.py). Every run starts from this one
               student with this one teacher, so the seeds vary the RL
  3. objective side (`sim`): PPO + MemOPD (`python -m memopd.train`, forward KL, state-aligned teacher)
               at the same compute budget, `--time-budget T --budget-clock cpu` (the process's CPU
               seconds of the training steps, one torch thread, evaluations not counted):
                 sync          on-policy (S = 0)
                 S<k>          --simulated-staleness k: each step trains on the rollouts of k steps before
                 S<k>+fresh    the same with --freshness weight (f-OPD's per-sample freshness weight)
               for k = 1, 2, 4, over seeds. Synchronous simulation: the system's overlap is left out, the
               objective's response to stale samples is all that differs
  4. system side (`async`): a fixed number of steps, wall-clock time: the synchronous trainer vs
               `--async-rollouts --max-staleness k --freshness weight` (one Ray rollout worker) for
               k = 1, 2, 4: episodes per second, measured lag, the learner's wait, final F1
  5. report    held-out F1 against training CPU seconds and against episodes trained on (mean ± std
               over seeds), the staleness and freshness each config measured, the async table

Everything lands in --out (default runs/async-fopd): teacher/ and student/ (shared by every run),
runs/sim/<config>/seed-<s>/ and runs/async/<config>/seed-<s>/ (run directories; each async run has
a train.log and wall.json beside it), results.json, results.md and curves.png. A rerun reuses
finished runs and resumes an unfinished one from its last checkpoint. Simulated runs go `--jobs` at
a time (1: in this process; more: subprocesses, one torch thread each); async runs always run one
at a time, each `python -m memopd.train` in a subprocess of its own (Ray is started and shut down
by it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

ENV = "memgym/LongQA-v0"
ENV_KWARGS = {"num_chunks": 6, "chunk_size": 48, "memory_budget": 16}
SMOKE_ENV_KWARGS = {"num_chunks": 3, "chunk_size": 24, "memory_budget": 16}

SIM_ARMS: dict[str, tuple[int, str]] = {
    "sync": (0, "off"),
    "S1": (1, "off"), "S1+fresh": (1, "weight"),
    "S2": (2, "off"), "S2+fresh": (2, "weight"),
    "S4": (4, "off"), "S4+fresh": (4, "weight"),
}
"""Objective side: config -> (--simulated-staleness, --freshness)."""

ASYNC_ARMS: dict[str, int | None] = {"sync": None, "async-S1": 1, "async-S2": 2, "async-S4": 4}
"""System side: config -> --max-staleness of --async-rollouts (None: the synchronous trainer)."""

SMOKE_SIM_ARMS = ["sync", "S2", "S2+fresh"]
SMOKE_ASYNC_ARMS = ["sync", "async-S2"]
"""What --smoke runs (each config's pipeline is the same; the smoke checks it, not every value)."""

REUSED: list[str] = []


@dataclasses.dataclass
class Budget:
    """What every run gets, and the models they share."""

    time_budget: float = 75.0
    steps: int = 400
    questions_per_step: int = 4
    group_size: int = 4
    ppo_epochs: int = 2
    lr: float = 2e-3
    rl_warmup_steps: int = 3
    max_new_tokens: int = 24
    eval_every: int = 5
    eval_episodes: int = 32
    async_steps: int = 40
    async_eval_every: int = 10
    rollout_workers: int = 1
    async_timeout: float = 900.0
    sft_chunks: int = 3
    teacher_steps: int = 250
    teacher_batch: int = 32
    teacher_episodes: int = 1000
    warmup_steps: int = 200
    warmup_batch: int = 32


SMOKE = Budget(time_budget=600.0, steps=2, questions_per_step=2, group_size=2, ppo_epochs=1, rl_warmup_steps=0,
               max_new_tokens=8, eval_every=0, eval_episodes=2, async_steps=3, async_eval_every=0,
               async_timeout=240.0, sft_chunks=2, teacher_steps=2, teacher_batch=2, teacher_episodes=4,
               warmup_steps=2, warmup_batch=2)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default="runs/async-fopd", help="experiment directory")
    ap.add_argument("--parts", default="sim,async", help="comma-separated parts out of ['sim', 'async']")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds of the simulated-staleness runs")
    ap.add_argument("--async-seeds", default="0", help="comma-separated seeds of the async runs")
    ap.add_argument("--sim-arms", help=f"comma-separated configs out of {list(SIM_ARMS)} (default: all; smoke: "
                                       f"{','.join(SMOKE_SIM_ARMS)})")
    ap.add_argument("--async-arms", help=f"comma-separated configs out of {list(ASYNC_ARMS)} (default: all; smoke: "
                                         f"{','.join(SMOKE_ASYNC_ARMS)})")
    ap.add_argument("--jobs", type=int, default=1, help="simulated runs at a time (1: in this process; more: "
                                                        "subprocesses with one torch thread each)")
    ap.add_argument("--smoke", action="store_true", help="a tiny budget that checks the pipeline, not the result")
    for f in dataclasses.fields(Budget):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None,
                        help=f"override the budget's {f.name} (default {f.default}; smoke {getattr(SMOKE, f.name)})")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # sim/<config>/<seed>: one simulated run (a --jobs worker)
    args = ap.parse_args(argv)
    args.part_list = [p for p in args.parts.split(",") if p]
    if args.sim_arms is None:
        args.sim_arms = ",".join(SMOKE_SIM_ARMS if args.smoke else SIM_ARMS)
    if args.async_arms is None:
        args.async_arms = ",".join(SMOKE_ASYNC_ARMS if args.smoke else ASYNC_ARMS)
    args.sim_list = [a for a in args.sim_arms.split(",") if a]
    args.async_list = [a for a in args.async_arms.split(",") if a]
    for name, given, known in (("--parts", args.part_list, ["sim", "async"]), ("--sim-arms", args.sim_list, SIM_ARMS),
                               ("--async-arms", args.async_list, ASYNC_ARMS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            ap.error(f"{name}: unknown value(s) {unknown}; choose from {list(known)}")
    base = SMOKE if args.smoke else Budget()
    args.budget = dataclasses.replace(base, **{f.name: getattr(args, f.name) for f in dataclasses.fields(Budget)
                                               if getattr(args, f.name) is not None})
    args.env_kwargs = SMOKE_ENV_KWARGS if args.smoke else ENV_KWARGS
    args.seed_list = [int(s) for s in args.seeds.split(",") if s != ""]
    args.async_seed_list = [int(s) for s in args.async_seeds.split(",") if s != ""]
    return args


# ------------------------------------------------------------------------------------------------
# 1-2. the shared teacher and warm student
# ------------------------------------------------------------------------------------------------

def sft_model(model: str, path: Path, steps: int, batch: int, episodes: int, seed: int,
              args: argparse.Namespace) -> Path:
    """memopd.sft on oracle trajectories of the task with ``sft_chunks`` chunks (reused when built)."""
    from memopd.sft import SFTConfig, run as run_sft

    b = args.budget
    if (path / "config.json").is_file():
        print(f"{path.name}: reusing {path}", file=sys.stderr, flush=True)
        REUSED.append(path.name)
        return path
    print(f"{path.name}: SFT of {model}, {steps} steps of {batch} oracle trajectories ({b.sft_chunks} chunks)",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    run_sft(SFTConfig(model=model, out=str(path), env=ENV, env_kwargs={**args.env_kwargs, "num_chunks": b.sft_chunks},
                      num_episodes=episodes, steps=steps, batch_episodes=batch, lr=3e-3,
                      warmup_steps=min(20, steps // 5), seed=seed, threads=1), progress=False)
    print(f"{path.name}: built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return path


def heldout(model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    """Held-out F1/EM of a model on the experiment's task, its own greedy rollouts (cached in heldout.json)."""
    cached = model_dir / "heldout.json"
    if not cached.is_file():
        from agents.models import load
        from memopd.learn.actor import Actor
        from memopd.train import TrainConfig

        model, tok = load(model_dir)
        cfg = TrainConfig(env=ENV, env_kwargs=args.env_kwargs, eval_episodes=args.budget.eval_episodes,
                          max_new_tokens=args.budget.max_new_tokens, progress=False)
        cached.write_text(json.dumps(Actor(cfg, model, tok).evaluate()))
    return json.loads(cached.read_text())


# ------------------------------------------------------------------------------------------------
# 3-4. the runs
# ------------------------------------------------------------------------------------------------

def run_path(out: Path, part: str, arm: str, seed: int) -> Path:
    return out / "runs" / part / arm / f"seed-{seed}"


def common_options(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig fields every run shares (PPO + MemOPD from the one warm student and teacher)."""
    b, out = args.budget, Path(args.out)
    return {"env": ENV, "env_kwargs": dict(args.env_kwargs), "model": str(out / "student"),
            "teacher": str(out / "teacher"), "student_warmup_steps": 0, "opd_divergence": "fkl", "seed": seed,
            "threads": 1, "progress": False, "questions_per_step": b.questions_per_step, "group_size": b.group_size,
            "ppo_epochs": b.ppo_epochs, "lr": b.lr, "warmup_steps": b.rl_warmup_steps,
            "max_new_tokens": b.max_new_tokens, "eval_episodes": b.eval_episodes, "save_every": 5,
            "audit_every": 0}


def sim_options(arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    b = args.budget
    staleness, freshness = SIM_ARMS[arm]
    return {**common_options(seed, args), "steps": b.steps, "eval_every": b.eval_every,
            "time_budget": b.time_budget, "budget_clock": "cpu", "simulated_staleness": staleness,
            "freshness": freshness}


def async_options(arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    b = args.budget
    opts = {**common_options(seed, args), "steps": b.async_steps, "eval_every": b.async_eval_every,
            "budget_clock": "wall"}
    if ASYNC_ARMS[arm] is not None:
        opts.update(async_rollouts=True, max_staleness=ASYNC_ARMS[arm], freshness="weight",
                    rollout_workers=b.rollout_workers)
    return opts


def to_flags(opts: dict[str, Any]) -> list[str]:
    """``memopd.train`` flags for TrainConfig fields."""
    flags: list[str] = []
    for key, value in opts.items():
        if key == "env_kwargs":
            for k, v in value.items():
                flags += ["--env-kwarg", f"{k}={v}"]
        elif isinstance(value, bool):
            flags.append(("--" if value else "--no-") + key.replace("_", "-"))
        else:
            flags += ["--" + key.replace("_", "-"), str(value)]
    return flags


def has_checkpoint(run_dir: Path) -> bool:
    return (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())


def run_sim_here(arm: str, seed: int, args: argparse.Namespace) -> Path:
    """One simulated-staleness run in this process (resumed from its checkpoint when it has one)."""
    from memopd.train import TrainConfig, Trainer, prepare

    run_dir = run_path(Path(args.out), "sim", arm, seed)
    cfg = TrainConfig(**sim_options(arm, seed, args), run_dir=str(run_dir))
    if has_checkpoint(run_dir):
        cfg = dataclasses.replace(cfg, resume=str(run_dir))
    cfg = prepare(cfg, explicit={"progress", "threads"})
    log = run_dir.parent / f"seed-{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as fh:
        def say(m: str) -> None:
            print(f"   {m}", file=sys.stderr, flush=True)
            print(m, file=fh, flush=True)

        Trainer(cfg, log=say).fit()
    return run_dir


def run_sim(arm: str, seed: int, args: argparse.Namespace) -> Path:
    """One simulated run: reused when finished; with --jobs > 1 in a subprocess of this script."""
    run_dir = run_path(Path(args.out), "sim", arm, seed)
    if (run_dir / "summary.json").is_file():
        REUSED.append(f"sim/{arm}/seed-{seed}")
        return run_dir
    print(f"== sim {arm} seed {seed}" + ("  (resuming)" if has_checkpoint(run_dir) else ""), file=sys.stderr,
          flush=True)
    t0 = time.perf_counter()
    if args.jobs <= 1:
        run_sim_here(arm, seed, args)
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one", f"sim/{arm}/{seed}", "--out", args.out]
        cmd += ["--smoke"] if args.smoke else []
        for f in dataclasses.fields(Budget):
            cmd += ["--" + f.name.replace("_", "-"), str(getattr(args.budget, f.name))]
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"sim {arm} seed {seed} failed (exit {done.returncode}); see "
                               f"{run_dir.parent / f'seed-{seed}.log'}")
    print(f"   sim {arm} seed {seed}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return run_dir


def stop(proc: subprocess.Popen) -> None:
    """Interrupt a run's process group (the trainer then shuts its Ray workers down), kill it if it lingers."""
    for sig, wait in ((signal.SIGINT, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_async(arm: str, seed: int, args: argparse.Namespace) -> Path:
    """One system-side run: ``python -m memopd.train`` in a subprocess (its wall time in wall.json)."""
    run_dir = run_path(Path(args.out), "async", arm, seed)
    if (run_dir / "summary.json").is_file():
        REUSED.append(f"async/{arm}/seed-{seed}")
        return run_dir
    resume = has_checkpoint(run_dir)
    cmd = [sys.executable, "-m", "memopd.train", *to_flags(async_options(arm, seed, args))]
    cmd += ["--resume", str(run_dir)] if resume else ["--run-dir", str(run_dir)]
    print(f"== async {arm} seed {seed}" + ("  (resuming)" if resume else ""), file=sys.stderr, flush=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    wall_file = run_dir.parent / f"seed-{seed}.wall.json"
    walls = json.loads(wall_file.read_text()) if wall_file.is_file() else []
    t0 = time.perf_counter()
    with (run_dir.parent / f"seed-{seed}.log").open("a") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            rc = proc.wait(args.budget.async_timeout)
        except subprocess.TimeoutExpired:
            stop(proc)
            rc = None
        except BaseException:
            stop(proc)
            raise
    walls.append({"wall_s": time.perf_counter() - t0, "rc": rc, "resumed": resume})
    wall_file.write_text(json.dumps(walls, indent=2))
    if rc != 0:
        why = f"timed out after {args.budget.async_timeout:.0f} s" if rc is None else f"failed (exit {rc})"
        raise RuntimeError(f"async {arm} seed {seed} {why}; see {run_dir.parent / f'seed-{seed}.log'}")
    print(f"   async {arm} seed {seed}: done in {walls[-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    return run_dir


# ------------------------------------------------------------------------------------------------
# 5. the report
# ------------------------------------------------------------------------------------------------

def mean_std(xs: Sequence[float | None]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not xs:
        return float("nan"), float("nan")
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0


def run_stats(run_dir: Path, episodes_per_step: int) -> dict[str, Any]:
    """One run's held-out curve (by step, training clock and episodes trained on) and its means."""
    from memopd.runlog import read_metrics

    rows = list(read_metrics(run_dir))
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [r for r in rows if "train_clock_s" in r]
    clock = {0: 0.0, **{r["step"]: r["train_clock_s"] for r in steps}}
    curve: dict[str, list[float]] = {"step": [], "clock_s": [], "episodes": [], "f1": []}
    for r in rows:
        if "eval/f1" in r:
            curve["step"].append(r["step"])
            curve["clock_s"].append(clock.get(r["step"], 0.0))
            curve["episodes"].append(r["step"] * episodes_per_step)
            curve["f1"].append(r["eval/f1"])

    def vals(key: str, rows_: list[dict[str, Any]] = steps) -> list[float]:
        return [r[key] for r in rows_ if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]

    def avg(key: str, rows_: list[dict[str, Any]] = steps) -> float | None:
        v = vals(key, rows_)
        return sum(v) / len(v) if v else None

    n = len(steps)
    clock_s = steps[-1]["train_clock_s"] if steps else 0.0
    later = steps[1:]  # without the first step (it waits for the Ray workers to start)
    later_s = clock_s - steps[0]["train_clock_s"] if steps else 0.0
    return {"f1_before": summary["eval_before"]["f1"], "f1_after": summary["eval_after"]["f1"],
            "f1_late": sum(curve["f1"][-3:]) / len(curve["f1"][-3:]) if curve["f1"] else None,
            "f1_teacher": (summary.get("eval_teacher") or {}).get("f1"), "steps": n, "clock_s": clock_s,
            "episodes": n * episodes_per_step,
            "episodes_per_s": n * episodes_per_step / clock_s if clock_s else None,
            "episodes_per_s_after_first": len(later) * episodes_per_step / later_s if later and later_s else None,
            "step_s": clock_s / n if n else None,
            "train_f1": avg("f1"), "lag": avg("fresh/lag"), "drift": avg("fresh/drift"), "score": avg("fresh/score"),
            "async_lag_mean": avg("async/lag_mean"), "async_lag_max": max(vals("async/lag_max"), default=None),
            "async_episodes_per_s": avg("async/episodes_per_s", later),
            "wait_s": sum(vals("async/wait_s")) if vals("async/wait_s") else None,
            "wait_s_first": steps[0].get("async/wait_s") if steps else None,
            "dropped_stale": sum(vals("async/dropped_stale")) if vals("async/dropped_stale") else None,
            "worker_restarts": max(vals("async/worker_restarts"), default=None), "curve": curve}


def process_wall(run_dir: Path) -> float | None:
    f = run_dir.parent / f"{run_dir.name}.wall.json"
    return sum(w["wall_s"] for w in json.loads(f.read_text())) if f.is_file() else None


def fmt(ms: tuple[float, float] | float | None, digits: int = 3) -> str:
    if ms is None:
        return "–"
    if isinstance(ms, tuple):
        m, sd = ms
        return "–" if math.isnan(m) else f"{m:.{digits}f} ± {sd:.{digits}f}"
    return "–" if isinstance(ms, float) and math.isnan(ms) else f"{ms:.{digits}f}"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = [("sim", "clock_s", "training CPU seconds (1 thread; evaluations excluded)"),
              ("sim", "episodes", "episodes trained on"),
              ("async", "clock_s", "training wall seconds (rollout + update; evaluations excluded)")]
    panels = [p for p in panels if results.get(p[0])]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 3.9), sharey=True, squeeze=False)
    for ax, (part, key, xlabel) in zip(axes[0], panels):
        for i, (arm, row) in enumerate(results[part]["arms"].items()):
            curves = [r["curve"] for r in row["runs"]]
            end = max(max(c[key]) for c in curves)
            grid = np.linspace(0, end, 60)
            f1 = np.array([np.interp(grid, c[key], c["f1"], right=np.nan) for c in curves])
            ok = ~np.isnan(f1).any(0)
            m = f1[:, ok].mean(0)
            sd = f1[:, ok].std(0, ddof=1) if len(f1) > 1 else np.zeros_like(m)
            style = "--" if arm.endswith("+fresh") else "-"
            color = f"C{[0, 1, 1, 2, 2, 3, 3][list(SIM_ARMS).index(arm)]}" if part == "sim" else f"C{i}"
            line, = ax.plot(grid[ok], m, style, color=color, label=f"{arm} (n={len(curves)})")
            if len(curves) > 1:
                ax.fill_between(grid[ok], m - sd, m + sd, color=line.get_color(), alpha=0.1)
        if results.get("teacher_f1") is not None:
            ax.axhline(results["teacher_f1"], color="k", ls=":", lw=1, label="teacher")
        ax.set_title("simulated staleness (same CPU budget)" if part == "sim" else
                     "real async on Ray vs sync (wall-clock, fixed steps)", fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("held-out F1 (mean ± std over seeds)")
    fig.suptitle(f"{ENV} {json.dumps(results['env_kwargs'])}, PPO + MemOPD (forward KL)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(results: dict[str, Any]) -> str:
    b = results["budget"]
    lines = [f"{ENV} {json.dumps(results['env_kwargs'])}; PPO + MemOPD (forward KL, state-aligned teacher), "
             f"{b['questions_per_step']} questions x {b['group_size']} samples a step, {b['ppo_epochs']} PPO "
             f"epochs, lr {b['lr']}; held-out F1 on {b['eval_episodes']} test episodes (greedy). Teacher "
             f"{fmt(results.get('teacher_f1'))}, warm student {fmt(results.get('student_f1'))}."]
    sim = results.get("sim")
    if sim:
        lines += ["", f"**Objective side** (simulated staleness): budget {b['time_budget']:g} training CPU "
                      f"seconds a run (one thread; evaluations every {b['eval_every']} steps not counted); mean ± "
                      f"std over seeds {sim['seeds']}. Lag, drift and freshness: means over each run's steps, "
                      "then over seeds "
                      "(drift and freshness are computed only with `--freshness weight`). Last 3 evals: the mean "
                      "of each run's last three held-out evaluations (the final one included), a steadier plateau "
                      "than one 32-episode evaluation.", "",
                  "| config | final F1 | per seed | last 3 evals | steps | episodes trained on | CPU s / step | "
                  "fresh/lag | fresh/drift | fresh/score |", "|---|---|---|---|---|---|---|---|---|---|"]
        for arm, row in sim["arms"].items():
            per = ", ".join(f"{r['f1_after']:.3f}" for r in row["runs"])
            lines.append(f"| {arm} | {fmt(row['f1'])} | {per} | {fmt(row['f1_late'])} | {fmt(row['steps'], 1)} | "
                         f"{fmt(row['episodes'], 0)} | {fmt(row['step_s'], 2)} | {fmt(row['lag'], 2)} | "
                         f"{fmt(row['drift'], 3)} | "
                         f"{fmt(row['score'], 3)} |")
    asy = results.get("async")
    if asy:
        lines += ["", f"**System side** (wall-clock): {b['async_steps']} steps a run, {b['rollout_workers']} Ray "
                      f"rollout worker(s), `--freshness weight` on the async runs; seeds {asy['seeds']} (mean "
                      "± std when several). "
                      "Episodes/s: episodes trained on per second of training wall-clock (evaluations excluded), "
                      "overall and without the first step (which waits for the workers to start).", "",
                  "| config | final F1 | steps | train wall s | process wall s | episodes/s | episodes/s after "
                  "step 1 | workers' episodes/s | async/lag_mean | lag max | wait s (first step) | dropped | "
                  "fresh/score |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for arm, row in asy["arms"].items():
            lag_max = max((r["async_lag_max"] for r in row["runs"] if r["async_lag_max"] is not None), default=None)
            lines.append(f"| {arm} | {fmt(row['f1'])} | {fmt(row['steps'][0], 0)} | {fmt(row['clock_s'], 1)} | "
                         f"{fmt(row['process_wall_s'], 0)} | {fmt(row['episodes_per_s'], 2)} | "
                         f"{fmt(row['episodes_per_s_after_first'], 2)} | {fmt(row['async_episodes_per_s'], 2)} | "
                         f"{fmt(row['async_lag_mean'], 2)} | {fmt(lag_max, 0)} | "
                         f"{fmt(row['wait_s'], 1)} ({fmt(row['wait_s_first'], 1)}) | "
                         f"{fmt(row['dropped_stale'][0], 0)} | {fmt(row['score'], 3)} |")
    reused = f" (it reused {len(results['reused'])} finished parts of an earlier one)" if results["reused"] else ""
    lines += ["", f"Wall-clock of this invocation: {results['wall_s'] / 60:.1f} min{reused}. Versions: "
                  + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + "."]
    return "\n".join(lines) + "\n"


def versions() -> dict[str, str]:
    import gymnasium
    import torch
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__,
         "transformers": transformers.__version__, "gymnasium": gymnasium.__version__}
    try:
        import ray

        v["ray"] = ray.__version__
    except ImportError:
        pass
    v["machine"] = f"{platform.machine()}, {os.cpu_count()} cores"
    return v


def collect(part: str, arms: list[str], seeds: list[int], args: argparse.Namespace) -> dict[str, Any]:
    out, b = Path(args.out), args.budget
    eps = b.questions_per_step * b.group_size
    res: dict[str, Any] = {"seeds": seeds, "arms": {}}
    for arm in arms:
        dirs = [run_path(out, part, arm, s) for s in seeds]
        runs = [run_stats(d, eps) for d in dirs if (d / "summary.json").is_file()]
        if not runs:
            continue
        row: dict[str, Any] = {"runs": runs, "f1": mean_std([r["f1_after"] for r in runs]),
                               "f1_late": mean_std([r["f1_late"] for r in runs])}
        for k in ("steps", "episodes", "clock_s", "step_s", "lag", "drift", "score", "episodes_per_s",
                  "episodes_per_s_after_first", "async_episodes_per_s", "async_lag_mean", "async_lag_max",
                  "wait_s", "wait_s_first", "dropped_stale"):
            row[k] = mean_std([r[k] for r in runs])
        if part == "async":
            row["process_wall_s"] = mean_std([process_wall(d) for d in dirs if (d / "summary.json").is_file()])
        res["arms"][arm] = row
    return res


def report(args: argparse.Namespace, t0: float) -> dict[str, Any]:
    out, b = Path(args.out), args.budget
    results: dict[str, Any] = {"env": ENV, "env_kwargs": args.env_kwargs, "budget": dataclasses.asdict(b),
                               "sim_arms": {a: SIM_ARMS[a] for a in args.sim_list},
                               "async_arms": {a: ASYNC_ARMS[a] for a in args.async_list},
                               "teacher_f1": heldout(out / "teacher", args)["f1"],
                               "student_f1": heldout(out / "student", args)["f1"]}
    if "sim" in args.part_list or any((out / "runs" / "sim").glob("*/seed-*/summary.json")):
        results["sim"] = collect("sim", args.sim_list, args.seed_list, args)
    if "async" in args.part_list or any((out / "runs" / "async").glob("*/seed-*/summary.json")):
        results["async"] = collect("async", args.async_list, args.async_seed_list, args)
    results = {k: v for k, v in results.items() if not (isinstance(v, dict) and "arms" in v and not v["arms"])}
    results["wall_s"] = time.perf_counter() - t0
    results["reused"] = list(REUSED)
    results["versions"] = versions()
    given = sys.argv[1:] if argv_given is None else argv_given
    results["command"] = "python examples/async_fopd.py " + " ".join(given)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "curves.png")
    (out / "results.md").write_text(markdown(results))
    return results


argv_given: list[str] | None = None


def main(argv: Sequence[str] | None = None) -> int:
    global argv_given
    argv_given = list(argv) if argv is not None else None
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from memopd.runtime import set_threads

    set_threads(1)
    if args.one:
        _, arm, seed = args.one.split("/")
        run_sim_here(arm, int(seed), args)
        return 0
    t0 = time.perf_counter()
    REUSED.clear()
    b = args.budget
    print(f"budget: {b}", file=sys.stderr, flush=True)
    sft_model("tiny-teacher", out / "teacher", b.teacher_steps, b.teacher_batch, b.teacher_episodes, 1000, args)
    sft_model("tiny", out / "student", b.warmup_steps, b.warmup_batch, max(b.teacher_episodes, 1000) if not args.smoke
              else b.teacher_episodes, 7, args)
    print(f"held-out F1 on the task: teacher {heldout(out / 'teacher', args)['f1']:.3f}, "
          f"warm student {heldout(out / 'student', args)['f1']:.3f}", file=sys.stderr, flush=True)
    failures: list[str] = []
    if "sim" in args.part_list:  # seed-major: a stopped experiment has whole seeds, every config
        jobs = [(arm, s) for s in args.seed_list for arm in args.sim_list]

        def job(arm: str, seed: int) -> None:
            try:
                run_sim(arm, seed, args)
            except Exception as exc:  # noqa: BLE001 - reported after the other runs
                failures.append(str(exc))

        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            list(pool.map(lambda j: job(*j), jobs))
    if "async" in args.part_list:
        for seed in args.async_seed_list:
            for arm in args.async_list:
                try:
                    run_async(arm, seed, args)
                except RuntimeError as exc:
                    failures.append(str(exc))
    results = report(args, t0)
    print(markdown(results))
    print(f"results: {out / 'results.md'}, {out / 'results.json'}, {out / 'curves.png'}")
    if failures:
        print("failed: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
