"""Baselines that can win against MemOPD: off-policy distillation, and PPO with a signal.

    python examples/reproduce_baselines.py --study offpolicy   # SFT on oracle / teacher trajectories
    python examples/reproduce_baselines.py --study signal      # PPO from a mid-plateau warm start
    python examples/reproduce_baselines.py --study variance    # 2 teachers x 2 warm starts
    python examples/reproduce_baselines.py --smoke --exp DIR   # both pipelines in about a minute (CI)

Both studies share examples/reproduce_memopd.py's setting, warm student and fair teacher
(`teacher-both/`, F1 1.000 acting in either context), in its experiment directory (--exp).

offpolicy  MemOPD's premise is that on-policy supervision matters. Two off-policy arms start from the
           same warm student (held-out F1 about 0.02) at the same compute as an RL arm: each step
           takes 32 fresh episodes and makes `ppo_epochs` optimizer passes over them, at the RL
           arms' learning rate and warm-up:
             sft-oracle   SFT on oracle trajectories (the warm start's own recipe: the task with
                          `sft_chunks` chunks), i.e. the supervised training continued
             sft-teacher  SFT on the teacher's own sampled trajectories (temperature 1) of the task,
                          each action in its own aligned state: sequence-level distillation
           Runs land in runs-offpolicy/<arm>/seed-<s>/ (curve.json, checkpoint.pt); the report
           (offpolicy.json / offpolicy.md) puts them beside the converged fair control's arms.
signal     The reproduction's PPO starts where almost every group of 4 samples scores 0, so it gets
           no gradient. Here the warm start is in the middle of the plateau: the warm student's SFT
           continued (oracle trajectories, as sft-oracle seed 0) until held-out F1 first reaches
           --mid-f1 (student-mid/), and each question gets 8 samples at the reproduction's number of
           episodes per step (4 questions x 8). Arms ppo, ppo+memopd and opd-only of
           examples/reproduce_memopd.py, runs in runs-signal/, report results-signal-<divergence>.*.

variance   The reproduction varies only the RL seed. Here the main matched control, ppo+opd-persist
           against ppo+memopd at the reproduction's budget (40 steps), runs for 2 fair teachers
           (teacher-both/ and one built by the same recipe with other seeds: teacher-s2000/,
           teacher-both-s2000/) x 2 warm students (student/ and student-s8/). The cell of the first
           teacher and student is the converged control's runs (--control) read at the same step;
           the others land in runs-var-t<i>-s<j>/; the report in variance.json / variance.md.

A rerun reuses finished work; a killed SFT arm resumes from its last evaluation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from imperfect_teacher import load_reproduce  # noqa: E402  (examples/ is not a package)

OFFPOLICY_ARMS = ("sft-oracle", "sft-teacher")
EPISODES_PER_STEP = 32
"""An RL step's episodes (8 questions x 4 samples): what each off-policy step trains on."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--exp", default="runs/reproduce", help="the reproduction's experiment directory (shared)")
    ap.add_argument("--study", choices=("offpolicy", "signal", "variance", "all"), default="all",
                    help="which study to run")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds")
    ap.add_argument("--arms", default=None,
                    help=f"comma-separated arms (offpolicy: {list(OFFPOLICY_ARMS)}; signal: ppo, ppo+memopd, "
                         "opd-only); default all of the study's")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per arm (default: offpolicy 120, as the converged fair control; signal 40)")
    ap.add_argument("--control", default="fair120",
                    help="the reproduce_memopd.py study (--name) whose ppo+memopd and ppo+opd-persist curves the "
                         "offpolicy report shows beside its arms")
    ap.add_argument("--mid-f1", type=float, default=0.2, help="signal: the warm start's held-out F1 to reach")
    ap.add_argument("--mid-max-steps", type=int, default=400, help="signal: SFT steps allowed to reach --mid-f1")
    ap.add_argument("--divergence", choices=("fkl", "rkl"), default="fkl", help="the distillation divergence")
    ap.add_argument("--smoke", action="store_true", help="a tiny budget that checks the pipeline, not the result")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bars")
    args = ap.parse_args(argv)
    args.seed_list = [int(s) for s in args.seeds.split(",") if s]
    if args.arms and args.study == "all":
        ap.error("--arms needs one --study")
    if args.arms and args.study == "offpolicy":
        unknown = sorted(set(args.arms.split(",")) - set(OFFPOLICY_ARMS))
        if unknown:
            ap.error(f"--arms: unknown off-policy arm(s) {unknown}; choose from {list(OFFPOLICY_ARMS)}")
    return args


