"""What the reward adds: an imperfect teacher, and OPD only vs PPO + MemOPD vs PPO.

    python examples/imperfect_teacher.py                    # the study (docs/RESULTS.md); reuses runs/reproduce
    python examples/imperfect_teacher.py --smoke --exp DIR  # the pipeline in about a minute (CI)

The teacher of examples/reproduce_memopd.py is near perfect (held-out F1 0.97), so a student that
distils it has nothing left for the task reward to teach. Here the teacher has a systematic blind
spot instead: it is fine-tuned exactly as that teacher, on the same oracle trajectories, except that
every trajectory whose answer is one of a third of the companies (every ``--blind-every``-th of the
LongQA company list) is left out. It never sees those company words in any input or output, so it
cannot copy them into a memory or an answer: on the task it scores about 2/3.

The warm student (the reproduction's ``student/``: SFT on all companies, copies the person's name,
not yet the company) then trains with the reproduction's budget under three arms:
  ppo          the F1 reward alone                             (the reward sees every company)
  ppo+memopd   reward + state-aligned distillation of the blind teacher
  opd-only     the blind teacher's distillation alone          (--reward none)
Held-out F1 is split by whether the answer is a company the teacher is blind to: on those, a
student above the teacher has passed it.

A partial blind spot (``--blind-share 0.1``): the teacher's data keeps that share of the blind
companies' trajectories instead of none, so it knows them a little and a student's samples
sometimes name them, which the reward can reinforce. With ``--student DIR`` (e.g. the signal
study's mid-plateau warm start) and the reproduction's budget options (``--group-size 8``...) the
arms start where PPO has a signal.

Everything lands in --exp (default runs/reproduce, shared with the reproduction): teacher-blind/
(the teacher and its training trajectories), runs-imperfect/<divergence>/<arm>/seed-<s>/ and the
reports results-imperfect-<divergence>.* (the reproduction's) and imperfect.md / imperfect.json
(the blind-spot split); with --blind-share S, teacher-blind-S/ and the study name imperfect-S
(--name to choose another). A rerun reuses finished work; a killed run resumes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
ARMS = ("ppo", "ppo+memopd", "opd-only")


def load_reproduce():
    """examples/reproduce_memopd.py as a module (examples/ is not a package)."""
    if "reproduce_memopd" in sys.modules:
        return sys.modules["reproduce_memopd"]
    spec = importlib.util.spec_from_file_location("reproduce_memopd", HERE / "reproduce_memopd.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def blind_companies(every: int) -> list[str]:
    """The companies the teacher never sees: every ``every``-th of LongQA's list."""
    from memgym.generators.longqa import COMPANIES

    return list(COMPANIES[::every])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--exp", default="runs/reproduce", help="the reproduction's experiment directory (shared)")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms out of {list(ARMS)}")
    ap.add_argument("--blind-every", type=int, default=3,
                    help="the teacher is blind to every N-th company (N=3: a third of them)")
    ap.add_argument("--blind-share", type=float, default=0.0,
                    help="the share of the blind companies' trajectories the teacher's data keeps (0: none, a "
                         "full blind spot; 0.1: a partial one)")
    ap.add_argument("--student", default=None, metavar="DIR",
                    help="the warm student (default: the reproduction's student/ in --exp)")
    ap.add_argument("--name", default=None, help="the study's name (default imperfect, or imperfect-S with "
                                                 "--blind-share S)")
    ap.add_argument("--rep-arg", action="append", default=[], metavar="ARG",
                    help="an option for the reproduction's budget, e.g. --rep-arg=--group-size=8 (repeatable)")
    ap.add_argument("--divergence", choices=("fkl", "rkl"), default="fkl", help="the distillation divergence")
    ap.add_argument("--steps", type=int, default=None, help="training steps per arm (default: the reproduction's)")
    ap.add_argument("--smoke", action="store_true", help="a tiny budget that checks the pipeline, not the result")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bars")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.arms.split(",")) - set(ARMS))
    if unknown:
        ap.error(f"--arms: unknown arm(s) {unknown}; choose from {list(ARMS)}")
    if args.blind_every < 2:
        ap.error("--blind-every must be at least 2 (1 would blind the teacher to every company)")
    if not 0.0 <= args.blind_share < 1.0:
        ap.error("--blind-share must be in [0, 1)")
    suffix = f"-{args.blind_share:g}" if args.blind_share else ""
    args.name = args.name or f"imperfect{suffix}"
    args.teacher_dir = f"teacher-blind{suffix}"
    return args


