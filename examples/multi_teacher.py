"""Several teachers in one run: specialists routed by task against one teacher of both, and
teachers routed by call role against either alone.

    python examples/multi_teacher.py --out runs/multi-teacher --threads 1        # every part, resumable
    python examples/multi_teacher.py --parts teachers                             # the five teachers only
    python examples/multi_teacher.py --arms by-task,generalist --seeds 0          # some student cells

The mix: LongQA at its default and Counting with one count in chunks of 64 tokens (``keys=1``,
``chunk_size=64``, its default when the study was run), in the digit presets' tokens (a
``tiny-digits`` student, warmed up for 100 SFT steps as then). The teachers (``tiny-teacher-digits``
fine-tuned by ``memopd.sft``'s loop on oracle trajectories, 32 episodes a step, each at the same
compute of 500 steps but the specialists):

  LongQA, Counting  a specialist each: 250 steps on 1,000 trajectories of its task (the auto
                    teacher's recipe, lr 3e-3 with a cosine decay, but a 10-step warm-up), so the
                    two together cost what one teacher of both costs;
  both              the generalist: 500 steps on 1,000 trajectories of each task;
  memory, answer    500 steps on the same 2,000 trajectories with only their memory calls, or only
                    their answer calls (each call is its own state, so the other role's calls are
                    simply left out): one teacher strong on memory updates, one on answers.

Each teacher's held-out F1 per task (64 test episodes each, greedy, as the run's agent). The
student arms, each ``python -m memopd.train`` on the mix (80 steps of PPO + MemOPD, its warm start,
its held-out F1 per task before and after on 64 test episodes each):

  by-task       --teacher LongQA-v0=<LongQA> --teacher Counting-v0=<Counting>
  generalist    --teacher <both>
  by-role       --teacher memory=<memory> --teacher answer=<answer>
  memory-only   --teacher <memory>
  answer-only   --teacher <answer>

Everything lands in --out: teachers/<name>/ (the models), students/<arm>-s<seed>/ (the runs: a
killed run is resumed), rows/ (one JSON file per finished cell, read back by a rerun) and
results.json (every finished cell); ``--publish FILE`` copies results.json there
(docs/data/multi_teacher/results.json for docs/RESULTS.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ENVS = ("memgym/LongQA-v0", "memgym/Counting-v0")
ENV_KWARGS = {"memgym/Counting-v0": {"keys": 1, "chunk_size": 64}}
"""Counting with one count in chunks of 64 tokens, as this study was run (its task default is two
counts in chunks of 32 since)."""
ENV_FLAGS = [a for env in ENVS
             for a in ("--env", env + "".join(f",{k}={v}" for k, v in ENV_KWARGS.get(env, {}).items()))]
STUDENT, TEACHER = "tiny-digits", "tiny-teacher-digits"
TEACHERS = {  # name -> (tasks it learns from, steps, the roles whose calls it is trained on)
    "LongQA": (("memgym/LongQA-v0",), 250, ("memory", "answer")),
    "Counting": (("memgym/Counting-v0",), 250, ("memory", "answer")),
    "both": (ENVS, 500, ("memory", "answer")),
    "memory": (ENVS, 500, ("memory",)),
    "answer": (ENVS, 500, ("answer",)),
}
ARMS = {  # arm -> its --teacher flags, in teacher names
    "by-task": ["LongQA-v0=LongQA", "Counting-v0=Counting"],
    "generalist": ["both"],
    "by-role": ["memory=memory", "answer=answer"],
    "memory-only": ["memory"],
    "answer-only": ["answer"],
}
PARTS = ("teachers", "students")
EVAL_EPISODES = 64
SMOKE_TRAIN = ["--steps", "2", "--questions-per-step", "2", "--group-size", "2", "--student-warmup-steps", "2",
               "--eval-every", "0"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python examples/multi_teacher.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/multi-teacher", help="the study's directory (reused by a rerun)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated parts of {list(PARTS)}")
    p.add_argument("--teachers", default=",".join(TEACHERS), help=f"comma-separated teachers of {list(TEACHERS)}")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated student arms of {list(ARMS)}")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated student seeds")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="tiny sizes: the pipeline in a few minutes")
    p.add_argument("--publish", default=None, help="copy results.json to this file")
    return p.parse_args(argv)


def cached(path: Path, compute) -> dict[str, Any]:
    """A cell's row: read back when a run finished it, else computed and written at once."""
    if path.is_file():
        return json.loads(path.read_text())
    row = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row, indent=1))
    return row


def role_only(episodes: list[Any], roles: Sequence[str]) -> list[Any]:
    """Each episode with only the calls of ``roles`` (each call is scored in its own state)."""
    if set(roles) >= {"memory", "answer"}:
        return episodes
    return [dataclasses.replace(e, invocations=[i for i in e.invocations if i.role in roles]) for e in episodes]