# ------------------------------------------------------------------------------------------------
# the off-policy arms
# ------------------------------------------------------------------------------------------------

def arm_episodes(arm: str, seed: int, teacher: Path, count: int, rep, b, env_kwargs: dict[str, Any],
                 cache: Path, progress: bool) -> list:
    """The arm's training episodes, drawn once and cached (a resumed run trains on the same ones):
    oracle trajectories of the SFT recipe's setting, or the teacher's samples on the task."""
    import gymnasium as gym

    import memgym  # noqa: F401
    from agents.backends.base import SamplingParams
    from agents.backends.hf import HFBackend
    from agents.memagent import MemAgent
    from agents.models import load
    from agents.records import load_episodes, save_episodes
    from agents.rollout import rollout
    from memopd.sft import oracle_episodes

    if cache.is_file():
        episodes = load_episodes(cache).episodes
        if len(episodes) >= count:
            return episodes[:count]
    t0 = time.perf_counter()
    model, tok = load(teacher)
    if arm == "sft-oracle":
        episodes = oracle_episodes(rep.ENV, {**env_kwargs, "num_chunks": b.sft_chunks}, tok, count,
                                   seed=50_000 + 1000 * seed, progress=progress)
    else:
        envs = [gym.make(rep.ENV, split="train", tokenizer=tok, **env_kwargs) for _ in range(8)]
        agent = MemAgent(HFBackend(model, tok, seed=seed),
                         sampling=SamplingParams(temperature=1.0, max_new_tokens=b.max_new_tokens))
        episodes = rollout(envs, agent, count, seed=60_000 + 1000 * seed, progress=progress,
                           run_id=f"teacher-samples-{seed}")
    cache.parent.mkdir(parents=True, exist_ok=True)
    save_episodes(cache, episodes)
    # what drawing them cost: the teacher's sampling is part of sequence-level distillation's compute
    cache.with_suffix(".seconds").write_text(f"{time.perf_counter() - t0:.3f}\n")
    return episodes


def evaluate(model: Any, tok: Any, rep, b, env_kwargs: dict[str, Any]) -> float:
    """Held-out F1: the trainer's evaluation (greedy, test episode g has seed 10_000 + g)."""
    from memopd.learn.actor import Actor
    from memopd.train import TrainConfig

    cfg = TrainConfig(env=rep.ENV, env_kwargs=env_kwargs, eval_episodes=b.eval_episodes, progress=False)
    return Actor(cfg, model, tok).evaluate()["f1"]


