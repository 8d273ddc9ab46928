"""The long-horizon study, part 4: SmolLM2-135M trained at L chunks, read at L, 8L and 32L.

    python examples/smollm2_at_length.py --out runs/smollm2-memopd                 # trains what is missing, resumable
    python examples/smollm2_at_length.py --policies memopd,fullcontext --lengths 2,64
    python examples/smollm2_at_length.py --cached-only --publish docs/data/smollm2_at_length/results.json
    python examples/smollm2_at_length.py --smoke --out DIR                          # the pipeline in minutes (CI)
    python examples/smollm2_at_length.py --resume-from docs/data/smollm2_at_length/results.json --lengths 2,16,64,256

SmolLM2's tokenizer writes every number digit by digit, so the document numbers of a long input are
pieces it has seen (the tiny presets needed digit presets for that). Its window is 8,192 tokens, so at
32L of the SmolLM2 study's task (LongQA, natural facts, L = 2 chunks of 64 tokens: 32L is 64 chunks,
about 4,100 tokens) a full-context reader is in its own range and its run is fair. Every policy is
trained at L by ``examples/smollm2_memopd.py`` (its three-seed setting: 24 steps of 2 questions x 4
samples), in the same --out, run by this script when its model is missing:

  memopd       PPO + MemOPD from the untouched SmolLM2 against the teacher (the arm's export)
  sft-student  SFT of the untouched SmolLM2 on as many oracle trajectories (192)
  teacher      SmolLM2 fine-tuned on 400 oracle trajectories (the MemOPD arm's teacher)
  warm-start   SmolLM2-135M-Instruct as downloaded (the MemOPD and SFT students' start), as a memory
               agent (F1 0 at L: it cannot show a drop)
  fullcontext  SmolLM2 fine-tuned by the teacher's recipe (30 steps of 8, lr 1e-4) on 400 records
               of the whole L-chunk input in one prompt with the gold answer (``FullContextOracle``),
               read as ``--agent fullcontext``: the same model, reading the input whole

Each is read greedy on the first ``EPISODES`` test episodes at every length (``LENGTHS``), one cell
per policy and length (at-length/rows/, a rerun recomputes nothing), in float32. The report is part 1's:
F1 against length, F1(32L) - F1(L) with its bootstrap lower bound over episodes (one seed), F1
against the chunks read after the fact, the retention fit, and the claim's verdict with part 1's
contrast (a policy that can fall must score 0.3 at L and drop by 0.3).

``--resume-from`` an earlier results JSON of this script (the published one, in a new checkout) takes
its cells as done (part 1's ``--resume-from``: the same env, episodes, dtype and training, or refused).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the study's other scripts, beside this file

import long_horizon as lh  # noqa: E402
import smollm2_memopd as sm  # noqa: E402

TASK = "LongQA-smollm2"
LENGTHS = (2, 16, 64)
"""L, 8L and 32L chunks of 64 SmolLM2 tokens."""
EPISODES = 64
DTYPE = "float32"
"""As the arms were read in training (bfloat16 was no faster here: 2.5 model calls/s against 2.4 at 16
chunks, batches of 8)."""
POLICIES = ("memopd", "fullcontext", "teacher", "sft-student", "warm-start")
TRAINING = ["--arms", "ppo+memopd", "--questions-per-step", "2", "--group-size", "4", "--seed", "0"]
"""The students' run of ``examples/smollm2_memopd.py`` (its three-seed setting, seed 0)."""
SMOKE = {"lengths": (2, 3), "episodes": 2, "models": ["--smoke", "--student", "tiny", "--teacher-base", "tiny-teacher"]}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python examples/smollm2_at_length.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/smollm2-memopd", help="examples/smollm2_memopd.py's directory (its models)")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated policies of {list(POLICIES)}")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated lengths in chunks (the "
                   "first is L)")
    lh.add_run_args(p, "tiny models and sizes: the pipeline, not the result")
    lh.add_resume_arg(p)
    args = p.parse_args(argv)
    args.policies = [x for x in args.policies.split(",") if x]
    if any(x not in POLICIES for x in args.policies):
        p.error(f"--policies takes {list(POLICIES)}, got {args.policies}")
    try:
        args.lengths = sorted({int(n) for n in args.lengths.split(",") if n})
    except ValueError:
        p.error(f"--lengths takes comma-separated chunk counts, got {args.lengths!r}")
    if args.smoke:
        args.lengths = list(SMOKE["lengths"])
    args.episodes = SMOKE["episodes"] if args.smoke else EPISODES
    args.tasks, args.seeds = [TASK], [0]  # part 1's report reads these
    return args


