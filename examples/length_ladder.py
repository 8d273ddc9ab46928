"""Length ladder: students trained at 6 chunks, evaluated from 3 to 192 chunks with the same memory.

    python examples/length_ladder.py                          # after examples/reproduce_memopd.py
                                                              #   --teacher-sft-context both
    python examples/length_ladder.py --smoke --exp DIR        # the pipeline in under a minute (CI)

The task is examples/reproduce_memopd.py's: `memgym/LongQA-v0` with `chunk_size=48,
memory_budget=16`, one fact among filler; only `num_chunks` changes (`--lengths`, default
3, 6, 12, 24, 48, 96, 192: 144 to 9,216 tokens of context), the memory stays 16 tokens. For each
length, held-out F1 on `--eval-episodes` test episodes (greedy), by the trainer's own evaluation
(`memopd.learn.actor.Actor.evaluate`: the same episodes, sampling and scoring as a run's held-out F1), of

  MemOPD student    the trained `ppo+memopd` student of each seed (<exp>/<tree>/<divergence>/ppo+memopd/seed-<s>)
  PPO student       the trained `ppo` student of each seed
  teacher           the teacher the arms were distilled from (<exp>/teacher-both)
  RAG + ...         the `rag-memagent` agent (agents.rag: BM25 top-1 chunk, then the same MemAgent calls over
                    it) with the MemOPD student of each seed, and with the teacher

(students: mean ± sample std over `--seeds`). A student is its warm start (<exp>/student) with the
newest checkpoint of its run loaded on top (memopd.checkpoint.load_latest).

The teacher shift: how far the flattened history moves the teacher's next-token distribution,
KL(p_aligned || p_persistent) (memopd.alignment.teacher_shift, the last column of the
state-alignment table of docs/RESULTS.md), per turn = per number of context updates before the
call, on `--shift-episodes` test episodes sampled (temperature 1) by the MemOPD student of the
first seed, at every ladder length whose flattened transcript fits the teacher's
`max_position_embeddings` (the longer ones cannot be scored in persistent context at all).

Everything lands in <exp>/length-ladder/ (`--out`): results.json (every number), results.md (the
tables, this invocation's wall-clock and versions), ladder.png (F1 vs context tokens, log axis;
the teacher shift per turn). Each (policy, length) evaluation, each length's context measurement
and each teacher-shift length is cached in its own file under cache/, written when it finishes:
a rerun reuses them (change a setting and only what it affects is redone; delete cache/ to redo
everything) and a killed run resumes at the first unfinished one.

`--smoke` first builds what it needs in --exp with `examples/reproduce_memopd.py --smoke` (arms
ppo and ppo+memopd, `--teacher-sft-context both`), then runs a ladder of 3 and 6 chunks on 4
episodes (tests/test_length_ladder.py runs it in CI). It checks the pipeline, not the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

ENV = "memgym/LongQA-v0"
CHUNK_SIZE = 48
MEMORY_BUDGET = 16
TRAIN_CHUNKS = 6
"""The length every student and the teacher were trained (RL) or evaluated at in reproduce_memopd."""
LENGTHS = (3, 6, 12, 24, 48, 96, 192)
SMOKE_LENGTHS = (3, 6)
SMOKE_EPISODES = 4
SHIFT_SEED = 20_000  # reproduce_memopd's alignment episodes
EVAL_SEED = 10_000  # memopd.learn.actor.Actor.evaluate's test episodes

ROWS = {  # key prefix -> (table row, agent, weights)
    "memopd": ("MemOPD student", "memagent", "ppo+memopd"),
    "ppo": ("PPO student", "memagent", "ppo"),
    "teacher": ("teacher", "memagent", None),
    "rag-memopd": ("RAG (BM25 top-1) + MemOPD student", "rag-memagent", "ppo+memopd"),
    "rag-teacher": ("RAG (BM25 top-1) + teacher", "rag-memagent", None),
}

REUSED: list[str] = []
"""Cached results this invocation found (so its wall-clock does not include them)."""
SPENT: list[float] = []
"""Seconds of the evaluations this invocation ran."""


def env_kwargs(n: int) -> dict[str, Any]:
    return {"num_chunks": n, "chunk_size": CHUNK_SIZE, "memory_budget": MEMORY_BUDGET}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from memopd.config import DEFAULT_THREADS, THREADS_HELP

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--exp", default=None,
                    help="the reproduce_memopd experiment directory (default runs/reproduce; with --smoke "
                         "runs/length-ladder-smoke)")
    ap.add_argument("--out", default=None, help="output directory (default <exp>/length-ladder)")
    ap.add_argument("--lengths", default=None,
                    help=f"comma-separated numbers of chunks (default {','.join(map(str, LENGTHS))}; smoke "
                         f"{','.join(map(str, SMOKE_LENGTHS))})")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds of the trained students")
    ap.add_argument("--eval-episodes", type=int, default=None,
                    help=f"held-out test episodes per evaluation, greedy (default 64; smoke {SMOKE_EPISODES})")
    ap.add_argument("--shift-episodes", type=int, default=None,
                    help=f"episodes of the teacher shift (default 32; smoke {SMOKE_EPISODES})")
    ap.add_argument("--shift-lengths", default=None,
                    help="comma-separated lengths of the teacher shift (default: every ladder length whose "
                         "flattened transcript fits the teacher's max_position_embeddings)")
    ap.add_argument("--tree", default="runs-fair", help="the runs' folder in <exp> (reproduce_memopd --teacher-sft-"
                                                       "context both: runs-fair; aligned: runs)")
    ap.add_argument("--divergence", default="fkl", help="the runs' distillation divergence folder")
    ap.add_argument("--teacher", default="teacher-both", help="the teacher's folder in <exp>")
    ap.add_argument("--student", default="student", help="the warm student's folder in <exp> (the runs' start)")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="most tokens sampled per call")
    ap.add_argument("--smoke", action="store_true", help="build a tiny experiment and run a tiny ladder (CI)")
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP.replace("%", "%%"))
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bars")
    args = ap.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    args.exp = Path(args.exp or ("runs/length-ladder-smoke" if args.smoke else "runs/reproduce"))
    args.out = Path(args.out) if args.out else args.exp / "length-ladder"
    args.length_list = sorted(set(ints(args.lengths) if args.lengths else
                                  (SMOKE_LENGTHS if args.smoke else LENGTHS)))
    args.seed_list = ints(args.seeds)
    if args.eval_episodes is None:
        args.eval_episodes = SMOKE_EPISODES if args.smoke else 64
    if args.shift_episodes is None:
        args.shift_episodes = SMOKE_EPISODES if args.smoke else 32
    args.shift_list = ints(args.shift_lengths) if args.shift_lengths else None
    if not args.length_list or min(args.length_list) < 1:
        ap.error("--lengths: give numbers of chunks >= 1")
    if not args.seed_list:
        ap.error("--seeds: give at least one seed")
    if args.eval_episodes < 1 or args.shift_episodes < 1:
        ap.error("--eval-episodes and --shift-episodes must be >= 1")
    return args


# ------------------------------------------------------------------------------------------------
# the experiment it reads (built by reproduce_memopd; --smoke builds a tiny one)
# ------------------------------------------------------------------------------------------------

def run_dir(args: argparse.Namespace, arm: str, seed: int) -> Path:
    return args.exp / args.tree / args.divergence / arm / f"seed-{seed}"


def needed(args: argparse.Namespace) -> list[Path]:
    """The finished parts of the experiment the ladder reads."""
    parts = [args.exp / args.teacher / "config.json", args.exp / args.student / "config.json"]
    arms = sorted({arm for _, _, arm in ROWS.values() if arm})
    return parts + [run_dir(args, arm, s) / "summary.json" for arm in arms for s in args.seed_list]


def build_smoke(args: argparse.Namespace) -> None:
    """reproduce_memopd --smoke into --exp, unless its parts are already there."""
    if all(p.is_file() for p in needed(args)):
        log(f"smoke experiment: reusing {args.exp}")
        REUSED.append("smoke experiment")
        return
    script = Path(__file__).resolve().parent / "reproduce_memopd.py"
    spec = importlib.util.spec_from_file_location("reproduce_memopd", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    log(f"smoke experiment: examples/reproduce_memopd.py --smoke into {args.exp}")
    argv = ["--smoke", "--out", str(args.exp), "--seeds", ",".join(map(str, args.seed_list)),
            "--arms", "ppo,ppo+memopd", "--teacher-sft-context", "both", "--threads", str(args.threads)]
    if not args.progress:
        argv.append("--no-progress")
    stdout, sys.stdout = sys.stdout, sys.stderr  # its report goes to stderr: stdout is this script's
    try:
        code = module.main(argv)
    finally:
        sys.stdout = stdout
    if code != 0:
        raise SystemExit(f"examples/reproduce_memopd.py --smoke failed (exit {code})")


def check_experiment(args: argparse.Namespace) -> None:
    missing = [p for p in needed(args) if not p.is_file()]
    if missing:
        raise SystemExit("length ladder: the experiment in {} is not finished; missing {}. Run examples/"
                         "reproduce_memopd.py --teacher-sft-context both --out {} first (or --smoke)."
                         .format(args.exp, ", ".join(str(p) for p in missing), args.exp))


# ------------------------------------------------------------------------------------------------
# policies and their weights
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Policy:
    """One evaluated policy: an agent with one set of weights."""

    key: str
    """File-safe name: memopd-seed-0, teacher, rag-teacher, ..."""
    kind: str
    """Its ROWS key."""
    agent: str
    model_dir: Path
    run_dir: Path | None
    seed: int | None

    @property
    def weights(self) -> str:
        """Where the weights come from: the run's newest checkpoint, or the model folder."""
        if self.run_dir is None:
            return str(self.model_dir)
        from memopd.checkpoint import list_checkpoints

        found = list_checkpoints(self.run_dir)
        return str(found[0]) if found else str(self.run_dir)


