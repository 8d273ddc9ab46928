"""Finding agents: entry-point plugins (a real *.dist-info on sys.path, read by importlib.metadata),
module:Class specs imported from the current directory, clear errors for everything else, the
constructor convention, and --agent / --agent-kwarg reaching the evaluated agent."""

from __future__ import annotations

import sys
import textwrap
import uuid
import warnings
from pathlib import Path

import pytest

from agents.memagent import MemAgent
from agents.records import load_episodes
from agents.registry import (BUILTIN_AGENTS, AgentPluginWarning, AgentSpecError, agent_names, build_agent,
                             check_trainable, registered_agents, resolve_agent)
from memopd.eval import evaluate, main, parse_args

AGENT_MODULE = '''
from agents.memagent import MemAgent


class {cls}(MemAgent):
    """A MemAgent that writes shorter answers."""

    name = "{name}"

    def __init__(self, backend=None, sampling=None, answer_max_new_tokens=32, shout=False, **kwargs):
        super().__init__(backend=backend, sampling=sampling, answer_max_new_tokens=answer_max_new_tokens, **kwargs)
        self.shout = shout
'''


def install_plugin(root: Path, dist: str, entries: str, module: str | None = None, source: str = "") -> None:
    """A distribution as pip leaves it: ``<dist>-0.1.dist-info`` with METADATA and entry_points.txt,
    next to its module, in ``root`` (a directory on sys.path)."""
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entries)
    if module:
        (root / f"{module}.py").write_text(source)


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    return root


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"  # a fresh module name: nothing cached in sys.modules


def test_builtins_are_registered_as_entry_points():
    """memopd's own distribution registers the five (pyproject.toml), not only the fallback table."""
    entries = registered_agents()
    assert set(BUILTIN_AGENTS) <= set(entries)
    assert {n: entries[n].target for n in BUILTIN_AGENTS} == BUILTIN_AGENTS
    assert {entries[n].source for n in BUILTIN_AGENTS} == {"memopd"}


def test_an_installed_plugin_is_found_by_name_and_listed_in_help(plugin_dir, capsys):
    module, cls = unique("notes_plugin"), "NotesAgent"
    install_plugin(plugin_dir, "notes-plugin", f"[memopd.agents]\nnotes = {module}:{cls}\n", module,
                   AGENT_MODULE.format(cls=cls, name="notes"))
    assert "notes" in agent_names() and registered_agents()["notes"].source == "notes-plugin"
    assert module not in sys.modules  # listing names imports nothing
    found = resolve_agent("notes")
    assert found.__name__ == cls and issubclass(found, MemAgent) and found.__module__ == module
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "{fullcontext,memagent,notes,oracle,rag,rag-memagent}" in " ".join(capsys.readouterr().out.split())


def test_flags_reach_the_evaluated_plugin_agent(plugin_dir, tmp_path, capsys):
    module = unique("shout_plugin")
    install_plugin(plugin_dir, "shout-plugin", f"[memopd.agents]\nshout = {module}:ShoutAgent\n", module,
                   AGENT_MODULE.format(cls="ShoutAgent", name="shout"))
    summary = evaluate(["--agent", "shout", "--model", "tiny", "--episodes", "2", "--env-kwarg", "num_chunks=2",
                        "--agent-kwarg", "shout=True", "--answer-max-new-tokens", "3", "--max-new-tokens", "6",
                        "--out", str(tmp_path / "out"), "--no-progress"])
    assert summary["agent"] == "shout" and summary["agent_kwargs"] == {"shout": True}
    episodes = load_episodes(tmp_path / "out" / "episodes.jsonl").episodes
    assert [e.agent for e in episodes] == ["shout", "shout"]
    answers = [i for e in episodes for i in e.invocations if i.role == "answer"]
    assert answers and all(len(i.response_ids) <= 3 for i in answers)  # answer_max_new_tokens reached it
    assert all(len(i.response_ids) <= 6 for e in episodes for i in e.invocations)  # and its sampling