def env_kwargs(n: int) -> dict[str, Any]:
    return {**sm.ENV_KWARGS, "num_chunks": n}


def env_argv(n: int) -> list[str]:
    return ["--env", sm.ENV, *[a for k, v in env_kwargs(n).items() for a in ("--env-kwarg", f"{k}={v}")]]


def students(args: argparse.Namespace) -> Path:
    """The teacher, the MemOPD student's export and the SFT-only student (trained once, resumable)."""
    out = Path(args.out)
    made = [out / "teacher", out / "export" / "student", out / "sft-student"]
    if not all((m / "config.json").is_file() for m in made):
        code = sm.main(["--out", str(out), "--threads", str(args.threads), *TRAINING,
                        *(SMOKE["models"] if args.smoke else [])])
        if code:
            raise SystemExit(f"error: examples/smollm2_memopd.py exited {code}; its log is in {out}")
    return out


def reader(args: argparse.Namespace) -> Path:
    """The full-context reader: SmolLM2 fine-tuned by the teacher's recipe on whole-input records at L."""
    from memopd.eval import evaluate as run_eval
    from memopd.sft import SFTConfig, run as run_sft

    out = Path(args.out) / "fullcontext"
    if (out / "config.json").is_file():
        return out
    b, base = (sm.SMOKE if args.smoke else sm.Budget()), ("tiny-teacher" if args.smoke else "smollm2")
    gold = Path(args.out) / "fullcontext-gold"
    if not (gold / "episodes.jsonl").is_file():
        run_eval([*env_argv(args.lengths[0]), "--agent", "agents.baselines:FullContextOracle", "--model", base,
                  "--split", "train", "--episodes", str(b.sft_episodes), "--seed", "0", "--no-progress",
                  "--out", str(gold), "--overwrite"])
    run_sft(SFTConfig(model=base, episodes=str(gold / "episodes.jsonl"), out=str(out), seed=1000, threads=args.threads,
                      progress=False, steps=b.sft_steps, batch_episodes=b.sft_batch, lr=b.sft_lr,
                      warmup_steps=max(1, b.sft_steps // 10), checkpoint_every=10), progress=False)
    return out


def model_of(policy: str, args: argparse.Namespace) -> tuple[str, list[str]]:
    """The model to read and the agent flags of ``memopd.eval``."""
    if policy == "warm-start":
        return ("tiny" if args.smoke else "smollm2"), []
    if policy == "fullcontext":
        return str(reader(args)), ["--agent", "fullcontext", "--batch-size", "4"]
    out = students(args)
    return str({"memopd": out / "export" / "student", "sft-student": out / "sft-student",
                "teacher": out / "teacher"}[policy]), []


def eval_cell(policy: str, n: int, args: argparse.Namespace) -> dict[str, Any] | None:
    """One policy at one length: its per-episode F1 and the chunks read after each sample's fact."""
    from agents.records import load_episodes
    from memopd.eval import evaluate as run_eval

    row_path = Path(args.out) / "at-length" / "rows" / f"{policy}-{n}.json"
    if row_path.is_file():
        return json.loads(row_path.read_text())
    if args.cached_only:
        return None
    model, agent = model_of(policy, args)
    out = Path(args.out) / "at-length" / "eval" / f"{policy}-{n}"
    b = sm.Budget()
    t0 = time.perf_counter()
    summary = run_eval([*env_argv(n), "--model", model, *agent, "--episodes", str(args.episodes),
                        "--temperature", "0", "--top-k", "1", "--max-new-tokens", str(b.max_new_tokens),
                        "--answer-max-new-tokens", str(b.answer_max_new_tokens), "--dtype", DTYPE,
                        "--threads", str(args.threads), "--no-progress", "--out", str(out), "--overwrite"])
    episodes = load_episodes(out / "episodes.jsonl").episodes
    f1 = [e.metrics.get("f1", 0.0) for e in episodes]
    ids = [e.sample_id for e in episodes]
    row = {"task": TASK, "policy": policy, "seed": 0, "num_chunks": n, "f1": f1, "mean_f1": sum(f1) / len(f1),
           "sample_ids": ids, "distances": fact_distances(model, n, ids), "calls_per_s": summary.get("calls_per_s"),
           "eval_s": time.perf_counter() - t0}
    lh.write_row(row_path, row)
    print(f"{policy} @ {n} chunks: F1 {row['mean_f1']:.3f} ({len(f1)} episodes)", flush=True)
    return row


def fact_distances(model: str, n: int, sample_ids: Sequence[str]) -> list[int]:
    """Chunks read after the fact (``n - 1 - c``, ``c`` its chunk), planned in the model's tokens as the
    evaluation's env planned them."""
    import gymnasium as gym

    from agents.models import load_tokenizer

    env = gym.make(sm.ENV, split="test", tokenizer=load_tokenizer(model), **env_kwargs(n))
    source = env.unwrapped.source
    got = [n - 1 - min(int(f["chunk"]) for f in source[source.index_of(sid)].supporting_facts) for sid in sample_ids]
    env.close()
    return got


def summarise(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per policy: F1 at each length, the drop from L to 32L with its lower bound (episodes
    resampled: one seed), F1 by the chunks read after the fact and the retention fit."""
    short, long = min(args.lengths), max(args.lengths)
    out: dict[str, Any] = {}
    for policy in args.policies:
        cells = [r for r in rows if r["policy"] == policy]
        if not cells:
            continue
        at = {str(r["num_chunks"]): {"f1": r["mean_f1"], "sd": 0.0, "seeds": 1, "episodes": len(r["f1"])}
              for r in sorted(cells, key=lambda r: r["num_chunks"])}
        table, fitted = lh.distance_table([(d, f) for r in cells for d, f in zip(r["distances"], r["f1"])])
        out[policy] = {"by_length": at, **lh.drop_lower_bound(cells, short, long), "by_distance": table,
                       "retention": fitted if len(cells) > 1 else {}}  # one length: too few distances
    return {TASK: out} if out else {}


def command(args: argparse.Namespace) -> str:
    parts = ["python examples/smollm2_at_length.py"] + (["--smoke"] if args.smoke else [])
    if args.policies != list(POLICIES):
        parts.append(f"--policies {','.join(args.policies)}")
    if args.lengths != list(LENGTHS) and not args.smoke:
        parts.append(f"--lengths {','.join(map(str, args.lengths))}")
    return " ".join(parts)


def resume(args: argparse.Namespace) -> None:
    """Take the cells of ``args.resume_from`` (this script's results JSON, the same settings) as rows."""
    path = args.resume_from
    results = lh.read_results(path, "examples/smollm2_at_length.py", args.smoke)
    for field, ours in (("env", sm.ENV), ("env_kwargs", sm.ENV_KWARGS), ("episodes", args.episodes),
                        ("dtype", DTYPE), ("training", "python examples/smollm2_memopd.py " + " ".join(TRAINING)),
                        ("train_chunks", args.lengths[0])):
        lh.refuse_unless_same(path, field.replace("_", " "), results.get(field), ours)
    cells = [(f"{r['policy']}-{r['num_chunks']}.json", r) for r in results.get("rows", [])]
    lh.resume_rows(Path(args.out) / "at-length" / "rows", cells, path)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import memgym  # noqa: F401  (registers the envs)

    t0 = time.perf_counter()
    if args.resume_from:
        resume(args)
    rows = [r for policy in args.policies for n in args.lengths if (r := eval_cell(policy, n, args)) is not None]
    summary = summarise(rows, args)
    import torch
    import transformers

    results = {"command": command(args), "env": sm.ENV, "env_kwargs": sm.ENV_KWARGS, "train_chunks": args.lengths[0],
               "lengths": args.lengths, "policies": args.policies, "episodes": args.episodes, "dtype": DTYPE,
               "training": "python examples/smollm2_memopd.py " + " ".join(TRAINING),
               "claim": {"margin": lh.CLAIM_MARGIN, "contrast": lh.CONTRAST}, "summary": summary,
               "verdicts": lh.verdicts(summary) if summary else {TASK: "not tested yet: no cell is finished"},
               "rows": rows, "wall_s_this_invocation": time.perf_counter() - t0,
               "versions": {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__}}
    lh.save(results, Path(args.out) / "at-length" / "results.json", args.publish)
    if summary:
        lh.plot(summary, Path(args.out) / "at-length" / "length.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
