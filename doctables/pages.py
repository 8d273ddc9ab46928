"""The tables of a page: which marker stands before each, and rewriting them from their renderers."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from doctables.core import REPO, TABLES, Data

PAGES = (REPO / "docs" / "RESULTS.md", REPO / "docs" / "BENCHMARKS.md")
"""The results pages: every table on them has a marker (rebuilt from data, or none kept)."""

MARKER = re.compile(r"^<!--\s*table:\s*(\S+)\s*-->\s*$")
FENCE = re.compile(r"^\s*```")
NO_DATA = "none"
SETTING = "setting"
"""A table that describes a setting (task, models, budget, flags), not a result."""


@dataclass
class Table:
    """A markdown table on a page: its lines [start, end), the marker before it ('' if none)."""
    page: Path
    start: int
    end: int
    marker: str
    section: str  # the nearest heading above it

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.start + 1}"


def tables(page: Path) -> list[Table]:
    """Every table of ``page`` (outside code blocks), with the marker on the line before it."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i, fenced, section = [], 0, False, ""
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            section = line.lstrip("#").strip()
        elif not fenced and line.startswith("|"):
            start = i
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            m = MARKER.match(lines[start - 1]) if start else None
            out.append(Table(page, start, i, m.group(1) if m else "", section))
            continue
        i += 1
    return out


def render(name: str, data: Data) -> str:
    if name not in TABLES:
        raise KeyError(f"no renderer is registered as {name!r} (doctables.MODULES)")
    return TABLES[name](data).rstrip("\n")


def differences(page: Path, data: Data) -> list[str]:
    """What differs between the page's rebuilt tables and their renderers' output, and every table
    without a marker."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out = []
    for t in tables(page):
        if not t.marker:
            out.append(f"{t.where()}: a table without <!-- table: NAME -->, <!-- table: none --> or "
                       "<!-- table: setting --> before it")
            continue
        if t.marker in (NO_DATA, SETTING):
            continue
        want = render(t.marker, data).splitlines()
        have = lines[t.start:t.end]
        if want != have:
            rows = [f"  page: {h}\n  data: {w}" for h, w in zip(have, want) if h != w]
            if len(have) != len(want):
                rows.append(f"  the page has {len(have)} lines, the data {len(want)}")
            out.append(f"{t.where()} ({t.marker}) differs from its data:\n" + "\n".join(rows))
    return out


def write(page: Path, data: Data) -> int:
    """Rewrite the page's rebuilt tables from their renderers; how many changed."""
    lines = page.read_text(encoding="utf-8").splitlines()
    changed = 0
    for t in reversed(tables(page)):  # from the end, so earlier line numbers stay put
        if t.marker and t.marker not in (NO_DATA, SETTING):
            want = render(t.marker, data).splitlines()
            if lines[t.start:t.end] != want:
                lines[t.start:t.end] = want
                changed += 1
    page.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return changed
