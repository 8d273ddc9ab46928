"""TurnOPD and Prune-OPD against vanilla OPD at the same compute budget, with and without drift.

    python examples/turn_prune_opd.py                      # the experiment of docs/RESULTS.md
    python examples/turn_prune_opd.py --smoke --out DIR    # the pipeline in about a minute (CI)

A long LongQA setting with tail turns: one fact in one of 12 chunks of 24 tokens, a 16-token
memory, 13 model calls an episode (12 memory writes, then the answer). Steps:

  1. teacher   the `tiny` preset (0.62M params) fine-tuned by memopd.sft on 1,000 oracle
               trajectories, 200 steps of 32: held-out F1 1.0 on the 12-chunk task
  2. student   the teacher's own SFT run stopped at step 120 of its 200 (same data, seed and
               schedule): mid-way across the copy plateau, it writes the format and copies the fact
               only sometimes (held-out F1 0.22). Both SFTs use the task with 3 chunks
               (`sft_chunks`): every call sees the same kind of state as with 12, and a tiny model
               trained on mostly-empty 12-chunk episodes stays on its copy plateau (see
               examples/reproduce_memopd.py). Warm starts of 110-180 steps on their own (shorter)
               cosine schedules had not left the plateau (F1 0.03) and OPD did not move them in
               10-15 steps; a `tiny-teacher` given 250 steps had not crossed it either
  3. drift teacher  the teacher fine-tuned further (60 steps of 16, lr 2e-3) on 400 12-chunk oracle
               trajectories whose memory writes change format from turn `switch_turn` (4) on: each
               fact's words reversed (`acme alice .` for `alice acme .`), the answer read from that
               memory as before. The turn is visible to it (chunk t starts with `Document t+1`), so
               from turn 4 on its memory writes disagree with the student's, which learnt the normal
               format: a teacher that is only partly compatible with the student
  4. arms      `python -m memopd.train` from the one warm student, OPD only (`--reward none`), the
               same rollouts per step, epochs and learning rate, and the same compute budget:
               `--time-budget T --budget-clock cpu` (the process's CPU seconds of the steps, one
               torch thread each, evaluations not counted):
                 vanilla        token-weighted KL, full rollouts
                 turnopd-depth  --adaptive-depth
                 turnopd-loss   --opd-weighting progressive
                 turnopd-both   both
                 prune-opd      --prune-opd (drift down-weighting and rollout stop, default detector)
                 prune-opd-strong --prune-opd --prune-drop 0.5 (drift setting only)
               in the main setting (the teacher of 1.) and vanilla vs both Prune-OPD arms with the
               drift teacher
  5. report    held-out F1 against cumulative training CPU seconds (mean ± std over seeds), and a
               table: final held-out F1, steps done within the budget, model calls per episode,
               tokens trained, CPU seconds to reach 90% of vanilla's final F1, drift statistics; and
               where Prune-OPD looks: the top-k overlap of each teacher with the warm student on its
               own samples, per turn, and the episodes the drift rule flags at each patience

OPD only, not PPO + OPD: both methods change what the distillation term sees (which turns are
rolled out, how tokens are weighed, which are kept), and an episode cut by either has no answer
and so no reward: with PPO on, the cut arms would also lose PPO signal, a second difference. The
paper's vanilla baseline is OPD alone, and on this task PPO adds nothing measurable to OPD
(docs/RESULTS.md, "What does not match").

Everything lands in --out (default runs/turn-prune): teacher/, student/, drift-teacher/ (shared by
every arm), runs/<setting>/<arm>/seed-<s>/ (run directories, each with its log beside it),
results.json, results.md, drift_diagnostic.json and curves.png. A rerun reuses finished work and
resumes an unfinished run from its last checkpoint. Runs go `--jobs` at a time, each a subprocess
with one torch thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

ENV = "memgym/LongQA-v0"
ENV_KWARGS = {"num_chunks": 12, "chunk_size": 24, "memory_budget": 16}
SMOKE_ENV_KWARGS = {"num_chunks": 6, "chunk_size": 24, "memory_budget": 16}

ARMS: dict[str, list[str]] = {
    "vanilla": [],
    "turnopd-depth": ["--adaptive-depth"],
    "turnopd-loss": ["--opd-weighting", "progressive"],
    "turnopd-both": ["--adaptive-depth", "--opd-weighting", "progressive"],
    "prune-opd": ["--prune-opd"],
    "prune-opd-strong": ["--prune-opd", "--prune-drop", "0.5"],
}
"""The flags that define an arm; everything else is the same command."""

SETTINGS: dict[str, tuple[str, list[str]]] = {
    "main": ("teacher", [a for a in ARMS if a != "prune-opd-strong"]),
    "drift": ("drift-teacher", ["vanilla", "prune-opd", "prune-opd-strong"]),
}
"""setting -> (its teacher, its arms)."""

LABELS = {"vanilla": "vanilla OPD", "turnopd-depth": "TurnOPD, depth only", "turnopd-loss": "TurnOPD, loss only",
          "turnopd-both": "TurnOPD, both", "prune-opd": "Prune-OPD",
          "prune-opd-strong": "Prune-OPD, drop 0.5"}

TITLES = {"main": "no drift: the student's own teacher",
          "drift": "drift: the drift teacher (memory writes reversed from turn 4)"}

REUSED: list[str] = []


@dataclasses.dataclass
class Budget:
    """What every arm gets, and the models they share."""

    time_budget: float = 50.0
    steps: int = 60
    questions_per_step: int = 4
    group_size: int = 4
    ppo_epochs: int = 2
    lr: float = 2e-3
    max_new_tokens: int = 24
    eval_every: int = 5
    eval_episodes: int = 32
    opd_turn_end: float = 0.2
    depth_probe_every: int = 5
    prune_topk: int = 8
    prune_threshold: float = 0.25
    prune_drop: float = 0.25
    sft_chunks: int = 3
    teacher_steps: int = 200
    teacher_batch: int = 32
    teacher_episodes: int = 1000
    warmup_steps: int = 120
    drift_steps: int = 60
    drift_batch: int = 16
    drift_episodes: int = 400
    switch_turn: int = 4


SMOKE = Budget(time_budget=1.0, steps=2, questions_per_step=2, group_size=2, ppo_epochs=1, max_new_tokens=8,
               eval_every=1, eval_episodes=2, depth_probe_every=2, sft_chunks=2, teacher_steps=10, teacher_batch=2,
               teacher_episodes=4, warmup_steps=5, drift_steps=2, drift_batch=2, drift_episodes=4,
               switch_turn=2)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default="runs/turn-prune", help="experiment directory")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds of the training runs")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated settings out of {list(SETTINGS)}")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (each a subprocess with one torch thread)")
    ap.add_argument("--smoke", action="store_true", help="a tiny budget that checks the pipeline, not the result")
    for f in dataclasses.fields(Budget):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None,
                        help=f"override the budget's {f.name} (default {f.default}; smoke {getattr(SMOKE, f.name)})")
    ap.add_argument("--build", choices=["teacher", "student", "drift-teacher"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    unknown = sorted(set(args.settings.split(",")) - set(SETTINGS))
    if unknown:
        ap.error(f"--settings: unknown setting(s) {unknown}; choose from {list(SETTINGS)}")
    base = SMOKE if args.smoke else Budget()
    args.budget = dataclasses.replace(base, **{f.name: getattr(args, f.name) for f in dataclasses.fields(Budget)
                                               if getattr(args, f.name) is not None})
    args.env_kwargs = SMOKE_ENV_KWARGS if args.smoke else ENV_KWARGS
    args.seed_list = [int(s) for s in args.seeds.split(",") if s != ""]
    args.setting_list = [s for s in args.settings.split(",") if s]
    return args


# ------------------------------------------------------------------------------------------------
# 1-3. the teachers and the warm student
# ------------------------------------------------------------------------------------------------

def drift_oracle_class():
    """An OracleAgent whose memory writes, from chunk ``switch_turn`` on, hold each fact's words in
    reverse order (and whose answer is read from that memory as before)."""
    from agents.oracle import OracleAgent

    class DriftOracle(OracleAgent):
        switch_turn = 4

        def _fit(self, facts: list[str], info: dict[str, Any]) -> str:
            if int(info.get("chunk_index", 0)) >= self.switch_turn:
                facts = [reverse_fact(f) for f in facts]
            return super()._fit(facts, info)

    return DriftOracle


def reverse_fact(fact: str) -> str:
    """``alice acme .`` -> ``acme alice .``: the words before the final period, reversed."""
    words = fact.split()
    tail = [words.pop()] if words and words[-1] == "." else []
    return " ".join(words[::-1] + tail)


def oracle_episodes(env_kwargs: dict[str, Any], tokenizer: Any, n: int, seed: int, switch_turn: int | None = None):
    """Oracle trajectories; with ``switch_turn``, the drift oracle's."""
    import gymnasium as gym

    import memgym  # noqa: F401
    from agents.oracle import OracleAgent
    from agents.rollout import rollout

    envs = [gym.make(ENV, split="train", tokenizer=tokenizer, **env_kwargs) for _ in range(8)]
    cls = OracleAgent
    if switch_turn is not None:
        cls = drift_oracle_class()
        cls.switch_turn = switch_turn
    agent = cls.for_env(envs[0], tokenizer=tokenizer)
    try:
        return rollout(envs, agent, n, seed=seed, progress=False, run_id=f"oracle-{seed}")
    finally:
        for e in envs:
            e.close()


