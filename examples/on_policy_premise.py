"""The long-horizon study, part 2, its positive control: does imitation recover from its own mistakes?

    python examples/on_policy_premise.py --out runs/long-horizon                # shares part 1's models
    python examples/on_policy_premise.py --tasks LongQA --policies teacher,sft-oracle --seeds 0
    python examples/on_policy_premise.py --cached-only --publish docs/data/on_policy_premise/results.json
    python examples/on_policy_premise.py --smoke --out DIR                      # the pipeline in minutes (CI)

On-policy distillation's premise: a student's own mistakes lead it to states that imitation data
never shows, and a student trained by imitation does not recover from them. Before any comparison
of methods rests on it, the premise has to be shown where the comparison runs (the positive
control). Here, on LongQA and KnowledgeUpdate at L = 6 chunks in part 1's settings
(``examples/long_horizon.py``: the digit presets, random numbering, chunks of 48 tokens, a 16-token
memory), each policy is read twice on the same first ``EPISODES`` test episodes, greedy:

  clean      ``memopd.eval`` as part 1 reads it (part 1's cell at L, reused when it exists);
  perturbed  the same with ``--memory-perturbation distractor@0``: after the first chunk's memory
             write the memory holds a plausible wrong fact for the asked person (``alice globex .``
             for ``alice acme .``; ``memgym.perturb``), the state an agent is in after a wrong write.

Recovery is possible where a supporting fact is read again after the perturbation (the fact sits in
a later chunk); on those episodes the loss is the paired difference F1(perturbed) - F1(clean), per
episode, mean ± se. The control shows the premise when every imitation agent (``IMITATORS``: SFT on
clean oracle trajectories, the student at part 1's compute, the auto teacher, the auto teacher
fine-tuned further) that learned the clean task loses at least ``PREMISE_GAP`` there, and the
recovering teacher below, which learned it too, loses less than half of that (recovery is learnable in this setting, from states that clean
demonstrations never show). Otherwise the comparison of part 2
(SFT-oracle, SFT-teacher, DAgger-style SFT and PPO + MemOPD at equal compute, on recovery and F1)
would not test the premise, and the reading says so. The teachers:

  teacher             part 1's: the auto teacher (SFT on clean oracle trajectories): itself an
                      imitation learner, it has never seen a wrong memory either
  teacher-recovering  the auto teacher fine-tuned further by its recipe on oracle trajectories drawn
                      under ``TEACHER_PERTURBATION`` (each write replaced by a distractor with
                      probability 0.25) by the *reader* oracle (``--agent-kwarg script=reader``,
                      ``memgym.oracle.ReaderScript``): it keeps the newest sentence about the asked
                      person, so it keeps the wrong memory until the fact comes again, then writes the
                      fact; its data shows recovery a model can learn from its inputs (noise injected
                      into the demonstrations, as DART does). The default oracle cannot serve here: it
                      keeps only the sample's supporting facts, so after a distractor it writes an empty
                      memory, which no reader of the text could tell from a true fact (privileged
                      information); the teacher fine-tuned on its data dropped its memories (F1 0.129
                      clean on LongQA, against the auto teacher's 0.859)
  teacher-further     the same fine-tuning on the reader oracle's clean trajectories (as many, the same
                      steps): more imitation at the recovering teacher's compute, so that what the
                      recovering teacher gains over the auto teacher is not extra training alone

The other policies are part 1's (``--policies`` of sft-oracle, sft-teacher, memopd, ppo,
opd-persistent, warm-start), trained by it when missing, in the same --out. Cells land in
rows-premise/ (one file per task, policy, seed and reading; a rerun recomputes nothing), the
evaluations in eval-premise/, the recovering teacher in <task>/teacher-recovering/.

Task variants (``--tasks``, ``long_horizon.TASKS``): ``LongQA-twice`` states each fact twice, in two
chunks (``fact_repeats=2``), so the fact is read again after the perturbation in every episode: the
setting of part 2's comparison (``examples/on_policy_recovery.py``); ``LongQA-distractors`` adds
distractor facts about other people (its auto teacher does not learn the clean task). Not in this
script: more than one build of each teacher.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # long_horizon, beside this file

import long_horizon as lh  # noqa: E402

TASKS = ("LongQA", "KnowledgeUpdate", "LongQA-distractors", "LongQA-twice")
DEFAULT_TASKS = ("LongQA", "KnowledgeUpdate")
POLICIES = ("teacher", "teacher-further", "teacher-recovering", "sft-oracle", "sft-teacher", "memopd", "ppo",
            "opd-persistent", "warm-start")
DEFAULT_POLICIES = ("teacher", "teacher-further", "teacher-recovering", "sft-oracle")
FIXED = ("teacher", "teacher-further", "teacher-recovering")
"""The seedless policies (read at seed 0)."""
IMITATORS = ("sft-oracle", "teacher", "teacher-further")
"""The imitation agents, all on clean oracle trajectories: the student at part 1's compute, the auto
teacher, and the auto teacher fine-tuned further at the recovering teacher's compute."""
RECOVERING = "teacher-recovering"
FURTHER = {"teacher-recovering": "oracle-perturbed", "teacher-further": "oracle-clean"}
"""The teachers fine-tuned further from the auto teacher, and the directory of their data."""
LEARNED = 0.5
"""The clean F1 an agent must reach for its loss under the perturbation to say anything."""
TEACHER_PERTURBATION = "distractor@p0.25"
"""The recovering teacher's data: oracle trajectories with each memory write replaced by a distractor
with this probability."""
RECOVERING_FROM_TEACHER = True
"""The recovering teacher is fine-tuned from the auto teacher (the recipe's steps and learning rate),
not from the preset: from the preset, the recipe's 250 steps on the perturbed trajectories left it on
the copy plateau on LongQA (final loss 1.30, F1 0.000 clean) and 750 steps short of it (loss 0.63,
F1 0.090), where the clean recipe's 250 reach 0.859."""
PERTURBATION = "distractor@0"
EPISODES = 256
PREMISE_GAP = 0.2
"""The imitation student must lose at least this much F1 where recovery is possible."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python examples/on_policy_premise.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/long-horizon", help="part 1's directory (its models and cells)")
    lh.add_study_args(p, TASKS, POLICIES, DEFAULT_POLICIES, "0", DEFAULT_TASKS)
    args = p.parse_args(argv)
    lh.split_study_args(p, args, TASKS, POLICIES)
    return args


def part1_args(args: argparse.Namespace) -> argparse.Namespace:
    """Part 1's options for the same directory, tasks and seeds, read at L only."""
    argv = ["--out", args.out, "--tasks", ",".join(args.tasks), "--seeds", ",".join(map(str, args.seeds)),
            "--threads", str(args.threads), *(["--smoke"] if args.smoke else []),
            *(["--cached-only"] if args.cached_only else [])]
    one = lh.parse_args(argv)
    one.lengths = [one.train_chunks]
    return one