def policies(args: argparse.Namespace) -> list[Policy]:
    out = []
    for kind, (_, agent, arm) in ROWS.items():
        if arm is None:
            out.append(Policy(kind, kind, agent, args.exp / args.teacher, None, None))
            continue
        for s in args.seed_list:
            out.append(Policy(f"{kind}-seed-{s}", kind, agent, args.exp / args.student, run_dir(args, arm, s), s))
    return out


class Weights:
    """Loads each set of weights once (a student serves both MemAgent and RAG)."""

    def __init__(self) -> None:
        self.loaded: dict[tuple[str, str | None], tuple[Any, Any]] = {}

    def get(self, p: Policy) -> tuple[Any, Any]:
        key = (str(p.model_dir), str(p.run_dir) if p.run_dir else None)
        if key not in self.loaded:
            from agents.models import load
            from memopd.checkpoint import load_latest

            model, tok = load(p.model_dir)
            if p.run_dir is not None:
                _, path = load_latest(p.run_dir, {"student": model})
                log(f"  loaded {path}")
            model.eval()
            self.loaded[key] = (model, tok)
        return self.loaded[key]

    def tokenizer(self, p: Policy) -> Any:
        """A tokenizer (every preset shares one): a loaded model's, else ``p``'s."""
        if self.loaded:
            return next(iter(self.loaded.values()))[1]
        return self.get(p)[1]


