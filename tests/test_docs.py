"""The documentation: README.md and the guides in docs/ (the mkdocs site of mkdocs.yml).

- every relative link of README.md and docs/*.md names a file that exists, and an anchor that one
  of its headings makes;
- every ```bash / ```python block of the README and the guides says, in an HTML comment on the line
  before it, how it is kept true:

  ``<!-- run -->``                this test runs it (smaller sizes appended, see ``FAST``)
  ``<!-- run-by: tests/X.py -->`` that test runs it (or the commands it stands for)
  ``<!-- memopd:NAME -->``        a named snippet that a test reads (``<!-- memgym:NAME -->`` too)
  ``<!-- no-run: REASON -->``     not run on CPU CI, and why (a GPU, hours, placeholders)
  ``<!-- file: PATH -->``         (any block) written to PATH before the page's runnable blocks run

  the results pages (docs/RESULTS.md, docs/BENCHMARKS.md) are records of measurements, exempt;
- the runnable blocks run: a page's files are written into a fresh directory (with ``examples/``
  of the repository beside them), its python blocks run there as one script and its bash
  commands one by one, each ``python -m MODULE ...`` with the smaller sizes of ``FAST[MODULE]``
  appended (a later flag overrides an earlier one);
- the site builds with ``mkdocs build --strict`` (where mkdocs is installed): a broken link, anchor
  or API reference fails it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
RECORDS = {"RESULTS.md", "BENCHMARKS.md"}  # measurements, unchanged: their commands are the experiments'
GUIDES = [p for p in PAGES if p.name not in RECORDS]
CODE_LANGS = {"bash", "sh", "shell", "console", "python", "py"}

# Smaller sizes for a documented command: appended to it, so they override its own.
TRAIN_FAST = ["--steps", "2", "--questions-per-step", "2", "--group-size", "2", "--max-new-tokens", "8",
              "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0", "--teacher",
              "tiny-teacher", "--no-progress", "--pack-tokens", "1024", "--threads", "1", "--ppo-epochs", "1",
              "--audit-every", "0", "--sample-episodes", "1"]
FAST = {"memopd.train": TRAIN_FAST, "memopd.eval": ["--episodes", "2", "--threads", "1"],
        "memopd.sft": ["--steps", "2", "--threads", "1"], "memopd.view": [], "memgym.play": [], "memgym.score": []}
# Pages whose runnable blocks take more than a few seconds (several trainings, Ray, torchrun).
SLOW_PAGES = {"README.md", "index.md", "agents.md", "training.md", "methods.md", "scale-out.md"}
PLAYER_INPUT = "alice acme .\n" * 40  # a memory per chunk, then the answer, for memgym.play and input()

FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*(.*?)\s*-->\s*$", re.S)
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def blocks(page: Path) -> list[tuple[str, str, str, int]]:
    """(language, code, marker, line) of every fenced block; the marker is the HTML comment on the
    last non-blank line before the fence ('' when there is none)."""
    text = page.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        out.append((m.group(1).lower(), m.group(2), marker.group(1) if marker and before.lstrip().startswith("<!--")
                    else "", text.count("\n", 0, m.start()) + 1))
    return out


def without_code(text: str) -> str:
    """The text without fenced blocks and inline code, where a link is not a link."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return re.sub(r"`[^`\n]*`", "``", text)


def slug(heading: str) -> str:
    """The anchor of a heading, as the site makes it (pymdownx.slugs.slugify, case lower) and as
    GitHub does: lowercase, punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text.replace("`", ""))
    text = unicodedata.normalize("NFC", text).lower()
    return re.sub(r"[^\w\- ]", "", text, flags=re.UNICODE).strip().replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in without_code(page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}_{n}")  # a repeated heading: the site's suffix
        out.add(s if n == 0 else f"{s}-{n}")  # ... and GitHub's
    return out


