"""The long-horizon study, part 3: state-aligned against persistent-history scoring, across teachers.

    python examples/aligned_vs_persistent.py --out runs/long-horizon            # every cell, resumable (days on 2 cores)
    python examples/aligned_vs_persistent.py --lengths 6 --seeds 0             # the short length, one RL seed
    python examples/aligned_vs_persistent.py --cached-only --publish docs/data/aligned_vs_persistent/results.json
    python examples/aligned_vs_persistent.py --smoke --out DIR                 # the pipeline in minutes (CI)
    python examples/aligned_vs_persistent.py --resume-from docs/data/aligned_vs_persistent/results.json --lengths 6

MemOPD scores the teacher in the state the student acted in (``--teacher-context aligned``: each
call's own prompt, the memory the student wrote); the persistent alternative scores it on the
flattened history of the whole episode (``persistent``), as a chat-transcript distiller would. Over
2 teachers x 2 warm students at 3 chunks the gap between them changed sign with the teacher build
(+0.21, +0.17, -0.04, -0.02), while the teacher's shift, KL(p_aligned || p_persistent) on the
student's states, grows with the number of context updates (0.25 nats at 3 chunks, 2.27 at 24). So
the comparison is made over several fair teachers, at L and at a long training length:

  teachers   ``TEACHERS``: the auto teacher's recipe (``memopd.learn.models.TEACHER_SFT``: 250 SFT
             steps of 32 oracle trajectories at L) with six SFT seeds, and once with the student's
             smaller shape (``tiny-digits``): seven builds, each read on 256 test episodes at L
             (the recipe is seed-fragile at L: some seeds stay on the copy plateau, see FAIR_F1)
  lengths    ``LENGTHS``: L = 6 chunks (part 1's) and 24 chunks, in part 1's settings (LongQA, the
             digit presets, random numbering, chunks of 48 tokens, a 16-token memory); the teachers
             are trained at L (part 1 shows them holding their F1 to 192 chunks)
  runs       per teacher, length and RL seed (``--seeds``): part 1's MemOPD run (``memopd.train
             --model tiny-digits``: its warm start at the training length, then
             ``long_horizon.RL_STEPS`` steps of PPO + OPD) with the teacher, scored
             ``--teacher-context aligned`` and ``persistent``; each read greedy on the first 256 test
             episodes at its length; each aligned run trained at L also at 32L = 192 chunks (part 1's
             claim with another teacher build, ``f1_at_32L``)
  shift      per teacher and length: KL(p_aligned || p_persistent) of the teacher
             (``memopd.alignment.teacher_shift``) on 32 training episodes part 1's warm start sampled
             at temperature 1 at that length (states like those training starts from), the mean over
             the action tokens of every call after the first

A teacher below ``FAIR_F1`` at L is left out of the runs and the report says so. The report: per length, each teacher's gap F1(aligned) - F1(persistent) (mean over seeds), the mean
gap over teachers with the between-teacher sd, how many teachers' gaps are positive, and each gap
beside its teacher's shift (with the Pearson correlation over teachers and lengths). The reading:
aligned beats persistent at a length when every teacher's gap is positive, or the mean gap exceeds
twice its standard error over teachers; otherwise it does not hold there.

``--resume-from`` an earlier results JSON of this script (the published one, in a new checkout) takes
its readings as done (part 1's ``--resume-from``: the same task options and RL steps, or refused): a
reading it brings needs no teacher or run, so the study goes on where it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the study's other scripts, beside this file

import long_horizon as lh  # noqa: E402

TASK = "LongQA"
TEACHERS = {"t1": ("tiny-teacher-digits", 1), "t2": ("tiny-teacher-digits", 2), "t3": ("tiny-teacher-digits", 3),
            "t4": ("tiny-teacher-digits", 4), "t5": ("tiny-teacher-digits", 5), "t6": ("tiny-teacher-digits", 6),
            "small": ("tiny-digits", 1)}
"""Teacher name -> (model preset, SFT seed). ``t1`` is the auto teacher's own seed (``memopd.learn.models.TEACHER_SEED``)."""
FAIR_F1 = 0.5
"""A teacher the recipe did not teach the task (greedy F1 below this at L) is read and reported but
gets no runs: scored either way it teaches nothing the gap could measure (``t2``, the recipe with SFT
seed 2, answered 0.023 where seed 1 answered 0.859)."""
CONTEXTS = ("aligned", "persistent")
LENGTHS = (6, 24)
EPISODES = 256
SHIFT_EPISODES = 32
SMOKE = {"lengths": (3, 4), "teachers": ("t1", "small"), "episodes": 2, "shift_episodes": 2, "sft_steps": 2}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python examples/aligned_vs_persistent.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/long-horizon", help="part 1's directory (its warm start is reused)")
    p.add_argument("--teachers", default=",".join(TEACHERS), help=f"comma-separated teachers of {list(TEACHERS)}")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated training lengths (chunks)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds")
    lh.add_run_args(p)
    lh.add_resume_arg(p)
    args = p.parse_args(argv)
    args.teachers = [t for t in args.teachers.split(",") if t]
    if any(t not in TEACHERS for t in args.teachers):
        p.error(f"--teachers takes {list(TEACHERS)}, got {args.teachers}")
    try:
        args.lengths = [int(n) for n in args.lengths.split(",") if n]
        args.seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error("--lengths and --seeds take comma-separated integers")
    if args.smoke:
        args.lengths, args.teachers, args.seeds = list(SMOKE["lengths"]), list(SMOKE["teachers"]), args.seeds[:1]
    return args