# ------------------------------------------------------------------------------------------------
# cached pieces of work
# ------------------------------------------------------------------------------------------------

def write_json(path: Path, data: Any) -> None:
    """Write atomically: a killed run leaves the old file or none, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def cached(path: Path, settings: dict[str, Any], label: str, compute) -> dict[str, Any]:
    """``compute()``'s result, reused from ``path`` when it was computed with the same settings."""
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            old = None
        if isinstance(old, dict) and old.get("settings") == settings:
            REUSED.append(label)
            return old
    t0 = time.perf_counter()
    result = {"settings": settings, **compute(), "seconds": None}
    result["seconds"] = time.perf_counter() - t0
    write_json(path, result)
    return result


def evaluation(args: argparse.Namespace, weights: Weights, p: Policy, n: int) -> dict[str, Any]:
    """Held-out F1 of one policy at one length, by the trainer's evaluation."""
    settings = {"env": ENV, "env_kwargs": env_kwargs(n), "eval_episodes": args.eval_episodes, "agent": p.agent,
                "weights": p.weights, "max_new_tokens": args.max_new_tokens}

    def compute() -> dict[str, Any]:
        from memopd.learn.actor import Actor
        from memopd.train import TrainConfig

        model, tok = weights.get(p)
        cfg = TrainConfig(env=ENV, env_kwargs=env_kwargs(n), eval_episodes=args.eval_episodes, agent=p.agent,
                          max_new_tokens=args.max_new_tokens, questions_per_step=1, group_size=1,
                          progress=args.progress)
        return Actor(cfg, model, tok).evaluate()

    path = args.out / "cache" / p.key / f"chunks-{n:04d}.json"
    t0 = time.perf_counter()
    before = len(REUSED)
    res = cached(path, settings, f"{p.key}@{n}", compute)
    if len(REUSED) > before:
        how = "reused"
    else:
        SPENT.append(res["seconds"])
        how = f"{time.perf_counter() - t0:.0f} s"
    log(f"  {p.key:<22} {n:>4} chunks: F1 {res['f1']:.3f}  ({how})")
    return res


