"""SmolLM2-135M-Instruct trained with MemOPD on a CPU, end to end, in one command.

    python examples/smollm2_memopd.py                           # the full experiment (see docs/RESULTS.md)
    python examples/smollm2_memopd.py --smoke --out DIR         # the same path, a couple of steps each
    python examples/smollm2_memopd.py --smoke --student tiny --teacher-base tiny-teacher --out DIR  # CI

The task: LongQA with natural-language facts ("Zane works at Planetex."), one fact in one of 2
chunks of 64 SmolLM2 tokens among distractor sentences, a 16-token memory, the answer written from
the memory alone. Untouched, SmolLM2-135M-Instruct scores F1 0 on it. Stages (each skipped when an
earlier invocation finished it, so a killed run resumes where it stopped):

  1. teacher  SmolLM2 fully fine-tuned by `memopd.sft` on oracle trajectories of the task
              (full fine-tuning: 135M fp32 weights + AdamW state are ~2.2 GB, which fits in memory,
              and LoRA would save little time on a CPU, where the backward through the activations
              dominates); its held-out F1 under the memory agent
  2. audit    the RCE audit (`memopd.audit`) on teacher-sampled episodes: packed vs each call alone
  3. arms     the untouched SmolLM2 (`--student-warmup-steps 0`) trained by `memopd.train`, the same
              budget for each arm, run side by side with one torch thread each (`--parallel-arms`),
              with gradient checkpointing (two trainers of a 135M model share the machine's memory):
                ppo+memopd  PPO + OPD against the teacher, state-aligned (reverse KL)
                ppo         PPO on the F1 reward alone (--opd-coef 0)
              and, when asked for (--arms ppo+memopd,ppo+memopd-lora):
                ppo+memopd-lora  ppo+memopd training LoRA adapters (rank 16) instead of every weight
              each arm is its own `python -m memopd.train` process, resumed with --resume after a kill
  3b. sft     the SFT-only baseline: the untouched student fine-tuned by `memopd.sft` on as many oracle
              trajectories as an arm samples (steps x questions x samples), one step per RL step, at
              the teacher's learning rate; its held-out F1 beside the arms'
  4. export   the trained MemOPD student by `memopd.export`, evaluated by `memopd.eval --model <export>`
  5. report   results.json / results.md (teacher F1, student F1 before / after per arm, audit,
              stage wall times) and curves.png (held-out F1 vs step and vs training wall-clock)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ENV = "memgym/LongQA-v0"
ENV_KWARGS = {"fact_style": "natural", "num_chunks": 2, "chunk_size": 64, "memory_budget": 16}

ARMS: dict[str, list[str]] = {
    "ppo+memopd": ["--opd-coef", "1.0", "--teacher-context", "aligned"],
    "ppo": ["--opd-coef", "0"],
    # LoRA rank 16 on every attention and MLP projection; alpha 32 and 10x the full-weight learning
    # rate, the usual LoRA setting (the adapters' update is scaled by alpha / r and starts at zero)
    "ppo+memopd-lora": ["--opd-coef", "1.0", "--teacher-context", "aligned",
                        "--lora-r", "16", "--lora-alpha", "32", "--lr", "5e-4"],
}
"""The flags that differ between arms (appended last, so they win); everything else is the same budget."""

DEFAULT_ARMS = ("ppo+memopd", "ppo")


@dataclasses.dataclass
class Budget:
    """What the teacher gets, and what every arm gets."""

    sft_steps: int = 30
    sft_batch: int = 8
    sft_episodes: int = 400
    sft_lr: float = 1e-4
    steps: int = 24
    questions_per_step: int = 4
    group_size: int = 2
    ppo_epochs: int = 1
    lr: float = 5e-5
    rl_warmup_steps: int = 2
    max_new_tokens: int = 16
    answer_max_new_tokens: int = 8
    eval_every: int = 6
    eval_episodes: int = 32
    final_eval_episodes: int = 64
    audit_episodes: int = 4
    save_every: int = 6


SMOKE = Budget(sft_steps=2, sft_batch=2, sft_episodes=8, steps=2, questions_per_step=1, group_size=2,
               rl_warmup_steps=0, eval_every=1, eval_episodes=2, final_eval_episodes=2, audit_episodes=1,
               save_every=1)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default="runs/smollm2-memopd", help="experiment directory")
    ap.add_argument("--smoke", action="store_true", help="a couple of steps per stage: the path, not the result")
    ap.add_argument("--student", default="smollm2", help="student model (the teacher is fine-tuned from "
                                                         "--teacher-base); tiny presets for a fast CI run")
    ap.add_argument("--teacher-base", default="smollm2", help="model the teacher is fine-tuned from")
    ap.add_argument("--seed", type=int, default=0, help="RL seed of the arms (seed N > 0 writes results-seed-N.* "
                    "beside seed 0's results.*, sharing its teacher, audit and export)")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated arms out of {list(ARMS)}")
    ap.add_argument("--parallel-arms", action=argparse.BooleanOptionalAction, default=True,
                    help="run the arms side by side, one torch thread each (else one after another with --threads)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the stages run alone (on a busy "
                    "2-core machine two threads were several times slower than one)")
    ap.add_argument("--sft-student", action=argparse.BooleanOptionalAction, default=True,
                    help="also fine-tune the SFT-only baseline (stage 3b) and report its held-out F1")
    ap.add_argument("--summarise", default=None, metavar="SEEDS", help="only read the finished seeds' results "
                    "(comma-separated, e.g. 0,1) and write OUT/results-seeds.{json,md}: each arm's mean and spread")
    for f in dataclasses.fields(Budget):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None,
                        help=f"override the budget's {f.name} (default {f.default}; smoke {getattr(SMOKE, f.name)})")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.arms.split(",")) - set(ARMS))
    if unknown:
        ap.error(f"--arms: unknown arm(s) {unknown}; choose from {list(ARMS)}")
    base = SMOKE if args.smoke else Budget()
    args.budget = dataclasses.replace(base, **{f.name: getattr(args, f.name) for f in dataclasses.fields(Budget)
                                               if getattr(args, f.name) is not None})
    args.arm_list = [a for a in args.arms.split(",") if a]
    return args


def stem(name: str, seed: int) -> str:
    """``name`` for seed 0 (the files the docs name), ``name-seed-N`` for another seed."""
    return name if seed == 0 else f"{name}-seed-{seed}"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Timings:
    """Wall-clock seconds of each finished stage, kept in OUT/timings.json across invocations."""

    def __init__(self, path: Path):
        self.path = path
        self.data: dict[str, float] = json.loads(path.read_text()) if path.is_file() else {}

    def run(self, name: str, fn, *a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        self.data[name] = self.data.get(name, 0.0) + time.perf_counter() - t0
        self.path.write_text(json.dumps(self.data, indent=2))
        return out


def env_flags() -> list[str]:
    return [x for k, v in ENV_KWARGS.items() for x in ("--env-kwarg", f"{k}={v}")]


def run_cli(cmd: list[str], logfile: Path | None = None, threads: int | None = None) -> subprocess.Popen:
    """Start ``python -m ...`` (output to ``logfile`` when given)."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    full = [sys.executable, *cmd]
    log("$ python " + " ".join(cmd))
    out = logfile.open("a") if logfile else None
    return subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT if out else None, env=env)


