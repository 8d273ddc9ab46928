"""``memopd.eval --lengths`` / ``--sweep``: one policy over several values of an env option, as
one table (``sweep.json``, ``sweep.md``) and one plot of F1 against input length
(``sweep.png``); ``--compare DIR`` adds other runs' sweeps (other policies) to both.

A sweep's input length is measured, not assumed: the mean tokens of every chunk of the first
few episodes' inputs (the env's own counter, the model's tokenizer), so the x axis is the same
for every policy on the same env, whatever each reads of it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from memgym.cli import CLIError, parse_kwargs

FILES = ("sweep.json", "sweep.md", "sweep.png")
LENGTH_KEY = "num_chunks"
"""The env option ``--lengths`` sweeps."""
MEASURED_EPISODES = 4
"""Episodes whose inputs are counted for a value's input length."""


def parse_sweep(lengths: str | None, sweep: str | None) -> tuple[str, list[Any]] | None:
    """``--lengths 6,12`` or ``--sweep KEY=V1,V2``: the env option and its values (None: no sweep)."""
    if lengths is not None and sweep is not None:
        raise CLIError("--lengths N,... sweeps num_chunks; --sweep KEY=V1,V2 sweeps any env option: give one")
    if lengths is not None:
        key, raw, flag = LENGTH_KEY, lengths, "--lengths"
    elif sweep is not None:
        key, sep, raw = sweep.partition("=")
        key, flag = key.strip(), "--sweep"
        if not sep or not key:
            raise CLIError(f"--sweep {sweep!r} is not KEY=V1,V2,... (e.g. --sweep num_chunks=6,12,24)")
    else:
        return None
    items = [item.strip() for item in raw.split(",")]
    if not all(items):
        raise CLIError(f"{flag} {raw!r}: give comma-separated values without gaps, e.g. 6,12,24")
    values = [parse_kwargs([f"{key}={item}"], flag)[key] for item in items]
    if len(set(map(repr, values))) != len(values):
        raise CLIError(f"{flag} {raw!r} repeats a value; give each once")
    if key == LENGTH_KEY and not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        raise CLIError(f"{flag} {raw!r}: the number of chunks must be whole numbers >= 1, e.g. 6,12,24")
    return key, values


def value_dir(out: Path, key: str, value: Any) -> Path:
    """Where one value's episodes.jsonl and summary.json go."""
    return out / f"{key}-{value}"


def input_tokens(env: Any, indices: Sequence[int], seed: int) -> float | None:
    """Mean units (the env counter's: tokens with a tokenizer) of all chunks of the inputs of
    samples ``indices``, read with an empty memory (the env's cost only; no agent, no model)."""
    counter = getattr(env.unwrapped, "counter", None)
    if counter is None or not indices:
        return None
    totals = []
    for k, index in enumerate(indices):
        _, info = env.reset(seed=seed + k, options={"index": int(index)})
        total = 0
        while info.get("phase") == "memory":
            total += counter.count(info.get("chunk", ""))
            _, _, _, _, info = env.step("")
        totals.append(total)
    return sum(totals) / len(totals)


def row(value: Any, summary: dict[str, Any], tokens: float | None, scores: Sequence[float]) -> dict[str, Any]:
    """One value's line of the table: its scores (F1 with its standard error over episodes),
    input length, costs and speed."""
    n = len(scores)
    sd = math.sqrt(sum((x - summary["f1"]) ** 2 for x in scores) / (n - 1)) if n > 1 else 0.0
    return {"value": value, "input_tokens": tokens, "episodes": n, "f1": summary["f1"], "f1_se": sd / math.sqrt(n) if n
            else 0.0, "em": summary["em"], "sub_em": summary["sub_em"], "calls": summary["calls"],
            "wall_s": summary.get("wall_s"), "calls_per_s": summary.get("calls_per_s")}


def read_compared(paths: Sequence[str]) -> list[dict[str, Any]]:
    """The sweeps of ``--compare DIR`` (each DIR holds a sweep.json), checked before any model loads."""
    out = []
    for p in paths:
        path = Path(p) / "sweep.json" if Path(p).is_dir() else Path(p)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CLIError(f"--compare {p}: no sweep.json there; give the --out of an earlier memopd.eval "
                           "--lengths or --sweep run") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CLIError(f"--compare {p}: {path} is not a sweep.json written by memopd.eval") from None
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or "policy" not in data:
            raise CLIError(f"--compare {p}: {path} is not a sweep.json written by memopd.eval")
        out.append({k: v for k, v in data.items() if k != "compared"})  # its own comparisons stay in its file
    return out


def write(out: Path, sweep: dict[str, Any], compared: Sequence[dict[str, Any]]) -> None:
    """sweep.json (this run's sweep, the compared runs' besides), sweep.md and sweep.png."""
    (out / "sweep.json").write_text(json.dumps({**sweep, "compared": list(compared)}, indent=2, default=str) + "\n",
                                    encoding="utf-8")
    everything = [sweep, *compared]
    (out / "sweep.md").write_text(markdown(everything) + "\n", encoding="utf-8")
    plot(everything, out / "sweep.png")


def markdown(sweeps: Sequence[dict[str, Any]]) -> str:
    """One table: a row per policy, a column per value (input tokens in brackets), F1 ± se."""
    first = sweeps[0]
    values = [r["value"] for r in first["rows"]]
    head = [f"{v} ({_tokens(r['input_tokens'])})" for v, r in zip(values, first["rows"])]
    lines = [f"F1 ± standard error over episodes, by {first['key']} (mean input tokens); {first['env']}",
             "", "| policy | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for s in sweeps:
        cells = {repr(r["value"]): f"{r['f1']:.3f} ± {r['f1_se']:.3f}" for r in s["rows"]}
        lines.append(f"| {s['policy']} | " + " | ".join(cells.get(repr(v), "-") for v in values) + " |")
    lines += ["", "| policy | " + first["key"] + " | episodes | calls / episode | calls / s | wall s |",
              "|---|---|---|---|---|---|"]
    for s in sweeps:
        for r in s["rows"]:
            lines.append(f"| {s['policy']} | {r['value']} | {r['episodes']} | {r['calls']:.0f} | "
                         f"{_num(r.get('calls_per_s'))} | {_num(r.get('wall_s'))} |")
    return "\n".join(lines)


def _tokens(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def plot(sweeps: Sequence[dict[str, Any]], path: Path) -> None:
    """F1 against input tokens (log axis), one line per policy, standard errors as bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for s in sweeps:
        pts = [(r["input_tokens"] if r["input_tokens"] is not None else r["value"], r["f1"], r["f1_se"])
               for r in s["rows"]]
        xs, ys, es = zip(*pts)
        ax.errorbar(xs, ys, yerr=es, marker="o", ms=4, capsize=2, label=s["policy"])
    numeric = all(isinstance(x, (int, float)) and x > 0 for s in sweeps for x in
                  (r["input_tokens"] if r["input_tokens"] is not None else r["value"] for r in s["rows"]))
    if numeric:  # a log axis, ticks at this run's points
        ax.set_xscale("log")
        ticks = [r["input_tokens"] if r["input_tokens"] is not None else r["value"] for r in sweeps[0]["rows"]]
        ax.set_xticks(ticks)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:,.0f}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("input tokens (mean per episode)" if sweeps[0]["rows"][0]["input_tokens"] is not None
                  else sweeps[0]["key"])
    ax.set_ylabel("F1")
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{sweeps[0]['env']}: F1 by {sweeps[0]['key']}", fontsize=9)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