def context_measure(args: argparse.Namespace, tokenizer: Callable[[], Any], n: int) -> dict[str, Any]:
    """Context tokens of the evaluation's test episodes (their chunks, counted as the env counts)."""
    settings = {"env": ENV, "env_kwargs": env_kwargs(n), "eval_episodes": args.eval_episodes}

    def compute() -> dict[str, Any]:
        import gymnasium as gym

        import memgym  # noqa: F401

        env = gym.make(ENV, split="test", tokenizer=tokenizer(), **env_kwargs(n))
        counter = env.unwrapped.counter
        totals = []
        for g in range(args.eval_episodes):  # Actor.evaluate's episode g resets with seed 10_000 + g
            _, info = env.reset(seed=EVAL_SEED + g)
            total = 0
            while info["phase"] == "memory":
                total += counter.count(info["chunk"])
                _, _, _, _, info = env.step("")
            totals.append(total)
        return {"nominal": n * CHUNK_SIZE, "mean": sum(totals) / len(totals), "min": min(totals), "max": max(totals)}

    return cached(args.out / "cache" / "context" / f"chunks-{n:04d}.json", settings, f"context@{n}", compute)


def transcript_tokens(episodes: Sequence[Any]) -> int:
    """The longest flattened transcript (persistent context) of the episodes, in positions."""
    from memopd.contexts import persistent_units

    return max(b.positions[-1] + 1 for u in persistent_units(episodes) for b in u.blocks)


