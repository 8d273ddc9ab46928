"""RESULTS.md, "SmolLM2-135M end to end": docs/data/smollm2_g4/ (3 seeds) and docs/data/smollm2_lora/."""

from __future__ import annotations

from doctables.core import Data, bold, f, listed, md, pm, table

G4 = "smollm2_g4/"
LORA = "smollm2_lora/"
SEED_FILES = {0: "results.json", 1: "results-seed-1.json", 2: "results-seed-2.json"}


@table("smollm2.three_seeds")
def three_seeds(d: Data) -> str:
    s = d(G4 + "results-seeds.json")
    arms = s["arms"]
    rows = [["teacher (SFT SmolLM2, 30 steps of 8 on 400 trajectories)", f(s["teacher_f1"]), "", ""]]
    names = {"ppo+memopd": "PPO + MemOPD", "ppo": "PPO alone (groups of 4)",
             "sft-only": "SFT-only student (192 oracle trajectories)"}
    for arm, name in names.items():
        a = arms[arm]
        curve = a.get("f1_curve")
        by_step = ", ".join(f"{st}: {f(m)}" for st, m in zip(curve["step"], curve["mean"])) if curve else ""
        rows.append([name, bold(pm(a["f1_after"]["mean"], a["f1_after"]["sd"]), arm != "ppo"),
                     listed(a["f1_after"]["each"]), by_step])
    return md(["model (held-out F1, 32 test episodes; the teacher 64)", "mean ± sd over 3 seeds", "each seed",
               "F1 by step (mean)"], rows)


@table("smollm2.ppo_signal")
def ppo_signal(d: Data) -> str:
    """Whether PPO alone got any reward: its sampled episodes' F1 per step, per seed."""
    rows = []
    for seed, name in SEED_FILES.items():
        t = d(G4 + name)["table"]
        for arm in ("ppo", "ppo+memopd"):
            r = t[arm]
            rewarded = sum(1 for x in r["train_f1"] if x > 0)
            same = "yes" if r["after"] == r["before"] else "no"
            rows.append([seed, arm, f"{rewarded} of {len(r['train_f1'])}", f(max(r["train_f1"])), f(r["before"]["f1"]),
                         f(r["after"]["f1"]), same])
    return md(["seed", "arm", "steps with any reward", "best step's mean training F1", "held-out F1 before",
               "after", "after = before exactly"], rows)


@table("smollm2.lora")
def lora(d: Data) -> str:
    s = d(LORA + "results-seeds.json")
    names = {"ppo+memopd": "full weights (lr 5e-5)", "ppo+memopd-lora": "LoRA r = 16, alpha 32 (lr 5e-4)"}
    rows = []
    for arm, name in names.items():
        a = s["arms"][arm]
        after = a["f1_after"]
        rows.append([name, f"{pm(after['mean'], after['sd'])} ({listed(after['each'])})",
                     " / ".join(f(x, 2) for x in a["f1_curve"]["mean"]),
                     f"{a['checkpoint_bytes']['mean'] / 2**20:,.1f}"])
    return md(["arm", "held-out F1 after 16 steps, mean ± sd (seeds 0, 1)",
               "F1 at steps 0 / 4 / 8 / 12 / 16 (mean of the seeds)", "checkpoint (MiB)"], rows)


@table("smollm2.lora_by_step")
def lora_by_step(d: Data) -> str:
    """Each seed's evaluations side by side, and LoRA minus full."""
    s = d(LORA + "results-seeds.json")["arms"]
    full, lo = s["ppo+memopd"]["f1_curve"], s["ppo+memopd-lora"]["f1_curve"]
    rows = []
    for i, step in enumerate(full["step"]):
        pairs = [(fs[i], ls[i]) for fs, ls in zip(full["each"], lo["each"])]
        rows.append([step, *(f"{f(a, 2)} / {f(b, 2)}" for a, b in pairs),
                     f"{sum(b - a for a, b in pairs) / len(pairs):+.2f}"])
    seeds = [f"seed {i}: full / LoRA" for i in range(len(full["each"]))]
    return md(["step", *seeds, "LoRA - full (mean)"], rows)