def test_rag_options_by_agent_kwarg(tmp_path):
    evaluate(["--agent", "rag", "--model", "tiny", "--episodes", "1", "--env-kwarg", "num_chunks=3",
              "--agent-kwarg", "top_k=1", "--answer-max-new-tokens", "2", "--out", str(tmp_path), "--no-progress"])
    (episode,) = load_episodes(tmp_path / "episodes.jsonl").episodes
    assert episode.agent == "rag" and len(episode.invocations[0].meta["retrieved"]) == 1


def test_broken_plugins_are_skipped_with_a_warning_naming_them(plugin_dir, tmp_path, capsys):
    install_plugin(plugin_dir, "garbled-plugin", "[memopd.agents]\nthis line is not an entry point\n")
    install_plugin(plugin_dir, "badvalue-plugin", "[memopd.agents]\nbadvalue = not a target\n")
    install_plugin(plugin_dir, "shadow-plugin", "[memopd.agents]\nmemagent = shadow_mod:Mine\n")
    module = unique("crashing_plugin")
    install_plugin(plugin_dir, "crash-plugin", f"[memopd.agents]\ncrash = {module}:Crash\n", module,
                   "raise RuntimeError('plugin bug')\n")
    with pytest.warns(AgentPluginWarning) as caught:
        names = agent_names()
    said = " | ".join(str(w.message) for w in caught)
    assert "'garbled-plugin': its entry points cannot be read" in said
    assert "'badvalue-plugin': entry point 'badvalue' = 'not a target' is not 'module:Class'" in said
    assert "'shadow-plugin': agent name 'memagent' is memopd's built-in" in said
    assert set(BUILTIN_AGENTS) <= set(names) and "crash" in names and "badvalue" not in names
    assert resolve_agent("memagent") is MemAgent  # the built-in is not replaced
    with pytest.raises(AgentSpecError, match=r"crash: importing module 'crashing_plugin_\w+' failed: "
                                             r"RuntimeError: plugin bug \(registered by 'crash-plugin'"):
        resolve_agent("crash")
    with warnings.catch_warnings():  # the CLI works for every other agent
        warnings.simplefilter("ignore", AgentPluginWarning)
        assert main(["--agent", "oracle", "--episodes", "1", "--env-kwarg", "num_chunks=2",
                     "--out", str(tmp_path / "ok"), "--no-progress"]) == 0
        assert main(["--agent", "crash", "--model", "tiny", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "error: --agent crash: importing module" in err and "RuntimeError: plugin bug" in err


def test_module_class_imports_from_the_current_directory(tmp_path, monkeypatch):
    package = unique("my_agents")
    (tmp_path / package).mkdir()
    (tmp_path / package / "notes.py").write_text(AGENT_MODULE.format(cls="NotesAgent", name="notes"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    cls = resolve_agent(f"{package}.notes:NotesAgent")
    assert cls.name == "notes" and issubclass(cls, MemAgent) and sys.path[0] == str(tmp_path)  # as python -m


@pytest.mark.parametrize("source, spec, says", [
    ("class NotAnAgent:\n    pass\n", "{m}:NotAnAgent",
     r"class {m}.NotAnAgent is not derived from agents.MemoryPolicy; an agent is a MemoryPolicy subclass"),
    ("def make():\n    pass\n", "{m}:make", r"make is a function, not a class"),
    ("from agents.policy import MemoryPolicy\nclass Half(MemoryPolicy):\n    pass\n", "{m}:Half",
     r"Half does not implement step\(\)"),
    ("from agents.memagent import MemAgent\nclass Mine(MemAgent):\n    pass\n", "{m}:Other",
     r"module '{m}' has no attribute 'Other'; its MemoryPolicy classes: Mine"),
    ("import not_installed_dependency_xyz\n", "{m}:A",
     r"module '{m}' imports 'not_installed_dependency_xyz', which is not installed"),
    ("def broken(:\n", "{m}:A", r"importing module '{m}' failed: SyntaxError"),
    ("", "no_such_module_xyz.sub:A", r"cannot import module 'no_such_module_xyz.sub' \(No module named "
                                     r"'no_such_module_xyz'\); check the spelling, run from the directory"),
    ("", "examples/notes_agent.py:NotesAgent", r"not module:Class .*not a file path"),
    ("", "gpt", r"unknown agent 'gpt'; available agents: .*fullcontext, memagent, oracle, rag"),
])
def test_bad_specs_are_refused_clearly(plugin_dir, source, spec, says):
    module = unique("spec_mod")
    (plugin_dir / f"{module}.py").write_text(source)
    spec = spec.format(m=module)
    with pytest.raises(AgentSpecError, match=says.format(m=module)) as exc:
        resolve_agent(spec)
    assert str(exc.value).startswith(f"{spec}: ")


def test_the_constructor_convention_is_checked(plugin_dir):
    module = unique("convention_mod")
    (plugin_dir / f"{module}.py").write_text(textwrap.dedent('''
        from agents.policy import MemoryPolicy

        class NoSampling(MemoryPolicy):
            def __init__(self, backend=None):
                super().__init__(backend)
            def step(self, state, obs, info):
                return ""
    '''))
    with pytest.raises(AgentSpecError, match=r"NoSampling.__init__ takes no sampling=; a model-backed agent "
                                             r"\(calls_model = True\) takes backend= and sampling="):
        build_agent(f"{module}:NoSampling", {"backend": None, "sampling": None})
    with pytest.raises(AgentSpecError, match=r"memagent: MemAgent takes no option 'colour' \(--agent-kwarg\); "
                                             r"it takes: answer_max_new_tokens, "):
        build_agent("memagent", {"backend": None, "sampling": None}, options={"colour": "blue"})
    with pytest.raises(AgentSpecError, match=r"rag: RAGAgent: top_k must be >= 1 \(got 0\)"):
        build_agent("rag", {"backend": None, "sampling": None, "tokenizer": object()}, options={"top_k": 0})


def test_eval_flags_are_checked_before_anything_loads(tmp_path, capsys):
    out = ["--out", str(tmp_path / "out"), "--no-progress"]
    assert main(["--agent", "agents.records:Episode", "--model", "tiny", *out]) == 2
    assert "error: --agent agents.records:Episode: class agents.records.Episode is not derived from " \
           "agents.MemoryPolicy" in capsys.readouterr().err
    assert main(["--agent", "memagent", "--model", "tiny", "--agent-kwarg", "sampling=0.5", *out]) == 2
    assert "--agent-kwarg sampling: set by the command line itself" in capsys.readouterr().err
    assert main(["--agent", "oracle", "--agent-kwarg", "colour", *out]) == 2
    assert "--agent-kwarg 'colour' is not KEY=VALUE" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_oracle_is_refused_for_training():
    with pytest.raises(AgentSpecError, match=r"oracle: OracleAgent makes no model calls .* nothing to train; train "
                                             r"a model-backed agent \(fullcontext, memagent, rag, rag-memagent or your own"):
        check_trainable(resolve_agent("oracle"), "oracle")
    check_trainable(resolve_agent("fullcontext"), "fullcontext")


def test_a_pip_installed_plugin_appears_in_both_clis_help(plugin_dir):
    """In a fresh process, as a user runs the CLIs after `pip install`: the plugin's name is listed."""
    import os
    import subprocess

    install_plugin(plugin_dir, "listed-plugin", "[memopd.agents]\nlisted = listed_mod:Listed\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_dir), os.environ.get("PYTHONPATH", "")])}
    for cli in ("memopd.eval", "memopd.train"):
        res = subprocess.run([sys.executable, "-m", cli, "--help"], capture_output=True, text=True, env=env,
                             timeout=300)
        assert res.returncode == 0, res.stderr
        flat = " ".join(res.stdout.split())
        agent_help = flat.split("options:", 1)[1].split("--agent ", 1)[1].split(" --", 1)[0]
        assert "listed" in agent_help and "memagent" in agent_help, (cli, agent_help)