def keep_share(items: Sequence[Any], is_blind: Any, share: float) -> list[Any]:
    """``items`` in order, less the blind ones but a ``share`` of them: the k-th blind item is kept
    when ``floor(k * share)`` steps up there (share 0.5: the 2nd, 4th, ...; 0: none)."""
    kept, k = [], 0
    for item in items:
        if is_blind(item):
            k += 1
            if int(k * share) == int((k - 1) * share):
                continue
        kept.append(item)
    return kept


def build_teacher(rep, exp: Path, b, blind: list[str], args: argparse.Namespace) -> Path:
    """The reproduction's teacher recipe on the oracle trajectories whose answer it is not blind to
    (and ``--blind-share`` of the others)."""
    from agents.models import load
    from agents.records import save_episodes
    from memopd.sft import SFTConfig, oracle_episodes, run as run_sft

    path = exp / args.teacher_dir
    if (path / "config.json").is_file():
        print(f"{args.teacher_dir}: reusing {path}", file=sys.stderr)
        return path
    data = exp / f"{args.teacher_dir}-data" / "episodes.jsonl"
    kwargs = {**rep.ENV_KWARGS, "num_chunks": b.sft_chunks}
    if not data.is_file():
        _, tok = load("tiny-teacher")
        # a third fewer usable trajectories: draw half as many again, keep the reproduction's count
        drawn = oracle_episodes(rep.ENV, kwargs, tok, b.teacher_episodes * 3 // 2, seed=1000, progress=args.progress)
        kept = keep_share(drawn, lambda e: bool(set(e.answers) & set(blind)), args.blind_share)[: b.teacher_episodes]
        n_blind = sum(bool(set(e.answers) & set(blind)) for e in kept)
        data.parent.mkdir(parents=True, exist_ok=True)
        save_episodes(data, kept)
        print(f"{args.teacher_dir}: {len(kept)} of {len(drawn)} oracle trajectories kept, {n_blind} of them about "
              f"the {len(blind)} blind companies", file=sys.stderr)
    run_sft(SFTConfig(model="tiny-teacher", out=str(path), env=rep.ENV, env_kwargs=kwargs, episodes=str(data),
                      steps=b.teacher_steps, batch_episodes=b.teacher_batch, lr=3e-3,
                      warmup_steps=min(20, b.teacher_steps // 5), seed=1000, threads=args.threads),
            progress=args.progress)
    return path


def split_f1(model: Any, tok: Any, blind: list[str], b, rep) -> dict[str, float]:
    """Held-out F1 (the trainer's evaluation: greedy, test seeds 10_000 + g) over all episodes and
    split by whether the gold company is one the teacher is blind to."""
    from memopd.learn.actor import Actor
    from memopd.train import TrainConfig

    cfg = TrainConfig(env=rep.ENV, env_kwargs=rep.ENV_KWARGS, eval_episodes=b.eval_episodes, progress=False)
    eps = Actor(cfg, model, tok).heldout_episodes()
    part = {"all": eps, "blind": [e for e in eps if set(e.answers) & set(blind)],
            "seen": [e for e in eps if not set(e.answers) & set(blind)]}
    out = {k: (sum(e.metrics["f1"] for e in v) / len(v) if v else float("nan")) for k, v in part.items()}
    out["n_blind"] = len(part["blind"])
    return out


def cached_split(path: Path, compute) -> dict[str, float]:
    if not path.is_file():
        path.write_text(json.dumps(compute()))
    return json.loads(path.read_text())


def report(rep, exp: Path, teacher: Path, blind: list[str], args: argparse.Namespace, b, t0: float) -> dict[str, Any]:
    from agents.models import load
    from memopd.checkpoint import load_latest

    model, tok = load(teacher)
    rows = {"teacher (blind)": [cached_split(teacher / f"heldout_split-n{b.eval_episodes}.json",
                                             lambda: split_f1(model, tok, blind, b, rep))]}
    student = Path(args.student) if args.student else exp / "student"
    model, tok = load(student)
    rows["warm student"] = [cached_split(student / f"heldout_split-blind{args.blind_every}-n{b.eval_episodes}.json",
                                         lambda: split_f1(model, tok, blind, b, rep))]
    for arm in args.arms.split(","):
        rows[arm] = []
        for seed in args.seed_list:
            run_dir = rep.run_path(exp, b, arm, seed, f"runs-{args.name}")

            def compute() -> dict[str, float]:
                m, t = load(student)
                load_latest(run_dir, {"student": m})
                return split_f1(m, t, blind, b, rep)

            rows[arm].append(cached_split(run_dir / "heldout_split.json", compute))
    table = {name: {k: rep.mean_std([r[k] for r in rs]) for k in ("all", "seen", "blind")} for name, rs in rows.items()}
    results = {"blind_companies": blind, "seeds": args.seed_list, "rows": rows, "table": table,
               "budget": {"steps": b.steps, "eval_episodes": b.eval_episodes, "divergence": b.divergence},
               "wall_s": time.perf_counter() - t0, "versions": rep.versions(),
               "command": "python examples/imperfect_teacher.py " + " ".join(sys.argv[1:])}
    lines = [f"Held-out F1 ({b.eval_episodes} test episodes, greedy) after {b.steps} steps, mean ± std over seeds "
             f"{args.seed_list}; split by whether the gold company is one of the {len(blind)} the teacher never saw "
             f"({rows['teacher (blind)'][0]['n_blind']} of the {b.eval_episodes} test questions).", "",
             "| model | F1 all | F1 seen companies | F1 blind companies |", "|---|---|---|---|"]
    for name, row in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[k][0]:.3f} ± {row[k][1]:.3f}" for k in ("all", "seen", "blind"))
                     + " |")
    lines += ["", f"Wall-clock of this invocation: {results['wall_s'] / 60:.1f} min. Versions: "
                  + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + "."]
    (exp / f"{args.name}.json").write_text(json.dumps(results, indent=2))
    (exp / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    rep = load_reproduce()
    t0 = time.perf_counter()
    exp = Path(args.exp)
    exp.mkdir(parents=True, exist_ok=True)
    common = ["--out", str(exp), "--threads", str(args.threads), "--divergence", args.divergence,
              "--progress" if args.progress else "--no-progress"] + (["--smoke"] if args.smoke else []) \
        + (["--steps", str(args.steps)] if args.steps else []) + args.rep_arg
    base = rep.parse_args(common)  # the reproduction's budget and settings
    b = base.budget
    blind = blind_companies(args.blind_every)
    teacher = build_teacher(rep, exp, b, blind, args)
    if args.student is None:
        rep.sft_model("tiny", exp / "student", b.warmup_steps, b.warmup_batch, 1000, 7, b, base)  # or reuse it
    student = Path(args.student) if args.student else exp / "student"
    args.seed_list = [int(s) for s in args.seeds.split(",") if s]
    rep.main(common + ["--teacher", str(teacher), "--student", str(student), "--name", args.name,
                       "--arms", args.arms, "--seeds", args.seeds])
    results = report(rep, exp, teacher, blind, args, b, t0)
    print((exp / f"{args.name}.md").read_text())
    print(f"results: {exp / f'{args.name}.md'}, {exp / f'{args.name}.json'}, "
          f"{exp / f'results-{args.name}-{args.divergence}.md'}")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
