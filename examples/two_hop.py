"""The main comparison on a harder task: 2-hop LongQA, with a teacher taught by a curriculum.

    python examples/two_hop.py                       # the study (docs/RESULTS.md)
    python examples/two_hop.py --smoke --exp DIR     # the pipeline in about a minute (CI)

The task is examples/reproduce_memopd.py's with `hops=2`: the question asks for the city of the
company a person works at, so the memory must keep `alice acme .` until the chunk that says
`acme paris .` arrives, and the answer is the second fact's object. Everything else (6 chunks of
48 tokens, a 16-token memory, the four arms, the budget, 3 seeds) is the reproduction's.

The teacher. Fine-tuned from scratch on 2-hop oracle trajectories with the reproduction's recipe
(250 steps of 32), `tiny-teacher` stays on its plateau (held-out F1 0.03). A curriculum teaches
it: start from the reproduction's 1-hop teacher, then 250 steps of 2-hop SFT (lr 3e-3), then 250
more (lr 1e-3). Each stage is kept, its held-out F1 is reported, and the SFT loss curves of all
of them are plotted. The warm student is the reproduction's recipe on 2-hop trajectories.

The student, too, can start from 1-hop competence (`--curriculum-student`, on by default): the
reproduction's trained MemOPD student (the fair control's `ppo+memopd`, seed 0, after its 40
steps on the 1-hop task) runs the same arms as a second warm start, in runs-curriculum/ with the
report results-curriculum-<divergence>.*.

Everything lands in --exp (default runs/reproduce-2hop): teacher/ (from scratch), teacher-from-1hop/
and teacher-from-1hop-500/ (the curriculum's two stages), student/, runs/<divergence>/<arm>/seed-<s>/,
the reproduction's report results-<divergence>.* and this study's two-hop.md / .json /
two-hop-sft.png. The 1-hop teacher is read from (or built in) --one-hop-exp (default runs/reproduce).
A rerun reuses finished work; a killed run resumes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from imperfect_teacher import load_reproduce  # noqa: E402  (examples/ is not a package)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--exp", default="runs/reproduce-2hop", help="this study's experiment directory")
    ap.add_argument("--one-hop-exp", default="runs/reproduce", help="the reproduction's directory (its 1-hop teacher)")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds")
    ap.add_argument("--arms", default=None, help="comma-separated arms (default: the reproduction's four)")
    ap.add_argument("--curriculum-student", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the arms from the 1-hop MemOPD student (runs-curriculum/)")
    ap.add_argument("--curriculum-seeds", default=None, help="seeds of the curriculum student's arms (default: --seeds)")
    ap.add_argument("--smoke", action="store_true", help="a tiny budget that checks the pipeline, not the result")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bars")
    return ap.parse_args(argv)


def teachers(rep, exp: Path, one_hop: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The from-scratch 2-hop teacher and the curriculum's stages (each built once, then reused)."""
    flags = ["--threads", str(args.threads), "--no-progress" if not args.progress else "--progress"] \
        + (["--smoke"] if args.smoke else [])
    one = rep.parse_args(flags)
    two = rep.parse_args(flags + ["--env-kwarg", "hops=2"])
    b = two.budget
    base = rep.sft_model("tiny-teacher", one_hop / "teacher", b.teacher_steps, b.teacher_batch, b.teacher_episodes,
                         1000, b, one)
    scratch = rep.sft_model("tiny-teacher", exp / "teacher", b.teacher_steps, b.teacher_batch, b.teacher_episodes,
                            1000, b, two)
    stage1 = rep.sft_model(str(base), exp / "teacher-from-1hop", b.teacher_steps, b.teacher_batch,
                           b.teacher_episodes, 1000, b, two)
    stage2 = rep.sft_model(str(stage1), exp / "teacher-from-1hop-500", b.teacher_steps, b.teacher_batch,
                           b.teacher_episodes, 1002, b, two, lr=1e-3)
    return {"1-hop teacher": base, "2-hop from scratch": scratch, "curriculum stage 1": stage1,
            "curriculum stage 2": stage2}


