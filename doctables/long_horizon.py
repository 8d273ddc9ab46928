"""RESULTS.md, "The long-horizon study": docs/data/long_horizon/ (examples/long_horizon.py)."""

from __future__ import annotations

from doctables.core import Data, f, md, table

STUDY = "long_horizon/results.json"
SMOLLM2 = "smollm2_at_length/results.json"


@table("long_horizon.length")
def length(d: Data) -> str:
    """F1 against input length per task and policy (mean over the seeds run, ± sd where more than
    one), and the drop from the shortest to the longest length with its bootstrap lower bound."""
    return _by_length(d(STUDY))


@table("long_horizon.smollm2")
def smollm2(d: Data) -> str:
    """Part 4 (examples/smollm2_at_length.py): SmolLM2's policies, as part 1's table."""
    return _by_length(d(SMOLLM2))


def _by_length(res: dict) -> str:
    lengths = [str(n) for n in res["lengths"]]
    far = str(res.get("far") or "")
    read_far = far and any(far in got["by_length"] for policies in res["summary"].values() for got in policies.values())
    columns = [*lengths, *([far] if read_far else [])]
    rows = []
    for task, policies in res["summary"].items():
        for policy, got in policies.items():
            cells = []
            for n in columns:
                c = got["by_length"].get(n)
                cells.append("–" if c is None else f(c["f1"]) + (f" ± {f(c['sd'])}" if c["seeds"] > 1 else ""))
            seeds = max(c["seeds"] for c in got["by_length"].values())
            drop = f"{got['drop']:+.3f} (≥ {got['lower_95']:+.3f})" if "drop" in got else "–"
            far_drop = [f"{got['far_drop']:+.3f} (≥ {got['far_lower_95']:+.3f})" if "far_drop" in got else "–"]
            rows.append([task, policy, seeds, *cells, drop, *(far_drop if read_far else []),
                         retained(got.get("retention") or {})])
    far_header = [f"F1({far}) − F1({lengths[0]}) (95% lower bound)"] if read_far else []
    return md(["task", "policy", "seeds", *[f"F1 @ {int(n):,} chunks" for n in columns],
               f"F1({lengths[-1]}) − F1({lengths[0]}) (95% lower bound)", *far_header,
               "retention r a chunk (half-life)"], rows)


def retained(fit: dict) -> str:
    """The per-chunk retention rate and its half-life in chunks (none: F1 never halves)."""
    if "r" not in fit:
        return "–"
    half = fit["half_life_chunks"]
    return f"{fit['r']:.5f} ({'none' if half is None else f'{half:,.0f}'})"