def episodes(args: argparse.Namespace) -> int:
    return lh.SMOKE["episodes"] if args.smoke else EPISODES


def further_teacher(task: str, policy: str, args: argparse.Namespace, one: argparse.Namespace) -> Path:
    """The auto teacher's recipe on the reader oracle's trajectories: for ``teacher-recovering`` drawn
    under ``TEACHER_PERTURBATION`` (the oracle keeps the wrong memory until the fact comes again, then
    writes the fact, so that recovery is in its data), for ``teacher-further`` clean (the same
    compute and trajectories with no perturbation: more imitation alone)."""
    from memopd.eval import evaluate as run_eval
    from memopd.learn.models import teacher_recipe
    from memopd.sft import SFTConfig, run as run_sft

    out = Path(args.out) / task / policy
    if (out / "config.json").is_file():
        return out
    _, cfg = lh.rl_config(task, "memopd", 0, one)
    recipe = teacher_recipe(cfg)
    if RECOVERING_FROM_TEACHER:
        recipe["model"] = lh.teacher_dir(task, one)
    if args.smoke:
        recipe.update(num_episodes=8, steps=2)
    data = Path(args.out) / task / FURTHER[policy]
    spec = ["--memory-perturbation", TEACHER_PERTURBATION] if policy == RECOVERING else []
    if not (data / "episodes.jsonl").is_file():
        run_eval([*lh.env_argv(task, one.train_chunks), "--agent", "oracle", "--agent-kwarg", "script=reader",
                  "--model", recipe["model"], "--split", "train", "--episodes", str(recipe["num_episodes"]),
                  "--seed", "1", *spec, "--no-progress", "--out", str(data), "--overwrite"])
    run_sft(SFTConfig(model=recipe["model"], episodes=str(data / "episodes.jsonl"), out=str(out), seed=1,
                      threads=args.threads, progress=False, steps=recipe["steps"],
                      batch_episodes=recipe["batch_episodes"], lr=recipe["lr"], checkpoint_every=25), progress=False)
    return out


