"""The packages' layering, read from their source: memgym <- agents <- memopd, no import cycle, the
learner's core (memopd/learn/) imported only by the training CLI and the plugins, and no module of
memopd/learn/ importing or naming a built-in plugin."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("memgym", "agents", "memopd")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = modules()


def _known(name: str) -> str | None:
    """The project module an imported name lives in (``memopd.learn.x.f`` -> ``memopd.learn.x``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(name: str, annotations: bool = False) -> set[str]:
    """Every project module ``name`` imports, at its top or inside a function (an import inside a
    function still makes the dependency); imports only for type annotations (``if TYPE_CHECKING``)
    left out unless ``annotations``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child) and not annotations:
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.rsplit(".", child.level - 1)[0] if child.level > 1 else package
                    base = f"{up}.{base}" if base else up
                found.update(f"{base}.{a.name}" for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in map(_known, found) if m and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


GRAPH = {m: imports(m) for m in MODULES}
GRAPH_WITH_ANNOTATIONS = {m: imports(m, annotations=True) for m in MODULES}


def test_the_helpers_find_imports_and_cycles_by_hand():
    assert "memopd.learn.trainer" in GRAPH["memopd.train"]  # the CLI assembles the trainer
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    assert cycles(GRAPH) == []


def test_no_import_cycle_through_annotation_imports():
    """A type checker follows ``if TYPE_CHECKING`` imports too: no cycle through them either."""
    assert cycles(GRAPH_WITH_ANNOTATIONS) == []


def test_the_layers_import_downward_only():
    up = sorted((m, t) for m, ts in GRAPH.items() for t in ts
                if (m.startswith("memgym") and not t.startswith("memgym"))
                or (m.startswith("agents") and t.startswith("memopd")))
    assert up == []


def test_the_learners_core_is_imported_by_the_cli_and_the_plugins_alone():
    # a shared module of memopd/ (runtime, sft, lora, ...) never reaches up into the learner
    users = sorted({m for m, ts in GRAPH.items() for t in ts
                   if t.startswith("memopd.learn") and not m.startswith(("memopd.learn", "memopd.plugins"))})
    assert users == ["memopd.train"]


def test_no_module_of_the_learner_names_a_plugin():
    builtin = sorted(m.rpartition(".")[2] for m in MODULES if m.startswith("memopd.plugins."))
    assert {"turn_opd", "prune_opd", "freshness", "staleness", "async_ray"} <= set(builtin)
    imported = sorted((m, t) for m, ts in GRAPH.items() for t in ts
                      if m.startswith("memopd.learn") and t.startswith("memopd.plugins"))
    assert imported == []
    # nor reads one's options or state by name (the entry-point group "memopd.plugins" is no plugin)
    names = re.compile(r"\b(" + "|".join(builtin + ["prune_opd", "turn_opd", "simulated_staleness", "BUILTIN_PLUGINS"])
                       + r")\b")
    named = sorted(f"{p.relative_to(ROOT)}:{i}" for m, p in MODULES.items() if m.startswith("memopd.learn")
                   for i, line in enumerate(p.read_text().splitlines(), 1) if names.search(line))
    assert named == []
