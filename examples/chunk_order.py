"""What the prompt order costs: MemAgent's order (memory, then the chunk) vs the chunk first.

    python examples/chunk_order.py                      # the comparison of docs/RESULTS.md (about an hour)
    python examples/chunk_order.py --smoke --out DIR    # the pipeline in about a minute (CI)

With the chunk before the memory (``MemAgent(template="memagent-chunk-first")``) the samples of a
question also share every turn's chunk in the packed rows (fewer tokens to compute: see
docs/BENCHMARKS.md, "Group-shared packing"). This asks whether a tiny model learns as well when the
memory comes after the chunk. Each order gets the embedded default's pipeline, in its own layout:

  1. teacher   `tiny-teacher` fine-tuned by memopd.sft on 1,000 oracle trajectories written in
               that order (the auto teacher's recipe: 250 steps of 32)
  2. student   the `tiny` preset warm-started by 100 SFT steps on those trajectories (the
               embedded default's warm start)
  3. train     `python -m memopd.train --env memgym/LongQA-v0` with the embedded default's
               settings (80 steps of 8 questions x 4 samples, 4 PPO epochs, forward KL, lr 2e-3),
               the agent `memagent` with the order's template, one seed per run

Reported per order: the teacher's held-out F1, the student's held-out F1 before and after
training (mean and std over seeds), the stored tokens a step packs, and the median step time.
Everything lands in --out (default runs/chunk-order): <order>/teacher, <order>/student,
<order>/seed-<s>/ (run directories), results.json and results.md. Finished stages are reused;
an unfinished run resumes from its last checkpoint. Runs go ``--jobs`` at a time (one torch thread
each).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

ENV = "memgym/LongQA-v0"
ORDERS = {"memagent": "memory, then the chunk (MemAgent's)", "memagent-chunk-first": "the chunk, then the memory"}
FULL = {"teacher_steps": 250, "teacher_episodes": 1000, "batch": 32, "warmup_steps": 100, "train": []}
SMOKE = {"teacher_steps": 2, "teacher_episodes": 8, "batch": 4, "warmup_steps": 2,
         "train": ["--steps", "2", "--questions-per-step", "2", "--group-size", "2", "--ppo-epochs", "1",
                   "--eval-episodes", "4", "--max-new-tokens", "12"]}


def sft(model: str, out: Path, order: str, steps: int, episodes: int, batch: int, seed: int, warmup: int) -> Path:
    """memopd.sft of ``model`` on oracle trajectories in ``order``'s layout (reused when done)."""
    from agents.models import load, save_pretrained
    from memopd.sft import SFTConfig, oracle_episodes, train_sft

    if (out / "config.json").is_file():
        print(f"{out}: reusing", file=sys.stderr)
        return out
    print(f"{out}: SFT of {model}, {steps} steps of {batch} oracle trajectories ({order})", file=sys.stderr)
    import torch

    torch.manual_seed(seed)
    m, tok = load(model)
    eps = oracle_episodes(ENV, {}, tok, episodes, seed=seed, progress=False, template=order)
    cfg = SFTConfig(model=model, steps=steps, batch_episodes=batch, lr=3e-3, warmup_steps=warmup, seed=seed)
    history = train_sft(m, eps, cfg, pad_token_id=tok.pad_token_id or 0, progress=False)
    save_pretrained(out, m, tok, files={"sft_metrics.jsonl": "".join(json.dumps(r) + "\n" for r in history)})
    return out


def train(order: str, seed: int, teacher: Path, student: Path, out: Path, extra: list[str]) -> Path:
    """One run of memopd.train (a subprocess, one thread; resumed when it has checkpoints)."""
    run_dir = out / order / f"seed-{seed}"
    if (run_dir / "summary.json").is_file():
        print(f"{run_dir}: reusing", file=sys.stderr)
        return run_dir
    cmd = [sys.executable, "-m", "memopd.train", "--env", ENV, "--agent", "memagent",
           "--agent-kwarg", f"template={order}", "--teacher", str(teacher), "--model", str(student),
           "--student-warmup-steps", "0", "--lr", "2e-3", "--opd-divergence", "fkl", "--seed", str(seed),
           "--threads", "1", "--no-progress", *extra]
    cmd += ["--resume", str(run_dir)] if (run_dir / "checkpoints").is_dir() else ["--run-dir", str(run_dir)]
    print(f"== {order} seed {seed}", file=sys.stderr, flush=True)
    log = out / order / f"seed-{seed}.log"
    with log.open("a") as fh:
        done = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{order} seed {seed} failed (exit {done.returncode}); see {log}")
    return run_dir


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0


