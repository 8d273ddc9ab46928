"""The length positive control: retrieval + a teacher trained at 6 chunks, read at up to 192 chunks.

    python examples/length_control.py                         # the study (docs/RESULTS.md, "Length-robust inputs")
    python examples/length_control.py --smoke --out DIR       # the pipeline in about a minute (CI)

The task is the length ladder's (examples/length_ladder.py): `memgym/LongQA-v0`, one fact among
filler, chunks of 48 tokens, a 16-token memory. Each arm fine-tunes a teacher with the auto
teacher's recipe (`memopd.learn.models.TEACHER_SFT`: 250 SFT steps of 32 oracle trajectories, from
1,000) in stages, one per `--sft-chunks` length: first on 3-chunk episodes (a tiny teacher trained
on 6-chunk episodes alone stays on its copy plateau, docs/RESULTS.md), then on the 6-chunk task,
as the length ladder's teacher was. It then evaluates the teacher greedily on `--eval-episodes` test
episodes at each of `--lengths` chunks as `rag-memagent` (BM25 ranks the chunks, the teacher runs
its memory call on the top-1 chunk, then answers), and as `memagent` at the training length. The
arms:

  before       tiny-teacher,        numbering=sequential   (the presets and labels of the length ladder)
  digits       tiny-teacher-digits, numbering=sequential   (digit tokens alone)
  random       tiny-teacher,        numbering=random       (random labels alone)
  after        tiny-teacher-digits, numbering=random       (both: the claim, >= 0.95 at 192 chunks)

Retrieval is exact on this task (no distractor facts), so what falls with length is what the
model reads in the retrieved chunk: its `Document K:` labels. Everything lands in --out (default
runs/length-control): teacher-<arm>/ (the SFT teachers), cache/<arm>-<agent>-<n>-<episodes>.json
(one per evaluation, reused by a rerun), results.json. An evaluation is a few seconds (retrieval
makes two model calls an episode at any length); the SFT stages are most of the time. `--smoke` runs two arms with a few SFT steps, 2
lengths and 4 episodes: it checks the pipeline, not the result.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ENV = "memgym/LongQA-v0"
ENV_KWARGS = {"chunk_size": 48, "memory_budget": 16}
TRAIN_CHUNKS = 6
SFT_CHUNKS = (3, 6)
"""The SFT stages' lengths: the last is the training length."""
LENGTHS = (6, 12, 24, 48, 96, 192)
ARMS = {  # name -> (teacher preset, numbering)
    "before": ("tiny-teacher", "sequential"),
    "digits": ("tiny-teacher-digits", "sequential"),
    "random": ("tiny-teacher", "random"),
    "after": ("tiny-teacher-digits", "random"),
}
SMOKE = {"arms": ("before", "after"), "lengths": (6, 12), "episodes": 4, "steps": 4, "sft_episodes": 16}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python examples/length_control.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/length-control", help="the study's directory (reused by a rerun)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms of {sorted(ARMS)}")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="chunks to evaluate at")
    p.add_argument("--eval-episodes", type=int, default=256, help="test episodes per (arm, length)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared machine)")
    p.add_argument("--smoke", action="store_true", help="the pipeline in about a minute (tiny sizes)")
    args = p.parse_args(argv)
    args.arms = list(SMOKE["arms"]) if args.smoke else [a for a in args.arms.split(",") if a]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        p.error(f"unknown arm(s) {unknown}; choose from {sorted(ARMS)}")
    args.lengths = list(SMOKE["lengths"]) if args.smoke else [int(n) for n in args.lengths.split(",") if n]
    if args.smoke:
        args.eval_episodes = SMOKE["episodes"]
    return args


def env_kwargs(numbering: str, num_chunks: int) -> dict[str, Any]:
    return {**ENV_KWARGS, "num_chunks": num_chunks, "numbering": numbering}


