"""The long-horizon study, part 2: does training in the student's own states teach the recovery that imitation does not?

    python examples/on_policy_recovery.py --out runs/long-horizon           # every arm and seed, resumable
    python examples/on_policy_recovery.py --policies dagger,memopd --seeds 0
    python examples/on_policy_recovery.py --cached-only --publish docs/data/on_policy_recovery/results.json
    python examples/on_policy_recovery.py --smoke --out DIR                 # the pipeline in minutes (CI)

Part 2's control (``examples/on_policy_premise.py``) showed on LongQA at L = 6 chunks that an agent
trained by imitation of clean demonstrations does not recover from a wrong memory when the fact
comes again, more imitation does not help, and a teacher fine-tuned on the reader oracle's
demonstrations with distractors put in does recover. Here the training methods are compared given
such a teacher, on a task (``TASKS``; by default LongQA with each fact stated twice, whose control
the premise script reads with ``--tasks LongQA-twice``) where the student's own mistakes reach
states to recover from. Every arm starts from the same imitation agent and trains for the same
number of updates; only where its training states come from, and who labels them, differs:

  start        the task's auto teacher (SFT on clean oracle trajectories: an imitation agent that
               learned the clean task; on LongQA it loses 0.350 where it could recover). Not part 1's
               student: SFT does not train that one at part 1's compute (0.027, the copy plateau), so
               an imitation arm from it would show nothing.
  teacher      the recovering teacher (``teacher-recovering`` of the control)
  budget       the recovering teacher's own fine-tuning: the auto teacher recipe's steps (250; 1000
               with distractor facts, ``long_horizon.TEACHER_STEPS``) of ``BATCH`` episodes at its
               learning rate

The arms (``ARMS``):

  sft-oracle   SFT on ``DATA`` clean trajectories of the reader oracle: the oracle's states, its actions
  sft-teacher  SFT on ``DATA`` trajectories the teacher sampled (temperature 1) on clean episodes: the
               teacher's states and actions (sequence-level distillation)
  dagger       ``ROUNDS`` rounds: the student samples ``DATA / ROUNDS`` clean episodes (temperature 1),
               the teacher's greedy action labels every call in the student's state
               (``memopd.relabel``), and the student trains a fifth of the updates on every
               round's data so far: the student's states, the teacher's actions
  memopd       ``memopd.train`` from the start with the teacher: PPO + MemOPD, as many steps of 4
               questions x 8 samples (``BATCH`` episodes) at ``RL_LR``, the teacher's distribution
               scored in the state the student acted in

Each arm is read as the control reads a policy (``on_policy_premise.cell``): greedy, clean and with a
distractor after the first chunk, on the same first 256 test episodes, paired per episode; recovery
is the change where the fact comes again. Beside it: the wall-clock of each arm's build, the
teacher's sampling and labelling included (``build.json``; a stage killed and resumed counts only its
last run), and how often the arm's training states start from a memory the oracle never holds
(``wrong_states``: anything beside the supporting facts; of those, the calls whose chunk brings the
fact, where recovery is taught; and memories of the control's kind, the asked fact's frame with a
wrong word). The premise predicts that the arms
trained in the student's states (dagger, memopd) recover where the others do not, and only as far
as the student's own mistakes reach such states.

Everything lands in --out (part 1's directory, whose start and teacher it reuses):
<task>/recovery/<arm>-s<seed>/ (data, models, runs, build.json), rows-recovery/ and eval-recovery/
(the readings), recovery.json (``--publish FILE`` copies it). A rerun recomputes nothing finished;
a killed SFT or RL run resumes from its checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the study's other scripts, beside this file

import long_horizon as lh  # noqa: E402
import on_policy_premise as premise  # noqa: E402

TASKS = ("LongQA-twice", "LongQA-distractors", "LongQA")
"""LongQA with each fact stated twice first (``fact_repeats`` 2, in different chunks): a student that
wrote a wrong memory after the first statement reads the fact again, a state to recover from. On
plain LongQA there is none: the start sampling at temperature 1 is off the oracle's path in half its
calls (it renames the person after reading the fact), but the fact comes once, and 2 of 1,792 calls
have it in their chunk. With distractor facts (``distractor_similarity`` 0.5) the auto teacher does
not learn the clean task (0.066 after 1,000 SFT steps), so no start and no teacher are there."""
ARMS = ("sft-oracle", "sft-teacher", "dagger", "memopd")
IMITATION = ("sft-oracle", "sft-teacher")
ON_POLICY = ("dagger", "memopd")
BATCH, LR = 32, 3e-3
RL_LR = 2e-4
"""The MemOPD arm's learning rate. The start is a trained model (a directory, for which memopd.train's
default is a pretrained model's 1e-6, too small to move a tiny model in 250 steps); at the tiny
presets' default from scratch, 2e-3, this arm's first run (LongQA-twice, seed 0) fell from F1 0.977
to 0.371 clean, its training reward at 0.1-0.36 and its OPD loss not falling, as PPO fell from a
trained start at 2e-3 (docs/RESULTS.md, "The lr 2e-3 collapse"; there it learned at 2e-4)."""
DATA = 1000
ROUNDS = 5
SMOKE = {"updates": 2, "data": 8, "rounds": 2}
MARGIN = 0.1
"""An on-policy arm recovers better when its loss where the fact comes again is smaller than every
imitation arm's by this much, beyond two standard errors of the difference over seeds."""
MIN_SEEDS = 3


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python examples/on_policy_recovery.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/long-horizon", help="part 1's directory (its start and teacher)")
    lh.add_study_args(p, TASKS, ARMS, ARMS, "0,1,2,3,4", TASKS[:1])
    args = p.parse_args(argv)
    lh.split_study_args(p, args, TASKS, ARMS)
    if args.smoke:
        args.seeds = args.seeds[:1]
    return args


