"""Reproduce MemOPD's claims at CPU scale: aligned vs persistent teacher scoring vs PPO, with seeds.

    python examples/reproduce_memopd.py                      # the full experiment (see docs/RESULTS.md)
    python examples/reproduce_memopd.py --smoke --out DIR    # the pipeline in about a minute (CI)

One LongQA setting where memory matters: one fact hidden in one of 6 chunks of 48 tokens (288
tokens of context), a 16-token memory, and the answer written from the memory alone. Steps:

  1. teacher   `tiny-teacher` (1.2M params) fine-tuned with memopd.sft on 1,000 oracle trajectories
  2. student   the `tiny` preset (0.62M params), warm-started by memopd.sft on oracle trajectories
               (200 steps: the format and the person's name, not yet the fact; held-out F1 ~0.02);
               every arm and seed starts from this one student, so the seeds vary the RL
  3. arms      the same rollouts per step, steps, epochs, learning rate and divergence for each:
                 ppo              PPO on the F1 reward alone                   (--opd-coef 0)
                 ppo+opd-persist  PPO + OPD, teacher scores the flattened history
                 ppo+memopd       PPO + OPD, teacher scores the state-aligned calls (MemOPD)
                 opd-only         OPD alone, state-aligned                     (--reward none)
  4. report    held-out F1 (mean, std over seeds) per arm, learning curves vs step and wall-clock,
               and the state-alignment table (re-scored minus recorded log-prob, per turn).

Both SFTs use oracle trajectories of the same task with 3 chunks (`sft_chunks`): every call sees
the same kind of state [question, memory, chunk] as with 6, but a 6-chunk episode is mostly calls
with nothing to copy, and a tiny teacher trained on those stayed on its copy plateau (6 chunks,
500 steps of 16 episodes: held-out F1 0.08; 3 chunks, 250 steps of 32: 0.97 on the 6-chunk task).

Everything lands in --out (default runs/reproduce): teacher/ and student/ (shared by every arm and
divergence), runs/<divergence>/<arm>/seed-<s>/ (full run directories), and the report
results-<divergence>.json, results-<divergence>.md, curves-<divergence>.png. A killed experiment
resumes where it stopped: finished runs are kept, an unfinished run resumes from its last
checkpoint. `--divergence rkl` runs the arms again with MemOPD's reverse KL beside the default.

The fair matched control (`--teacher-sft-context both`): the teacher is fine-tuned on each call's
own prompt and on the flattened transcript of the same episodes (memopd.sft --context both), so it
is competent on both kinds of state the arms score with. It lands in teacher-both/, its runs in
runs-fair/<divergence>/<arm>/seed-<s>/ and its report in results-fair-<divergence>.* (the warm
student is shared); the report adds both teachers' action NLL on held-out oracle trajectories of the
6-chunk task under aligned and persistent context (the aligned-only teacher/ is built for it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ENV = "memgym/LongQA-v0"
ENV_KWARGS = {"num_chunks": 6, "chunk_size": 48, "memory_budget": 16}

ARMS: dict[str, dict[str, Any]] = {
    "ppo": {"opd_coef": 0.0},
    "ppo+opd-persist": {"opd_coef": 1.0, "teacher_context": "persistent"},
    "ppo+memopd": {"opd_coef": 1.0, "teacher_context": "aligned"},
    "opd-only": {"opd_coef": 1.0, "teacher_context": "aligned", "reward": "none"},
}
"""What differs between arms; everything else is the same TrainConfig."""

REUSED: list[str] = []
"""What this invocation found finished by an earlier one (so its wall-clock does not include it)."""


@dataclasses.dataclass
class Budget:
    """What every arm gets, and the teacher and warm start they share."""

    steps: int = 40
    questions_per_step: int = 8
    group_size: int = 4
    ppo_epochs: int = 2
    lr: float = 2e-3
    rl_warmup_steps: int = 5
    ref_beta: float = 0.0
    entropy_coef: float = 0.0
    divergence: str = "fkl"
    eval_every: int = 5
    eval_episodes: int = 64
    sft_chunks: int = 3
    teacher_steps: int = 250
    teacher_batch: int = 32
    teacher_episodes: int = 1000
    warmup_steps: int = 200
    warmup_batch: int = 32
    both_steps: int = 150
    max_new_tokens: int = 48


SMOKE = Budget(steps=2, questions_per_step=2, group_size=2, ppo_epochs=1, rl_warmup_steps=0, eval_every=1,
               eval_episodes=4, teacher_steps=2, teacher_batch=2, teacher_episodes=8, warmup_steps=2,
               warmup_batch=2, both_steps=2, max_new_tokens=12)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default="runs/reproduce", help="experiment directory")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds (every seed starts from the one warm student)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms out of {list(ARMS)}")
    ap.add_argument("--smoke", action="store_true", help="a tiny budget that checks the pipeline, not the result")
    ap.add_argument("--teacher-sft-context", choices=("aligned", "both"), default="aligned",
                    help="the teacher's SFT context: aligned (teacher/, runs/) or both, the fair matched control "
                         "(teacher-both/, runs-fair/, results-fair-*)")
    ap.add_argument("--env-kwarg", action="append", default=[], metavar="KEY=VALUE",
                    help=f"change the task setting {ENV_KWARGS} (repeatable, e.g. memory_budget=32 or hops=2); "
                         "the teacher and student SFTs use it too, with num_chunks = --sft-chunks")
    ap.add_argument("--teacher", default=None, metavar="DIR",
                    help="a finished teacher to use instead of building one in --out (another study's)")
    ap.add_argument("--student", default=None, metavar="DIR",
                    help="a finished warm student to use instead of building one in --out")
    ap.add_argument("--name", default=None,
                    help="the study's name: runs in runs-NAME/, report in results-NAME-<divergence>.* "
                         "(default: none, or 'fair' with --teacher-sft-context both)")
    for f in dataclasses.fields(Budget):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None,
                        help=f"override the budget's {f.name} (default {f.default}; smoke {getattr(SMOKE, f.name)})")
    from memopd.config import DEFAULT_THREADS, THREADS_HELP

    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP.replace("%", "%%"))
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bars")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what the report records as its command
    unknown = sorted(set(args.arms.split(",")) - set(ARMS))
    if unknown:
        ap.error(f"--arms: unknown arm(s) {unknown}; choose from {list(ARMS)}")
    base = SMOKE if args.smoke else Budget()
    args.budget = dataclasses.replace(base, **{f.name: getattr(args, f.name) for f in dataclasses.fields(Budget)
                                               if getattr(args, f.name) is not None})
    args.seed_list = [int(s) for s in args.seeds.split(",") if s != ""]
    args.arm_list = [a for a in args.arms.split(",") if a]
    from memgym.cli import parse_kwargs

    args.fair = args.teacher_sft_context == "both"
    args.env_kwargs = {**ENV_KWARGS, **parse_kwargs(args.env_kwarg)}
    name = args.name if args.name is not None else ("fair" if args.fair else "")
    args.tree = f"runs-{name}" if name else "runs"
    args.report_name = f"results-{name + '-' if name else ''}{args.budget.divergence}"
    return args


# ------------------------------------------------------------------------------------------------
# 1-2. the shared teacher and warm student
# ------------------------------------------------------------------------------------------------

def sft_model(model: str, path: Path, steps: int, batch: int, episodes: int, seed: int, b: Budget,
              args: argparse.Namespace, context: str = "aligned", num_chunks: int | None = None,
              lr: float = 3e-3) -> Path:
    """memopd.sft of ``model`` (a preset or a model directory) on oracle trajectories of the task with
    ``num_chunks`` chunks (default ``b.sft_chunks``: see the module doc)."""
    from memopd.sft import SFTConfig, run as run_sft

    if (path / "config.json").is_file():
        print(f"{path.name}: reusing {path}", file=sys.stderr)
        REUSED.append(path.name)
        return path
    num_chunks = num_chunks or b.sft_chunks
    print(f"{path.name}: SFT of {model}, {steps} steps of {batch} oracle trajectories ({num_chunks} chunks, "
          f"{context} context)", file=sys.stderr)
    run_sft(SFTConfig(model=model, out=str(path), env=ENV, env_kwargs={**args.env_kwargs, "num_chunks": num_chunks},
                      num_episodes=episodes, steps=steps, batch_episodes=batch, lr=lr,
                      warmup_steps=min(20, steps // 5), seed=seed, threads=args.threads, context=context),
            progress=args.progress)
    return path


TRANSCRIPT_AGENT = "agents.memagent:TranscriptMemAgent"
"""MemAgent acting in the persistent-history context (each call sees the flattened transcript)."""


def heldout_f1(model_dir: Path, b: Budget, env_kwargs: dict[str, Any] = ENV_KWARGS, agent: str = "memagent") -> float:
    """Held-out F1 of a model on the task setting ``env_kwargs`` (cached beside the model in
    heldout.json, or heldout-<setting>.json for a setting other than the default); with
    ``agent=TRANSCRIPT_AGENT``, acting in the persistent-history context (heldout-transcript*.json)."""
    from agents.models import load
    from memopd.learn.actor import Actor
    from memopd.train import TrainConfig

    cached = model_dir / f"heldout{'-transcript' if agent == TRANSCRIPT_AGENT else ''}{setting_tag(env_kwargs)}.json"
    if not cached.is_file():
        model, tok = load(model_dir)
        cfg = TrainConfig(env=ENV, env_kwargs=env_kwargs, agent=agent, eval_episodes=b.eval_episodes, progress=False)
        cached.write_text(json.dumps(Actor(cfg, model, tok).evaluate()))
    return json.loads(cached.read_text())["f1"]


def setting_tag(env_kwargs: dict[str, Any]) -> str:
    """'' for the default setting, else e.g. '-memory_budget=32' (names per-setting caches)."""
    return "".join(f"-{k}={v}" for k, v in sorted(env_kwargs.items()) if ENV_KWARGS.get(k, None) != v)


def heldout_nll(model_dir: Path, b: Budget, env_kwargs: dict[str, Any] = ENV_KWARGS) -> dict[str, float]:
    """Mean action NLL of a model on ``b.eval_episodes`` held-out oracle trajectories of the task, with
    each action in its call's own prompt (aligned) and in the flattened transcript (persistent);
    cached beside the model in heldout_nll.json."""
    import torch

    from agents.models import load
    from memopd.sft import SFTConfig, nll_loss, oracle_episodes

    cached = model_dir / f"heldout_nll{setting_tag(env_kwargs)}.json"
    if not cached.is_file():
        model, tok = load(model_dir)
        model.eval()
        episodes = oracle_episodes(ENV, env_kwargs, tok, b.eval_episodes, seed=30_000, split="test", progress=False)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        with torch.no_grad():
            nll = {c: nll_loss(model, episodes, SFTConfig().pack_tokens, pad, context=c)[0].item()
                   for c in ("aligned", "persistent")}
        cached.write_text(json.dumps(nll))
    return json.loads(cached.read_text())


# ------------------------------------------------------------------------------------------------
# 3. the arms
# ------------------------------------------------------------------------------------------------

def arm_config(arm: str, seed: int, student: Path, teacher: Path, run_dir: Path, b: Budget,
               args: argparse.Namespace):
    from memopd.train import TrainConfig

    return TrainConfig(env=ENV, env_kwargs=args.env_kwargs, model=str(student), teacher=str(teacher),
                       student_warmup_steps=0, run_dir=str(run_dir), steps=b.steps, seed=seed,
                       threads=args.threads, questions_per_step=b.questions_per_step, group_size=b.group_size,
                       max_new_tokens=b.max_new_tokens, ppo_epochs=b.ppo_epochs, lr=b.lr,
                       warmup_steps=b.rl_warmup_steps, ref_beta=b.ref_beta, entropy_coef=b.entropy_coef,
                       opd_divergence=b.divergence, eval_every=b.eval_every, eval_episodes=b.eval_episodes,
                       save_every=5, progress=args.progress, **ARMS[arm])


def run_path(out: Path, b: Budget, arm: str, seed: int, tree: str = "runs") -> Path:
    return out / tree / b.divergence / arm / f"seed-{seed}"


def run_arm(arm: str, seed: int, student: Path, teacher: Path, out: Path, b: Budget,
            args: argparse.Namespace) -> Path:
    from memopd.checkpoint import list_checkpoints
    from memopd.train import Trainer, prepare

    run_dir = run_path(out, b, arm, seed, args.tree)
    if (run_dir / "summary.json").is_file():
        REUSED.append(f"{arm}/seed-{seed}")
        return run_dir
    cfg = arm_config(arm, seed, student, teacher, run_dir, b, args)
    if list_checkpoints(run_dir):
        cfg = dataclasses.replace(cfg, resume=str(run_dir))
    print(f"== {arm}  seed {seed}" + ("  (resuming)" if cfg.resume else ""), file=sys.stderr)
    cfg = prepare(cfg, explicit={"progress", "threads"})
    quiet = lambda m: print(f"   {m}", file=sys.stderr, flush=True)  # noqa: E731
    Trainer(cfg, log=quiet).fit()
    return run_dir


# ------------------------------------------------------------------------------------------------
# 4. the report
# ------------------------------------------------------------------------------------------------

def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for arm, runs in results["curves"].items():
        n = min(len(c["f1"]) for c in runs.values())
        if n == 0:
            continue
        f1 = np.array([c["f1"][:n] for c in runs.values()])
        for ax, key in zip(axes, ("step", "seconds")):
            x = np.array([c[key][:n] for c in runs.values()]).mean(0)
            line, = ax.plot(x, f1.mean(0), marker="o", ms=3, label=f"{arm} (n={len(runs)})")
            sd = f1.std(0, ddof=1) if len(f1) > 1 else np.zeros(n)  # the table's std: over seeds, n - 1
            ax.fill_between(x, f1.mean(0) - sd, f1.mean(0) + sd, color=line.get_color(), alpha=0.15)
    teacher_f1 = results.get("teacher_f1")
    for ax, xlabel in zip(axes, ("training step", "training wall-clock (s, rollout + update)")):
        if teacher_f1 is not None:
            ax.axhline(teacher_f1, color="k", ls="--", lw=1, label="teacher")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out F1 (mean ± std over seeds)")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"{ENV} {json.dumps(results['env_kwargs'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def alignment_tables(out: Path, teacher: Path, seed: int, b: Budget, tree: str = "runs",
                     env_kwargs: dict[str, Any] = ENV_KWARGS, student_dir: Path | None = None) -> dict[str, Any]:
    """Per-turn state alignment on 32 test episodes sampled (temperature 1) by the trained MemOPD
    student of ``seed`` (its warm start when that arm did not run):
      - the sampling student re-scores its own actions: |log p - log p recorded|, aligned vs
        persistent (the pure state effect: same weights, only the context differs);
      - the teacher scores them: |log p_teacher - log p recorded| in each mode, and how far the
        persistent history moves the teacher's full distribution, KL(p_aligned || p_persistent)."""
    import gymnasium as gym

    import memgym  # noqa: F401
    from agents.backends.base import SamplingParams
    from agents.backends.hf import HFBackend
    from agents.memagent import MemAgent
    from agents.models import load
    from agents.rollout import rollout
    from memopd.alignment import state_alignment, teacher_shift
    from memopd.checkpoint import load_latest

    student, tok = load(student_dir or out / "student")
    run_dir = run_path(out, b, "ppo+memopd", seed, tree)
    source = "warm-start"
    if (run_dir / "summary.json").is_file():
        load_latest(run_dir, {"student": student})
        source = f"ppo+memopd (after {b.steps} steps)"
    envs = [gym.make(ENV, split="test", tokenizer=tok, **env_kwargs) for _ in range(8)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=b.max_new_tokens)
    episodes = rollout(envs, MemAgent(HFBackend(student, tok, seed=seed), sampling=sampling), 32, seed=20_000,
                       progress=False, run_id="alignment")
    teacher_model, _ = load(teacher)
    return {"episodes_from": source, "seed": seed,
            "student": state_alignment(student, episodes).to_dict(),
            "teacher": state_alignment(teacher_model, episodes).to_dict(),
            "teacher_shift": [vars(r) for r in teacher_shift(teacher_model, episodes)]}


