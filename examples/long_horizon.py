"""The long-horizon study, part 1: policies trained at L = 6 chunks, read at L to 32L (192 chunks).

    python examples/long_horizon.py --out runs/long-horizon                  # every cell, resumable
    python examples/long_horizon.py --tasks LongQA --policies memopd,teacher --seeds 0    # some cells
    python examples/long_horizon.py --cached-only --publish docs/data/long_horizon/results.json
    python examples/long_horizon.py --smoke --out DIR                         # the pipeline in minutes (CI)
    python examples/long_horizon.py --resume-from docs/data/long_horizon/results.json --policies sft-oracle --seeds 3,4

The claim under test (docs/RESULTS.md, "The long-horizon study"): a compact-memory student trained at
L keeps its F1 at 32L, the one-sided 95% lower bound of F1(32L) - F1(L) above -0.05 (bootstrap over
seeds, then episodes within each seed), where a policy that can fall (the untrained warm start, the
full-context agent trained at L) scores at least 0.3 at L and drops by at least 0.3 (else the test
was too easy, or, with no such policy, not made).

The tasks (``TASKS``), each in the digit presets' tokens with random document numbering (the
length-robust inputs of docs/RESULTS.md, "Length-robust inputs") and a 16-token memory, only
``num_chunks`` changing between training and evaluation, all in chunks of 48 tokens (with random
labels a fact document does not always fit beside another in 32: at 32 a VariableTracking run
stopped at step 282 on a training sample its planner could not pack): one-hop LongQA, and by
default two tasks where the memory binds: MultiValue (both cities a person visits, two facts
anywhere in the input) and VariableTracking (the variables a chain of two assignments gives a value). KnowledgeUpdate (the latest cities of two people) and
Counting (two running counts) are options: the recipe's teacher learns them only partly (about 0.67
at their defaults, one item of two).

The policies (``POLICIES``), all trained at L on the same task with the same student
(``tiny-digits``) and teacher (the auto teacher of ``memopd.train --teacher auto``: the embedded
recipe, built once per task):

  memopd          ``python -m memopd.train`` at its defaults but ``RL_STEPS``: the warm start the task
                  recommends, then PPO + MemOPD (the teacher scores each call in the state the student acted in)
  opd-persistent  the same with ``--teacher-context persistent`` (the teacher reads the flattened history)
  ppo             the same with ``--opd-coef 0`` (PPO alone, no teacher)
  warm-start      the RL runs' starting point: the warm start's SFT recipe alone (``memopd.sft``)
  sft-oracle      SFT on oracle trajectories for the warm start's steps plus the RL steps, 32 episodes
                  a step (the RL arms' episodes a step): imitation at the RL arms' compute
  sft-teacher     the same on 1,000 trajectories the teacher sampled (temperature 1): sequence-level
                  distillation, every action in the teacher's own states
  teacher         the teacher itself (greedy)
  rag-top1/-top3  ``rag-memagent`` with the teacher: BM25 ranks the chunks, the teacher reads the top k
  fullcontext     the full-context agent (``--agent fullcontext``: the whole input in one prompt, one
                  answer call): the teacher's weights with 16,384 positions (its rotary positions
                  need no new weights), fine-tuned by ``memopd.sft`` on ``FullContextOracle`` records
                  at L (its prompts, the gold answer as the response; ``READER`` is the recipe). It
                  starts from the teacher so that it differs from the memory agents in how it reads,
                  not in what it knows: the same model that finds the fact in a chunk

Each RL and SFT policy runs ``--seeds`` seeds (the teacher and retrieval are deterministic: seed 0).
Evaluation: greedy, by ``python -m memopd.eval``, on the first ``EPISODES_ENDS`` test episodes at L
and 32L and ``EPISODES_BETWEEN`` between (``LENGTHS``).

F1 against the distance from the fact to the question (``fact_distances``: chunks read after the
first chunk that holds a supporting fact with an answer word, from the sample's ``supporting_facts``)
pools every length's episodes of a policy (the lengths all its seeds were read at: ``balanced``), in
bins of powers of two, with a per-chunk retention rate
``r`` fitted to it (``retention``: least squares of F1 = a * r**d; a memory that keeps the fact through
each later call with probability r).

Past the ladder, the memory policies (``FAR_POLICIES``) are read at ``FAR`` = 1,000 chunks (about
48,000 tokens of input, 167 times L) on ``FAR_EPISODES`` test episodes (``--far``; 0 skips it), with
the drop F1(1,000) - F1(L) beside the claim's; the claim itself stays at 32L.

Not yet in this script (the issue's other policies and parts): the full-context agent trained at
32L (its ceiling: 9,000-token prompts, about 30 times a step at L), a second teacher and warm-start
build.

Everything lands in --out (default runs/long-horizon): teacher/<task>/ (the auto teacher's
evaluation), <task>/<policy>-s<seed>/ (runs and SFT models; a killed run is resumed), eval/ (one
memopd.eval per policy, seed and length), rows/ (one JSON file per finished evaluation, so several
processes can share the study) and results.json (every finished cell; ``--publish FILE`` copies it).

A new checkout has none of --out: ``--resume-from`` an earlier results JSON (the published one) takes its
finished cells as done (``resume_rows``: written to rows/ where missing, never over a cell computed here),
so the study goes on where it stopped and a later ``--publish`` keeps them. It must come from this
script with the same settings (task options, training length, student, each task's ``recipe``), or it
is refused. The cells it brings need no models; a new seed trains its own, against a teacher rebuilt
by the same recipe (the same weights on the same torch build: docs/RESULTS.md, "The long-horizon study").
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Sequence

TASKS = {  # task -> env options of training and evaluation (num_chunks aside)
    "LongQA": {"chunk_size": 48, "memory_budget": 16, "numbering": "random"},
    "KnowledgeUpdate": {"chunk_size": 48, "memory_budget": 16, "numbering": "random"},
    "Counting": {"chunk_size": 48, "memory_budget": 16, "numbering": "random"},
    "MultiValue": {"chunk_size": 48, "memory_budget": 16, "numbering": "random"},
    "VariableTracking": {"chunk_size": 48, "memory_budget": 16, "numbering": "random"},
    "LongQA-distractors": {"chunk_size": 48, "memory_budget": 16, "numbering": "random", "distractor_similarity": 0.5},
    "LongQA-twice": {"chunk_size": 48, "memory_budget": 16, "numbering": "random", "fact_repeats": 2},
}
ENV_OF = {"LongQA-distractors": "LongQA", "LongQA-twice": "LongQA"}
"""A task variant's env (its options are its entry in TASKS); any other task is its own env."""
TEACHER_STEPS = {"LongQA-distractors": 1000, "VariableTracking": 750}
"""The auto teacher's SFT steps where the recipe's 250 leave it short of the task: with distractor
facts the teacher of 250 steps answers 0.012 (its loss still falling, 1.08 at step 226); on
VariableTracking it ends at loss 0.25 and answers 0.830 at L, below the student's warm start (0.951),
so MemOPD there pulled the student down toward it (0.736 at L, one seed)."""
PART1_TASKS = ("LongQA", "MultiValue", "VariableTracking")
"""This script's tasks by default (the variants serve part 2's scripts)."""
TRAIN_CHUNKS = 6
LENGTHS = (6, 12, 24, 48, 96, 192)
"""L to 32L chunks."""
EPISODES_ENDS, EPISODES_BETWEEN = 256, 128
FAR, FAR_EPISODES = 1000, 128
FAR_POLICIES = ("memopd", "teacher")
"""The policies read at ``FAR`` chunks: the claim's student and the best memory agent (the teacher)."""
RL_LR = {"VariableTracking": 2e-4}
"""The RL policies' learning rate where the warm start already answers the task (the tiny presets'
default, 2e-3, is for a student starting at the floor). VariableTracking's warm start answers 0.938
held-out at L; at 2e-3 PPO + MemOPD moved it down (0.938 -> 0.875 held-out, 0.840 at L on the ladder,
0.654 at 32L, with a teacher of 0.939), as PPO alone fell from a trained start at 2e-3 and learned at
2e-4 (docs/RESULTS.md, "The lr 2e-3 collapse")."""
STUDENT = "tiny-digits"
RL_STEPS = 300
"""Steps of every RL policy (the task's default is 80: at 80 the first MemOPD student was still rising,
held-out F1 0.11, 0.13, 0.22 at steps 40, 60, 80, against its teacher's 0.91)."""
RL = {"memopd": [], "opd-persistent": ["--teacher-context", "persistent"], "ppo": ["--opd-coef", "0"]}
SFT = ("warm-start", "sft-oracle", "sft-teacher")
FIXED = {"teacher": None, "rag-top1": 1, "rag-top3": 3}  # policy -> retrieval top_k (None: the teacher alone)
READERS = ("fullcontext",)
READER = {"positions": 16_384, "gold_episodes": 4000, "steps": 300, "lr": 1e-3, "batch_episodes": 32}
"""The full-context reader's recipe. From scratch (``tiny-long``'s shape, the digit tokenizer) its loss
sat at chance among the companies (2.0) for 150 steps with one data order and for more than 600
with another (lr 3e-3, 4,000 records): when a from-scratch reader learns at all is luck of the data
order here, so it starts from the teacher."""
READER_STEPS = {"VariableTracking": 900}
"""The reader's SFT steps where ``READER["steps"]`` leave it short of the task at L: started from
VariableTracking's 750-step teacher, 300 steps ended at loss 0.57 and answered 0.840 at L, below the
memory agents it is the contrast to (the warm start's 0.951)."""
POLICIES = (*RL, *SFT, *FIXED, *READERS)
TEACHER_SAMPLES = 1000
CLAIM_MARGIN = -0.05
"""The claim: the one-sided 95% lower bound of F1(32L) - F1(L) is above this."""
CONTRAST = -0.3
"""The required contrast: a policy that can fall drops by at least this much."""
CONTRAST_POLICIES = ("warm-start", "fullcontext")
"""The policies that must fall where the claim is tested."""
SMOKE = {"lengths": (3, 6), "far": 12, "train_chunks": 3, "episodes": 4,
         "train": ["--steps", "2", "--questions-per-step", "2", "--group-size", "2", "--student-warmup-steps", "2",
                   "--eval-episodes", "2", "--eval-every", "0", "--teacher", "tiny-teacher-digits"]}