def teacher_cell(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Fine-tune one teacher (its directory under teachers/) and evaluate it on each task."""
    from agents import models
    from memopd.learn.models import pad_id
    from memopd.runtime import set_threads
    from memopd.sft import SFTConfig, oracle_episodes, train_sft

    set_threads(args.threads)
    tasks, steps, roles = TEACHERS[name]
    steps = 3 if args.smoke else steps
    out = Path(args.out) / "teachers" / name
    t0 = time.perf_counter()
    if not (out / "config.json").is_file():
        model, tok = models.load(TEACHER)
        eps = [e for env in tasks
               for e in oracle_episodes(env, ENV_KWARGS.get(env, {}), tok, 40 if args.smoke else 1000, seed=2,
                                        progress=False)]
        cfg = SFTConfig(steps=steps, batch_episodes=32, lr=3e-3, warmup_steps=10, seed=1, threads=args.threads,
                        checkpoint_every=25)  # a killed build resumes from its last state
        losses = train_sft(model, role_only(eps, roles), cfg, pad_token_id=pad_id(tok), progress=False,
                           log=lambda m: None, state_dir=out.with_name(out.name + ".state"))
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.replace(out)
    else:
        losses = None
    figures = evaluate(str(out), args)
    return {"teacher": name, "tasks": list(tasks), "steps": steps, "roles": list(roles), "heldout": figures,
            "build_s": time.perf_counter() - t0, "loss_last": _last_loss(losses)}


def _last_loss(history: list[dict[str, float]] | None) -> float | None:
    """The SFT loss of the last step (None: the teacher was built by an earlier run)."""
    return float(history[-1]["loss"]) if history else None


def evaluate(model_dir: str, args: argparse.Namespace) -> dict[str, float]:
    """A model's held-out F1 on each task as the run's agent (greedy, ``EVAL_EPISODES`` each)."""
    from agents import models
    from memopd import config as cfgmod
    from memopd import train
    from memopd.learn.actor import Actor

    n = 4 if args.smoke else EVAL_EPISODES
    argv = ENV_FLAGS + ["--model", model_dir, "--eval-episodes", str(n),
                                                          "--threads", str(args.threads), "--no-progress"]
    cfg = cfgmod.parse_args(train.TrainConfig, train.env_flags(argv), "t", "")
    model, tok = models.load(model_dir)
    return Actor(cfg, model.eval(), tok).evaluate()


def student_cell(arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One student run of an arm (resumed when a checkpoint is there)."""
    out = Path(args.out)
    run = out / "students" / f"{arm}-s{seed}"
    teachers = []
    for route in ARMS[arm]:
        key, _, name = route.rpartition("=")
        teachers += ["--teacher", f"{key}={out / 'teachers' / name}" if key else str(out / "teachers" / name)]
    if (run / "summary.json").is_file():
        pass
    elif (run / "checkpoints").is_dir():
        subprocess.run([sys.executable, "-m", "memopd.train", "--resume", str(run), "--no-progress"], check=True)
    else:
        argv = ENV_FLAGS + teachers + [
            "--model", STUDENT, "--student-warmup-steps", "100", "--seed", str(seed), "--threads", str(args.threads),
            "--no-progress", "--eval-episodes", str(4 if args.smoke else EVAL_EPISODES), "--run-dir", str(run),
            *(SMOKE_TRAIN if args.smoke else [])]
        subprocess.run([sys.executable, "-m", "memopd.train", *argv], check=True)
    summary = json.loads((run / "summary.json").read_text())
    return {"arm": arm, "seed": seed, "teachers": ARMS[arm], "before": summary["eval_before"],
            "after": summary["eval_after"], "steps": summary["steps"]}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    parts = args.parts.split(",")
    rows = out / "rows"
    if "teachers" in parts:
        for name in args.teachers.split(","):
            cached(rows / f"teacher-{name}.json", lambda: teacher_cell(name, args))
            print(f"teacher {name}: done", flush=True)
    if "students" in parts:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for arm in args.arms.split(","):
                cached(rows / f"student-{arm}-s{seed}.json", lambda: student_cell(arm, seed, args))
                print(f"student {arm} seed {seed}: done", flush=True)
    results = {"command": "python examples/multi_teacher.py --threads 1",  # the whole study; rows/ holds what ran
               "envs": list(ENVS), "env_kwargs": ENV_KWARGS, "student": STUDENT, "teacher_base": TEACHER,
               "eval_episodes": EVAL_EPISODES,
               "arms": list(ARMS), "routes": ARMS,
               "teachers": [json.loads(p.read_text()) for p in sorted(rows.glob("teacher-*.json"))],
               "students": [json.loads(p.read_text()) for p in sorted(rows.glob("student-*.json"))]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if args.publish:
        Path(args.publish).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "results.json", args.publish)
    return 0


if __name__ == "__main__":
    sys.exit(main())