# ------------------------------------------------------------------------------------------ links
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_names_an_existing_file_and_anchor(page):
    broken = []
    for target in LINK.findall(without_code(page.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and "api" not in dest.relative_to(REPO).parts:
            if anchor not in anchors(dest):
                broken.append(f"{target}: no heading of {dest.name} makes #{anchor}")
    assert not broken, f"{page.relative_to(REPO)}:\n" + "\n".join(broken)


def test_the_readme_is_short_and_links_the_guides():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    assert 'pip install -e ".[dev,bench]"' in text and "\npytest\n" in text and "mkdocs build --strict" in text
    for guide in ("gym", "agents", "training", "methods", "scale-out", "teacher", "RESULTS", "BENCHMARKS"):
        assert f"](docs/{guide}.md)" in text, guide


def test_mkdocs_nav_lists_every_page():
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    for page in [*DOCS.glob("*.md"), *DOCS.glob("api/*.md")]:
        assert f": {page.relative_to(DOCS).as_posix()}" in nav, page.name


def test_the_training_guide_names_every_option_group_of_train_help():
    from memopd import config as cfgmod
    from memopd.train import TrainConfig

    parser = cfgmod.build_parser(TrainConfig, "python -m memopd.train", "")
    titles = [g.title for g in parser._action_groups if g.title not in ("positional arguments", "options")]
    guide = (DOCS / "training.md").read_text(encoding="utf-8")
    assert titles and [t for t in titles if f"| {t} |" not in guide] == []
    flags = {a.option_strings[-1 if a.option_strings[0] == "-h" else 0] for g in parser._action_groups[2:]
             for a in g._group_actions}
    assert [f for f in sorted(flags) if f"`{f}`" not in guide] == []


# -------------------------------------------------------------------------------- code blocks
@pytest.mark.parametrize("page", GUIDES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_code_block_says_how_it_is_kept_true(page):
    tests = "\n".join(p.read_text(encoding="utf-8") for p in (REPO / "tests").glob("test_*.py"))
    wrong = []
    for lang, code, marker, line in blocks(page):
        where = f"{page.relative_to(REPO)}:{line}"
        kind = marker.split(":", 1)[0].strip()
        if lang not in CODE_LANGS and kind != "file":
            continue
        if marker == "run" or kind == "file":
            continue
        if kind == "no-run":
            if not marker.split(":", 1)[1:] or not marker.split(":", 1)[1].strip():
                wrong.append(f"{where}: <!-- no-run: REASON --> needs its reason")
        elif kind == "run-by":
            test = marker.split(":", 1)[1].split()[0] if marker.split(":", 1)[1].split() else ""
            if not (REPO / test).is_file():
                wrong.append(f"{where}: run-by names {test!r}, which is no file")
        elif re.fullmatch(r"(memgym|memopd):[\w-]+", marker):
            if f"<!-- {marker} -->" not in tests:
                wrong.append(f"{where}: no test reads <!-- {marker} -->")
        else:
            wrong.append(f"{where}: a ```{lang} block needs <!-- run -->, <!-- run-by: tests/... -->, "
                         f"<!-- no-run: reason --> or a named marker before it (has {marker!r})")
    assert not wrong, "\n".join(wrong)


def bash_commands(code: str) -> list[tuple[dict[str, str], list[str]]]:
    """(environment, argv) of each command of a bash block: comments dropped, continuations joined,
    ``export K=V`` kept for the commands after it, ``K=V cmd`` for that command."""
    env: dict[str, str] = {}
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        if argv[0] == "export":
            env.update(a.split("=", 1) for a in argv[1:])
            continue
        own = {}
        while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
            key, value = argv.pop(0).split("=", 1)
            own[key] = value
        out.append(({**env, **own}, argv))
    return out


def runnable(argv: list[str]) -> list[str]:
    """The command to run for a documented one: this interpreter, the smaller sizes appended."""
    if argv[0] == "torchrun":
        module = argv[argv.index("-m") + 1]
        return [sys.executable, "-m", "torch.distributed.run", *argv[1:], *FAST[module]]
    assert argv[0] == "python", f"no rule to run {shlex.join(argv)}"
    if argv[1] == "-m":
        assert argv[2] in FAST, f"no smaller sizes for {argv[2]}: add them to FAST"
        return [sys.executable, *argv[1:], *FAST[argv[2]]]
    return [sys.executable, *argv[1:]]


def write_files(page: Path, where: Path) -> None:
    for lang, code, marker, _ in blocks(page):
        if marker.split(":", 1)[0].strip() != "file":
            continue
        path = where / marker.split(":", 1)[1].strip()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code, encoding="utf-8")


def _run_page(page: Path, tmp_path: Path, done: set[str]) -> None:
    where = tmp_path / page.stem
    where.mkdir()
    (where / "examples").symlink_to(REPO / "examples")
    write_files(page, where)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "NO_MKDOCS_2_WARNING": "1"}
    script = []
    for lang, code, marker, line in blocks(page):
        if marker != "run" or code in done:
            continue
        done.add(code)  # a block shown on two pages (README.md and docs/index.md) runs once
        if lang in ("python", "py"):
            script.append(code)
            continue
        for extra, argv in bash_commands(code):
            cmd = runnable(argv)
            out = subprocess.run(cmd, cwd=where, env={**env, **extra}, input=PLAYER_INPUT, capture_output=True,
                                 text=True, timeout=900)
            assert out.returncode == 0, f"{page.name}:{line}: {shlex.join(argv)}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    if script:
        out = subprocess.run([sys.executable, "-c", "\n".join(script)], cwd=where, env=env, input=PLAYER_INPUT,
                             capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, f"{page.name}: its python blocks\n{out.stderr[-3000:]}"


def _page_params():
    out = []
    for page in GUIDES:
        if not any(marker == "run" for _, _, marker, _ in blocks(page)):
            continue
        marks = [pytest.mark.slow] if page.name in SLOW_PAGES else []
        out.append(pytest.param(page, marks=marks, id=str(page.relative_to(REPO))))
    return out


@pytest.mark.parametrize("page", _page_params())
def test_the_runnable_blocks_of_a_page_run(page, tmp_path):
    # README.md and docs/index.md share the quickstart: index.md skips the blocks the README ran
    done = set()
    if page.name == "index.md":
        done = {code for _, code, marker, _ in blocks(REPO / "README.md") if marker == "run"}
    _run_page(page, tmp_path, done)


def test_the_guides_run_what_they_promise():
    """The pages this test runs hold the commands that matter most: the README's quickstart, the
    gym's play and add-a-task commands, the training commands and the CPU torchrun line."""
    run = {p.name: [c for _, c, m, _ in blocks(p) if m == "run"] for p in GUIDES}
    readme = "\n".join(run["README.md"])
    for module in ("memgym.play", "memopd.eval", "memopd.train", "memopd.view"):
        assert f"python -m {module} " in readme, module
    assert any("MyQA" in c for c in run["gym.md"]) and any("MyGen" in c for c in run["gym.md"])
    assert any("torchrun --nproc-per-node 2" in c for c in run["scale-out.md"])
    assert any("--teacher-context persistent" in c for c in run["training.md"])


# --------------------------------------------------------------------------------------- the site
def test_the_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip('mkdocs is not installed (pip install -e ".[docs]")')
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "api" / "memopd" / "index.html").is_file()
    assert "Trainer" in (tmp_path / "site" / "api" / "memopd" / "index.html").read_text(encoding="utf-8")