def sizes(task: str, one: argparse.Namespace, args: argparse.Namespace) -> tuple[int, int, int]:
    """Updates (the auto teacher recipe's steps), trajectories and DAgger rounds (the smoke's are tiny)."""
    from memopd.learn.models import teacher_recipe

    if args.smoke:
        return SMOKE["updates"], SMOKE["data"], SMOKE["rounds"]
    return teacher_recipe(lh.rl_config(task, "memopd", 0, one)[1])["steps"], DATA, ROUNDS


def arm_home(task: str, arm: str, seed: int, args: argparse.Namespace) -> Path:
    """Where one arm and seed keeps its data, model, run and build.json."""
    return Path(args.out) / task / "recovery" / f"{arm}-s{seed}"


def stage(build: Path, name: str, done: Path, fn: Callable[[], Any]) -> None:
    """Run ``fn`` unless ``done`` exists, adding its wall-clock seconds to ``build`` under ``name``."""
    if done.exists():
        return
    t0 = time.perf_counter()
    fn()
    times = json.loads(build.read_text()) if build.is_file() else {}
    times[name] = times.get(name, 0.0) + time.perf_counter() - t0
    build.parent.mkdir(parents=True, exist_ok=True)
    build.write_text(json.dumps(times, indent=1) + "\n")


def sample(task: str, model: str, out: Path, n: int, seed: int, agent: Sequence[str], one: argparse.Namespace,
           args: argparse.Namespace) -> None:
    """``n`` training episodes of ``model`` (temperature 1) or of a scripted agent, at L."""
    from memopd.eval import evaluate as run_eval

    run_eval([*lh.env_argv(task, one.train_chunks), "--model", model, *agent, "--split", "train", "--episodes",
              str(n), "--temperature", "1", "--seed", str(seed), "--threads", str(args.threads), "--no-progress",
              "--out", str(out), "--overwrite"])


def sft(start: str, episodes: Path, out: Path, steps: int, seed: int, args: argparse.Namespace) -> None:
    from memopd.sft import SFTConfig, run as run_sft

    run_sft(SFTConfig(model=start, episodes=str(episodes), out=str(out), seed=seed, threads=args.threads,
                      progress=False, steps=steps, batch_episodes=BATCH, lr=LR, checkpoint_every=25), progress=False)


def relabel(data: Path, teacher: str, out: Path) -> None:
    from memopd import relabel as rl

    if rl.main(["--episodes", str(data), "--teacher", teacher, "--out", str(out)]) != 0:
        raise SystemExit(f"error: relabelling {data} failed (its message above)")