def cached(key: str, args: argparse.Namespace) -> bool:
    """Whether the reading ``key`` is done (its row kept)."""
    return (home(args) / "rows" / f"{key}.json").is_file()


def resume(args: argparse.Namespace, short: int, far: int) -> None:
    """Take the readings of ``args.resume_from`` (this script's results JSON, the same settings) as
    rows: each teacher's F1 at L, each run's at its length and at 32L, each shift."""
    path = args.resume_from
    results = lh.read_results(path, "examples/aligned_vs_persistent.py", args.smoke)
    lh.refuse_unless_same(path, "task", (results.get("task"), results.get("env")), (TASK, lh.TASKS[TASK]))
    lh.refuse_unless_same(path, "RL steps", results.get("rl_steps"), lh.RL_STEPS)
    episodes = results.get("episodes")
    cells = [(f"teacher-{name}.json", {"key": f"teacher-{name}", "num_chunks": short, "f1": f1, "episodes": episodes})
             for name, f1 in results.get("teacher_f1", {}).items()]
    cells += [(f"shift-{s['teacher']}-{s['num_chunks']}.json", s) for s in results.get("shifts", [])]
    for run in results.get("runs", []):
        cells.append((f"{run['key']}.json", {k: run[k] for k in ("key", "num_chunks", "f1", "episodes")}))
        if "f1_at_32L" in run:
            key = f"{run['key']}-at-{far}"
            cells.append((f"{key}.json", {"key": key, "num_chunks": far, "f1": run["f1_at_32L"], "episodes": episodes}))
    lh.resume_rows(home(args) / "rows", cells, path)


def part1(args: argparse.Namespace) -> argparse.Namespace:
    """Part 1's options for its helpers (its settings, this --out)."""
    return lh.parse_args(["--out", args.out, "--tasks", TASK, "--threads", str(args.threads),
                          *(["--smoke"] if args.smoke else [])])


def home(args: argparse.Namespace) -> Path:
    return Path(args.out) / TASK / "aligned-vs-persistent"


# --- the teachers, the runs --------------------------------------------------------------------------------
def teacher(name: str, args: argparse.Namespace) -> Path:
    """A teacher by the auto teacher's recipe at L, with its model preset and SFT seed."""
    from memopd.learn.models import TEACHER_SFT
    from memopd.sft import SFTConfig, run as run_sft

    out = home(args) / "teachers" / name
    if (out / "config.json").is_file():
        return out
    model, seed = TEACHERS[name]
    one = part1(args)
    recipe = {**TEACHER_SFT, "model": model,
              **({"steps": SMOKE["sft_steps"], "num_episodes": 8, "batch_episodes": 4} if args.smoke else {})}
    run_sft(SFTConfig(env=lh.env_id(TASK), env_kwargs={**lh.TASKS[TASK], "num_chunks": one.train_chunks}, out=str(out),
                      seed=seed, threads=args.threads, progress=False, checkpoint_every=25, **recipe), progress=False)
    return out