def one_hop_memopd_student(rep, one_hop: Path, args: argparse.Namespace) -> Path:
    """The fair control's trained MemOPD student of seed 0 (its final model), trained when missing."""
    b = rep.parse_args(["--smoke"] if args.smoke else []).budget
    run = rep.run_path(one_hop, b, "ppo+memopd", 0, "runs-fair")
    if not (run / "model" / "config.json").is_file():
        rep.main(["--out", str(one_hop), "--teacher-sft-context", "both", "--arms", "ppo+memopd", "--seeds", "0",
                  "--threads", str(args.threads), "--progress" if args.progress else "--no-progress"]
                 + (["--smoke"] if args.smoke else []))
    return run / "model"


def sft_losses(model_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (model_dir / "sft_metrics.jsonl").read_text().splitlines()]


def plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name, lw=1.2)
    ax.set_yscale("log")
    ax.set_xlabel("SFT step (of 32 oracle trajectories, 3 chunks)")
    ax.set_ylabel("action NLL (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    rep = load_reproduce()
    t0 = time.perf_counter()
    exp, one_hop = Path(args.exp), Path(args.one_hop_exp)
    exp.mkdir(parents=True, exist_ok=True)
    found = teachers(rep, exp, one_hop, args)
    b = rep.parse_args(["--smoke"] if args.smoke else []).budget
    two_hop = {**rep.ENV_KWARGS, "hops": 2}
    f1 = {name: rep.heldout_f1(path, b, two_hop) for name, path in found.items()}
    argv_rep = ["--out", str(exp), "--env-kwarg", "hops=2", "--teacher", str(found["curriculum stage 2"]),
                "--seeds", args.seeds, "--threads", str(args.threads),
                "--progress" if args.progress else "--no-progress"] + (["--smoke"] if args.smoke else []) \
        + (["--arms", args.arms] if args.arms else [])
    rep.main(argv_rep)
    one_hop_student = None
    if args.curriculum_student:
        one_hop_student = one_hop_memopd_student(rep, one_hop, args)
        rep.main(argv_rep + ["--student", str(one_hop_student), "--name", "curriculum",
                             "--seeds", args.curriculum_seeds or args.seeds])
    curves = {"1-hop task, from scratch": sft_losses(found["1-hop teacher"]),
              "2-hop task, from scratch": sft_losses(found["2-hop from scratch"]),
              "2-hop task, from the 1-hop teacher": sft_losses(found["curriculum stage 1"])
              + sft_losses(found["curriculum stage 2"])}
    plot(curves, exp / "two-hop-sft.png")
    results: dict[str, Any] = {"teacher_f1_2hop": f1, "curriculum_student": str(one_hop_student), "sft_final_loss": {k: v[-1] for k, v in curves.items()},
                               "wall_s": time.perf_counter() - t0, "versions": rep.versions(),
                               "command": "python examples/two_hop.py " + " ".join(sys.argv[1:])}
    lines = [f"Teachers' held-out F1 on the 2-hop task ({b.eval_episodes} test episodes, greedy):", "",
             "| teacher | SFT | F1 (2-hop) |", "|---|---|---|"]
    how = {"1-hop teacher": "the reproduction's (1-hop task)", "2-hop from scratch": "2-hop, from scratch",
           "curriculum stage 1": "2-hop, from the 1-hop teacher", "curriculum stage 2": "stage 1 + 250 steps at lr 1e-3"}
    lines += [f"| {name} | {how[name]} | {f1[name]:.3f} |" for name in found]
    lines += ["", f"Wall-clock of this invocation: {results['wall_s'] / 60:.1f} min. The arms' tables: "
                  f"results-{b.divergence}.md (the 2-hop warm student) and results-curriculum-{b.divergence}.md "
                  "(the 1-hop MemOPD student)."]
    (exp / "two-hop.json").write_text(json.dumps(results, indent=2))
    (exp / "two-hop.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