def build(task: str, arm: str, seed: int, one: argparse.Namespace, args: argparse.Namespace) -> Path:
    """The arm's trained model (built when missing; every stage resumes)."""
    start = lh.teacher_dir(task, one)
    teacher = str(premise.further_teacher(task, premise.RECOVERING, args, one))
    updates, data, rounds = sizes(task, one, args)
    home = arm_home(task, arm, seed, args)
    log, model = home / "build.json", home / "model"
    if arm in IMITATION:
        states = home / "data"
        agent = ["--agent", "oracle", "--agent-kwarg", "script=reader"] if arm == "sft-oracle" else []
        source = teacher if arm == "sft-teacher" else start  # for the oracle, only its tokenizer
        stage(log, "sample", states / "episodes.jsonl",
              lambda: sample(task, source, states, data, 10 + seed, agent, one, args))
        stage(log, "sft", model / "config.json",
              lambda: sft(start, states / "episodes.jsonl", model, updates, seed, args))
    elif arm == "dagger":
        current = start
        for r in range(rounds):
            step = home / f"round-{r}"
            stage(log, "sample", step / "student" / "episodes.jsonl",
                  lambda: sample(task, current, step / "student", data // rounds, 100 * seed + r, [], one, args))
            stage(log, "relabel", step / "labelled.jsonl",
                  lambda: relabel(step / "student" / "episodes.jsonl", teacher, step / "labelled.jsonl"))
            pooled = step / "pooled.jsonl"  # every round's labelled states so far (DAgger's aggregation)
            if not pooled.is_file():
                partial = pooled.with_suffix(".partial")
                partial.write_text("".join((home / f"round-{k}" / "labelled.jsonl").read_text() for k in range(r + 1)))
                partial.replace(pooled)
            stage(log, "sft", step / "model" / "config.json",
                  lambda: sft(current, pooled, step / "model", updates // rounds, 1000 * seed + r, args))
            current = str(step / "model")
        if not model.exists():
            model.symlink_to(Path(current).resolve())
    else:
        stage(log, "train", home / "run" / "summary.json", lambda: train_memopd(task, start, teacher, home / "run",
                                                                           seed, updates, one, args))
        if not model.exists():
            model.symlink_to((home / "run" / "model").resolve())
    return model


def train_memopd(task: str, start: str, teacher: str, run: Path, seed: int, updates: int, one: argparse.Namespace,
                 args: argparse.Namespace) -> None:
    from memopd import train

    questions, group = (2, 2) if args.smoke else (4, BATCH // 4)
    argv = lh.rl_argv(run, [*lh.env_argv(task, one.train_chunks), "--model", start, "--teacher", teacher,
                            "--seed", str(seed), "--steps", str(updates), "--lr", str(RL_LR),
                            "--questions-per-step", str(questions), "--group-size", str(group),
                            "--student-warmup-steps", "0", "--threads", str(args.threads), "--no-progress",
                            "--eval-every", "0"])
    if train.main(argv) != 0:
        raise SystemExit(f"error: the run {run} failed (its log above); rerun to resume it")


def training_states(task: str, arm: str, seed: int, args: argparse.Namespace) -> list[Path]:
    """The episode files whose calls are the arm's training states."""
    home = arm_home(task, arm, seed, args)
    if arm in IMITATION:
        return [home / "data" / "episodes.jsonl"]
    if arm == "dagger":
        return sorted(home.glob("round-*/student/episodes.jsonl"))
    return sorted((home / "run" / "episodes").glob("step-*.jsonl"))


def wrong_states(task: str, files: Sequence[Path], one: argparse.Namespace) -> dict[str, int]:
    """How often the calls of ``files`` start from a memory the oracle never holds (states imitation of
    the oracle never shows): ``off_oracle``, a memory with anything beside the supporting facts (a
    fact about another person, a wrong name, a wrong word); ``off_oracle_fact_in_chunk``, those whose
    chunk brings a supporting fact (where writing it recovers); ``wrong_frame``, a memory that fills
    the asked fact's frame with a wrong word (``alice globex .``: the control's perturbation, the
    frames of ``memgym.oracle.ReaderScript``)."""
    import gymnasium as gym

    from agents.models import load_tokenizer
    from agents.records import load_episodes
    from memgym.oracle import ReaderScript, contains

    env = gym.make(lh.env_id(task), split="train", **{**lh.TASKS[task], "num_chunks": one.train_chunks})
    source, tokenizer = env.unwrapped.source, load_tokenizer(lh.STUDENT)
    counts = {"calls": 0, "off_oracle": 0, "off_oracle_fact_in_chunk": 0, "wrong_frame": 0}
    for path in files:
        for episode in load_episodes(path).episodes:
            sample = source[source.index_of(episode.sample_id)]
            facts = [f["text"] for f in sample.supporting_facts]
            frames = ReaderScript(facts, str(sample.answers[0])).frames
            for call in episode.invocations:
                memory = tokenizer.decode(call.prompt_ids[slice(*call.spans["memory"])])
                chunk = tokenizer.decode(call.prompt_ids[slice(*call.spans["chunk"])]) if "chunk" in call.spans else ""
                rest = memory
                for fact in facts:
                    rest = rest.replace(fact, " ")
                off = bool(rest.strip())
                counts["calls"] += 1
                counts["off_oracle"] += off
                counts["off_oracle_fact_in_chunk"] += off and any(contains(chunk, f) for f in facts)
                counts["wrong_frame"] += any(m.group(0) not in facts for fr in frames for m in fr.finditer(memory))
    return counts


def start_states(task: str, one: argparse.Namespace, args: argparse.Namespace) -> dict[str, int] | None:
    """The start's own states: ``wrong_states`` of 256 training episodes it samples (temperature 1),
    the states on-policy training begins from."""
    home = Path(args.out) / task / "recovery" / "start-states"
    if not (home / "states.json").is_file():
        if args.cached_only:
            return None
        sample(task, lh.teacher_dir(task, one), home, SMOKE["data"] if args.smoke else 256, 7, [], one, args)
        (home / "states.json").write_text(json.dumps(wrong_states(task, [home / "episodes.jsonl"], one)) + "\n")
    return json.loads((home / "states.json").read_text())


def seed_row(task: str, arm: str, seed: int, one: argparse.Namespace,
             args: argparse.Namespace) -> dict[str, Any] | None:
    """One arm and seed: the paired reading, its build's wall-clock and its training states."""
    def model_of() -> tuple[str, list[str]]:
        return str(build(task, arm, seed, one, args)), []

    clean = premise.cell(task, arm, seed, None, one, args, model_of, where="recovery")
    perturbed = premise.cell(task, arm, seed, premise.PERTURBATION, one, args, model_of, where="recovery")
    if clean is None or perturbed is None:
        return None
    home = arm_home(task, arm, seed, args)
    states = home / "states.json"
    if not states.is_file():
        states.write_text(json.dumps(wrong_states(task, training_states(task, arm, seed, args), one)) + "\n")
    times = json.loads((home / "build.json").read_text()) if (home / "build.json").is_file() else {}
    return {"arm": arm, "seed": seed, **premise.paired(clean, perturbed), "build_s": times,
            "states": json.loads(states.read_text())}


def mean_se(values: Sequence[float]) -> tuple[float | None, float | None]:
    n = len(values)
    if not n:
        return None, None
    mu = sum(values) / n
    return mu, (math.sqrt(sum((v - mu) ** 2 for v in values) / (n - 1) / n) if n > 1 else None)


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per arm, over seeds: clean F1, the loss where the fact comes again (each seed's mean paired
    change), build minutes and the share of training calls in a wrong-memory state."""
    out: dict[str, Any] = {}
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        if not mine:
            continue
        calls = sum(r["states"]["calls"] for r in mine)
        clean, clean_se = mean_se([r["f1_clean_all"] for r in mine])
        loss, loss_se = mean_se([r["recovery"]["loss"] for r in mine if r["recovery"]["loss"] is not None])
        out[arm] = {"seeds": len(mine), "f1_clean": clean, "f1_clean_se": clean_se,
                    "f1_recoverable_clean": mean_se([r["recovery"]["f1_clean"] for r in mine])[0],
                    "f1_recoverable_perturbed": mean_se([r["recovery"]["f1_perturbed"] for r in mine])[0],
                    "loss": loss, "loss_se": loss_se, "loss_by_seed": [r["recovery"]["loss"] for r in mine],
                    "build_min": mean_se([sum(r["build_s"].values()) / 60 for r in mine])[0],
                    **{f"{k}_share": (sum(r["states"][k] for r in mine) / calls if calls else None)
                       for k in ("off_oracle", "off_oracle_fact_in_chunk", "wrong_frame")}}
    return out


def verdict(summary: dict[str, Any]) -> str:
    """Holds when an on-policy arm's loss is smaller than every imitation arm's by ``MARGIN`` and by
    two standard errors of the difference (``MIN_SEEDS`` seeds each)."""
    arms = [a for a in (*IMITATION, *ON_POLICY) if a in summary]
    short = [a for a in arms if summary[a]["seeds"] < MIN_SEEDS or summary[a]["loss_se"] is None]
    if short or not any(a in summary for a in IMITATION) or not any(a in summary for a in ON_POLICY):
        seeds = ", ".join(f"{a} {summary[a]['seeds']}" for a in arms) or "none read"
        return f"not tested yet: an imitation and an on-policy arm need {MIN_SEEDS} seeds each ({seeds})"
    best = max((a for a in ON_POLICY if a in summary), key=lambda a: summary[a]["loss"])
    said = []
    for imitator in (a for a in IMITATION if a in summary):
        gap = summary[best]["loss"] - summary[imitator]["loss"]
        se = math.sqrt(summary[best]["loss_se"] ** 2 + summary[imitator]["loss_se"] ** 2)
        said.append((imitator, gap, se))
    if all(gap >= MARGIN and gap > 2 * se for _, gap, se in said):
        return f"holds: {best} loses less than " + ", ".join(f"{i} by {g:.3f} ± {s:.3f}" for i, g, s in said)
    return f"does not hold: {best} against " + ", ".join(f"{i} {g:+.3f} ± {s:.3f}" for i, g, s in said)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import memgym  # noqa: F401  (registers the envs)

    one = premise.part1_args(args)
    rows = []
    for task in args.tasks:
        for seed in args.seeds:
            for arm in args.policies:
                row = seed_row(task, arm, seed, one, args)
                if row is not None:
                    rows.append({"task": task, **row})
    references = {}
    for task in args.tasks:
        for policy in ("teacher", premise.RECOVERING):
            clean = premise.cell(task, policy, 0, None, one, args)
            perturbed = premise.cell(task, policy, 0, premise.PERTURBATION, one, args)
            if clean is not None and perturbed is not None:
                references[f"{task}/{'start' if policy == 'teacher' else 'teacher'}"] = premise.paired(clean, perturbed)
        states = start_states(task, one, args)
        if states is not None:
            references[f"{task}/start-states"] = states
    summary = {task: summarise([r for r in rows if r["task"] == task]) for task in args.tasks}
    budget = {task: dict(zip(("updates", "trajectories", "dagger_rounds"), sizes(task, one, args)))
              for task in args.tasks}
    results = {"command": command(args), "tasks": {t: lh.TASKS[t] for t in args.tasks}, "num_chunks": one.train_chunks,
               "perturbation": premise.PERTURBATION, "budget": budget, "batch_episodes": BATCH, "lr": LR,
               "rl_lr": RL_LR, "margin": MARGIN, "arms": args.policies,
               "seeds": args.seeds, "references": references, "summary": summary,
               "verdicts": {t: verdict(s) for t, s in summary.items()}, "rows": rows}
    lh.save(results, Path(args.out) / "recovery.json", args.publish)
    return 0


def plot(results: dict[str, Any], path: Path) -> None:
    """A panel per task with arms: F1 clean and with the distractor where the fact comes again, per
    arm (mean ± se over seeds, each seed a dot), the start and the teacher as references (their
    recoverable episodes, ± se over episodes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t, s in results["summary"].items() if s]
    fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(6.5 * max(1, len(tasks)), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        refs = {name: results["references"].get(f"{task}/{name}") for name in ("start", "teacher")}
        names = [f"({n})" for n in ("start",) if refs["start"]] + list(results["summary"][task]) \
            + [f"({n})" for n in ("teacher",) if refs["teacher"]]
        for x, name in enumerate(names):
            ref = refs.get(name.strip("()"))
            if ref is not None:
                points = {"clean": ([ref["recovery"]["f1_clean"]], None),
                          "perturbed": ([ref["recovery"]["f1_perturbed"]], None)}
            else:
                mine = [r for r in results["rows"] if r["task"] == task and r["arm"] == name]
                points = {k: ([r["recovery"][f"f1_{k}"] for r in mine],
                              mean_se([r["recovery"][f"f1_{k}"] for r in mine])[1]) for k in ("clean", "perturbed")}
            for k, dx, colour in (("clean", -0.12, "tab:blue"), ("perturbed", 0.12, "tab:red")):
                ys, err = points[k]
                ax.errorbar([x + dx], [sum(ys) / len(ys)], yerr=[err or 0], fmt="o", color=colour, capsize=4,
                            label=(f"F1 {'clean' if k == 'clean' else results['perturbation']}, fact read again"
                                   if x == 0 else None))
                if len(ys) > 1:
                    ax.scatter([x + dx + 0.06] * len(ys), ys, s=8, color=colour, alpha=0.5)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylim(-0.02, 1.05)
        ax.set_ylabel("held-out F1 (recoverable episodes)")
        ax.set_title(f"{task}: {results['num_chunks']} chunks, {results['budget'][task]['updates']} updates an arm")
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command(args: argparse.Namespace) -> str:
    parts = ["python examples/on_policy_recovery.py", *(["--smoke"] if args.smoke else [])]
    if args.tasks != list(TASKS[:1]):
        parts.append(f"--tasks {','.join(args.tasks)}")
    if args.policies != list(ARMS):
        names = ",".join(args.policies) or '""'  # none: the references alone
        parts.append(f"--policies {names}")
    if args.seeds != [0, 1, 2, 3, 4]:
        parts.append(f"--seeds {','.join(map(str, args.seeds))}")
    return " ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