def cell(task: str, policy: str, seed: int, spec: str | None, one: argparse.Namespace,
         args: argparse.Namespace, model_of: Callable[[], tuple[str, list[str]]] | None = None,
         where: str = "premise") -> dict[str, Any] | None:
    """One policy read at L, clean (``spec`` None) or under ``spec``: per episode its sample, F1 and
    whether a supporting fact was read again after the perturbation (None: not perturbed). The model
    and its agent flags come from ``model_of`` (default: this script's policies, built when missing);
    rows land in rows-<where>/, evaluations in eval-<where>/."""
    from agents.records import load_episodes
    from memopd.eval import evaluate as run_eval

    name = f"{task}-{policy}-s{seed}-{'clean' if spec is None else 'perturbed'}"
    row_path = Path(args.out) / f"rows-{where}" / f"{name}.json"
    if row_path.is_file():
        return json.loads(row_path.read_text())
    if args.cached_only:
        return None
    if model_of is not None:
        model, agent = model_of()
    elif policy in FURTHER:
        model, agent = str(further_teacher(task, policy, args, one)), []
    else:
        model, agent = lh.model_of(task, policy, seed, one)
    out = Path(args.out) / f"eval-{where}" / name
    run_eval([*lh.env_argv(task, one.train_chunks), "--model", model, *agent, "--episodes", str(episodes(args)),
              "--temperature", "0", "--top-k", "1", "--threads", str(args.threads), "--no-progress",
              *([] if spec is None else ["--memory-perturbation", spec]), "--out", str(out), "--overwrite"])
    got = load_episodes(out / "episodes.jsonl").episodes
    row = {"task": task, "policy": policy, "seed": seed, "num_chunks": one.train_chunks, "spec": spec,
           "sample_ids": [e.sample_id for e in got], "f1": [e.metrics.get("f1", 0.0) for e in got],
           "reappears": [e.perturbations[-1].reappears if e.perturbations else None for e in got]}
    lh.write_row(row_path, row)
    print(f"{task} {policy} seed {seed} {spec or 'clean'}: F1 {sum(row['f1']) / len(row['f1']):.3f}", flush=True)
    return row


def paired(clean: dict[str, Any], perturbed: dict[str, Any]) -> dict[str, Any]:
    """F1 clean and perturbed, and their paired difference (mean ± se), on the episodes where the
    fact was read again after the perturbation, on those where it was not, and F1 of both reads on
    all episodes. Episodes pair by sample."""
    base = dict(zip(clean["sample_ids"], clean["f1"]))
    groups: dict[str, list[tuple[float, float]]] = {"recovery": [], "no_recovery": []}
    for sid, f1, again in zip(perturbed["sample_ids"], perturbed["f1"], perturbed["reappears"]):
        if sid in base and again is not None:
            groups["recovery" if again else "no_recovery"].append((base[sid], f1))
    out: dict[str, Any] = {}
    for name, pairs in groups.items():
        n = len(pairs)
        diffs = [b - a for a, b in pairs]
        mu = sum(diffs) / n if n else None
        sd = math.sqrt(sum((d - mu) ** 2 for d in diffs) / (n - 1)) if n > 1 else 0.0
        out[name] = {"episodes": n, "f1_clean": sum(a for a, _ in pairs) / n if n else None,
                     "f1_perturbed": sum(b for _, b in pairs) / n if n else None,
                     "loss": mu, "loss_se": sd / math.sqrt(n) if n > 1 else None}
    out["f1_clean_all"] = sum(clean["f1"]) / len(clean["f1"])
    out["f1_perturbed_all"] = sum(perturbed["f1"]) / len(perturbed["f1"])
    return out


