"""RESULTS.md, "A PPO that can win: the lr 2e-3 collapse measured": docs/data/ppo_collapse/."""

from __future__ import annotations

from doctables.core import Data, f, md, table

P = "ppo_collapse/"


def _rows(run: dict) -> tuple[dict[int, float], list[dict]]:
    """A run's held-out F1 by step, and its training-step rows."""
    evals = {r["step"]: r["eval/f1"] for r in run["rows"] if "eval/f1" in r}
    return evals, [r for r in run["rows"] if "reward" in r]


def _at(steps: list[dict], step: int, key: str) -> float:
    return next(r[key] for r in steps if r["step"] == step)


def _table(d: Data, path: str, label: str) -> str:
    rows = []
    for run in d(path)["runs"].values():
        evals, steps = _rows(run)
        rows.append([f"{label}, lr {run['lr']:.0e}".replace("e-0", "e-"), str(run["seed"]),
                     " / ".join(f(evals[s]) for s in (0, 5, 10, 15, 20)),
                     " / ".join(f(_at(steps, s, "kl_to_start"), 2) for s in (5, 10, 20)),
                     f(max(r["clip_frac"] for r in steps), 2), f(max(r["approx_kl"] for r in steps), 2),
                     f(max(r["entropy"] for r in steps), 2),
                     f"{_at(steps, 1, 'memory_tokens_per_call'):.1f} / {max(r['memory_tokens_per_call'] for r in steps):.1f}"])
    return md(["PPO alone", "seed", "held-out F1 at 0 / 5 / 10 / 15 / 20", "KL to the start at 5 / 10 / 20",
               "clip share, max", "update KL, max", "entropy, max", "memory tokens a call, step 1 / max"], rows)


@table("ppo_collapse.lr")
def by_lr(d: Data) -> str:
    return _table(d, P + "results.json", "default objective")


@table("ppo_collapse.fixed")
def fixed(d: Data) -> str:
    return _table(d, P + "results-fixed.json", "no step on a zero gradient")


@table("ppo_collapse.drgrpo")
def drgrpo(d: Data) -> str:
    return _table(d, P + "results-drgrpo.json", "Dr. GRPO objective")