def save_atomic(obj: Any, path: Path) -> None:
    import torch

    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def sft_arm(arm: str, seed: int, student: Path, teacher: Path, run_dir: Path, steps: int, rep, b,
            env_kwargs: dict[str, Any], progress: bool, stop_at_f1: float | None = None,
            eval_every: int | None = None) -> dict[str, Any]:
    """One off-policy arm: ``steps`` steps of EPISODES_PER_STEP fresh episodes, ``b.ppo_epochs``
    AdamW passes over each at the RL arms' lr and warm-up; held-out F1 every ``eval_every`` steps
    (and before the first). Returns its curve (``{"step", "seconds", "f1", "episodes"}``, seconds =
    training wall-clock, evaluations excluded). With ``stop_at_f1``, stops at the first evaluation
    that reaches it. Resumes from ``run_dir/checkpoint.pt``."""
    import torch

    from agents.models import load
    from memopd.runtime import lr_lambda
    from memopd.sft import nll_loss

    eval_every = eval_every or b.eval_every
    done = run_dir / "curve.json"
    if done.is_file():
        return json.loads(done.read_text())
    torch.manual_seed(seed)
    model, tok = load(student)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=b.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda("constant", b.rl_warmup_steps, steps, 0.0))
    curve: dict[str, list] = {"step": [], "seconds": [], "f1": [], "episodes": []}
    start, clock = 0, 0.0
    ckpt = run_dir / "checkpoint.pt"
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        curve, start, clock = state["curve"], state["step"], state["clock"]
        print(f"   {arm} seed {seed}: resuming at step {start}", file=sys.stderr)
    episodes = arm_episodes(arm, seed, teacher, steps * EPISODES_PER_STEP, rep, b, env_kwargs,
                            run_dir / "episodes.jsonl", progress)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    if start == 0:
        model.eval()
        curve = {"step": [0], "seconds": [0.0], "f1": [evaluate(model, tok, rep, b, env_kwargs)], "episodes": [0]}
    for step in range(start, steps):
        t0 = time.perf_counter()
        batch = episodes[step * EPISODES_PER_STEP:(step + 1) * EPISODES_PER_STEP]
        model.train()
        for _ in range(b.ppo_epochs):  # as the RL arms: one optimizer step per pass over the batch
            loss, _ = nll_loss(model, batch, 4096, pad)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        sched.step()
        clock += time.perf_counter() - t0
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            model.eval()
            f1 = evaluate(model, tok, rep, b, env_kwargs)
            for k, v in (("step", step + 1), ("seconds", clock), ("f1", f1),
                         ("episodes", (step + 1) * EPISODES_PER_STEP)):
                curve[k].append(v)
            print(f"   {arm} seed {seed} step {step + 1}: loss {loss.item():.3f}, held-out F1 {f1:.3f}",
                  file=sys.stderr, flush=True)
            run_dir.mkdir(parents=True, exist_ok=True)
            save_atomic({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                         "curve": curve, "step": step + 1, "clock": clock}, ckpt)
            if stop_at_f1 is not None and f1 >= stop_at_f1:
                break
    curve["stopped_at"] = curve["step"][-1]
    drawn = run_dir / "episodes.seconds"
    curve["episodes_s"] = float(drawn.read_text()) if drawn.is_file() else None
    done.write_text(json.dumps(curve))
    return curve


def offpolicy(args: argparse.Namespace, rep, base: argparse.Namespace) -> dict[str, Any]:
    b = base.budget
    exp = Path(args.exp)
    steps = args.steps or (2 if args.smoke else 120)
    teacher, student = exp / "teacher-both", exp / "student"
    arms = args.arms.split(",") if args.arms else list(OFFPOLICY_ARMS)
    curves: dict[str, dict[str, Any]] = {}
    for seed in args.seed_list:  # seed-major, as the reproduction: a stopped study has whole seeds
        for arm in arms:
            print(f"== {arm}  seed {seed}", file=sys.stderr)
            curves.setdefault(arm, {})[str(seed)] = sft_arm(
                arm, seed, student, teacher, exp / "runs-offpolicy" / arm / f"seed-{seed}", steps, rep, b,
                base.env_kwargs, args.progress)
    control = exp / f"results-{args.control}-{b.divergence}.json"
    if control.is_file():  # the on-policy arms it is compared with (their own report, same teacher)
        fair = json.loads(control.read_text())
        for arm in ("ppo+memopd", "ppo+opd-persist"):
            if arm in fair["curves"]:
                curves[arm] = fair["curves"][arm]
    results = {"steps": steps, "seeds": args.seed_list, "episodes_per_step": EPISODES_PER_STEP,
               "updates_per_step": b.ppo_epochs, "lr": b.lr, "eval_episodes": b.eval_episodes,
               "control": str(control.name) if control.is_file() else None,
               "curves": curves, "table": table(curves), "versions": rep.versions(),
               "command": "python examples/reproduce_baselines.py " + " ".join(sys.argv[1:])}
    (exp / "offpolicy.json").write_text(json.dumps(results, indent=2))
    (exp / "offpolicy.md").write_text(markdown(results))
    return results


