"""A student distilled from a teacher with another tokenizer, next to the same-tokenizer runs.

    python examples/other_tokenizer.py                      # the study (docs/RESULTS.md), 3 seeds
    python examples/other_tokenizer.py --smoke --out DIR    # the same path, a couple of steps (CI)
    python examples/other_tokenizer.py --student DIR        # every arm from this warm start instead

The task and budget are the embedded default's (``memopd.train`` with no flags: LongQA at its
defaults, the ``tiny`` student warm-started on oracle trajectories, then PPO + MemOPD). Two
teachers of the same shape, fine-tuned on oracle trajectories:

  same    ``--teacher auto``: ``tiny-teacher``, the student's tokenizer (``memopd.learn.models.
          TEACHER_SFT``: 250 SFT steps on 1,000 trajectories; held-out F1 1.0)
  other   ``tiny-teacher-bpe1k``: its own 1024-token BPE (task words split in two or three,
          other ids), fine-tuned here on trajectories in its own tokens by :data:`OTHER_TEACHER_SFT`
          (the same recipe stopped at 250 steps left it at held-out F1 0.0: its sequences are
          longer, and it needs 1,000 steps on 2,000 trajectories)

Arms, each for every seed, the same budget of steps and episodes:

  same-full      the full-vocabulary divergence to the same-tokenizer teacher (the embedded
                 default's; with --student, a model directory, the reverse KL)
  same-sampled   the sampled estimator of the reverse KL (k3 of the log-ratio at the sampled
                 token, as a loss)
  other-sampled  the same against the other-tokenizer teacher, each call scored in its tokens
                 and the log-probs shared back by text spans (memopd.retokenize)
  same-sampled-fkl, other-sampled-fkl
                 the sampled estimator of the forward KL (importance-weighted by teacher over
                 student at the sampled token), against either teacher, with one PPO epoch a
                 step (the others four)

  same-topk      the top-20 + tail estimator (the teacher's 20 most likely tokens and one bucket for
                 the rest) against the same-tokenizer teacher
  other-topk     the same against the other-tokenizer teacher: its 20 most likely tokens of its own
                 vocabulary and the tail, against the student's distribution summed onto them by
                 first pieces, at the first student token of each chunk (memopd.retokenize, rule 4)

  served-topk    the same-tokenizer teacher behind a stock ``vllm serve`` on 127.0.0.1 (started
                 here, with ``--vllm-python``'s vLLM), the top-20 + tail estimator, the served
                 log-probs audited against the local copy every 10 steps (asked for by name:
                 ``--arms served-topk``; it needs vLLM)

No divergence moves the embedded default's tiny warm start off its copy plateau but the full
forward KL (docs/teacher.md "What it can teach"). ``--student DIR`` starts every arm from a student
past that plateau instead (a model directory or training checkpoint, e.g. one of the embedded
default's own forward-KL run where its held-out F1 is 0.2-0.4), at the tiny preset's learning rate
unless --lr says otherwise. The default arms are those that learn from there: the sampled reverse
KL (same-sampled, other-sampled; asked for by name) fell to F1 0 with four PPO epochs.

same-sampled separates what the estimator costs from what the other tokenizer costs. Each arm is
its own ``python -m memopd.train`` (resumed after a kill); finished stages are skipped on a rerun.
Everything lands in --out: teacher-other/, runs/<arm>/seed-<s>/, results.json (every number and
curve), results.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ARMS: dict[str, list[str]] = {
    "same-full": [],
    "same-sampled": ["--opd-estimator", "sampled"],
    "other-sampled": ["--opd-estimator", "sampled"],  # + --teacher teacher-other
    # one PPO epoch: with four, every sampled arm fell to F1 0 (docs/teacher.md)
    "same-sampled-fkl": ["--opd-estimator", "sampled", "--opd-divergence", "fkl", "--ppo-epochs", "1"],
    "other-sampled-fkl": ["--opd-estimator", "sampled", "--opd-divergence", "fkl", "--ppo-epochs", "1"],  # + other
    "served-topk": ["--opd-estimator", "topk", "--opd-topk", "20"],  # + --teacher URL of the same teacher, served
    "same-topk": ["--opd-estimator", "topk", "--opd-topk", "20"],
    "other-topk": ["--opd-estimator", "topk", "--opd-topk", "20"],  # + other: its top-20 mapped by text
}


DEFAULT_ARMS = ("same-full", "same-sampled-fkl", "other-sampled-fkl", "same-topk", "other-topk")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default="runs/other-tokenizer", help="experiment directory")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, out of {list(ARMS)}")
    ap.add_argument("--vllm-python", default=sys.executable, help="served-topk: the Python that has vLLM")
    ap.add_argument("--steps", type=int, default=None, help="training steps per arm (default: the embedded default's)")
    ap.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every this many steps")
    ap.add_argument("--eval-episodes", type=int, default=64, help="held-out episodes per evaluation")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each run (runs go one after another)")
    ap.add_argument("--same-teacher", default=None, help="the same-tokenizer teacher (default: auto, the embedded "
                    "default's; smoke: the untrained tiny-teacher preset, which needs no build)")
    ap.add_argument("--student", default=None, help="warm-started student every arm starts from (a model directory "
                    "or checkpoint; default: the embedded default's, the tiny preset after its SFT warm-up)")
    ap.add_argument("--lr", type=float, default=None, help="learning rate of each arm (default: the embedded "
                    "default's, 0.002 for the tiny preset, also with --student)")
    ap.add_argument("--smoke", action="store_true", help="a couple of steps per stage: the path, not the result")
    args = ap.parse_args(argv)
    args.same_teacher = args.same_teacher or ("tiny-teacher" if args.smoke else "auto")
    if args.student is not None:
        from memopd.learn.models import TINY_LR

        if not Path(args.student).exists():
            ap.error(f"--student: {args.student} does not exist (give a model directory or training checkpoint)")
        # not a preset, so memopd.train would default to a pretrained model's rate: say the tiny one
        args.lr = TINY_LR if args.lr is None else args.lr
    args.seed_list = [int(s) for s in args.seeds.split(",") if s]
    args.arm_list = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(args.arm_list) - set(ARMS))
    if unknown:
        ap.error(f"--arms: unknown arm(s) {unknown}; choose from {list(ARMS)}")
    return args


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], logfile: Path) -> None:
    log("$ python " + " ".join(cmd))
    with logfile.open("a") as fh:
        code = subprocess.call([sys.executable, *cmd], stdout=fh, stderr=subprocess.STDOUT)
    if code != 0:
        sys.exit(f"error: `python {' '.join(cmd)}` failed (exit {code}); its output is in {logfile}")


OTHER_TEACHER_SFT = {"num_episodes": 2000, "steps": 1000}
"""The other-tokenizer teacher's recipe: the auto teacher's (``TEACHER_SFT``) with these changes."""


def other_teacher(out: Path, args: argparse.Namespace) -> Path:
    """tiny-teacher-bpe1k fine-tuned on oracle trajectories in its own tokens (:data:`OTHER_TEACHER_SFT`)."""
    from memopd.learn.models import TEACHER_SFT

    path = out / "teacher-other"
    if (path / "config.json").is_file():
        return path
    recipe = {**TEACHER_SFT, **OTHER_TEACHER_SFT, "model": "tiny-teacher-bpe1k"}
    if args.smoke:
        recipe.update(num_episodes=8, steps=2, batch_episodes=4)
    run(["-m", "memopd.sft", "--model", recipe["model"], "--out", str(path), "--num-episodes",
         str(recipe["num_episodes"]), "--steps", str(recipe["steps"]), "--batch-episodes", str(recipe["batch_episodes"]),
         "--lr", str(recipe["lr"]), "--seed", "1", "--threads", str(args.threads), "--no-progress"],
        out / "teacher-other.log")
    return path


def arm_command(arm: str, run_dir: Path, seed: int, teachers: dict[str, str], args: argparse.Namespace) -> list[str]:
    from memopd.checkpoint import list_checkpoints

    if list_checkpoints(run_dir):  # a served teacher's URL changes: the resume is told the new one
        extra = ["--teacher", teachers["served"]] if arm.startswith("served") else []
        return ["-m", "memopd.train", "--resume", str(run_dir), "--threads", str(args.threads), "--no-progress", *extra]
    cmd = ["-m", "memopd.train", "--run-dir", str(run_dir), "--seed", str(seed), "--eval-every", str(args.eval_every),
           "--eval-episodes", str(args.eval_episodes), "--threads", str(args.threads), "--no-progress",
           "--teacher", teachers[arm.split("-")[0]], *ARMS[arm]]
    if arm.startswith("served"):
        cmd += ["--teacher-audit-model", teachers["same-dir"], "--audit-every", "10"]
    if args.steps is not None:
        cmd += ["--steps", str(args.steps)]
    if args.student is not None:  # not a preset: no SFT warm-up
        cmd += ["--model", args.student]
    if args.lr is not None:
        cmd += ["--lr", str(args.lr)]
    if args.smoke:
        cmd += ["--steps", "2", "--questions-per-step", "2", "--group-size", "2", "--student-warmup-steps", "2",
                "--eval-every", "1", "--eval-episodes", "2", "--sample-episodes", "0"]
    return cmd


def mean_sd(xs: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def report(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    from memopd.runlog import heldout_curve, read_metrics

    runs: dict[str, dict[str, Any]] = {}
    for arm in ARMS:  # every finished run of these seeds, asked for in this invocation or an earlier one
        for seed in args.seed_list:
            d = out / "runs" / arm / f"seed-{seed}"
            if not (d / "summary.json").is_file():
                continue
            s = json.loads((d / "summary.json").read_text())
            rows = [r for r in read_metrics(d) if "step_s" in r]
            runs.setdefault(arm, {})[str(seed)] = {
                "before": s["eval_before"]["f1"], "after": s["eval_after"]["f1"], "teacher": (s["eval_teacher"] or {}).get("f1"),
                "curve": heldout_curve(d), "s_per_step": statistics.fmean(r["step_s"] for r in rows),
                "teacher_score_s": statistics.fmean(r.get("teacher/score_s", 0.0) for r in rows),
                "chunks_per_action": statistics.fmean(r.get("teacher/chunks_per_action", 1.0) for r in rows),
                "tokens_per_action": statistics.fmean(r.get("teacher/tokens_per_action", 1.0) for r in rows),
                "supervised_share": statistics.fmean(r.get("teacher/supervised_share", 1.0) for r in rows)}
    table = {arm: {k: mean_sd([r[k] for r in per.values()]) for k in ("before", "after", "s_per_step")}
             | {"teacher": per[next(iter(per))]["teacher"],
                "chunks_per_action": statistics.fmean(r["chunks_per_action"] for r in per.values()),
                "tokens_per_action": statistics.fmean(r["tokens_per_action"] for r in per.values()),
                "supervised_share": statistics.fmean(r.get("supervised_share", 1.0) for r in per.values())}
             for arm, per in runs.items()}
    results = {"seeds": args.seed_list, "eval_episodes": args.eval_episodes, "eval_every": args.eval_every,
               "steps": args.steps, "student": args.student, "lr": args.lr, "smoke": args.smoke, "table": table, "runs": runs,
               "command": "python examples/other_tokenizer.py " + " ".join(sys.argv[1:])}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"Held-out F1 ({args.eval_episodes} test episodes, greedy), mean +- sd over the seeds each arm ran "
             f"(of {args.seed_list}).", "",
             "| arm | seeds | teacher F1 | F1 before | F1 after | s / step | teacher tokens / action | chunks / action "
             "| actions supervised |", "|---|---|---|---|---|---|---|---|---|"]
    for arm, t in table.items():
        teacher = "-" if t["teacher"] is None else f"{t['teacher']:.3f}"  # a served teacher is not evaluated
        lines.append(f"| {arm} | {t['after']['n']} | {teacher} | {t['before']['mean']:.3f} | {t['after']['mean']:.3f} +- "
                     f"{t['after']['sd']:.3f} | {t['s_per_step']['mean']:.2f} | {t['tokens_per_action']:.2f} | "
                     f"{t['chunks_per_action']:.2f} | {t['supervised_share']:.3f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plot(runs, out / "curves.png")
    return results


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    """Held-out F1 by step: each seed thin, the mean over seeds thick, one colour per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (arm, per), colour in zip(runs.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        curves = [r["curve"] for r in per.values()]
        for c in curves:
            ax.plot(c["step"], c["f1"], color=colour, alpha=0.3, linewidth=0.8)
        steps = curves[0]["step"]
        if all(c["step"] == steps for c in curves):
            ax.plot(steps, [statistics.fmean(c["f1"][i] for c in curves) for i in range(len(steps))], color=colour,
                    linewidth=2, label=f"{arm} ({len(curves)} seed{'s' * (len(curves) > 1)})")
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out F1")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    teachers = {"same": args.same_teacher}
    if any(a.startswith("other") for a in args.arm_list):
        teachers["other"] = str(other_teacher(out, args))
    todo = [(seed, arm) for seed in args.seed_list for arm in args.arm_list  # seed by seed: whole seeds first
            if not (out / "runs" / arm / f"seed-{seed}" / "summary.json").is_file()]
    server = None
    if any(arm.startswith("served") for _, arm in todo):
        from agents.backends.vllm_serve import VLLMServer
        from memopd.learn.models import ensure_teacher
        from memopd.train import TrainConfig

        from agents.models import load

        # the model directory vllm serve reads (a preset's or the auto teacher's cache entry)
        teachers["same-dir"] = load(ensure_teacher(TrainConfig(teacher=args.same_teacher), log))[0].config._name_or_path
        server = VLLMServer(teachers["same-dir"], max_model_len=4096, max_logprobs=20, python=args.vllm_python,
                            lifetime_s=6 * 3600)
        teachers["served"] = server.start()
        log(f"teacher {teachers['same-dir']} served at {teachers['served']}")
    try:
        for seed, arm in todo:
            run_dir = out / "runs" / arm / f"seed-{seed}"
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            run(arm_command(arm, run_dir, seed, teachers, args), run_dir.parent / f"seed-{seed}.log")
    finally:
        if server is not None:
            server.stop()
    print((out / "results.md").read_text() if report(out, args) else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