def warm_start(args: argparse.Namespace) -> Path:
    """Part 1's warm start of the student (SFT on oracle trajectories), trained there when missing."""
    return lh.train_sft(TASK, "warm-start", 0, part1(args))


def train(name: str, context: str, n: int, seed: int, args: argparse.Namespace) -> Path:
    """PPO + OPD from the warm start with ``name`` scored ``context``, trained at ``n`` chunks."""
    from memopd import train as trainer

    run = home(args) / "runs" / f"{name}-{context}-{n}-s{seed}"
    if (run / "summary.json").is_file():
        return run
    argv = [*lh.env_argv(TASK, n), "--model", lh.STUDENT, "--seed", str(seed), "--threads", str(args.threads),
            "--no-progress", "--steps", str(lh.RL_STEPS), "--teacher", str(teacher(name, args)),
            "--teacher-context", context,
            *(lh.SMOKE["train"][:-2] if args.smoke else [])]  # the smoke's steps win; its teacher is left out
    if trainer.main(lh.rl_argv(run, argv)) != 0:
        raise SystemExit(f"error: the run {run} failed (its log above); rerun to resume it")
    return run


# --- the readings --------------------------------------------------------------------------------------------
def read(model: Callable[[], Path], n: int, key: str, args: argparse.Namespace) -> dict[str, Any]:
    """Greedy F1 of ``model()`` at ``n`` chunks on the first test episodes (one cell, kept; the model is
    built or trained only where the cell is not)."""
    from memopd.eval import evaluate

    path = home(args) / "rows" / f"{key}.json"
    if path.is_file():
        return json.loads(path.read_text())
    out = home(args) / "eval" / key
    count = SMOKE["episodes"] if args.smoke else EPISODES
    evaluate([*lh.env_argv(TASK, n), "--model", str(model()), "--episodes", str(count), "--temperature", "0",
              "--top-k", "1", "--threads", str(args.threads), "--no-progress", "--out", str(out), "--overwrite"])
    summary = json.loads((out / "summary.json").read_text())
    row = {"key": key, "num_chunks": n, "f1": summary["f1"], "episodes": summary["episodes"]}
    lh.write_row(path, row)
    return row


