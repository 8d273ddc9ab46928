"""The memory ladder: MemOPD and the aligned-vs-persistent gap as the memory budget grows.

    python examples/memory_ladder.py                    # the study (docs/RESULTS.md); reuses runs/reproduce
    python examples/memory_ladder.py --smoke --exp DIR  # the pipeline in about a minute (CI)

The fair matched control of examples/reproduce_memopd.py (teacher fine-tuned on aligned states and
flattened transcripts, `--teacher-sft-context both`) at memory budgets 8, 16, 32 and 64 tokens, the
task otherwise unchanged (6 chunks of 48 tokens). At every budget the same teacher and warm student,
and the same two arms, for each of --seeds:
  ppo+memopd        PPO + OPD, the teacher scores the state-aligned calls
  ppo+opd-persist   PPO + OPD, the teacher scores the flattened history
The gap is the aligned arm's held-out F1 minus the persistent arm's, and beside it how far the
flattened history moves the teacher's next-token distribution (mean KL(p_aligned || p_persistent)
per token over the turns after the first, on episodes of the trained MemOPD student of the first
seed: the state-alignment table's last column).

Budget 16 is the fair control itself (runs-fair/, built here when missing); the others run in
runs-mem<M>/ with reports results-mem<M>-<divergence>.*. The ladder's own report is
memory-ladder.md / .json / .png in --exp. A rerun reuses finished work; a killed run resumes.
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

ARMS = ("ppo+memopd", "ppo+opd-persist")
FAIR_BUDGET = 16
"""The reproduction's memory budget: this rung is the fair control's runs."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--exp", default="runs/reproduce", help="the reproduction's experiment directory (shared)")
    ap.add_argument("--budgets", default="8,16,32,64", help="comma-separated memory budgets (tokens)")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds")
    ap.add_argument("--divergence", choices=("fkl", "rkl"), default="fkl", help="the distillation divergence")
    ap.add_argument("--smoke", action="store_true", help="a tiny budget that checks the pipeline, not the result")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bars")
    args = ap.parse_args(argv)
    args.budget_list = sorted(int(m) for m in args.budgets.split(",") if m)
    args.seed_list = [int(s) for s in args.seeds.split(",") if s]
    if not args.budget_list or min(args.budget_list) < 1:
        ap.error("--budgets: give positive token counts, e.g. 8,16,32,64")
    return args


def rung(rep, exp: Path, m: int, args: argparse.Namespace) -> str:
    """Train (or reuse) one budget's two arms; returns the study name its runs and report are under."""
    common = ["--out", str(exp), "--threads", str(args.threads), "--divergence", args.divergence,
              "--seeds", args.seeds, "--arms", ",".join(ARMS), "--progress" if args.progress else "--no-progress"] \
        + (["--smoke"] if args.smoke else [])
    if m == FAIR_BUDGET:  # the fair control itself (its report carries both teachers' NLL)
        b = rep.parse_args(common).budget
        if not all((rep.run_path(exp, b, arm, s, "runs-fair") / "summary.json").is_file()
                   for arm in ARMS for s in args.seed_list):  # else keep the fair report as it is
            rep.main(common + ["--teacher-sft-context", "both"])
        return "fair"
    if not (exp / "teacher-both" / "config.json").is_file():  # the teacher and student the ladder shares
        rep.main(common + ["--teacher-sft-context", "both", "--seeds", args.seeds.split(",")[0]])
    rep.main(common + ["--teacher", str(exp / "teacher-both"), "--student", str(exp / "student"),
                       "--env-kwarg", f"memory_budget={m}", "--name", f"mem{m}"])
    return f"mem{m}"


