"""Every table of the results pages (docs/RESULTS.md, docs/BENCHMARKS.md) is rebuilt from the results
JSON in docs/data/, or says that its data was not kept.

How a section keeps its tables true (the pattern, in full in doctables/__init__.py):

- commit the study's results JSON under docs/data/<study>/;
- write one renderer per table in doctables/<study>.py (``@table("<study>.<name>")``, a function of
  the data returning the table's markdown) and list the module in ``doctables.MODULES``;
- put ``<!-- table: <study>.<name> -->`` on the line before the table on the page, and write it with
  ``python -m doctables --write``;
- a table measured but whose data was not kept has ``<!-- table: none -->`` before it, and its
  section says "data not kept" in words; a table that describes a setting (task, models, budget,
  flags) and holds no result has ``<!-- table: setting -->``.

The tests: each page's rebuilt tables equal their renderers' output (one number changed in a
results JSON fails here); every table has a marker; every renderer is used on a page and its
output moves when any file it reads moves (so no table is typed in by hand); a section with a
table of no data says so; the commands the results JSON record are the scripts' own.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from doctables import load_all
from doctables.core import DATA, REPO, Data
from doctables.pages import NO_DATA, PAGES, differences, render, tables

TABLES = load_all()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_table_equals_its_data(page):
    problems = differences(page, Data())
    assert not problems, "\n".join(problems) + "\n(python -m doctables --write rewrites the rebuilt tables)"


def test_every_renderer_is_on_a_page():
    used = {t.marker for page in PAGES for t in tables(page)}
    assert sorted(set(TABLES) - used) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_section_with_a_table_of_no_data_says_so(page):
    text = page.read_text(encoding="utf-8")
    sections = re.split(r"^#{2,4} ", text, flags=re.M)
    silent = []
    for t in tables(page):
        if t.marker != NO_DATA:
            continue
        body = next((s for s in sections if s.startswith(t.section)), "")
        if "data not kept" not in body.lower():
            silent.append(f"{t.where()} (section {t.section!r})")
    assert not silent, "sections with a table of no data that do not say 'data not kept':\n" + "\n".join(silent)


def perturbed(value):
    """Every number of a JSON value moved (bools kept): an int by 7, a float by 10% and 0.1237."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value + 7
    if isinstance(value, float):
        return value * 1.1 + 0.1237
    if isinstance(value, list):
        return [perturbed(v) for v in value]
    if isinstance(value, dict):
        return {k: perturbed(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("name", sorted(TABLES))
def test_a_table_moves_with_every_file_it_reads(name, tmp_path):
    """A renderer that ignored a file it opens (a number typed in) would render the same table after
    the file's numbers moved; failing to render counts as moving."""
    data = Data()
    before = render(name, data)
    assert data.read, f"{name} reads no results file"
    for path in sorted(data.read):
        root = tmp_path / path.replace("/", "_")
        shutil.copytree(DATA, root)
        (root / path).write_text(json.dumps(perturbed(json.loads((DATA / path).read_text()))))
        try:
            after = render(name, Data(root))
        except Exception:  # noqa: BLE001 - the renderer depends on the numbers it was given
            continue
        assert after != before, f"{name}: the table does not move when docs/data/{path} does"


def recorded_commands() -> list[tuple[str, str]]:
    out = []
    for file in sorted(DATA.rglob("*.json")):
        command = json.loads(file.read_text()).get("command") if file.stat().st_size < 5_000_000 else None
        if isinstance(command, str) and re.match(r"python (examples|benchmarks)/\w+\.py", command):
            out.append((str(file.relative_to(DATA)), command))
    return out


def test_recorded_commands_name_their_own_script_and_its_flags():
    """Each results JSON's command is a command of the script that wrote it: every flag in it is one
    of that script's (a study run inside another script once recorded its caller's flags)."""
    helps: dict[str, str] = {}
    wrong = []
    for path, command in recorded_commands():
        script = command.split()[1]
        if script not in helps:
            helps[script] = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True,
                                           text=True, timeout=120).stdout
        source = (REPO / script).read_text()  # a flag hidden from --help (argparse.SUPPRESS) is in the source
        for flag in re.findall(r"(?:^|\s)(--[\w-]+)", command):
            if not re.search(re.escape(flag) + r"\b", helps[script]) and f'"{flag}"' not in source:
                wrong.append(f"docs/data/{path}: {script} has no {flag} ({command})")
    assert not wrong, "\n".join(wrong)


def test_figures_with_data_are_drawn_from_it(tmp_path):
    """Each figure of a data-backed section is drawn from its results JSON by the study script's own
    plot function (python -m doctables --figures), and the page shows it."""
    from doctables.figures import FIGURES, draw_all

    pages = "\n".join(p.read_text(encoding="utf-8") for p in PAGES)
    assert [name for name in FIGURES if f"]({name})" not in pages] == []
    data = Data()
    for path in draw_all(data, tmp_path):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path.name
    assert data.read  # drawn from docs/data


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_section_with_results_has_its_data_or_says_it_has_none(page):
    """A section (heading of level 2-4) with a result table or a figure links its results JSON,
    rebuilds a table from data, or says "data not kept"."""
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    silent = []
    for section in re.split(r"^(?=#{2,4} )", text, flags=re.M):
        result_tables = [m for m in re.findall(r"<!-- table: (\S+) -->", section) if m != "setting"]
        unmarked = re.search(r"^\|", re.sub(r"<!-- table: setting -->\n(\|.*\n)+", "", section), flags=re.M)
        has_results = result_tables or "![" in section or (unmarked and not result_tables)
        backed = ("](data/" in section or "data not kept" in section.lower()
                  or any(m != NO_DATA for m in result_tables))
        if has_results and not backed:
            silent.append(section.splitlines()[0])
    assert not silent, "sections with results but no data and no 'data not kept':\n" + "\n".join(silent)


def test_tables_are_found_with_their_markers_and_not_in_code(tmp_path):
    from doctables.pages import tables

    page = tmp_path / "page.md"
    page.write_text("# T\n\n## A\n\n<!-- table: x.y -->\n| a |\n|---|\n| 1 |\n\ntext\n\n| b |\n|---|\n\n"
                    "```\n| not | a table |\n```\n\n### B\n<!-- table: none -->\n| c |\n|---|\n", encoding="utf-8")
    found = [(t.marker, t.section, t.start, t.end) for t in tables(page)]
    assert found == [("x.y", "A", 5, 8), ("", "A", 11, 13), ("none", "B", 20, 22)]