def versions() -> dict[str, str]:
    import gymnasium
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "gymnasium": gymnasium.__version__,
            "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads"}


def markdown(results: dict[str, Any]) -> str:
    lines = [f"Held-out F1 ({results['budget']['eval_episodes']} test episodes, greedy) after "
             f"{results['budget']['steps']} steps; mean ± std over seeds {results['seeds']}. "
             f"Teacher F1 {results['teacher_f1']:.3f}; warm-start student "
             f"{results['before_f1'][0]:.3f} ± {results['before_f1'][1]:.3f}.", "",
             "| arm | F1 | EM | per seed | train s/step |", "|---|---|---|---|---|"]
    nll = results.get("teacher_nll")
    if nll:
        lines[1:1] = ["", "Teachers: held-out F1 acting in each context (aligned: MemAgent, each call its own "
                          "prompt; persistent: each call sees the flattened transcript), and mean action NLL "
                          f"(nats/token) on {results['budget']['eval_episodes']} held-out oracle trajectories in each "
                          "context.", "",
                      "| teacher (SFT context) | F1 aligned | F1 persistent | NLL aligned | NLL persistent |",
                      "|---|---|---|---|---|"]
        lines[6:6] = [f"| {name} | {row['f1']:.3f} | {row['f1_transcript']:.3f} | {row['aligned']:.3f} | "
                      f"{row['persistent']:.3f} |" for name, row in nll.items()]
    for arm, row in results["table"].items():
        lines.append(f"| {arm} | {row['f1'][0]:.3f} ± {row['f1'][1]:.3f} | {row['em'][0]:.3f} ± {row['em'][1]:.3f} | "
                     f"{', '.join(f'{x:.3f}' for x in row['per_seed'])} | {row['s_per_step']:.1f} |")
    al = results.get("alignment")
    if al:
        lines += ["", f"State alignment: 32 test episodes sampled by the {al['episodes_from']} student of seed "
                      f"{al['seed']}. Mean / max over each turn's sampled tokens of |log p re-scored - log p "
                      "recorded| (the student re-scoring its own samples; the teacher scoring them) and of the "
                      "teacher's full-vocabulary KL(p_aligned || p_persistent).", "",
                  "| turn | tokens | student aligned | student persistent | teacher aligned | teacher persistent "
                  "| teacher KL(aligned ‖ persistent) |", "|---|---|---|---|---|---|---|"]
        rows = {who: {m: {t["turn"]: t for t in al[who]["turns"][m]} for m in al[who]["turns"]}
                for who in ("student", "teacher")}
        shift = {t["turn"]: t for t in al["teacher_shift"]}
        for turn in sorted(rows["student"]["aligned"]):
            cells = [rows[w][m][turn] for w in ("student", "teacher") for m in ("aligned", "persistent")]
            cells.append(shift[turn])
            lines.append(f"| {turn} | {shift[turn]['tokens']} | "
                         + " | ".join(f"{c['mean_gap']:.2e} / {c['max_gap']:.2e}" for c in cells) + " |")
    reused = f" (it reused {len(results['reused'])} finished parts of an earlier one)" if results["reused"] else ""
    lines += ["", f"Wall-clock of this invocation: {results['wall_s'] / 60:.1f} min{reused}. Versions: "
                  + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + "."]
    return "\n".join(lines) + "\n"