def add_study_args(p: argparse.ArgumentParser, tasks: Sequence[str], policies: Sequence[str],
                   default_policies: Sequence[str], default_seeds: str,
                   default_tasks: Sequence[str] | None = None) -> None:
    """The options this study's scripts share (this one and the two of part 2)."""
    p.add_argument("--tasks", default=",".join(default_tasks or tasks), help=f"comma-separated tasks of {list(tasks)}")
    p.add_argument("--policies", default=",".join(default_policies),
                   help=f"comma-separated policies of {list(policies)}")
    p.add_argument("--seeds", default=default_seeds, help="comma-separated seeds of the trained policies")
    add_run_args(p)


def add_run_args(p: argparse.ArgumentParser, smoke: str = "tiny sizes: the pipeline, not the result") -> None:
    """The options of every script of this study: threads, cached cells only, publish, smoke."""
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared machine)")
    p.add_argument("--cached-only", action="store_true", help="compute nothing: results from the finished cells")
    p.add_argument("--publish", default=None, help="copy the results JSON to this file")
    p.add_argument("--smoke", action="store_true", help=smoke)


def split_study_args(p: argparse.ArgumentParser, args: argparse.Namespace, tasks: Sequence[str],
                     policies: Sequence[str]) -> None:
    """The comma-separated lists as lists; an unknown task or policy is a usage error."""
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.policies = [x for x in args.policies.split(",") if x]
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    bad = [t for t in args.tasks if t not in tasks] + [x for x in args.policies if x not in policies]
    if bad:
        p.error(f"unknown {bad}: --tasks takes {list(tasks)}, --policies {list(policies)}")