def shift(name: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """KL(p_aligned || p_persistent) of teacher ``name`` on the warm start's own states at ``n`` chunks:
    the mean over action tokens of the calls after the first, and per turn."""
    from agents.models import load
    from agents.records import load_episodes
    from memopd.alignment import teacher_shift
    from memopd.eval import evaluate

    path = home(args) / "rows" / f"shift-{name}-{n}.json"
    if path.is_file():
        return json.loads(path.read_text())
    sampled = home(args) / "warm-samples" / str(n)
    if not (sampled / "episodes.jsonl").is_file():
        count = SMOKE["shift_episodes"] if args.smoke else SHIFT_EPISODES
        evaluate([*lh.env_argv(TASK, n), "--model", str(warm_start(args)), "--split", "train", "--episodes",
                  str(count), "--temperature", "1", "--seed", "0", "--threads", str(args.threads), "--no-progress",
                  "--out", str(sampled), "--overwrite"])
    model, _ = load(str(teacher(name, args)))
    turns = teacher_shift(model, load_episodes(sampled / "episodes.jsonl").episodes)
    later = [t for t in turns if t.turn > 0 and t.tokens]
    tokens = sum(t.tokens for t in later)
    row = {"teacher": name, "num_chunks": n, "kl": sum(t.mean_gap * t.tokens for t in later) / tokens if tokens else 0.0,
           "turns": [{"turn": t.turn, "mean": t.mean_gap, "max": t.max_gap, "tokens": t.tokens} for t in turns]}
    lh.write_row(path, row)
    return row


# --- the report --------------------------------------------------------------------------------------------
def mean_sd(xs: Sequence[float]) -> tuple[float, float | None]:
    mu = sum(xs) / len(xs)
    return mu, (math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else None)


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    if len(xs) < 3:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sx, sy = math.sqrt(sum((x - mx) ** 2 for x in xs)), math.sqrt(sum((y - my) ** 2 for y in ys))
    return sxy / (sx * sy) if sx and sy else None


def summarise(runs: list[dict[str, Any]], shifts: list[dict[str, Any]], teachers: dict[str, float]) -> dict[str, Any]:
    """Per length: each teacher's F1 under each context (mean over seeds), its gap and shift; the mean
    gap over teachers with its between-teacher sd and se; the verdict (:func:`verdict`)."""
    out: dict[str, Any] = {"lengths": {}}
    kl = {(s["teacher"], s["num_chunks"]): s["kl"] for s in shifts}
    pairs = []
    for n in sorted({r["num_chunks"] for r in runs}):
        per: dict[str, Any] = {}
        for name in teachers:
            got = {c: [r["f1"] for r in runs if (r["teacher"], r["context"], r["num_chunks"]) == (name, c, n)]
                   for c in CONTEXTS}
            seeds = sorted({r["seed"] for r in runs if (r["teacher"], r["num_chunks"]) == (name, n)})
            both = [s for s in seeds if all(any((r["teacher"], r["context"], r["num_chunks"], r["seed"]) == (name, c, n, s)
                                                for r in runs) for c in CONTEXTS)]
            if not both:
                continue
            f1 = {c: sum(got[c]) / len(got[c]) for c in CONTEXTS}
            per[name] = {"teacher_f1": teachers[name], "seeds": len(both), **{f"f1_{c}": f1[c] for c in CONTEXTS},
                         "gap": f1["aligned"] - f1["persistent"], "shift_kl": kl.get((name, n))}
            at_32l = [r["f1_at_32L"] for r in runs if (r["teacher"], r["context"], r["num_chunks"]) == (name, "aligned", n)
                      and "f1_at_32L" in r]
            if at_32l:
                per[name]["f1_aligned_at_32L"] = sum(at_32l) / len(at_32l)
            if kl.get((name, n)) is not None:
                pairs.append((kl[(name, n)], per[name]["gap"]))
        if not per:
            continue
        gaps = [t["gap"] for t in per.values()]
        mu, sd = mean_sd(gaps)
        se = sd / math.sqrt(len(gaps)) if sd is not None else None
        out["lengths"][str(n)] = {"teachers": per, "mean_gap": mu, "sd_gap": sd, "se_gap": se,
                                  "positive": sum(g > 0 for g in gaps), "verdict": verdict(gaps, se)}
    out["gap_vs_shift_pearson"] = pearson([p[0] for p in pairs], [p[1] for p in pairs])
    return out


def verdict(gaps: Sequence[float], se: float | None) -> str:
    """Aligned beats persistent when every teacher's gap is positive (at least 3 teachers), or the
    mean gap is above twice its standard error over teachers."""
    mu = sum(gaps) / len(gaps)
    if len(gaps) < 3:
        return f"not tested yet: {len(gaps)} teacher(s), 3 needed"
    if all(g > 0 for g in gaps) or (se is not None and mu > 2 * se):
        return f"holds: mean gap {mu:+.3f} over {len(gaps)} teachers, {sum(g > 0 for g in gaps)} positive"
    return f"does not hold: mean gap {mu:+.3f} over {len(gaps)} teachers, {sum(g > 0 for g in gaps)} positive"


def plot(results: dict[str, Any], path: Path) -> None:
    """F1 against training length (log axis) under each context, the mean over teachers with a ±sd
    band between teachers and each teacher's F1 as a dot (left); each teacher's gap against its
    shift KL(aligned || persistent), a marker per length (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    lengths = results["summary"]["lengths"]
    xs = sorted(int(n) for n in lengths)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for context, colour in zip(CONTEXTS, ("tab:blue", "tab:red")):
        per = [[t[f"f1_{context}"] for t in lengths[str(n)]["teachers"].values()] for n in xs]
        mu = [mean_sd(v)[0] for v in per]
        sd = [mean_sd(v)[1] or 0.0 for v in per]
        left.errorbar(xs, mu, yerr=sd, marker="o", capsize=4, color=colour, label=f"{context} (mean over teachers, ±sd)")
        left.fill_between(xs, [m - s for m, s in zip(mu, sd)], [m + s for m, s in zip(mu, sd)], color=colour, alpha=0.15)
        for n, v in zip(xs, per):
            left.scatter([n] * len(v), v, s=10, color=colour, alpha=0.5)
    left.set_xscale("log", base=2)
    left.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    left.set_xticks(xs)
    left.set_ylim(-0.02, 1.02)
    left.set_xlabel("training length (chunks)")
    left.set_ylabel("held-out F1 at the training length")
    left.set_title(f"{results['task']}: PPO + OPD, teacher scored aligned or persistent")
    left.legend(fontsize=7)
    for n, marker in zip(xs, "osD^v"):
        teachers = lengths[str(n)]["teachers"]
        got = [(t["shift_kl"], t["gap"], name) for name, t in teachers.items() if t["shift_kl"] is not None]
        right.scatter([g[0] for g in got], [g[1] for g in got], marker=marker, label=f"{n} chunks")
        for kl, gap, name in got:
            right.annotate(name, (kl, gap), fontsize=7, xytext=(3, 3), textcoords="offset points")
    right.axhline(0, color="grey", lw=0.8)
    right.set_xlabel("teacher shift KL(aligned || persistent) on the warm start's states (nats)")
    right.set_ylabel("gap F1(aligned) - F1(persistent)")
    right.set_title("each teacher's gap against its shift")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def far_length(args: argparse.Namespace) -> int:
    """32L, where part 1's claim is read: each aligned run trained at L is read there too, part 1's
    MemOPD student with another teacher build."""
    return lh.SMOKE["lengths"][-1] if args.smoke else lh.LENGTHS[-1]


def fair(teachers: dict[str, float], smoke: bool = False) -> list[str]:
    """The teachers that get runs: those the recipe taught the task (every one in a smoke run, whose
    teachers train two steps)."""
    return [name for name, f1 in teachers.items() if smoke or f1 >= FAIR_F1]


def command(args: argparse.Namespace) -> str:
    parts = ["python examples/aligned_vs_persistent.py", *(["--smoke"] if args.smoke else [])]
    if not args.smoke:
        for flag, value, default in (("--teachers", args.teachers, list(TEACHERS)),
                                     ("--lengths", args.lengths, list(LENGTHS)), ("--seeds", args.seeds, [0, 1, 2])):
            if value != default:
                parts.append(f"{flag} {','.join(map(str, value))}")
    return " ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import memgym  # noqa: F401  (registers the envs)

    t0 = time.perf_counter()
    teachers: dict[str, float] = {}
    runs, shifts = [], []
    short, far = part1(args).train_chunks, far_length(args)
    if args.resume_from:
        resume(args, short, far)
    for name in args.teachers:  # the cheap readings first: a teacher's F1 and shifts, then its runs
        if cached(f"teacher-{name}", args) or not args.cached_only:
            row = read(partial(teacher, name, args), short, f"teacher-{name}", args)
            teachers[name] = row["f1"]
        for n in args.lengths:
            if cached(f"shift-{name}-{n}", args) or not args.cached_only:
                shifts.append(shift(name, n, args))
    fit = fair(teachers, args.smoke)
    for n in args.lengths:
        for seed in args.seeds:
            for name in (t for t in args.teachers if t in fit):
                for context in CONTEXTS:
                    key = f"{name}-{context}-{n}-s{seed}"
                    if not cached(key, args) and args.cached_only:
                        continue
                    run = partial(train, name, context, n, seed, args)  # trained only where the reading is not kept
                    row = {**read(run, n, key, args), "teacher": name, "context": context, "seed": seed}
                    if context == "aligned" and n == short and far > n:
                        key_far = f"{key}-at-{far}"  # part 1's claim with this teacher build
                        if cached(key_far, args) or not args.cached_only:
                            row["f1_at_32L"] = read(run, far, key_far, args)["f1"]
                    runs.append(row)
    summary = summarise(runs, shifts, teachers)
    import torch
    import transformers

    results = {"command": command(args), "task": TASK, "env": lh.TASKS[TASK], "teachers": {t: TEACHERS[t] for t in args.teachers},
               "lengths": args.lengths, "seeds": args.seeds, "rl_steps": lh.RL_STEPS, "episodes": EPISODES,
               "teacher_f1": teachers, "fair_f1": FAIR_F1, "unfair": [t for t in teachers if t not in fit],
               "summary": summary,
               "verdicts": {n: got["verdict"] for n, got in summary["lengths"].items()},
               "runs": runs, "shifts": shifts, "wall_s_this_invocation": time.perf_counter() - t0,
               "versions": {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__}}
    lh.save(results, home(args) / "results.json", args.publish)
    return 0


if __name__ == "__main__":
    sys.exit(main())