def check(proc: subprocess.Popen, what: str, logfile: Path | None = None) -> None:
    if proc.wait() != 0:
        tail = logfile.read_text()[-3000:] if logfile and logfile.is_file() else ""
        raise SystemExit(f"{what} failed (exit {proc.returncode})" + (f"; end of {logfile}:\n{tail}" if tail else ""))


# ------------------------------------------------------------------------------------------------
# 1-2. teacher, its held-out F1, the RCE audit
# ------------------------------------------------------------------------------------------------

def teacher_sft(out: Path, args: argparse.Namespace) -> Path:
    b, path = args.budget, out / "teacher"
    if (path / "config.json").is_file():
        log(f"teacher: reusing {path}")
        return path
    cmd = ["-m", "memopd.sft", "--model", args.teacher_base, "--out", str(path), *env_flags(),
           "--num-episodes", str(b.sft_episodes), "--steps", str(b.sft_steps), "--batch-episodes", str(b.sft_batch),
           "--lr", str(b.sft_lr), "--warmup-steps", str(max(1, b.sft_steps // 10)), "--seed", "1000",
           "--threads", str(args.threads), "--no-progress"]
    check(run_cli(cmd, out / "teacher.log"), "teacher SFT", out / "teacher.log")
    return path


def sft_student(out: Path, args: argparse.Namespace) -> Path:
    """The SFT-only baseline of a seed: the untouched student fine-tuned on oracle trajectories, as
    many as an arm samples, one SFT step per RL step (each on as many trajectories as an RL step)."""
    b, path = args.budget, out / stem("sft-student", args.seed)
    if (path / "config.json").is_file():
        log(f"sft-student: reusing {path}")
        return path
    per_step = b.questions_per_step * b.group_size
    cmd = ["-m", "memopd.sft", "--model", args.student, "--out", str(path), *env_flags(),
           "--num-episodes", str(b.steps * per_step), "--steps", str(b.steps), "--batch-episodes", str(per_step),
           "--lr", str(b.sft_lr), "--warmup-steps", str(max(1, b.rl_warmup_steps)), "--seed", str(2000 + args.seed),
           "--threads", str(args.threads), "--no-progress"]
    check(run_cli(cmd, out / f"{stem('sft-student', args.seed)}.log"), "SFT-only student",
          out / f"{stem('sft-student', args.seed)}.log")
    return path


def train_config(model: str, b: Budget, eval_episodes: int, threads: int):
    from memopd.train import TrainConfig

    return TrainConfig(env=ENV, env_kwargs=ENV_KWARGS, model=model, max_new_tokens=b.max_new_tokens,
                       agent_kwargs={"answer_max_new_tokens": b.answer_max_new_tokens},
                       eval_episodes=eval_episodes, threads=threads, progress=False)


def heldout(model_spec: str, path: Path, b: Budget, episodes: int, threads: int) -> dict[str, float]:
    """Held-out F1 / EM of a model under the memory agent (greedy, test split), cached in ``path``."""
    if not path.is_file():
        from agents.models import load
        from memopd.learn.actor import Actor

        model, tok = load(model_spec)
        path.write_text(json.dumps(Actor(train_config(model_spec, b, episodes, threads), model, tok).evaluate()))
    return json.loads(path.read_text())


def audit(teacher: Path, out: Path, b: Budget, seed: int) -> dict[str, Any]:
    """RCE audit of the real model: episodes sampled by the teacher at temperature 1, each action
    token's full-vocabulary log-probs from packed scoring vs the call run alone (aligned), and the
    flattened history for contrast (persistent)."""
    path = out / "audit.json"
    if path.is_file():
        return json.loads(path.read_text())
    import gymnasium as gym

    import memgym  # noqa: F401
    from agents.backends.base import SamplingParams
    from agents.backends.hf import HFBackend
    from agents.memagent import MemAgent
    from agents.models import load
    from agents.records import save_episodes
    from agents.rollout import rollout
    from memopd.audit import rce_audit

    model, tok = load(teacher)
    envs = [gym.make(ENV, split="test", tokenizer=tok, **ENV_KWARGS) for _ in range(b.audit_episodes)]
    agent = MemAgent(HFBackend(model, tok, seed=seed), SamplingParams(temperature=1.0, max_new_tokens=b.max_new_tokens),
                     answer_max_new_tokens=b.answer_max_new_tokens)
    eps = rollout(envs, agent, b.audit_episodes, seed=30_000, progress=False, run_id="audit")
    save_episodes(out / "audit-episodes.jsonl", eps)
    res = rce_audit(model, eps, modes=("aligned", "persistent"))
    data = {m: {"max_abs_diff": r.max_abs_diff, "tolerance": r.tolerance, "passed": bool(r.passed),
                "tokens": r.num_actions} for m, r in res.items()}
    data["episodes"] = len(eps)
    data["calls"] = sum(len(e.invocations) for e in eps)
    path.write_text(json.dumps(data, indent=2))
    return data


# ------------------------------------------------------------------------------------------------
# 3. the arms
# ------------------------------------------------------------------------------------------------

def arm_dir(out: Path, arm: str, seed: int) -> Path:
    return out / "runs" / arm / f"seed-{seed}"


def arm_command(arm: str, run_dir: Path, teacher: Path, args: argparse.Namespace, threads: int) -> list[str]:
    from memopd.checkpoint import list_checkpoints

    b = args.budget
    if list_checkpoints(run_dir):  # settings come from its config.toml
        return ["-m", "memopd.train", "--resume", str(run_dir), "--threads", str(threads), "--no-progress"]
    return ["-m", "memopd.train", "--model", args.student, "--teacher", str(teacher), "--student-warmup-steps", "0",
            "--run-dir", str(run_dir), *env_flags(), "--steps", str(b.steps), "--seed", str(args.seed),
            "--questions-per-step", str(b.questions_per_step), "--group-size", str(b.group_size),
            "--ppo-epochs", str(b.ppo_epochs), "--lr", str(b.lr), "--warmup-steps", str(b.rl_warmup_steps),
            "--max-new-tokens", str(b.max_new_tokens),
            "--agent-kwarg", f"answer_max_new_tokens={b.answer_max_new_tokens}",
            "--eval-every", str(b.eval_every), "--eval-episodes", str(b.eval_episodes),
            "--save-every", str(b.save_every), "--keep-checkpoints", "1", "--audit-every", str(b.save_every),
            "--gradient-checkpointing",
            "--threads", str(threads), "--no-progress", *ARMS[arm]]


def run_arms(out: Path, teacher: Path, args: argparse.Namespace) -> None:
    todo = [a for a in args.arm_list if not (arm_dir(out, a, args.seed) / "summary.json").is_file()]
    for a in sorted(set(args.arm_list) - set(todo)):
        log(f"arm {a}: finished earlier, reusing {arm_dir(out, a, args.seed)}")
    threads = 1 if args.parallel_arms else args.threads
    procs = []
    for arm in todo:
        run_dir = arm_dir(out, arm, args.seed)
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        logfile = run_dir.parent / f"seed-{args.seed}.log"
        proc = run_cli(arm_command(arm, run_dir, teacher, args, threads), logfile, threads)
        if args.parallel_arms:
            procs.append((proc, arm, logfile))
        else:
            check(proc, f"arm {arm}", logfile)
    for proc, arm, logfile in procs:
        check(proc, f"arm {arm}", logfile)


# ------------------------------------------------------------------------------------------------
# 4-5. export, eval of the export, report
# ------------------------------------------------------------------------------------------------

def export_and_eval(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    b = args.budget
    run_dir = arm_dir(out, "ppo+memopd" if "ppo+memopd" in args.arm_list else args.arm_list[0], args.seed)
    export = out / "export" / "student"
    source = out / "export" / "source.txt"  # the run it was made from (a later seed reuses seed 0's export)
    if not (export / "config.json").is_file():
        check(run_cli(["-m", "memopd.export", str(run_dir), "--out", str(export), "--overwrite"]), "export")
        source.write_text(str(run_dir))
    summary = out / "eval-export" / "summary.json"
    if not summary.is_file():
        cmd = ["-m", "memopd.eval", "--model", str(export), "--agent", "memagent", *env_flags(),
               "--episodes", str(b.final_eval_episodes), "--batch-size", str(min(32, b.final_eval_episodes)),
               "--max-new-tokens", str(b.max_new_tokens), "--answer-max-new-tokens", str(b.answer_max_new_tokens),
               "--seed", "10000", "--threads", str(args.threads), "--out", str(out / "eval-export"), "--no-progress"]
        check(run_cli(cmd), "memopd.eval of the export")
    s = json.loads(summary.read_text())
    size = sum(f.stat().st_size for f in export.iterdir() if f.is_file())
    made_from = source.read_text() if source.is_file() else str(run_dir)
    return {"path": str(export), "from": made_from, "f1": s["f1"], "em": s["em"], "episodes": s["episodes"],
            "bytes": size}


def train_stats(run_dir: Path) -> dict[str, Any]:
    from memopd.checkpoint import list_checkpoints
    from memopd.runlog import read_metrics

    rows = [r for r in read_metrics(run_dir) if "step_s" in r]
    audits = [r["audit/max_abs_diff"] for r in read_metrics(run_dir) if "audit/max_abs_diff" in r]
    ckpts = list_checkpoints(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"s_per_step": sum(r["step_s"] for r in rows) / max(1, len(rows)),
            "update_s_per_step": sum(r["step_s"] - r["rollout_s"] for r in rows) / max(1, len(rows)),
            "peak_rss_mb": summary.get("peak_rss_mb"),
            "checkpoint_bytes": sum(f.stat().st_size for f in ckpts[0].rglob("*") if f.is_file()) if ckpts else None,
            "train_f1": [r["f1"] for r in rows], "kl": [r.get("kl/all") for r in rows],
            "audit_max_abs_diff": max(audits) if audits else None}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for arm, c in results["curves"].items():
        for ax, key in zip(axes, ("step", "seconds")):
            ax.plot(c[key], c["f1"], marker="o", ms=3, label=arm)
    for ax, xlabel in zip(axes, ("training step", "training wall-clock (s, rollout + update)")):
        ax.axhline(results["teacher"]["f1"], color="k", ls="--", lw=1, label="teacher (SFT SmolLM2)")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"held-out F1 ({results['budget']['eval_episodes']} episodes, greedy)")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"{results['student']} student, {ENV} {json.dumps(ENV_KWARGS)}, seed {results['seed']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def versions() -> dict[str, str]:
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores"}


def markdown(r: dict[str, Any]) -> str:
    b = r["budget"]
    head = (f"Student {r['student']}, teacher {r['teacher_base']} fine-tuned ({b['sft_steps']} SFT steps of "
            f"{b['sft_batch']} oracle trajectories). Held-out F1 under the memory agent, {b['eval_episodes']} test "
            f"episodes (greedy) during training, RL seed {r['seed']}.")
    sft = r.get("sft_student")
    sft_line = (f" SFT-only student (the same oracle trajectories as an arm samples): F1 {sft['f1']:.3f} (EM "
                f"{sft['em']:.3f}).") if sft else ""
    lines = [head, "", f"Teacher F1 {r['teacher']['f1']:.3f} (EM {r['teacher']['em']:.3f}).{sft_line}", "",
             "| arm | F1 before | F1 after | EM after | s / step | update s / step | peak RSS (MiB) | checkpoint (MiB) "
             "| max RCE in training |", "|---|---|---|---|---|---|---|---|---|"]
    for arm, row in r["table"].items():
        rce = f"{row['audit_max_abs_diff']:.1e}" if row["audit_max_abs_diff"] is not None else "-"
        ckpt = f"{row['checkpoint_bytes'] / 2**20:.1f}" if row.get("checkpoint_bytes") else "-"
        rss = f"{row['peak_rss_mb']:.0f}" if row.get("peak_rss_mb") else "-"
        lines.append(f"| {arm} | {row['before']['f1']:.3f} | {row['after']['f1']:.3f} | {row['after']['em']:.3f} | "
                     f"{row['s_per_step']:.1f} | {row['update_s_per_step']:.1f} | {rss} | {ckpt} | {rce} |")
    a = r["audit"]
    lines += ["", (f"RCE audit of the teacher on {a['episodes']} sampled episodes ({a['calls']} calls): aligned max "
                   f"|log p_pack - log p_alone| {a['aligned']['max_abs_diff']:.2e} (tolerance "
                   f"{a['aligned']['tolerance']:.0e}, passed {a['aligned']['passed']}); persistent (the flattened "
                   f"history) {a['persistent']['max_abs_diff']:.2f}.")]
    e = r.get("export")
    if e:
        lines += ["", (f"Export {e['path']} ({e['bytes'] / 2**20:.0f} MiB) evaluated by `memopd.eval --model`: "
                       f"F1 {e['f1']:.3f}, EM {e['em']:.3f} on {e['episodes']} test episodes.")]
    t = r["timings"]
    lines += ["", ("Stage wall-clock (s): " + ", ".join(f"{k} {v:.0f}" for k, v in t.items())
                   + f"; total {sum(t.values()) / 60:.1f} min. Versions: "
                   + ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + ".")]
    return "\n".join(lines) + "\n"


def report(out: Path, args: argparse.Namespace, timings: Timings, teacher: dict, audit_data: dict,
           export: dict | None, sft: dict | None = None) -> dict[str, Any]:
    from memopd.runlog import heldout_curve

    table, curves = {}, {}
    for arm in args.arm_list:
        run_dir = arm_dir(out, arm, args.seed)
        s = json.loads((run_dir / "summary.json").read_text())
        curves[arm] = heldout_curve(run_dir)
        table[arm] = {"before": s["eval_before"], "after": s["eval_after"], "steps": s["steps"], **train_stats(run_dir)}
    results = {"env": ENV, "env_kwargs": ENV_KWARGS, "student": args.student, "teacher_base": args.teacher_base,
               "seed": args.seed, "budget": dataclasses.asdict(args.budget), "teacher": teacher, "audit": audit_data,
               "table": table, "curves": curves, "export": export, "sft_student": sft, "timings": timings.data,
               "parallel_arms": args.parallel_arms, "versions": versions(),
               "command": "python examples/smollm2_memopd.py " + " ".join(sys.argv[1:])}
    (out / f"{stem('results', args.seed)}.json").write_text(json.dumps(results, indent=2))
    (out / f"{stem('results', args.seed)}.md").write_text(markdown(results))
    plot(results, out / f"{stem('curves', args.seed)}.png")
    return results


def summarise(out: Path, seeds: list[int]) -> dict[str, Any]:
    """Each arm over ``seeds`` (their results files): held-out F1 after training and along the
    curve (mean, sd and each seed's), s / step, update s / step, peak RSS, checkpoint size."""
    import statistics

    per = {s: json.loads((out / f"{stem('results', s)}.json").read_text()) for s in seeds}
    first = per[seeds[0]]

    def stat(xs: list[float]) -> dict[str, Any]:
        return {"mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0, "each": xs}

    arms: dict[str, Any] = {}
    for arm in first["table"]:
        rows = [per[s]["table"][arm] for s in seeds]
        curves = [per[s]["curves"][arm] for s in seeds]
        steps = curves[0]["step"]
        arms[arm] = {"f1_after": stat([r["after"]["f1"] for r in rows]),
                     "f1_curve": {"step": steps, "mean": [statistics.fmean(c["f1"][i] for c in curves)
                                                          for i in range(len(steps))],
                                  "each": [c["f1"] for c in curves]},
                     **{k: stat([r[k] for r in rows]) for k in ("s_per_step", "update_s_per_step", "peak_rss_mb",
                                                                   "checkpoint_bytes")}}
    sfts = [per[s].get("sft_student") for s in seeds]
    if all(sfts):
        arms["sft-only"] = {"f1_after": stat([x["f1"] for x in sfts])}
    res = {"seeds": seeds, "teacher_f1": first["teacher"]["f1"], "budget": first["budget"], "arms": arms,
           "command": "python examples/smollm2_memopd.py " + " ".join(sys.argv[1:])}
    (out / "results-seeds.json").write_text(json.dumps(res, indent=2) + "\n")
    lines = [f"Seeds {seeds}; teacher held-out F1 {res['teacher_f1']:.3f}. Mean +- sd over seeds.", "",
             "| arm | F1 after | F1 by step (mean) | s / step | update s / step | peak RSS (MiB) | checkpoint (MiB) |",
             "|---|---|---|---|---|---|---|"]
    for arm, a in arms.items():
        if "f1_curve" not in a:  # the SFT-only student: its final F1 only
            lines.append(f"| {arm} | {a['f1_after']['mean']:.3f} +- {a['f1_after']['sd']:.3f} | - | - | - | - | - |")
            continue
        curve = ", ".join(f"{s}: {f:.3f}" for s, f in zip(a["f1_curve"]["step"], a["f1_curve"]["mean"]))
        lines.append(f"| {arm} | {a['f1_after']['mean']:.3f} +- {a['f1_after']['sd']:.3f} | {curve} | "
                     f"{a['s_per_step']['mean']:.1f} | {a['update_s_per_step']['mean']:.1f} | "
                     f"{a['peak_rss_mb']['mean']:.0f} | {a['checkpoint_bytes']['mean'] / 2**20:.1f} |")
    (out / "results-seeds.md").write_text("\n".join(lines) + "\n")
    return res


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarise:
        summarise(Path(args.out), [int(s) for s in args.summarise.split(",")])
        print((Path(args.out) / "results-seeds.md").read_text())
        return 0
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    b = args.budget
    log(f"budget: {b}")
    timings = Timings(out / "timings.json")
    teacher = timings.run("teacher_sft", teacher_sft, out, args) if not (out / "teacher" / "config.json").is_file() \
        else out / "teacher"
    teacher_f1 = heldout(str(teacher), out / "teacher" / "heldout.json", b, b.final_eval_episodes, args.threads) \
        if (out / "teacher" / "heldout.json").is_file() else \
        timings.run("teacher_eval", heldout, str(teacher), out / "teacher" / "heldout.json", b, b.final_eval_episodes,
                    args.threads)
    log(f"teacher held-out F1 {teacher_f1['f1']:.3f} (EM {teacher_f1['em']:.3f}, {b.final_eval_episodes} episodes)")
    audit_data = audit(teacher, out, b, args.seed) if (out / "audit.json").is_file() else \
        timings.run("audit", audit, teacher, out, b, args.seed)
    log(f"RCE audit: aligned max |diff| {audit_data['aligned']['max_abs_diff']:.2e} "
        f"(passed {audit_data['aligned']['passed']}), persistent {audit_data['persistent']['max_abs_diff']:.2f}")
    if any(not (arm_dir(out, a, args.seed) / "summary.json").is_file() for a in args.arm_list):
        timings.run(stem("arms", args.seed), run_arms, out, teacher, args)
    sft = None
    if args.sft_student:
        sft_dir = sft_student(out, args) if (out / stem("sft-student", args.seed) / "config.json").is_file() else \
            timings.run(stem("sft_student", args.seed), sft_student, out, args)
        sft = heldout(str(sft_dir), sft_dir / "heldout.json", b, b.eval_episodes, args.threads)
        log(f"SFT-only student held-out F1 {sft['f1']:.3f} (EM {sft['em']:.3f}, {b.eval_episodes} episodes)")
    export = timings.run("export_eval", export_and_eval, out, args) \
        if not (out / "eval-export" / "summary.json").is_file() else export_and_eval(out, args)
    results = report(out, args, timings, teacher_f1, audit_data, export, sft)
    print(markdown(results))
    names = [f"{stem('results', args.seed)}.md", f"{stem('results', args.seed)}.json", f"{stem('curves', args.seed)}.png"]
    print("results: " + ", ".join(str(out / n) for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