def run_stats(run_dir: Path) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "step_s" in r and "tokens_per_s" in r]
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    epochs = tomllib.loads((run_dir / "config.toml").read_text()).get("ppo_epochs", 4)
    # stored tokens a step packs: tokens_per_s counts them once per PPO epoch over the learn time
    stored = [r["tokens_per_s"] * (r["step_s"] - r["rollout_s"]) / epochs for r in steps]
    curve = {r["step"]: r["eval/f1"] for r in rows if "eval/f1" in r}
    return {"curve": curve, "f1_before": summary["eval_before"]["f1"], "f1_after": summary["eval_after"]["f1"],
            "f1_teacher": (summary.get("eval_teacher") or {}).get("f1"),
            "stored_tokens": statistics.median(stored) if stored else None,
            "step_s": statistics.median(r["step_s"] for r in steps[1:]) if len(steps) > 1 else None}


def report(out: Path, seeds: list[int], wall: float) -> dict[str, Any]:
    res: dict[str, Any] = {"seeds": seeds, "wall_s": wall, "orders": {}}
    for order in ORDERS:
        runs = [run_stats(out / order / f"seed-{s}") for s in seeds]
        agg = {k: mean_std([r[k] for r in runs if r[k] is not None]) for k in runs[0] if k != "curve" and
               any(r[k] is not None for r in runs)}
        steps = sorted(set.intersection(*(set(r["curve"]) for r in runs)))
        curve = {t: mean_std([r["curve"][t] for r in runs]) for t in steps}
        res["orders"][order] = {"runs": runs, **{k: {"mean": m, "std": sd} for k, (m, sd) in agg.items()},
                                "curve": {"mean": {t: m for t, (m, _) in curve.items()},
                                          "std": {t: sd for t, (_, sd) in curve.items()}}}
    (out / "results.json").write_text(json.dumps(res, indent=2))
    lines = ["| prompt order | teacher F1 | student F1 before | student F1 after (mean ± std) | per seed | "
             "stored tokens a step | step s |", "|---|---|---|---|---|---|---|"]
    for order, r in res["orders"].items():
        per = ", ".join(f"{x['f1_after']:.3f}" for x in r["runs"])
        lines.append(f"| {ORDERS[order]} | {r['f1_teacher']['mean']:.3f} | {r['f1_before']['mean']:.3f} | "
                     f"{r['f1_after']['mean']:.3f} ± {r['f1_after']['std']:.3f} | {per} | "
                     f"{r['stored_tokens']['mean']:.0f} | {r['step_s']['mean']:.2f} |")
    steps = list(next(iter(res["orders"].values()))["curve"]["mean"])
    lines += ["", "| prompt order | " + " | ".join(f"F1 at step {t}" for t in steps) + " |",
              "|---|" + "---|" * len(steps)]
    for order, r in res["orders"].items():
        lines.append(f"| {ORDERS[order]} | " + " | ".join(
            f"{r['curve']['mean'][t]:.3f} ± {r['curve']['std'][t]:.3f}" for t in steps) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return res


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/chunk-order", help="experiment directory")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds of the training runs")
    ap.add_argument("--jobs", type=int, default=2, help="training runs at a time (one torch thread each)")
    ap.add_argument("--smoke", action="store_true", help="a tiny budget that checks the pipeline, not the result")
    args = ap.parse_args(argv)
    from memopd.runtime import set_threads

    set_threads(1)  # one thread a process: on a shared 2-core machine more threads thrash
    b = SMOKE if args.smoke else FULL
    out, seeds, t0 = Path(args.out), [int(s) for s in args.seeds.split(",") if s], time.perf_counter()
    made = {}
    for order in ORDERS:
        teacher = sft("tiny-teacher", out / order / "teacher", order, b["teacher_steps"], b["teacher_episodes"],
                      b["batch"], seed=1, warmup=min(20, b["teacher_steps"] // 5))
        student = sft("tiny", out / order / "student", order, b["warmup_steps"], b["teacher_episodes"],
                      b["batch"], seed=2, warmup=min(10, b["warmup_steps"] // 5))
        made[order] = (teacher, student)
    jobs = [(o, s) for s in seeds for o in ORDERS]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(lambda j: train(j[0], j[1], *made[j[0]], out, b["train"]), jobs))
    report(out, seeds, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