def add_resume_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resume-from", default=None, metavar="JSON",
                   help="an earlier results JSON of this script (the published one, in a new checkout): "
                        "its finished cells are taken as done, not recomputed")


def read_results(path: str, script: str, smoke: bool) -> dict[str, Any]:
    """``--resume-from``'s results JSON, which must be ``script``'s (its ``command``) with this ``--smoke``
    setting; else one error line."""
    try:
        results = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --resume-from {path}: cannot read it as JSON ({e})") from None
    said = str(results.get("command", "")) if isinstance(results, dict) else ""
    if not said.startswith(f"python {script}"):
        raise SystemExit(f"error: --resume-from {path} is not a results JSON of {script} (its command: {said!r})")
    refuse_unless_same(path, "smoke setting", "--smoke" in said.split(), smoke)
    return results


def refuse_unless_same(path: str, what: str, theirs: Any, ours: Any) -> None:
    """One error line where a resumed results JSON was computed with other settings than this run's."""
    if theirs != ours:
        raise SystemExit(f"error: --resume-from {path} was computed with another {what} ({theirs!r}, here {ours!r}); "
                         "its cells would not be this study's: resume from a matching file or start afresh")


def resume_rows(rows_dir: Path, cells: Sequence[tuple[str, dict[str, Any]]], path: str) -> None:
    """Write each (file name, row) of a resumed results JSON to ``rows_dir`` where no row of that name
    is there (a cell computed here is kept)."""
    written = 0
    for name, row in cells:
        target = rows_dir / name
        if not target.is_file():
            write_row(target, row)
            written += 1
    print(f"resumed {written} finished cells of {len(cells)} from {path} ({len(cells) - written} were here)",
          flush=True)


