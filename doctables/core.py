"""The registry of table renderers, the data they read, and the number formats they share."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "docs" / "data"

Renderer = Callable[["Data"], str]
TABLES: dict[str, Renderer] = {}


def table(name: str) -> Callable[[Renderer], Renderer]:
    """Register a renderer under ``name`` (what ``<!-- table: NAME -->`` on a page refers to)."""
    def register(fn: Renderer) -> Renderer:
        if name in TABLES and TABLES[name] is not fn:
            raise ValueError(f"two renderers are named {name!r}")
        TABLES[name] = fn
        return fn
    return register


class Data:
    """The results JSON under ``root`` (docs/data by default), read once each; remembers which files
    a renderer read, so a test can change them and see the table move."""

    def __init__(self, root: Path | str = DATA):
        self.root = Path(root)
        self.read: set[str] = set()
        self._cache: dict[str, Any] = {}

    def __call__(self, path: str) -> Any:
        self.read.add(path)
        if path not in self._cache:
            file = self.root / path
            if not file.is_file():
                raise FileNotFoundError(f"no results file docs/data/{path}")
            self._cache[path] = json.loads(file.read_text(encoding="utf-8"))
        return self._cache[path]


# -- statistics ---------------------------------------------------------------------------------------
def mean(xs: Iterable[float]) -> float:
    return statistics.fmean(list(xs))


def sd(xs: Sequence[float]) -> float:
    """The sample standard deviation (n - 1), 0 for a single value."""
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def se(xs: Sequence[float]) -> float:
    """The standard error of the mean, sd / sqrt(n)."""
    return sd(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0


def diff_se(a: Sequence[float], b: Sequence[float]) -> float:
    """The standard error of mean(a) - mean(b) for two independent groups."""
    return math.sqrt(se(a) ** 2 + se(b) ** 2)


# -- formats ------------------------------------------------------------------------------------------
def f(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def signed(x: float, digits: int = 3) -> str:
    return f"{x:+.{digits}f}"


def pm(m: float, e: float, digits: int = 3, sign: bool = False) -> str:
    """``m ± e``; ``sign`` writes the mean with its sign."""
    return f"{signed(m, digits) if sign else f(m, digits)} ± {f(e, digits)}"


def mean_sd(xs: Sequence[float], digits: int = 3) -> str:
    return pm(mean(xs), sd(xs), digits)


def mean_se(xs: Sequence[float], digits: int = 3, sign: bool = False) -> str:
    return pm(mean(xs), se(xs), digits, sign)


def listed(xs: Iterable[float], digits: int = 3) -> str:
    return ", ".join(f(x, digits) for x in xs)


def thousands(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def bold(s: str, on: bool = True) -> str:
    return f"**{s}**" if on else s


def md(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table (header, separator, rows), no trailing newline."""
    lines = ["|" + "|".join(f" {c} " if c else " " for c in header) + "|", "|" + "---|" * len(header)]
    lines += ["|" + "|".join(f" {c} " if str(c) else " " for c in row) + "|" for row in rows]
    return "\n".join(lines)


def at_step(curve: dict, step: int) -> float:
    """A held-out curve's F1 at ``step`` (it must have been evaluated there)."""
    return curve["f1"][curve["step"].index(step)]