def shift(args: argparse.Namespace, weights: Weights, student: Policy, teacher: Policy, n: int) -> dict[str, Any]:
    """The teacher's KL(aligned || persistent) per turn at one length, on episodes of the student."""
    settings = {"env": ENV, "env_kwargs": env_kwargs(n), "episodes": args.shift_episodes, "seed": SHIFT_SEED,
                "student": student.weights, "teacher": teacher.weights, "max_new_tokens": args.max_new_tokens}

    def compute() -> dict[str, Any]:
        import gymnasium as gym

        import memgym  # noqa: F401
        from agents.backends.base import SamplingParams
        from agents.backends.hf import HFBackend
        from agents.memagent import MemAgent
        from agents.rollout import rollout
        from memopd.alignment import teacher_shift

        model, tok = weights.get(student)
        teacher_model, _ = weights.get(teacher)
        limit = int(teacher_model.config.max_position_embeddings)
        envs = [gym.make(ENV, split="test", tokenizer=tok, **env_kwargs(n)) for _ in range(8)]
        sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
        agent = MemAgent(HFBackend(model, tok, seed=student.seed or 0), sampling=sampling)
        episodes = rollout(envs, agent, args.shift_episodes, seed=SHIFT_SEED, progress=False, run_id="shift")
        tokens = transcript_tokens(episodes)
        out = {"num_chunks": n, "max_positions": limit, "transcript_tokens": tokens, "fits": tokens <= limit,
               "sampled_f1": sum(e.metrics.get("f1", 0.0) for e in episodes) / len(episodes)}
        if out["fits"]:
            out["turns"] = [dataclasses.asdict(r) for r in teacher_shift(teacher_model, episodes)]
        return out

    res = cached(args.out / "cache" / "shift" / f"chunks-{n:04d}.json", settings, f"shift@{n}", compute)
    what = (f"KL per turn, {len(res['turns'])} turns" if res["fits"] else
            f"transcript of {res['transcript_tokens']} tokens > {res['max_positions']} positions: not scored")
    log(f"  teacher shift {n:>4} chunks: {what}")
    return res


def seen_documents(tokenizer: Any, episodes: int) -> int:
    """The largest document number in the test episodes at the training length: the labels
    (``Document K:``) every model here has read."""
    import re

    import gymnasium as gym

    import memgym  # noqa: F401

    env = gym.make(ENV, split="test", tokenizer=tokenizer, **env_kwargs(TRAIN_CHUNKS))
    top = 0
    for g in range(episodes):
        _, info = env.reset(seed=EVAL_SEED + g)
        while info["phase"] == "memory":
            top = max([top] + [int(k) for k in re.findall(r"Document (\d+):", info["chunk"])])
            _, _, _, _, info = env.step("")
    return top


def label_split(args: argparse.Namespace, weights: Weights, teacher: Policy, n: int, seen: int) -> dict[str, Any]:
    """RAG + teacher at one length, F1 split by whether the retrieved fact's document number was
    seen at the training length: retrieval is exact here (no distractor facts), so a drop on
    unseen numbers is the label's effect, not the memory's."""
    settings = {"env": ENV, "env_kwargs": env_kwargs(n), "eval_episodes": args.eval_episodes, "seen": seen,
                "teacher": teacher.weights, "max_new_tokens": args.max_new_tokens}

    def compute() -> dict[str, Any]:
        import re

        import gymnasium as gym

        import memgym  # noqa: F401
        from agents.backends.base import SamplingParams
        from agents.backends.hf import HFBackend
        from agents.rag import RAGMemAgent
        from agents.rollout import rollout

        model, tok = weights.get(teacher)
        envs = [gym.make(ENV, split="test", tokenizer=tok, **env_kwargs(n)) for _ in range(8)]
        sp = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, greedy=True, seed=0)
        eps = rollout(envs, RAGMemAgent(HFBackend(model, tok, seed=0), sampling=sp), args.eval_episodes,
                      seed=EVAL_SEED, progress=False, run_id="label-split")
        parts: dict[str, list[float]] = {"seen": [], "unseen": [], "unmatched": []}
        for e in eps:
            text = tok.decode(e.invocations[0].prompt_ids)
            person = re.search(r"does (\w+) work", e.question)
            fact = f"{person.group(1)} {e.answers[0]} ." if person and e.answers else None
            if not fact or fact not in text:
                parts["unmatched"].append(e.metrics["f1"])
                continue
            k = int(re.findall(r"Document (\d+):", text[:text.index(fact)])[-1])
            parts["seen" if k <= seen else "unseen"].append(e.metrics["f1"])
        return {k: {"n": len(v), "f1": sum(v) / len(v) if v else None} for k, v in parts.items()}

    return cached(args.out / "cache" / "label-split" / f"chunks-{n:04d}.json", settings, f"labels@{n}", compute)