def resume(args: argparse.Namespace) -> None:
    """Take the finished cells of ``args.resume_from`` (this script's results JSON, the same settings)."""
    path = args.resume_from
    results = read_results(path, "examples/long_horizon.py", args.smoke)
    refuse_unless_same(path, "training length", results.get("train_chunks"), args.train_chunks)
    refuse_unless_same(path, "student", results.get("student"), STUDENT)
    for task, options in results.get("tasks", {}).items():
        refuse_unless_same(path, f"{task} options", options, TASKS.get(task))
        if not args.smoke:  # the smoke's recipe is SMOKE's, whatever recipe() says
            refuse_unless_same(path, f"{task} recipe", results.get("recipes", {}).get(task), recipe(task))
    cells = [(f"{r['task']}-{r['policy']}-s{r['seed']}-{r['num_chunks']}.json", r) for r in results.get("rows", [])]
    resume_rows(Path(args.out) / "rows", cells, path)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python examples/long_horizon.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/long-horizon", help="the study's directory (reused by a rerun)")
    add_study_args(p, list(TASKS), POLICIES, POLICIES, "0,1,2,3,4", PART1_TASKS)
    add_resume_arg(p)
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated evaluation lengths (chunks)")
    p.add_argument("--far", type=int, default=FAR,
                   help=f"read {list(FAR_POLICIES)} at this many chunks past the ladder (0: not)")
    args = p.parse_args(argv)
    split_study_args(p, args, list(TASKS), POLICIES)
    args.lengths = [int(n) for n in args.lengths.split(",") if n]
    args.train_chunks = TRAIN_CHUNKS
    if args.smoke:
        args.lengths, args.train_chunks, args.seeds = list(SMOKE["lengths"]), SMOKE["train_chunks"], args.seeds[:1]
        args.far = SMOKE["far"] if args.far else 0
    if args.far and args.far <= max(args.lengths):
        p.error(f"--far ({args.far}) must be past the ladder's longest length ({max(args.lengths)}), or 0")
    return args


def env_argv(task: str, chunks: int) -> list[str]:
    """``--env`` and ``--env-kwarg`` flags of ``task`` at ``chunks`` chunks."""
    opts = {**TASKS[task], "num_chunks": chunks}
    return ["--env", env_id(task), *[a for k, v in opts.items() for a in ("--env-kwarg", f"{k}={v}")]]


def env_id(task: str) -> str:
    """The gymnasium id of ``task`` (a variant's env: ``ENV_OF``)."""
    return f"memgym/{ENV_OF.get(task, task)}-v0"


def episodes_at(n: int, args: argparse.Namespace) -> int:
    if args.smoke:
        return SMOKE["episodes"]
    if n == args.far:
        return FAR_EPISODES
    return EPISODES_ENDS if n in (min(args.lengths), max(args.lengths)) else EPISODES_BETWEEN


# --- training ----------------------------------------------------------------------------------------------
def rl_config(task: str, policy: str, seed: int, args: argparse.Namespace) -> tuple[list[str], Any]:
    """The RL policy's ``memopd.train`` flags and their resolved config (the task's [train] table in)."""
    from memopd import config as cfgmod
    from memopd import train

    argv = [*env_argv(task, args.train_chunks), "--model", STUDENT, "--seed", str(seed), "--threads",
            str(args.threads), "--no-progress", "--steps", str(RL_STEPS), *RL.get(policy, []),
            *(["--teacher-sft-steps", str(TEACHER_STEPS[task])] if task in TEACHER_STEPS else []),
            *(["--lr", str(RL_LR[task])] if task in RL_LR else []),
            *(SMOKE["train"] if args.smoke else [])]  # the smoke's --steps comes last and wins
    cfg, given = cfgmod.parse_known(train.TrainConfig, train.teacher_flags(train.env_flags(argv)), "memopd.train", "")
    return argv, train.task_defaults(cfg, given)  # as memopd.train resolves it: flags given win over [train]


def teacher_dir(task: str, args: argparse.Namespace) -> str:
    """The RL runs' teacher: the auto teacher of the task at L (built here once, where they find it)."""
    from memopd.learn.models import ensure_teacher

    _, cfg = rl_config(task, "memopd", 0, args)
    return ensure_teacher(cfg, log=lambda m: print(m, flush=True))


def rl_argv(run: Path, fresh: Sequence[str]) -> list[str]:
    """``memopd.train``'s flags for ``run``: ``--resume`` where it holds a checkpoint, else ``fresh`` with
    ``--run-dir`` (a run killed before its first checkpoint starts over, as memopd.train advises)."""
    from memopd.checkpoint import list_checkpoints

    if run.is_dir() and list_checkpoints(run):
        return ["--resume", str(run)]
    return [*fresh, "--run-dir", str(run)]


def recipe(task: str) -> dict[str, Any]:
    """The settings of ``task``'s trained policies that differ between tasks (for the results JSON)."""
    from memopd.learn.models import TEACHER_SFT, TINY_LR

    return {"teacher_sft_steps": TEACHER_STEPS.get(task, TEACHER_SFT["steps"]), "rl_steps": RL_STEPS,
            "rl_lr": RL_LR.get(task, TINY_LR), "reader_steps": READER_STEPS.get(task, READER["steps"])}


