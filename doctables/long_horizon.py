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


ALIGNED = "aligned_vs_persistent/results.json"


@table("long_horizon.aligned")
def aligned(d: Data) -> str:
    """Part 3 (examples/aligned_vs_persistent.py): per training length and teacher, F1 with the
    teacher scored aligned and persistent (mean over RL seeds), the gap and the teacher's shift;
    then the mean gap over teachers with its between-teacher sd, and the verdict."""
    res = d(ALIGNED)
    rows = []
    for n, got in res["summary"]["lengths"].items():
        for name, t in got["teachers"].items():
            kl = "–" if t["shift_kl"] is None else f(t["shift_kl"], 2)
            rows.append([n, name, f(t["teacher_f1"]), t["seeds"], f(t["f1_aligned"]), f(t["f1_persistent"]),
                         f"{t['gap']:+.3f}", kl, f(t.get("f1_aligned_at_32L"))])
        kl_of = {s["teacher"]: s["kl"] for s in res["shifts"] if str(s["num_chunks"]) == n}
        for name in res.get("unfair", []):
            rows.append([n, name, f(res["teacher_f1"][name]), 0, "–", "–", "–",
                         f"{f(kl_of[name], 2) if name in kl_of else '–'}; not fair (F1 below {res['fair_f1']}): no runs",
                         "–"])
        spread = "" if got["sd_gap"] is None else f" ± {f(got['sd_gap'])} sd"
        rows.append([n, f"**mean over {len(got['teachers'])}**", "", "", "", "", f"{got['mean_gap']:+.3f}{spread}",
                     got["verdict"], ""])
    return md(["training length (chunks)", "teacher", "teacher F1 @ 6 chunks", "RL seeds", "F1 aligned",
               "F1 persistent", "gap", "teacher shift KL (nats) / verdict", "F1 aligned @ 192 chunks"], rows)