# ------------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------------

def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


def versions() -> dict[str, str]:
    import gymnasium
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "gymnasium": gymnasium.__version__,
            "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads"}


def shift_summary(res: dict[str, Any]) -> dict[str, Any]:
    """Per length: mean KL over the memory turns after the first, at the last memory turn, at the answer."""
    turns = res["turns"]
    memory = [t for t in turns if 0 < t["turn"] < res["num_chunks"]]
    answer = [t for t in turns if t["turn"] == res["num_chunks"]]
    return {"memory_turns_mean": sum(t["mean_gap"] for t in memory) / len(memory) if memory else None,
            "last_memory_turn": memory[-1]["mean_gap"] if memory else None,
            "answer_turn": answer[0]["mean_gap"] if answer else None}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    for row, by_n in results["table"].items():
        ns = [int(n) for n in by_n]
        x = np.array([results["context_tokens"][str(n)]["mean"] for n in ns])
        m = np.array([by_n[str(n)]["f1"][0] for n in ns])
        sd = np.array([by_n[str(n)]["f1"][1] for n in ns])
        k = len(by_n[str(ns[0])]["per_seed"])
        line, = ax.plot(x, m, marker="o", ms=4, ls="--" if row.startswith("RAG") else "-",
                        label=row + (f" (n={k})" if k > 1 else ""))
        if k > 1:
            ax.fill_between(x, m - sd, m + sd, color=line.get_color(), alpha=0.15)
    ctx = results["context_tokens"]
    train_x = ctx[str(TRAIN_CHUNKS)]["mean"] if str(TRAIN_CHUNKS) in ctx else TRAIN_CHUNKS * CHUNK_SIZE
    ax.axvline(train_x, color="k", lw=0.8, ls=":", label=f"training length ({TRAIN_CHUNKS} chunks)")
    ax.set_xscale("log")
    ax.set_xticks([ctx[str(n)]["mean"] for n in results["lengths"]],
                  [f"{ctx[str(n)]['mean']:.0f}\n({n})" for n in results["lengths"]], fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("context tokens per episode, measured (chunks), log scale")
    ax.set_ylabel("held-out F1 (mean ± std over seeds)")
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    sh = results["teacher_shift"]
    for n, res in sh["by_length"].items():
        if not res["fits"]:
            continue
        turns = [t for t in res["turns"] if t["turn"] > 0]
        bx.plot([t["turn"] for t in turns], [t["mean_gap"] for t in turns], marker=".", label=f"{n} chunks")
    bx.set_yscale("log")
    bx.set_xscale("log")
    bx.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    bx.set_xlabel("turn = context updates before the call (last: the answer), log scale")
    bx.set_ylabel("teacher KL(aligned ‖ persistent) per token")
    bx.grid(alpha=0.3, which="both")
    if bx.lines:
        bx.legend(fontsize=7)
    bx.set_title(f"episodes of {sh['episodes_from']}", fontsize=8)
    fig.suptitle(f"{ENV} chunk_size={CHUNK_SIZE}, memory_budget={MEMORY_BUDGET}; trained at {TRAIN_CHUNKS} chunks",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(results: dict[str, Any]) -> str:
    ns = results["lengths"]
    ctx = results["context_tokens"]
    lines = [f"Held-out F1 ({results['eval_episodes']} test episodes, greedy) of policies trained at "
             f"{TRAIN_CHUNKS} chunks, by number of chunks (context tokens: chunks × {CHUNK_SIZE}; the memory "
             f"stays {MEMORY_BUDGET} tokens). Students: mean ± std over seeds {results['seeds']}.", "",
             "| policy \\ chunks (nominal tokens) | " + " | ".join(f"{n} ({ctx[str(n)]['nominal']:,})" for n in ns)
             + " |",
             "|---|" + "---|" * len(ns)]
    for row, by_n in results["table"].items():
        cells = []
        for n in ns:
            f1 = by_n[str(n)]["f1"]
            cells.append(f"{f1[0]:.3f} ± {f1[1]:.3f}" if len(by_n[str(n)]["per_seed"]) > 1 else f"{f1[0]:.3f}")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    per_seed = ["{}: {}".format(row, ", ".join(f"{n}: {'/'.join(f'{x:.3f}' for x in by_n[str(n)]['per_seed'])}"
                                              for n in ns))
                for row, by_n in results["table"].items() if len(by_n[str(ns[0])]["per_seed"]) > 1]
    if per_seed:
        lines += ["", "Per seed (chunks: F1 of each seed): " + "; ".join(per_seed) + "."]
    lines += ["", "Measured context tokens per episode (mean, min-max over the test episodes; the plot's x): "
                  + ", ".join(f"{n}: {ctx[str(n)]['mean']:.0f} ({ctx[str(n)]['min']}-{ctx[str(n)]['max']})"
                              for n in ns) + "."]
    ls = results.get("label_split")
    if ls:
        f = lambda c: "-" if c["f1"] is None else f"{c['f1']:.3f} (n={c['n']})"  # noqa: E731
        lines += ["", f"RAG + teacher, F1 split by the retrieved fact's document number: at most {ls['seen']} (the "
                      f"largest number in the {TRAIN_CHUNKS}-chunk test episodes) or above; retrieval is exact here, "
                      "so the split isolates the unseen label.", "",
                  "| chunks | F1, document number seen | F1, unseen | fact not found in the retrieved chunk |",
                  "|---|---|---|---|"]
        lines += [f"| {n} | {f(c['seen'])} | {f(c['unseen'])} | {c['unmatched']['n']} |" for n, c in ls["by_length"].items()]
    sh = results["teacher_shift"]
    fitting = [n for n, r in sh["by_length"].items() if r["fits"]]
    lines += ["", f"Teacher shift: {sh['episodes']} test episodes sampled (temperature 1) by {sh['episodes_from']}; "
                  "the teacher scores each memory write and answer in its own state (aligned) and in the flattened "
                  "history (persistent); mean per token of the full-vocabulary KL(p_aligned ‖ p_persistent). Turn t "
                  f"follows t context updates. The teacher has {sh['max_positions']} positions.", "",
              "| chunks | transcript tokens (max) | memory turns 1..n-1 | last memory turn | answer turn |",
              "|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.2e}"  # noqa: E731
    for n, res in sh["by_length"].items():
        if res["fits"]:
            s = shift_summary(res)
            lines.append(f"| {n} | {res['transcript_tokens']} | {fmt(s['memory_turns_mean'])} | "
                         f"{fmt(s['last_memory_turn'])} | {fmt(s['answer_turn'])} |")
        else:
            lines.append(f"| {n} | {res['transcript_tokens']} | does not fit | | |")
    if fitting:
        n = fitting[-1]
        lines += ["", f"Per turn at {n} chunks (mean / max over the turn's sampled tokens):", "",
                  "| turn | sampled tokens | teacher KL(aligned ‖ persistent) |", "|---|---|---|"]
        lines += [f"| {t['turn']} | {t['tokens']} | {t['mean_gap']:.2e} / {t['max_gap']:.2e} |"
                  for t in sh["by_length"][n]["turns"]]
    reused = (f" (it reused {len(results['reused'])} finished parts of an earlier one)" if results["reused"] else "")
    lines += ["", f"Wall-clock of this invocation: {results['wall_s'] / 60:.1f} min{reused}; the held-out evaluations "
                  f"took {results['evaluated_s'] / 60:.1f} min of it, and {results['all_evaluations_s'] / 60:.1f} min "
                  "when each was first run. Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items())
                  + ".",
              "", f"Command: `{results['command']}`"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from memopd.runtime import set_threads

    set_threads(args.threads)
    t0 = time.perf_counter()
    REUSED.clear()
    SPENT.clear()
    if args.smoke:
        build_smoke(args)
    check_experiment(args)
    args.out.mkdir(parents=True, exist_ok=True)
    weights = Weights()
    pols = policies(args)
    log(f"length ladder: {len(pols)} policies x {len(args.length_list)} lengths {args.length_list}, "
        f"{args.eval_episodes} episodes each -> {args.out}")
    context: dict[str, Any] = {}
    evals: dict[str, dict[str, Any]] = {p.key: {} for p in pols}
    for n in args.length_list:  # length-major: a stopped run has whole lengths, every policy
        for p in pols:
            evals[p.key][str(n)] = evaluation(args, weights, p, n)
        context[str(n)] = context_measure(args, lambda: weights.tokenizer(pols[0]), n)
    table: dict[str, dict[str, Any]] = {}
    for kind, (row, _, _) in ROWS.items():
        mine = [p for p in pols if p.kind == kind]
        table[row] = {}
        for n in args.length_list:
            f1s = [evals[p.key][str(n)]["f1"] for p in mine]
            ems = [evals[p.key][str(n)]["em"] for p in mine]
            table[row][str(n)] = {"f1": mean_std(f1s), "em": mean_std(ems), "per_seed": f1s}
    # the teacher shift, from short to long, up to the first length whose transcript does not fit
    student = next(p for p in pols if p.kind == "memopd")
    teacher = next(p for p in pols if p.kind == "teacher")
    by_length: dict[str, Any] = {}
    limit = None
    for n in args.shift_list or args.length_list:
        if args.shift_list is None and limit is not None and n * CHUNK_SIZE > limit:
            break  # the chunks alone fill the positions: not sampled
        res = shift(args, weights, student, teacher, n)
        by_length[str(n)] = res
        limit = res["max_positions"]
        if args.shift_list is None and not res["fits"]:
            break
    seen = seen_documents(weights.tokenizer(teacher), args.eval_episodes)
    splits = {str(n): label_split(args, weights, teacher, n, seen) for n in args.length_list}
    all_s = sum(e["seconds"] for by_n in evals.values() for e in by_n.values())
    results = {
        "env": ENV, "env_kwargs": {"chunk_size": CHUNK_SIZE, "memory_budget": MEMORY_BUDGET},
        "train_chunks": TRAIN_CHUNKS, "lengths": args.length_list, "seeds": args.seed_list,
        "eval_episodes": args.eval_episodes, "max_new_tokens": args.max_new_tokens, "experiment": str(args.exp),
        "rows": {row: {"agent": agent, "arm": arm} for row, agent, arm in ROWS.values()},
        "policies": {p.key: {"row": ROWS[p.kind][0], "agent": p.agent, "seed": p.seed, "weights": p.weights,
                             "by_length": evals[p.key]} for p in pols},
        "table": table, "context_tokens": context, "label_split": {"seen": seen, "by_length": splits},
        "teacher_shift": {"episodes": args.shift_episodes, "seed": SHIFT_SEED,
                          "episodes_from": f"the MemOPD student of seed {student.seed}",
                          "max_positions": limit, "by_length": by_length,
                          "summary": {n: shift_summary(r) for n, r in by_length.items() if r["fits"]}},
    }
    results["wall_s"] = time.perf_counter() - t0
    results["all_evaluations_s"] = all_s
    results["evaluated_s"] = sum(SPENT)
    results["reused"] = list(REUSED)
    results["versions"] = versions()
    results["command"] = "python examples/length_ladder.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write_json(args.out / "results.json", results)
    plot(results, args.out / "ladder.png")
    (args.out / "results.md").write_text(markdown(results))
    print(markdown(results))
    print(f"results: {args.out / 'results.md'}, {args.out / 'results.json'}, {args.out / 'ladder.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