def train_rl(task: str, policy: str, seed: int, args: argparse.Namespace) -> Path:
    from memopd import train

    run = Path(args.out) / task / f"{policy}-s{seed}"
    if not (run / "summary.json").is_file():
        argv, _ = rl_config(task, policy, seed, args)
        if train.main(rl_argv(run, argv)) != 0:
            raise SystemExit(f"error: the run {run} failed (its log above); rerun to resume it")
    return run


def train_sft(task: str, policy: str, seed: int, args: argparse.Namespace) -> Path:
    """warm-start, sft-oracle or sft-teacher: ``memopd.sft`` of the student with the warm start's
    recipe (``memopd.learn.models.warm_start_student``), for the warm start's steps or those plus the
    RL steps, on oracle trajectories or on the teacher's."""
    from memopd.eval import evaluate as run_eval
    from memopd.sft import SFTConfig, run as run_sft

    out = Path(args.out) / task / f"{policy}-s{seed}"
    if (out / "config.json").is_file():
        return out
    _, cfg = rl_config(task, "memopd", seed, args)
    steps = cfg.student_warmup_steps + (0 if policy == "warm-start" else cfg.steps)
    episodes = None
    if policy == "sft-teacher":  # the teacher's own trajectories at L, sampled once per task
        sampled = Path(args.out) / task / "teacher-samples"
        if not (sampled / "episodes.jsonl").is_file():
            n = 8 if args.smoke else TEACHER_SAMPLES
            run_eval([*env_argv(task, args.train_chunks), "--model", teacher_dir(task, args), "--split", "train",
                      "--episodes", str(n), "--temperature", "1", "--seed", "0", "--threads", str(args.threads),
                      "--no-progress", "--out", str(sampled), "--overwrite"])
        episodes = str(sampled / "episodes.jsonl")
    env_kwargs = {**TASKS[task], "num_chunks": args.train_chunks}
    run_sft(SFTConfig(env=env_id(task), env_kwargs=env_kwargs, model=STUDENT, out=str(out), seed=seed + 2,
                      threads=args.threads, progress=False, episodes=episodes, num_episodes=1000, steps=steps,
                      batch_episodes=cfg.questions_per_step * cfg.group_size, lr=3e-3, warmup_steps=10,
                      checkpoint_every=25), progress=False)
    return out


def reader_start(task: str, args: argparse.Namespace) -> Path:
    """The teacher with ``READER["positions"]`` positions (written once per task): the same weights,
    only ``max_position_embeddings`` changed (rotary positions have no weights of their own)."""
    from agents.models import load

    out = Path(args.out) / task / "fullcontext-start"
    if not (out / "config.json").is_file():
        model, tokenizer = load(teacher_dir(task, args))
        model.config.max_position_embeddings = READER["positions"]
        tmp = out.with_name(out.name + ".tmp")  # written whole, then renamed: a kill leaves no half model
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.replace(out)
    return out


def train_reader(task: str, seed: int, args: argparse.Namespace) -> Path:
    """The full-context reader: ``FullContextOracle`` records at L (train split, once per task), then
    ``memopd.sft`` of :func:`reader_start` on them."""
    from memopd.eval import evaluate as run_eval
    from memopd.sft import SFTConfig, run as run_sft

    out = Path(args.out) / task / f"fullcontext-s{seed}"
    if (out / "config.json").is_file():
        return out
    start = str(reader_start(task, args))
    gold = Path(args.out) / task / "fullcontext-gold"
    if not (gold / "episodes.jsonl").is_file():
        n = 8 if args.smoke else READER["gold_episodes"]
        run_eval([*env_argv(task, args.train_chunks), "--agent", "agents.baselines:FullContextOracle", "--model",
                  start, "--split", "train", "--episodes", str(n), "--seed", "0", "--no-progress",
                  "--out", str(gold), "--overwrite"])
    steps = 2 if args.smoke else recipe(task)["reader_steps"]
    run_sft(SFTConfig(model=start, episodes=str(gold / "episodes.jsonl"), out=str(out), seed=seed + 2,
                      threads=args.threads, progress=False, steps=steps, batch_episodes=READER["batch_episodes"],
                      lr=READER["lr"], warmup_steps=20, checkpoint_every=100), progress=False)
    return out


def model_of(task: str, policy: str, seed: int, args: argparse.Namespace) -> tuple[str, list[str]]:
    """The model to evaluate and the agent flags of ``memopd.eval``."""
    if policy in RL:
        return str(train_rl(task, policy, seed, args)), []
    if policy in SFT:
        return str(train_sft(task, policy, seed, args)), []
    if policy in READERS:
        return str(train_reader(task, seed, args)), ["--agent", "fullcontext", "--batch-size", "8"]
    top_k = FIXED[policy]
    return teacher_dir(task, args), ([] if top_k is None else ["--agent", "rag-memagent", "--agent-kwarg",
                                                                 f"top_k={top_k}"])