def ladder_row(rep, exp: Path, name: str, m: int, args: argparse.Namespace) -> dict[str, Any]:
    """One budget's numbers, read from its run directories (the seeds asked for) and its report's
    state-alignment table."""
    b = rep.parse_args(["--smoke"] if args.smoke else []).budget
    finals = {arm: [json.loads((rep.run_path(exp, b, arm, s, f"runs-{name}") / "summary.json").read_text())
                    ["eval_after"]["f1"] for s in args.seed_list] for arm in ARMS}
    gaps = [a - p for a, p in zip(finals["ppo+memopd"], finals["ppo+opd-persist"])]
    res = json.loads((exp / f"results-{name}-{args.divergence}.json").read_text())
    shift = [t["mean_gap"] for t in res["alignment"]["teacher_shift"] if t["turn"] > 0]
    teacher_f1 = rep.heldout_f1(exp / "teacher-both", b, {**rep.ENV_KWARGS, "memory_budget": m})
    return {"study": name, "teacher_f1": teacher_f1, "per_seed": finals,
            "aligned": rep.mean_std(finals["ppo+memopd"]), "persistent": rep.mean_std(finals["ppo+opd-persist"]),
            "gap": rep.mean_std(gaps), "per_seed_gap": gaps, "teacher_kl": sum(shift) / len(shift)}


def plot(rows: dict[int, dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = sorted(rows)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for key, label in (("aligned", "PPO + MemOPD (aligned)"), ("persistent", "PPO + OPD (persistent history)")):
        axes[0].errorbar(ms, [rows[m][key][0] for m in ms], yerr=[rows[m][key][1] for m in ms], marker="o",
                         capsize=3, label=label)
    axes[0].plot(ms, [rows[m]["teacher_f1"] for m in ms], "k--", lw=1, label="teacher")
    axes[0].set_ylabel("held-out F1 (mean ± std over seeds)")
    axes[1].plot(ms, [rows[m]["teacher_kl"] for m in ms], marker="o", color="C3")
    axes[1].set_ylabel("teacher KL(aligned ‖ persistent), nats/token")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("memory budget (tokens)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    rep = load_reproduce()
    t0 = time.perf_counter()
    exp = Path(args.exp)
    exp.mkdir(parents=True, exist_ok=True)
    names = {m: rung(rep, exp, m, args) for m in args.budget_list}
    rows = {m: ladder_row(rep, exp, names[m], m, args) for m in args.budget_list}
    results = {"budgets": args.budget_list, "seeds": args.seed_list, "divergence": args.divergence, "rows": rows,
               "wall_s": time.perf_counter() - t0, "versions": rep.versions(),
               "command": "python examples/memory_ladder.py " + " ".join(sys.argv[1:])}
    lines = [f"Held-out F1 after training at each memory budget (6 chunks of 48 tokens), mean ± std over seeds "
             f"{args.seed_list}; gap = aligned - persistent per seed; teacher KL = mean KL(p_aligned ‖ "
             "p_persistent) per token on turns 1-6, episodes of the first seed's MemOPD student.", "",
             "| memory budget | teacher F1 | PPO + MemOPD (aligned) | PPO + OPD (persistent) | gap | teacher KL |",
             "|---|---|---|---|---|---|"]
    for m in args.budget_list:
        r = rows[m]
        lines.append(f"| {m} | {r['teacher_f1']:.3f} | {r['aligned'][0]:.3f} ± {r['aligned'][1]:.3f} | "
                     f"{r['persistent'][0]:.3f} ± {r['persistent'][1]:.3f} | {r['gap'][0]:+.3f} ± {r['gap'][1]:.3f} | "
                     f"{r['teacher_kl']:.2f} |")
    lines += ["", f"Wall-clock of this invocation: {results['wall_s'] / 60:.1f} min. Versions: "
                  + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + "."]
    (exp / "memory-ladder.json").write_text(json.dumps(results, indent=2))
    (exp / "memory-ladder.md").write_text("\n".join(lines) + "\n")
    plot(rows, exp / "memory-ladder.png")
    print("\n".join(lines))
    print(f"results: {exp / 'memory-ladder.md'}, {exp / 'memory-ladder.json'}, {exp / 'memory-ladder.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