def report(out: Path, teacher: Path, student: Path, args: argparse.Namespace, t0: float) -> dict[str, Any]:
    from memopd.runlog import heldout_curve

    b = args.budget
    curves: dict[str, dict[str, Any]] = {}
    table: dict[str, Any] = {}
    before, teacher_f1 = [], heldout_f1(teacher, b, args.env_kwargs)
    for arm in args.arm_list:
        finals, ems, secs = [], [], []
        for seed in args.seed_list:
            run_dir = run_path(out, b, arm, seed, args.tree)
            summary = json.loads((run_dir / "summary.json").read_text())
            curves.setdefault(arm, {})[str(seed)] = heldout_curve(run_dir)
            finals.append(summary["eval_after"]["f1"])
            ems.append(summary["eval_after"]["em"])
            secs.append(curves[arm][str(seed)]["seconds"][-1] / max(1, summary["steps"]))
            before.append(summary["eval_before"]["f1"])
        table[arm] = {"f1": mean_std(finals), "em": mean_std(ems), "per_seed": finals,
                      "s_per_step": sum(secs) / len(secs)}
    results = {"env": ENV, "env_kwargs": args.env_kwargs, "arms": {a: ARMS[a] for a in args.arm_list},
               "seeds": args.seed_list, "budget": dataclasses.asdict(b), "teacher_f1": teacher_f1,
               "before_f1": mean_std(before[: len(args.seed_list)]), "table": table, "curves": curves}
    if args.fair:
        results["teacher_nll"] = {f"{d} ({c})": {"f1": heldout_f1(out / d, b, args.env_kwargs),
                                                  "f1_transcript": heldout_f1(out / d, b, args.env_kwargs,
                                                                              TRANSCRIPT_AGENT),
                                                  **heldout_nll(out / d, b, args.env_kwargs)}
                                  for d, c in (("teacher", "aligned"), ("teacher-both", "both"))}
    if args.seed_list:
        results["alignment"] = alignment_tables(out, teacher, args.seed_list[0], b, args.tree, args.env_kwargs,
                                                student)
    results["wall_s"] = time.perf_counter() - t0
    results["reused"] = list(REUSED)
    results["versions"] = versions()
    results["command"] = "python examples/reproduce_memopd.py " + " ".join(args.argv)
    name = args.report_name
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))
    plot(results, out / f"{name.replace('results', 'curves')}.png")
    (out / f"{name}.md").write_text(markdown(results))
    return results