def table(curves: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per arm over seeds: final F1, area under the F1-by-step curve (mean F1 over the steps) and the
    mean training seconds per step, each as (mean, sample std, per seed)."""
    rep = load_reproduce()
    out = {}
    for arm, runs in curves.items():
        finals = [c["f1"][-1] for c in runs.values()]
        aucs = [auc(c["step"], c["f1"]) for c in runs.values()]
        s_step = [c["seconds"][-1] / max(1, c["step"][-1]) for c in runs.values()]
        drawn = [c["episodes_s"] / max(1, c["step"][-1]) for c in runs.values() if c.get("episodes_s") is not None]
        out[arm] = {"final": (*rep.mean_std(finals), finals), "auc": (*rep.mean_std(aucs), aucs),
                    "s_per_step": rep.mean_std(s_step)[0],
                    "episodes_s_per_step": rep.mean_std(drawn)[0] if drawn else None}
    return out


def auc(steps: Sequence[float], f1: Sequence[float]) -> float:
    """Mean F1 over [0, last step], trapezoids between evaluations."""
    area = sum((steps[i + 1] - steps[i]) * (f1[i + 1] + f1[i]) / 2 for i in range(len(steps) - 1))
    return area / steps[-1] if steps[-1] else f1[-1]


def markdown(results: dict[str, Any]) -> str:
    lines = [f"Held-out F1 ({results['eval_episodes']} test episodes, greedy) over {results['steps']} steps of "
             f"{results['episodes_per_step']} episodes and {results['updates_per_step']} optimizer steps each; "
             f"mean ± std over seeds {results['seeds']}.", "",
             "| arm | final F1 | AUC (mean F1 over the steps) | train s/step | drawing the episodes, s/step "
             "| per seed (final) |", "|---|---|---|---|---|---|"]
    for arm, row in results["table"].items():
        drawn = row.get("episodes_s_per_step")
        lines.append(f"| {arm} | {row['final'][0]:.3f} ± {row['final'][1]:.3f} | {row['auc'][0]:.3f} ± "
                     f"{row['auc'][1]:.3f} | {row['s_per_step']:.2f} | "
                     + ("in the step" if drawn is None else f"{drawn:.2f}") + " | "
                     + ", ".join(f"{x:.3f}" for x in row["final"][2]) + " |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# PPO with a signal
# ------------------------------------------------------------------------------------------------

def mid_student(args: argparse.Namespace, rep, base: argparse.Namespace) -> Path:
    """The warm student's oracle SFT continued (sft-oracle's recipe, seed 0) to the first evaluation
    (every 5 steps) at or above --mid-f1; saved as student-mid/ with its F1 in heldout.json."""
    from agents.models import load, save_pretrained

    exp = Path(args.exp)
    path = exp / "student-mid"
    if (path / "config.json").is_file():
        return path
    b = base.budget
    steps = 2 if args.smoke else args.mid_max_steps
    run_dir = exp / "runs-mid-search"
    curve = sft_arm("sft-oracle", 0, exp / "student", exp / "teacher-both", run_dir, steps, rep, b,
                    base.env_kwargs, args.progress, stop_at_f1=args.mid_f1, eval_every=1 if args.smoke else 5)
    if curve["f1"][-1] < args.mid_f1 and not args.smoke:
        raise SystemExit(f"error: the oracle SFT did not reach held-out F1 {args.mid_f1} in {steps} steps "
                         f"(last {curve['f1'][-1]:.3f}); raise --mid-max-steps")
    import torch

    model, tok = load(exp / "student")
    model.load_state_dict(torch.load(run_dir / "checkpoint.pt", weights_only=False)["model"])
    save_pretrained(path, model, tok, files={"mid_search.json": json.dumps(curve)})
    return path


def signal(args: argparse.Namespace, rep, common: list[str]) -> None:
    base = rep.parse_args(common)
    mid = mid_student(args, rep, base)
    steps = args.steps or (2 if args.smoke else 40)
    b = base.budget
    rep.main(common + ["--teacher", str(Path(args.exp) / "teacher-both"), "--student", str(mid),
                       "--name", "signal", "--arms", args.arms or "ppo,ppo+memopd,opd-only",
                       "--seeds", args.seeds, "--steps", str(steps),
                       "--questions-per-step", str(max(1, b.questions_per_step * b.group_size // 8)),
                       "--group-size", str(8 if not args.smoke else 2)])


TEACHER_SEEDS = (1000, 2000)
"""The fair teachers' SFT seeds (the first is the reproduction's); the second SFT uses seed + 1."""
STUDENT_SEEDS = (7, 8)
"""The warm students' SFT seeds (the first is the reproduction's)."""
MAIN_ARMS = ("ppo+opd-persist", "ppo+memopd")


def variance(args: argparse.Namespace, rep, common: list[str], base: argparse.Namespace) -> dict[str, Any]:
    b, exp = base.budget, Path(args.exp)
    steps = args.steps or (2 if args.smoke else 40)
    teachers = [exp / "teacher-both"]
    for seed in TEACHER_SEEDS[1:]:
        t = rep.sft_model("tiny-teacher", exp / f"teacher-s{seed}", b.teacher_steps, b.teacher_batch,
                          b.teacher_episodes, seed, b, base)
        teachers.append(rep.sft_model(str(t), exp / f"teacher-both-s{seed}", b.both_steps, b.teacher_batch,
                                      b.teacher_episodes, seed + 1, b, base, context="both",
                                      num_chunks=base.env_kwargs["num_chunks"], lr=1e-3))
    students = [exp / "student"] + [rep.sft_model("tiny", exp / f"student-s{seed}", b.warmup_steps, b.warmup_batch,
                                                  1000, seed, b, base) for seed in STUDENT_SEEDS[1:]]
    cells: dict[str, Any] = {}
    control = exp / f"results-{args.control}-{b.divergence}.json"
    for i, teacher in enumerate(teachers):
        for j, student in enumerate(students):
            name = f"t{i}-s{j}"
            cell = {"teacher": teacher.name, "student": student.name,
                    "teacher_f1": rep.heldout_f1(teacher, b, base.env_kwargs),
                    "student_f1": rep.heldout_f1(student, b, base.env_kwargs), "arms": {}}
            if i == 0 and j == 0 and control.is_file():  # the converged control's runs, read at `steps`
                fair = json.loads(control.read_text())
                for arm in MAIN_ARMS:
                    cell["arms"][arm] = {s: at_step(c, steps) for s, c in fair["curves"][arm].items()
                                         if int(s) in args.seed_list}
                cell["source"] = control.name
            else:
                rep.main(common + ["--teacher", str(teacher), "--student", str(student), "--name", f"var-{name}",
                                   "--arms", ",".join(MAIN_ARMS), "--seeds", args.seeds, "--steps", str(steps)])
                res = json.loads((exp / f"results-var-{name}-{b.divergence}.json").read_text())
                for arm in MAIN_ARMS:
                    cell["arms"][arm] = {s: c["f1"][-1] for s, c in res["curves"][arm].items()}
                cell["source"] = f"results-var-{name}-{b.divergence}.json"
            cells[name] = cell
    results = {"steps": steps, "seeds": args.seed_list, "cells": cells, "summary": variance_summary(cells, rep),
               "versions": rep.versions(),
               "command": "python examples/reproduce_baselines.py " + " ".join(sys.argv[1:])}
    (exp / "variance.json").write_text(json.dumps(results, indent=2))
    lines = [f"Held-out F1 after {steps} steps ({b.eval_episodes} test episodes), per teacher x warm student, "
             f"mean over RL seeds {args.seed_list}; gap = ppo+memopd - ppo+opd-persist.", "",
             "| cell | teacher (F1) | warm student (F1) | persistent | MemOPD | gap |", "|---|---|---|---|---|---|"]
    for name, c in cells.items():
        p, m = (sum(c["arms"][a].values()) / len(c["arms"][a]) for a in MAIN_ARMS)
        lines.append(f"| {name} | {c['teacher']} ({c['teacher_f1']:.3f}) | {c['student']} ({c['student_f1']:.3f}) "
                     f"| {p:.3f} | {m:.3f} | {m - p:+.3f} |")
    sm = results["summary"]
    lines += ["", f"Over the {len(cells)} cells: gap {sm['gap'][0]:+.3f} ± {sm['gap'][1]:.3f} (std over cells); "
                  f"over every run: persistent {sm['persistent'][0]:.3f} ± {sm['persistent'][1]:.3f}, MemOPD "
                  f"{sm['memopd'][0]:.3f} ± {sm['memopd'][1]:.3f}."]
    (exp / "variance.md").write_text("\n".join(lines) + "\n")
    return results


def at_step(curve: dict[str, list], step: int) -> float:
    """A curve's held-out F1 at ``step`` (an evaluation step of it)."""
    return curve["f1"][curve["step"].index(step)]


