"""RESULTS.md, "Length-robust inputs: the positive control": docs/data/length_control/
(examples/length_control.py)."""

from __future__ import annotations

from doctables.core import Data, bold, f, md, pm, table

LENGTH = "length_control/results.json"
ARMS = {"before": ("tiny-teacher", "sequential"), "digits": ("tiny-teacher-digits", "sequential"),
        "random": ("tiny-teacher", "random"), "after": ("tiny-teacher-digits", "random")}


def cell(row: dict | None) -> str:
    return "–" if row is None else pm(row["f1"], row["se"])


@table("long_inputs.length_control")
def length_control(d: Data) -> str:
    """Greedy F1 ± se over test episodes per arm and length; the claim's cell (after, longest) in bold."""
    res = d(LENGTH)
    lengths, train = res["lengths"], res["train_chunks"]
    rows = []
    for arm in res["arms"]:
        got = {(r["agent"], r["chunks"]): r for r in res["rows"] if r["arm"] == arm}
        preset, numbering = ARMS[arm]
        cells = [cell(got.get(("rag-memagent", n))) for n in lengths]
        cells[-1] = bold(cells[-1], arm == "after")
        rows.append([f"{arm} ({preset}, {numbering})", cell(got.get(("memagent", train))), *cells])
    return md(["arm (teacher, numbering)", f"memagent @ {train}", *[f"RAG @ {n}" for n in lengths]], rows)