def verdicts(summary: dict[str, Any]) -> dict[str, str]:
    """Per task: whether the control shows the premise. Every imitation agent (``IMITATORS``) that
    learned the clean task (F1 at least ``LEARNED``) loses at least ``PREMISE_GAP`` where it could
    recover (the one that recovers best is named), and the recovering teacher, which learned it too,
    loses less than half of that."""
    said = {}
    for task, policies in summary.items():
        def loss(p: str) -> float | None:
            return policies.get(p, {}).get("recovery", {}).get("loss")

        def learned(p: str) -> bool:
            return p in policies and policies[p]["f1_clean_all"] >= LEARNED and loss(p) is not None

        clean = ", ".join(f"{p} {policies[p]['f1_clean_all']:.3f}" for p in (*IMITATORS, RECOVERING) if p in policies)
        imitators = [p for p in IMITATORS if learned(p)]
        if not imitators:
            said[task] = f"not tested yet: no imitation agent reaches F1 {LEARNED} clean ({clean or 'none read'})"
        elif not learned(RECOVERING):
            said[task] = f"not tested yet: the recovering teacher must reach F1 {LEARNED} clean ({clean})"
        else:
            best = max(imitators, key=loss)  # the imitation agent that recovers best
            if -loss(best) < PREMISE_GAP:
                said[task] = (f"not shown: where it could recover, imitation's F1 changes by at most "
                              f"{loss(best):+.3f} ({best}; it must lose {PREMISE_GAP})")
            elif -loss(RECOVERING) >= PREMISE_GAP / 2:
                said[task] = (f"not shown: the recovering teacher's F1 changes by {loss(RECOVERING):+.3f} too "
                              f"(recovery is not shown learnable); {best}'s by {loss(best):+.3f}")
            else:
                said[task] = (f"shown: where it could recover, {best}'s F1 changes by {loss(best):+.3f}, "
                              f"the recovering teacher's by {loss(RECOVERING):+.3f}")
    return said


def summarise(pairs: dict[tuple[str, str, int], dict[str, Any]]) -> dict[str, Any]:
    """Per task and policy: the paired reading, averaged over seeds (each seed's episodes pooled)."""
    out: dict[str, Any] = {}
    for (task, policy, _), got in sorted(pairs.items()):
        out.setdefault(task, {}).setdefault(policy, []).append(got)
    for task, policies in out.items():
        for policy, seeds in policies.items():
            merged: dict[str, Any] = {"seeds": len(seeds)}
            for group in ("recovery", "no_recovery"):
                cells = [s[group] for s in seeds if s[group]["episodes"]]
                n = sum(c["episodes"] for c in cells)
                merged[group] = {"episodes": n, **{k: (sum(c[k] * c["episodes"] for c in cells) / n if n else None)
                                                   for k in ("f1_clean", "f1_perturbed", "loss")},
                                 "loss_se": (math.sqrt(sum((c["loss_se"] or 0.0) ** 2 * c["episodes"] ** 2
                                                           for c in cells)) / n if n else None)}
            for key in ("f1_clean_all", "f1_perturbed_all"):
                merged[key] = sum(s[key] for s in seeds) / len(seeds)
            policies[policy] = merged
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import memgym  # noqa: F401  (registers the envs)

    one = part1_args(args)
    pairs, rows = {}, []
    for task in args.tasks:
        for policy in args.policies:
            for seed in ([0] if policy in FIXED else args.seeds):
                clean = cell(task, policy, seed, None, one, args)
                perturbed = cell(task, policy, seed, PERTURBATION, one, args)
                if clean is None or perturbed is None:
                    continue
                rows.append(perturbed)
                pairs[(task, policy, seed)] = paired(clean, perturbed)
    summary = summarise(pairs)
    results = {"command": command(args), "tasks": {t: lh.TASKS[t] for t in args.tasks},
               "num_chunks": one.train_chunks, "perturbation": PERTURBATION, "premise_gap": PREMISE_GAP,
               "policies": args.policies, "seeds": args.seeds, "summary": summary, "verdicts": verdicts(summary),
               "rows": rows}
    lh.save(results, Path(args.out) / "premise.json", args.publish)
    return 0


def command(args: argparse.Namespace) -> str:
    parts = ["python examples/on_policy_premise.py", *(["--smoke"] if args.smoke else [])]
    for flag, value, default in (("--tasks", args.tasks, list(DEFAULT_TASKS)), ("--policies", args.policies,
                                                                          list(DEFAULT_POLICIES)),
                                 ("--seeds", args.seeds, [0])):
        if value != default:
            parts.append(f"{flag} {','.join(map(str, value))}")
    return " ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