# --- evaluation --------------------------------------------------------------------------------------------
def eval_cell(task: str, policy: str, seed: int, n: int, args: argparse.Namespace) -> dict[str, Any] | None:
    """One policy, seed and length: its per-episode F1 (read back when a run did it)."""
    from agents.records import load_episodes
    from memopd.eval import evaluate as run_eval

    row_path = Path(args.out) / "rows" / f"{task}-{policy}-s{seed}-{n}.json"
    if row_path.is_file():
        return json.loads(row_path.read_text())
    if args.cached_only:
        return None
    model, agent = model_of(task, policy, seed, args)
    out = Path(args.out) / "eval" / f"{task}-{policy}-s{seed}-{n}"
    t0 = time.perf_counter()
    summary = run_eval([*env_argv(task, n), "--model", model, *agent, "--episodes", str(episodes_at(n, args)),
                        "--temperature", "0", "--top-k", "1", "--threads", str(args.threads), "--no-progress",
                        "--out", str(out), "--overwrite"])
    episodes = load_episodes(out / "episodes.jsonl").episodes
    f1 = [e.metrics.get("f1", 0.0) for e in episodes]
    row = {"task": task, "policy": policy, "seed": seed, "num_chunks": n, "f1": f1, "mean_f1": sum(f1) / len(f1),
           "sample_ids": [e.sample_id for e in episodes],
           "calls_per_s": summary.get("calls_per_s"), "eval_s": time.perf_counter() - t0}
    write_row(row_path, row)
    print(f"{task} {policy} seed {seed} @ {n} chunks: F1 {row['mean_f1']:.3f} ({len(f1)} episodes)", flush=True)
    return row


def write_row(path: Path, row: dict[str, Any]) -> None:
    """One finished cell's JSON, written whole and then renamed: a killed write leaves no half row."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(row) + "\n")
    tmp.replace(path)


def seeds_of(policy: str, args: argparse.Namespace) -> list[int]:
    return [0] if policy in FIXED else args.seeds


# --- the report --------------------------------------------------------------------------------------------
_DISTANCES: dict[tuple[str, int], dict[str, int]] = {}


def fact_distances(task: str, n: int, sample_ids: Sequence[str]) -> list[int]:
    """Chunks read after the fact, per test sample at ``n`` chunks: ``n - 1 - c`` with ``c`` the first
    chunk (0-based) holding a supporting fact with an answer word (every supporting fact where none
    has one, as in Counting). The memory must carry the answer across these chunks' calls."""
    import gymnasium as gym

    got = _DISTANCES.setdefault((task, n), {})
    missing = [sid for sid in sample_ids if sid not in got]
    if missing:
        env = gym.make(env_id(task), **{**TASKS.get(task, {}), "num_chunks": n}, split="test")
        source = env.unwrapped.source
        for sid in missing:
            sample = source[source.index_of(sid)]
            words = set(" ".join(map(str, sample.answers)).lower().split())
            facts = [f for f in sample.supporting_facts if isinstance(f, dict) and "chunk" in f]
            holding = [f for f in facts if words & set(str(f.get("text", "")).lower().split())] or facts
            got[sid] = n - 1 - min(int(f["chunk"]) for f in holding)
        env.close()
    return [got[sid] for sid in sample_ids]


def retention(points: list[tuple[int, float]]) -> dict[str, float | None]:
    """The per-chunk retention rate: ``r`` and ``a`` of the least-squares fit F1 = a * r**d over
    (distance, F1) points, ``r`` in [0, 1] (a coarse grid, then a fine one around its best; ``a`` in
    closed form for each r), and the half-life ``log(0.5) / log(r)`` in chunks (None at r = 1)."""
    if not points:
        return {}

    def fit(r: float) -> tuple[float, float]:
        w = [r ** d for d, _ in points]
        ww = sum(x * x for x in w)
        a = sum(x * y for x, (_, y) in zip(w, points)) / ww if ww > 0 else 0.0
        return sum((y - a * x) ** 2 for x, (_, y) in zip(w, points)), a

    best = min((i / 1000 for i in range(1001)), key=lambda r: fit(r)[0])
    lo, hi = max(0.0, best - 0.001), min(1.0, best + 0.001)
    r = min((lo + (hi - lo) * i / 400 for i in range(401)), key=lambda r: fit(r)[0])
    half = math.log(0.5) / math.log(r) if 0 < r < 1 else (None if r >= 1 else 0.0)  # None: never halves
    return {"r": r, "a": fit(r)[1], "half_life_chunks": half, "points": len(points)}