def build(what: str, out: Path, b: Budget, env_kwargs: dict[str, Any]) -> None:
    """SFT of one shared model (run in its own process, one torch thread)."""
    import torch

    from agents.models import load, save_pretrained
    from memopd.sft import SFTConfig, train_sft

    torch.set_num_threads(1)
    sft_kwargs = {**env_kwargs, "num_chunks": b.sft_chunks}
    if what in ("teacher", "student"):  # the student: the teacher's SFT run, stopped at step b.warmup_steps
        base, kw, n, steps, batch, seed, lr, switch = "tiny", sft_kwargs, b.teacher_episodes, \
            b.teacher_steps, b.teacher_batch, 7, 3e-3, None
    else:
        base, kw, n, steps, batch, seed, lr, switch = str(out / "teacher"), env_kwargs, b.drift_episodes, \
            b.drift_steps, b.drift_batch, 2000, 2e-3, b.switch_turn
    torch.manual_seed(seed)
    model, tok = load(base)
    eps = oracle_episodes(kw, tok, n, seed=seed, switch_turn=switch)
    cfg = SFTConfig(model=base, steps=steps, batch_episodes=batch, lr=lr, warmup_steps=min(20, steps // 5), seed=seed)
    stop_at = b.warmup_steps if what == "student" else steps

    class Stop(Exception):
        pass

    def log(message: str) -> None:  # memopd.sft logs after every tenth of the steps' update
        print(f"   {what}: {message}", file=sys.stderr, flush=True)
        if message.startswith(f"sft step {stop_at}/") and stop_at < steps:
            raise Stop

    t0 = time.process_time()
    history: list[dict[str, Any]] = []
    try:
        history = train_sft(model, eps, cfg, pad_token_id=tok.pad_token_id or 0, progress=False, log=log)
    except Stop:
        model.eval()
    info = {"base": base, "env_kwargs": kw, "episodes": n, "schedule_steps": steps, "steps": stop_at,
            "batch": batch, "lr": lr, "seed": seed, "switch_turn": switch, "cpu_s": time.process_time() - t0}
    save_pretrained(out / what, model, tok, files={"sft_metrics.jsonl": "".join(json.dumps(r) + "\n" for r in history),
                                                   "build.json": json.dumps(info, indent=2)})


def build_sub(what: str, args: argparse.Namespace) -> Path:
    """``build`` in a subprocess (reused when done); its log goes to <out>/<what>.log."""
    out = Path(args.out)
    path = out / what
    if (path / "config.json").is_file():
        print(f"{what}: reusing {path}", file=sys.stderr, flush=True)
        REUSED.append(what)
        return path
    print(f"{what}: building", file=sys.stderr, flush=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--build", what, "--out", str(out)]
    cmd += ["--smoke"] if args.smoke else []
    for f in dataclasses.fields(Budget):
        cmd += ["--" + f.name.replace("_", "-"), str(getattr(args.budget, f.name))]
    t0 = time.perf_counter()
    with (out / f"{what}.log").open("a") as fh:
        done = subprocess.run(cmd, check=False, stdout=fh, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"building {what} failed (exit {done.returncode}); see {out / f'{what}.log'}")
    print(f"{what}: built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return path


def heldout(model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    """Held-out F1/EM of a model on the experiment's task, its own rollouts (cached in heldout.json)."""
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
# 4. the runs
# ------------------------------------------------------------------------------------------------

def run_path(out: Path, setting: str, arm: str, seed: int) -> Path:
    return out / "runs" / setting / arm / f"seed-{seed}"


def train_command(setting: str, arm: str, seed: int, args: argparse.Namespace) -> list[str]:
    b, out = args.budget, Path(args.out)
    cmd = [sys.executable, "-m", "memopd.train", "--env", ENV]
    for k, v in args.env_kwargs.items():
        cmd += ["--env-kwarg", f"{k}={v}"]
    cmd += ["--model", str(out / "student"), "--teacher", str(out / SETTINGS[setting][0]),
            "--student-warmup-steps", "0", "--reward", "none", "--opd-divergence", "fkl", "--seed", str(seed),
            "--threads", "1", "--no-progress", "--time-budget", str(b.time_budget), "--budget-clock", "cpu",
            "--steps", str(b.steps), "--questions-per-step", str(b.questions_per_step),
            "--group-size", str(b.group_size), "--ppo-epochs", str(b.ppo_epochs), "--lr", str(b.lr),
            "--max-new-tokens", str(b.max_new_tokens), "--eval-every", str(b.eval_every),
            "--eval-episodes", str(b.eval_episodes), "--save-every", "5", "--audit-every", "0",
            "--opd-turn-end", str(b.opd_turn_end), "--depth-probe-every", str(b.depth_probe_every),
            "--prune-topk", str(b.prune_topk), "--prune-threshold", str(b.prune_threshold), "--prune-drop", str(b.prune_drop),
            *ARMS[arm]]
    return cmd


def run_one(setting: str, arm: str, seed: int, args: argparse.Namespace) -> Path:
    """One training run (a subprocess; reused when finished, resumed when it has a checkpoint)."""
    run_dir = run_path(Path(args.out), setting, arm, seed)
    if (run_dir / "summary.json").is_file():
        REUSED.append(f"{setting}/{arm}/seed-{seed}")
        return run_dir
    cmd = train_command(setting, arm, seed, args)
    resume = (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    cmd += ["--resume", str(run_dir)] if resume else ["--run-dir", str(run_dir)]
    print(f"== {setting} {arm} seed {seed}" + ("  (resuming)" if resume else ""), file=sys.stderr, flush=True)
    log = run_dir.parent / f"seed-{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("a") as fh:
        done = subprocess.run(cmd, check=False, stdout=fh, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{setting} {arm} seed {seed} failed (exit {done.returncode}); see {log}")
    print(f"   {setting} {arm} seed {seed}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return run_dir


# ------------------------------------------------------------------------------------------------
# 5. the report
# ------------------------------------------------------------------------------------------------

def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not xs:
        return float("nan"), float("nan")
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0


def run_stats(run_dir: Path) -> dict[str, Any]:
    """One run's curve (held-out F1 by cumulative training CPU seconds) and totals."""
    from memopd.runlog import read_metrics

    rows = list(read_metrics(run_dir))
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [r for r in rows if "train_clock_s" in r]
    clock = {0: 0.0, **{r["step"]: r["train_clock_s"] for r in steps}}
    curve = {"step": [], "clock_s": [], "f1": []}
    for r in rows:
        if "eval/f1" in r:
            curve["step"].append(r["step"])
            curve["clock_s"].append(clock.get(r["step"], 0.0))
            curve["f1"].append(r["eval/f1"])

    def avg(key: str, positive: bool = False) -> float | None:
        vals = [r[key] for r in steps if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
                and (r[key] > 0 or not positive)]
        return sum(vals) / len(vals) if vals else None

    half = steps[-1]["train_clock_s"] / 2 if steps else 0.0
    late = [f for c, f in zip(curve["clock_s"], curve["f1"]) if c >= half and c > 0]
    return {"f1_before": summary["eval_before"]["f1"], "f1_after": summary["eval_after"]["f1"],
            "f1_late": sum(late) / len(late) if late else None,
            "f1_teacher": (summary.get("eval_teacher") or {}).get("f1"), "steps": len(steps),
            "clock_s": steps[-1]["train_clock_s"] if steps else 0.0,
            "calls_per_episode": avg("calls_per_episode"),
            "tokens_trained": sum(r.get("action_tokens", 0) for r in steps),
            "overlap": avg("prune/overlap"), "drift_episodes": avg("prune/drift_episodes"),
            "stopped_episodes": avg("prune/stopped_episodes"),
            "depth_limit": avg("depth/limit", positive=True),  # the cut steps' limit (0 logs a full probe)
            "cut_episodes": avg("depth/cut_episodes"), "curve": curve}


def time_to(curve: dict[str, list[float]], target: float) -> float | None:
    """Training CPU seconds at the first evaluation with held-out F1 >= target (None: never)."""
    for c, f in zip(curve["clock_s"], curve["f1"]):
        if f >= target:
            return c
    return None


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    settings = list(results["settings"])
    fig, axes = plt.subplots(1, len(settings), figsize=(5.2 * len(settings), 3.9), sharey=True, squeeze=False)
    for ax, setting in zip(axes[0], settings):
        res = results["settings"][setting]
        for arm, row in res["arms"].items():
            curves = [r["curve"] for r in row["runs"]]
            end = max(max(c["clock_s"]) for c in curves)
            grid = np.linspace(0, end, 60)
            f1 = np.array([np.interp(grid, c["clock_s"], c["f1"], right=np.nan) for c in curves])
            ok = ~np.isnan(f1).any(0)
            m = f1[:, ok].mean(0)
            sd = f1[:, ok].std(0, ddof=1) if len(f1) > 1 else np.zeros_like(m)
            line, = ax.plot(grid[ok], m, label=f"{LABELS[arm]} (n={len(curves)})")
            ax.fill_between(grid[ok], m - sd, m + sd, color=line.get_color(), alpha=0.15)
        if res.get("teacher_f1") is not None:
            ax.axhline(res["teacher_f1"], color="k", ls="--", lw=1, label="teacher")
        ax.axvline(results["budget"]["time_budget"], color="grey", ls=":", lw=1)
        ax.set_title(TITLES[setting], fontsize=9)
        ax.set_xlabel("cumulative training CPU seconds (1 thread; evaluations excluded)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("held-out F1 (mean ± std over seeds)")
    fig.suptitle(f"{ENV} {json.dumps(results['env_kwargs'])}, OPD only, same CPU budget", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def fmt(ms: tuple[float, float], digits: int = 3) -> str:
    m, sd = ms
    return "n/a" if math.isnan(m) else f"{m:.{digits}f} ± {sd:.{digits}f}"


def markdown(results: dict[str, Any]) -> str:
    b = results["budget"]
    lines = [f"{ENV} {json.dumps(results['env_kwargs'])}; OPD only (forward KL), "
             f"{b['questions_per_step']} questions x {b['group_size']} samples a step, {b['ppo_epochs']} epochs, "
             f"lr {b['lr']}; budget {b['time_budget']:.0f} training CPU seconds a run (one thread), at most "
             f"{b['steps']} steps; held-out F1 on {b['eval_episodes']} test episodes (greedy) every "
             f"{b['eval_every']} steps and after the last; mean ± std over seeds {results['seeds']}. *F1, second half*: "
             "the mean of a run's evaluations in the second half of its budget (less noisy than one evaluation)."]
    for setting, res in results["settings"].items():
        lines += ["", f"**{setting}** (teacher `{SETTINGS[setting][0]}`: held-out F1 {res['teacher_f1']:.3f} in its "
                      f"own rollouts; warm student {results['student_f1']:.3f})", "",
                  "| arm | final F1 | per seed | F1, second half | steps in budget | calls / episode | tokens trained | "
                  f"CPU s to F1 >= {res['target']:.2f} | drifted / stopped episodes | depth limit |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for arm, row in res["arms"].items():
            per = ", ".join(f"{r['f1_after']:.3f}" for r in row["runs"])
            reached = [t for t in row["time_to_target"] if t is not None]
            tt = (f"{fmt(mean_std(reached), 0)} ({len(reached)}/{len(row['runs'])})" if reached
                  else f"not reached (0/{len(row['runs'])})")
            drift = (f"{fmt(row['drift_episodes'], 2)} / {fmt(row['stopped_episodes'], 2)}"
                     if not math.isnan(row["drift_episodes"][0]) else "")
            depth = fmt(row["depth_limit"], 1) if not math.isnan(row["depth_limit"][0]) else ""
            lines.append(f"| {LABELS[arm]} | {fmt(row['f1'])} | {per} | {fmt(row['f1_late'])} | {fmt(row['steps'], 1)} | "
                         f"{fmt(row['calls_per_episode'], 2)} | {fmt(row['tokens_trained'], 0)} | {tt} | {drift} | "
                         f"{depth} |")
    dd = results.get("drift_diagnostic")
    if dd:
        pats = list(next(iter(dd["teachers"].values()))["flagged_by_drop"])
        lines += ["", f"Where Prune-OPD looks, at the warm start: {dd['episodes']} train episodes sampled by the warm "
                      f"student; top-{dd['k']} overlap with each teacher at every sampled token, the share below "
                      f"{dd['threshold']}, and the episodes the drift rule flags with each patience.", "",
                  "| teacher | mean overlap | below threshold | overlap per turn | "
                  + " | ".join(f"zeroed, drop {p}" for p in pats) + " |",
                  "|---|---|---|---|" + "---|" * len(pats)]
        for name, t in dd["teachers"].items():
            lines.append(f"| {name} | {t['overlap']:.3f} | {t['low_share']:.3f} | "
                         + " ".join(f"{x:.2f}" for x in t["per_turn"]) + " | "
                         + " | ".join(f"{t['flagged_by_drop'][p]}/{dd['episodes']}" for p in pats) + " |")
    reused = f" (it reused {len(results['reused'])} finished parts of an earlier one)" if results["reused"] else ""
    lines += ["", f"Wall-clock of this invocation: {results['wall_s'] / 60:.1f} min{reused}. Versions: "
                  + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + "."]
    return "\n".join(lines) + "\n"


def drift_diagnostic(args: argparse.Namespace, episodes: int = 32) -> dict[str, Any]:
    """How far each teacher is from the warm student where Prune-OPD looks: on ``episodes`` train
    episodes sampled (temperature 1) by the warm student, the top-k overlap (the runs' k) of the
    student's and each teacher's next-token distributions at every sampled token, its mean per turn,
    and how many episodes the drift rule flags at the runs' threshold with patience 1, 2 and the
    runs' patience (cached in drift_diagnostic.json)."""
    out, b = Path(args.out), args.budget
    cached = out / "drift_diagnostic.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    import gymnasium as gym
    import torch

    import memgym  # noqa: F401
    from agents.backends.base import SamplingParams
    from agents.backends.hf import HFBackend
    from agents.memagent import MemAgent
    from agents.models import load
    from agents.rollout import rollout
    from memopd import losses
    from memopd.packing import pack_episodes
    from memopd.scoring import action_states
    k = b.prune_topk
    student, tok = load(out / "student")
    envs = [gym.make(ENV, split="train", tokenizer=tok, **args.env_kwargs) for _ in range(8)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=b.max_new_tokens)
    eps = rollout(envs, MemAgent(HFBackend(student, tok, seed=0), sampling=sampling), episodes, seed=30_000,
                  progress=False, run_id="drift-diagnostic")
    batch = pack_episodes(eps, 4096, mode="aligned", pad_token_id=tok.pad_token_id or 0)
    res: dict[str, Any] = {"episodes": len(eps), "k": k, "threshold": b.prune_threshold, "teachers": {}}
    with torch.no_grad():
        s_states = action_states(student, batch)
        for name in sorted({t for t, _ in SETTINGS.values()}):
            teacher, _ = load(out / name)
            ov = losses.overlap_from_states(s_states, k, teacher=action_states(teacher, batch)).float()
            turns = batch.token_map[:, 1]
            flagged = {}  # episodes whose reliability reaches 0, by --prune-drop
            for drop in sorted({0.25, 0.5, b.prune_drop}):
                w = losses.reliability(ov < b.prune_threshold, batch.token_map[:, 0], drop)
                flagged[str(drop)] = len(set(batch.token_map[w <= 0, 0].tolist()))
            res["teachers"][name] = {
                "overlap": float(ov.mean()), "low_share": float((ov < b.prune_threshold).float().mean()),
                "per_turn": [float(ov[turns == j].mean()) for j in range(int(turns.max()) + 1)],
                "flagged_by_drop": flagged}
    cached.write_text(json.dumps(res, indent=2))
    return res


def versions() -> dict[str, str]:
    import gymnasium
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "gymnasium": gymnasium.__version__,
            "machine": platform.machine()}


def report(args: argparse.Namespace, t0: float) -> dict[str, Any]:
    out, b = Path(args.out), args.budget
    results: dict[str, Any] = {"env": ENV, "env_kwargs": args.env_kwargs, "seeds": args.seed_list,
                               "budget": dataclasses.asdict(b), "arms": {a: ARMS[a] for a in ARMS},
                               "student_f1": heldout(out / "student", args)["f1"], "settings": {}}
    for setting in args.setting_list:
        teacher, arms = SETTINGS[setting]
        res: dict[str, Any] = {"teacher": teacher, "teacher_f1": heldout(out / teacher, args)["f1"], "arms": {}}
        for arm in arms:
            runs = [run_stats(run_path(out, setting, arm, s)) for s in args.seed_list]
            res["arms"][arm] = {"runs": runs, "f1": mean_std([r["f1_after"] for r in runs]),
                                "f1_late": mean_std([r["f1_late"] for r in runs]),
                                **{k: mean_std([r[k] for r in runs]) for k in
                                   ("steps", "clock_s", "calls_per_episode", "tokens_trained", "overlap",
                                    "drift_episodes", "stopped_episodes", "depth_limit", "cut_episodes")}}
        # time to 90% of vanilla's final F1 (the Prune-OPD claim's "less time at equal accuracy")
        res["target"] = 0.9 * res["arms"]["vanilla"]["f1"][0] if "vanilla" in res["arms"] else 0.0
        for row in res["arms"].values():
            row["time_to_target"] = [time_to(r["curve"], res["target"]) for r in row["runs"]]
        results["settings"][setting] = res
    results["drift_diagnostic"] = drift_diagnostic(args, episodes=4 if args.smoke else 32)
    results["wall_s"] = time.perf_counter() - t0
    results["reused"] = list(REUSED)
    results["versions"] = versions()
    results["command"] = "python examples/turn_prune_opd.py " + " ".join(sys.argv[1:])
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "curves.png")
    (out / "results.md").write_text(markdown(results))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.build:
        build(args.build, out, args.budget, args.env_kwargs)
        return 0
    from memopd.runtime import set_threads

    set_threads(1)
    t0 = time.perf_counter()
    REUSED.clear()
    print(f"budget: {args.budget}", file=sys.stderr, flush=True)
    need_drift = "drift" in args.setting_list
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(lambda w: build_sub(w, args), ["teacher", "student"]))
        drift_teacher: Future | None = pool.submit(build_sub, "drift-teacher", args) if need_drift else None
        lock = threading.Lock()
        failures: list[BaseException] = []

        def job(setting: str, arm: str, seed: int) -> None:
            try:
                if setting == "drift" and drift_teacher is not None:
                    drift_teacher.result()
                run_one(setting, arm, seed, args)
            except BaseException as exc:  # noqa: BLE001 - reported after the other runs
                with lock:
                    failures.append(exc)

        jobs = [(st, arm, s) for s in args.seed_list for st in args.setting_list for arm in SETTINGS[st][1]]
        list(pool.map(lambda j: job(*j), jobs))
    if failures:
        raise SystemExit("; ".join(str(f) for f in failures))
    results = report(args, t0)
    print(markdown(results))
    print(f"results: {out / 'results.md'}, {out / 'results.json'}, {out / 'curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
