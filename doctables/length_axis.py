"""RESULTS.md: the length axis, a compact-memory agent against the full-context baseline, both
fine-tuned at 6 chunks and evaluated to 192 (``memopd.eval --lengths``; docs/agents.md's recipe)."""

from __future__ import annotations

from pathlib import Path

from doctables.core import Data, f, md, table, thousands
from doctables.figures import figure

FULLCONTEXT = "fullcontext/sweep.json"
NAMES = {"memagent": "MemAgent (`tiny-teacher`, 16-token memory)",
         "fullcontext": "full context (`tiny-long`, one prompt)"}


def sweeps(d: Data) -> list[dict]:
    """The memory agent's sweep (compared), then the full-context one, each with a readable name."""
    s = d(FULLCONTEXT)
    both = [*s["compared"], {k: v for k, v in s.items() if k != "compared"}]
    return [{**x, "policy": NAMES.get(x["agent"], x["policy"])} for x in both]


@table("length_axis.fullcontext")
def fullcontext(d: Data) -> str:
    runs = sweeps(d)
    head = ["policy \\ chunks (tokens)", *(f"{r['value']} ({thousands(r['input_tokens'])})" for r in runs[0]["rows"])]
    rows = [[s["policy"], *(f"{f(r['f1'])} ± {f(r['f1_se'])}" for r in s["rows"])] for s in runs]
    return md(head, rows)


@figure("fullcontext_length.png")
def fullcontext_figure(d: Data, path: Path) -> None:
    from memopd.eval_sweep import plot  # memopd.eval's own plot of a sweep

    plot([{**s, "policy": s["policy"].replace("`", "")} for s in sweeps(d)], path)