def by_distance(cells: list[dict[str, Any]]) -> tuple[dict[str, dict[str, float]], dict[str, float | None]]:
    """F1 by the chunks read after the fact (bins 0, 1, 2-3, 4-7, ...; every length and seed pooled)
    and the retention fit. Rows without ``sample_ids`` (the first cells) are the first test samples
    in order, as ``memopd.eval`` reads them."""
    points = []
    for r in cells:
        ids = r.get("sample_ids") or [f"{r['task'].lower()}-test-0-{i}" for i in range(len(r["f1"]))]
        points += list(zip(fact_distances(r["task"], r["num_chunks"], ids), r["f1"]))
    return distance_table(points)


def distance_table(points: list[tuple[int, float]]) -> tuple[dict[str, dict[str, float]], dict[str, float | None]]:
    """(distance, F1) points binned by the chunks read after the fact (0, 1, 2-3, 4-7, ...), and the
    retention fit over them."""
    bins: dict[int, list[float]] = {}
    for d, f in points:
        bins.setdefault(0 if d == 0 else 1 << (d.bit_length() - 1), []).append(f)
    table = {str(lo): {"f1": sum(v) / len(v), "episodes": len(v)} for lo, v in sorted(bins.items())}
    return table, retention(points)


def drop_lower_bound(rows: list[dict[str, Any]], short: int, long: int, draws: int = 2000) -> dict[str, float]:
    """F1(long) - F1(short) over seeds, and its one-sided 95% lower bound by a two-level bootstrap:
    seeds with replacement, then each drawn seed's episodes at both lengths with replacement."""
    by_seed = {}
    for r in rows:
        by_seed.setdefault(r["seed"], {})[r["num_chunks"]] = r["f1"]
    seeds = sorted(s for s, got in by_seed.items() if short in got and long in got)
    if not seeds:
        return {}

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    point = mean([mean(by_seed[s][long]) - mean(by_seed[s][short]) for s in seeds])
    rng = random.Random(0)
    boot = []
    for _ in range(draws):
        diffs = []
        for s in rng.choices(seeds, k=len(seeds)):
            a, b = by_seed[s][short], by_seed[s][long]
            diffs.append(mean(rng.choices(b, k=len(b))) - mean(rng.choices(a, k=len(a))))
        boot.append(mean(diffs))
    boot.sort()
    return {"drop": point, "lower_95": boot[int(0.05 * draws)], "seeds": len(seeds)}