def given_model(path: str, flag: str) -> Path:
    """A finished model directory passed on the command line (checked before any work)."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise SystemExit(f"error: {flag} {path}: no model there (no config.json); pass a directory a finished SFT saved "
                         "(e.g. runs/reproduce/teacher)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    REUSED.clear()
    b = args.budget
    print(f"budget: {b}", file=sys.stderr)
    if args.teacher:
        teacher = given_model(args.teacher, "--teacher")
    else:
        teacher = sft_model("tiny-teacher", out / "teacher", b.teacher_steps, b.teacher_batch, b.teacher_episodes,
                            1000, b, args)
        if args.fair:  # the aligned teacher, fine-tuned further on both kinds of state (it stays, for the report)
            teacher = sft_model(str(teacher), out / "teacher-both", b.both_steps, b.teacher_batch,
                                b.teacher_episodes, 1001, b, args, context="both",
                                num_chunks=args.env_kwargs["num_chunks"], lr=1e-3)
    student = (given_model(args.student, "--student") if args.student
               else sft_model("tiny", out / "student", b.warmup_steps, b.warmup_batch, 1000, 7, b, args))
    print(f"held-out F1 on the task: teacher {heldout_f1(teacher, b, args.env_kwargs):.3f}, "
          f"warm student {heldout_f1(student, b, args.env_kwargs):.3f}", file=sys.stderr)
    for seed in args.seed_list:  # seed-major: a stopped experiment has whole seeds, every arm
        for arm in args.arm_list:
            run_arm(arm, seed, student, teacher, out, b, args)
    results = report(out, teacher, student, args, t0)
    print(markdown(results))
    name = args.report_name
    print(f"results: {out / f'{name}.md'}, {out / f'{name}.json'}, {out / (name.replace('results', 'curves') + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