def teacher(arm: str, args: argparse.Namespace) -> Path:
    """The arm's SFT teacher: the auto teacher's recipe, one stage per length of ``SFT_CHUNKS``
    (each stage starts from the last), each stage built once."""
    from memopd.learn.models import TEACHER_SFT
    from memopd.sft import SFTConfig, run as run_sft

    preset, numbering = ARMS[arm]
    model = preset
    for stage, chunks in enumerate(SFT_CHUNKS):
        out = Path(args.out) / f"teacher-{arm}" / f"stage-{stage}-{chunks}"
        if not (out / "config.json").is_file():
            recipe = {**TEACHER_SFT, "model": model}
            if args.smoke:
                recipe.update(steps=SMOKE["steps"], num_episodes=SMOKE["sft_episodes"], batch_episodes=4)
            print(f"{arm}: SFT of {model} on {recipe['num_episodes']} oracle trajectories, {chunks} chunks, "
                  f"numbering={numbering}, {recipe['steps']} steps", flush=True)
            run_sft(SFTConfig(env=ENV, env_kwargs=env_kwargs(numbering, chunks), out=str(out), seed=1 + stage,
                              threads=args.threads, progress=False, **recipe), progress=False)
        model = str(out)
    return Path(model)


def evaluate(arm: str, agent: str, n: int, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Greedy F1 of ``agent`` with the arm's teacher on ``n`` chunks (cached per evaluation)."""
    from agents.records import load_episodes
    from memopd.eval import evaluate as run_eval

    cache = Path(args.out) / "cache" / f"{arm}-{agent}-{n}-{args.eval_episodes}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    numbering = ARMS[arm][1]
    where = Path(args.out) / "evals" / f"{arm}-{agent}-{n}-{args.eval_episodes}"
    argv = ["--env", ENV, "--agent", agent, "--model", str(model), "--episodes", str(args.eval_episodes),
            "--temperature", "0", "--top-k", "1", "--threads", str(args.threads), "--no-progress", "--out", str(where)]
    for key, value in env_kwargs(numbering, n).items():
        argv += ["--env-kwarg", f"{key}={value}"]
    t0 = time.perf_counter()
    summary = run_eval(argv)
    f1 = [e.metrics.get("f1", 0.0) for e in load_episodes(where / "episodes.jsonl").episodes]
    mean = sum(f1) / len(f1)
    sd = math.sqrt(sum((x - mean) ** 2 for x in f1) / (len(f1) - 1)) if len(f1) > 1 else 0.0
    row = {"arm": arm, "agent": agent, "chunks": n, "numbering": numbering, "teacher": ARMS[arm][0],
           "f1": mean, "se": sd / math.sqrt(len(f1)), "episodes": len(f1), "em": summary["em"],
           "peak_context": summary["peak_context"], "wall_s": time.perf_counter() - t0}
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(row, indent=2) + "\n")
    print(f"{arm} {agent} @ {n} chunks: F1 {mean:.3f} +- {row['se']:.3f} (se, {len(f1)} episodes)", flush=True)
    return row


def table(results: dict[str, Any]) -> str:
    """The markdown table of docs/RESULTS.md, from results.json (tests/test_length_control.py rebuilds it)."""
    lengths = results["lengths"]
    head = "| arm (teacher, numbering) | memagent @ 6 | " + " | ".join(f"RAG @ {n}" for n in lengths) + " |"
    lines = [head, "|---" * (len(lengths) + 2) + "|"]
    for arm in results["arms"]:
        rows = {(r["agent"], r["chunks"]): r for r in results["rows"] if r["arm"] == arm}
        preset, numbering = ARMS[arm]
        cells = [_cell(rows.get(("memagent", TRAIN_CHUNKS)))] + [_cell(rows.get(("rag-memagent", n))) for n in lengths]
        lines.append(f"| {arm} ({preset}, {numbering}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(row: dict[str, Any] | None) -> str:
    return "-" if row is None else f"{row['f1']:.3f} ± {row['se']:.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import memgym  # noqa: F401  (registers the envs)
    from memopd.runtime import set_threads

    set_threads(args.threads)
    t0 = time.perf_counter()
    rows = []
    for arm in args.arms:
        model = teacher(arm, args)
        rows.append(evaluate(arm, "memagent", TRAIN_CHUNKS, model, args))
        rows += [evaluate(arm, "rag-memagent", n, model, args) for n in args.lengths]
    import torch
    import transformers

    results = {"env": ENV, "env_kwargs": ENV_KWARGS, "train_chunks": TRAIN_CHUNKS, "arms": args.arms,
               "lengths": args.lengths, "eval_episodes": args.eval_episodes, "rows": rows,
               "command": " ".join(["python examples/length_control.py", *(sys.argv[1:] if argv is None else argv)]),
               "wall_s_this_invocation": time.perf_counter() - t0,
               "versions": {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__}}
    out = Path(args.out) / "results.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