def balanced(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cells at the lengths every seed of the policy was read at: pooled by distance, a length only
    some seeds have (one seed read at ``FAR``) would weigh those seeds' long distances alone."""
    seeds = {r["seed"] for r in cells}
    full = {n for n in {r["num_chunks"] for r in cells} if {r["seed"] for r in cells if r["num_chunks"] == n} == seeds}
    return [r for r in cells if r["num_chunks"] in full]


def summarise(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per task and policy: F1 mean ± sd over seeds at each length, the drop from L to 32L, and from
    L to the far length where the policy was read there."""
    out: dict[str, Any] = {}
    short, long, far = min(args.lengths), max(args.lengths), args.far
    for task in args.tasks:
        for policy in args.policies:
            cells = [r for r in rows if r["task"] == task and r["policy"] == policy]
            if not cells:
                continue
            at = {}
            for n in sorted({r["num_chunks"] for r in cells}):
                means = [r["mean_f1"] for r in cells if r["num_chunks"] == n]
                mu = sum(means) / len(means)
                sd = math.sqrt(sum((m - mu) ** 2 for m in means) / (len(means) - 1)) if len(means) > 1 else 0.0
                at[str(n)] = {"f1": mu, "sd": sd, "seeds": len(means)}
            table, fitted = by_distance(balanced(cells)) if task in TASKS else ({}, {})  # (hand-made: no samples)
            out.setdefault(task, {})[policy] = {"by_length": at, **drop_lower_bound(cells, short, long),
                                                "by_distance": table, "retention": fitted}
            if far and str(far) in at:
                out[task][policy].update({f"far_{k}": v for k, v in drop_lower_bound(cells, short, far).items()})
    return out


def verdicts(summary: dict[str, Any]) -> dict[str, str]:
    """Per task: holds / does not hold / not tested, by the claim and its required contrast: a
    policy that can fall (the untrained warm start, the full-context agent) must score at
    least ``-CONTRAST`` at L and drop by at least that much, or the test was too easy."""
    said = {}
    for task, policies in summary.items():
        memopd = policies.get("memopd", {})
        contrast = [p for p in CONTRAST_POLICIES if "drop" in policies.get(p, {})]
        able = [p for p in contrast if policies[p]["by_length"][min(policies[p]["by_length"], key=int)]["f1"]
                >= -CONTRAST]
        if "lower_95" not in memopd:
            said[task] = "not tested yet: the memopd policy needs both ends of the ladder"
        elif not able:
            said[task] = (f"not tested: no contrast policy ({', '.join(CONTRAST_POLICIES)}) scores {-CONTRAST} at L, "
                          "so none can show the required drop")
        elif all(policies[p]["drop"] > CONTRAST for p in able):
            said[task] = f"too easy: no contrast policy drops by {-CONTRAST} ({', '.join(able)})"
        elif memopd["lower_95"] > CLAIM_MARGIN:
            said[task] = f"holds: memopd's drop {memopd['drop']:+.3f}, lower bound {memopd['lower_95']:+.3f}"
        else:
            said[task] = f"does not hold: memopd's drop {memopd['drop']:+.3f}, lower bound {memopd['lower_95']:+.3f}"
    return said


def plot(summary: dict[str, Any], path: Path) -> None:
    """A panel per task: F1 against input length (top) and against the chunks read after the fact
    (bottom, where the policies have them), log axes, one line per policy, a ±sd band over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    tasks = list(summary)
    named = list(dict.fromkeys([*POLICIES, *(p for t in tasks for p in summary[t])]))
    colors = {p: plt.get_cmap("tab10" if len(named) <= 10 else "tab20")(i) for i, p in enumerate(named)}
    fig, axes = plt.subplots(2, max(1, len(tasks)), figsize=(5 * max(1, len(tasks)), 7.5), squeeze=False)
    for col, task in enumerate(tasks):
        top, bottom = axes[0][col], axes[1][col]
        for policy, got in summary[task].items():  # a policy keeps its colour in every panel
            xs = sorted(int(n) for n in got["by_length"])
            ys = [got["by_length"][str(n)]["f1"] for n in xs]
            sd = [got["by_length"][str(n)]["sd"] for n in xs]
            (line,) = top.plot(xs, ys, marker="o", label=policy, color=colors[policy])
            top.fill_between(xs, [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)],
                             color=line.get_color(), alpha=0.15)
            bins = got.get("by_distance") or {}
            if bins:
                ds = sorted(int(d) for d in bins)
                bottom.plot([d + 1 for d in ds], [bins[str(d)]["f1"] for d in ds], marker=".",
                            color=line.get_color(), label=policy)
        top.set_xscale("log", base=2)
        top.set_title(task)
        top.set_xlabel("input length (chunks)")
        bottom.set_xscale("log", base=2)
        bottom.set_xlabel("chunks read after the fact + 1 (bins of powers of two)")
        for ax in (top, bottom):
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
            ax.set_ylim(-0.02, 1.02)
            ax.set_ylabel("held-out F1")
        top.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command(args: argparse.Namespace) -> str:
    """The command that computes these cells (where they land and --publish aside)."""
    parts = ["python examples/long_horizon.py"]
    if args.smoke:
        parts.append("--smoke")
    for flag, value, default in (("--tasks", args.tasks, list(PART1_TASKS)), ("--policies", args.policies, list(POLICIES)),
                                 ("--seeds", args.seeds, [0, 1, 2, 3, 4]), ("--lengths", args.lengths, list(LENGTHS))):
        if value != default and not (args.smoke and flag in ("--seeds", "--lengths")):
            parts.append(f"{flag} {','.join(map(str, value))}")
    if args.far != FAR and not args.smoke:
        parts.append(f"--far {args.far}")
    return " ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import memgym  # noqa: F401  (registers the envs)

    t0 = time.perf_counter()
    if args.resume_from:
        resume(args)
    rows = []
    for task in args.tasks:  # the cheap, seedless policies first: the teacher is built for every other
        for policy in sorted(args.policies, key=lambda p: p not in FIXED):
            for seed in seeds_of(policy, args):
                for n in [*args.lengths, *([args.far] if args.far and policy in FAR_POLICIES else [])]:
                    row = eval_cell(task, policy, seed, n, args)
                    if row is not None:
                        rows.append(row)
    summary = summarise(rows, args)
    import torch
    import transformers

    results = {"command": command(args),
               "tasks": {t: TASKS[t] for t in args.tasks}, "train_chunks": args.train_chunks,
               "lengths": args.lengths, "far": args.far, "policies": args.policies, "seeds": args.seeds,
               "student": STUDENT, "recipes": {t: recipe(t) for t in args.tasks},
               "claim": {"margin": CLAIM_MARGIN, "contrast": CONTRAST}, "summary": summary,
               "verdicts": verdicts(summary), "rows": rows,
               "wall_s_this_invocation": time.perf_counter() - t0,
               "versions": {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__}}
    save(results, Path(args.out) / "results.json", args.publish)
    if summary:
        plot(summary, Path(args.out) / "length.png")
    return 0


def save(results: dict[str, Any], path: Path, publish: str | None) -> None:
    """Write the results JSON, say its verdicts, and copy it to ``publish`` when given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results) + "\n")
    for task, said in results["verdicts"].items():
        print(f"{task}: {said}")
    print(f"saved {path}")
    if publish:
        Path(publish).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, publish)


if __name__ == "__main__":
    sys.exit(main())