def variance_summary(cells: dict[str, Any], rep) -> dict[str, Any]:
    gaps = []
    runs: dict[str, list[float]] = {a: [] for a in MAIN_ARMS}
    for c in cells.values():
        means = {a: sum(c["arms"][a].values()) / len(c["arms"][a]) for a in MAIN_ARMS}
        gaps.append(means["ppo+memopd"] - means["ppo+opd-persist"])
        for a in MAIN_ARMS:
            runs[a] += list(c["arms"][a].values())
    return {"gap": rep.mean_std(gaps), "persistent": rep.mean_std(runs["ppo+opd-persist"]),
            "memopd": rep.mean_std(runs["ppo+memopd"])}


def shared_models(rep, base: argparse.Namespace) -> None:
    """The fair control's teacher-both/ and warm student/: built by its recipe, or reused."""
    b, out = base.budget, Path(base.out)
    teacher = rep.sft_model("tiny-teacher", out / "teacher", b.teacher_steps, b.teacher_batch, b.teacher_episodes,
                            1000, b, base)
    rep.sft_model(str(teacher), out / "teacher-both", b.both_steps, b.teacher_batch, b.teacher_episodes, 1001, b,
                  base, context="both", num_chunks=base.env_kwargs["num_chunks"], lr=1e-3)
    rep.sft_model("tiny", out / "student", b.warmup_steps, b.warmup_batch, 1000, 7, b, base)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    rep = load_reproduce()
    exp = Path(args.exp)
    exp.mkdir(parents=True, exist_ok=True)
    common = ["--out", str(exp), "--threads", str(args.threads), "--divergence", args.divergence,
              "--progress" if args.progress else "--no-progress"] + (["--smoke"] if args.smoke else [])
    if not args.smoke:
        common += ["--eval-every", "10", "--eval-episodes", "128"]
    base = rep.parse_args(common + ["--teacher-sft-context", "both"])
    shared_models(rep, base)
    if args.study in ("offpolicy", "all"):
        results = offpolicy(args, rep, base)
        print((exp / "offpolicy.md").read_text())
        assert results["table"]
    if args.study in ("signal", "all"):
        signal(args, rep, common)
    if args.study in ("variance", "all"):
        variance(args, rep, common, base)
        print((exp / "variance.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
