"""Finding agents by name: built-ins, installed plugins, and ``module:Class`` specs.

An agent is named on the command line (``--agent NAME|module:Class``) as

- a registered name: an entry point of the ``memopd.agents`` group (the way Gymnasium finds
  environment plugins). A package registers its agents in its ``pyproject.toml``::

      [project.entry-points."memopd.agents"]
      notes = "my_package.notes:NotesAgent"

  memopd registers its own five (memagent, fullcontext, rag, rag-memagent, oracle) the same way, and keeps
  them in :data:`BUILTIN_AGENTS` too, so a source checkout that was not reinstalled finds them;
- or ``module:Class``: a :class:`agents.policy.MemoryPolicy` subclass importable from an
  installed package or, as ``python -m`` does, from the current directory
  (``examples.notes_agent:NotesAgent``).

A broken plugin (unreadable entry points, a value that is not ``module:Class``, a name that
would shadow a built-in) is skipped with an :class:`AgentPluginWarning` naming it; the other
agents stay usable. A plugin is imported only when it is asked for, so ``--help`` and the other
agents never run its code.

Constructor convention (what :func:`build_agent` relies on):

- a **model-backed** agent (``calls_model = True``, the default) takes ``backend=`` (the
  :class:`agents.backends.Backend` its calls go through) and ``sampling=`` (the
  :class:`agents.backends.SamplingParams` of its calls) as keyword arguments; these are what a
  trainer hands it, and it can then train it;
- a **scripted** agent (``calls_model = False``, e.g. the oracle) takes ``tokenizer=`` (the
  tokenizer of its records) and, when it names it, ``samples=`` (the env's sample source);
- anything else is an option (``--agent-kwarg KEY=VALUE``). CLI settings that are not part of
  the convention (``answer_max_new_tokens``, ``top_k``) reach only a constructor that takes them.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import re
import sys
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from agents.policy import MemoryPolicy

ENTRY_POINT_GROUP = "memopd.agents"

BUILTIN_AGENTS = {
    "memagent": "agents.memagent:MemAgent",
    "fullcontext": "agents.baselines:FullContextAgent",
    "rag": "agents.baselines:RAGAgent",
    "rag-memagent": "agents.rag:RAGMemAgent",
    "oracle": "agents.oracle:OracleAgent",
}
"""The agents memopd ships (name -> ``module:Class``), also registered as entry points."""

MODEL_ARGS = ("backend", "sampling")
"""What a model-backed agent's constructor takes (keyword arguments)."""
SCRIPTED_ARGS = ("tokenizer",)
"""What a scripted agent's constructor takes (keyword arguments)."""

_TARGET = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class AgentSpecError(ValueError):
    """An agent spec cannot be used: unknown name, import failure, not a MemoryPolicy, a
    constructor that does not follow the convention or refuses its options. The message starts
    with the spec and says how to fix it."""

    def __init__(self, spec: str, reason: str) -> None:
        super().__init__(f"{spec}: {reason}")
        self.spec = spec
        self.reason = reason


class AgentPluginWarning(UserWarning):
    """An installed ``memopd.agents`` plugin is broken and was skipped (the message names it)."""


@dataclass(frozen=True)
class AgentEntry:
    """A registered agent: its name, ``module:Class`` target and where it came from."""

    name: str
    target: str
    source: str
    """The distribution that registered it, or ``"built-in"`` (the fallback table)."""


# ------------------------------------------------------------------------------------------------
# the registry
# ------------------------------------------------------------------------------------------------

def registered_agents() -> dict[str, AgentEntry]:
    """Every agent name: entry points of installed distributions, then the built-ins they lack.

    Scanned once per ``sys.path`` (a test or a notebook that adds a directory sees its plugins)."""
    return dict(_scan(tuple(sys.path)))


def agent_names() -> list[str]:
    """The registered names, sorted."""
    return sorted(registered_agents())


@lru_cache(maxsize=8)
def _scan(path_key: tuple[str, ...]) -> tuple[tuple[str, AgentEntry], ...]:
    found: dict[str, AgentEntry] = {}
    seen: set[str] = set()
    for dist in importlib.metadata.distributions():
        label = _dist_name(dist)
        if label in seen:  # the first distribution of a name on sys.path wins, as importlib's own lookup
            continue
        seen.add(label)
        for entry in _entries(dist, label):
            _add(found, entry)
    for name, target in BUILTIN_AGENTS.items():  # a checkout without (re)installed entry points
        found.setdefault(name, AgentEntry(name, target, "built-in"))
    return tuple(found.items())


def _dist_name(dist: importlib.metadata.Distribution) -> str:
    """The normalised distribution name; its metadata folder's name when METADATA lacks one."""
    name = dist.metadata["Name"] if dist.metadata is not None else None
    folder = getattr(getattr(dist, "_path", None), "name", None) or "unknown"  # e.g. foo-1.0.dist-info
    return re.sub(r"[-_.]+", "-", str(name or folder)).lower()


def _entries(dist: importlib.metadata.Distribution, label: str) -> list[AgentEntry]:
    """One distribution's ``memopd.agents`` entry points; a malformed ``entry_points.txt`` (which
    makes ``importlib.metadata.entry_points()`` raise for everyone) skips only this one."""
    try:
        points = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
    except Exception as exc:  # noqa: BLE001 - any failure to read a plugin's metadata is the plugin's
        warnings.warn(f"memopd.agents plugin {label!r}: its entry points cannot be read ({type(exc).__name__}: "
                      f"{exc}); its agents are skipped. Fix or reinstall that package.", AgentPluginWarning,
                      stacklevel=4)
        return []
    out = []
    for ep in points:
        target = re.sub(r"\s+", "", ep.value.split("[", 1)[0])  # extras ("mod:Cls [gpu]") do not matter here
        if not _TARGET.match(target):
            warnings.warn(f"memopd.agents plugin {label!r}: entry point {ep.name!r} = {ep.value!r} is not "
                          "'module:Class'; skipped", AgentPluginWarning, stacklevel=4)
            continue
        out.append(AgentEntry(ep.name, target, label))
    return out


def _add(found: dict[str, AgentEntry], entry: AgentEntry) -> None:
    """Keep the first registration of a name; a plugin never replaces a built-in name."""
    builtin = BUILTIN_AGENTS.get(entry.name)
    if builtin is not None and entry.target != builtin:
        warnings.warn(f"memopd.agents plugin {entry.source!r}: agent name {entry.name!r} is memopd's built-in "
                      f"({builtin}); its {entry.target} is skipped. Register it under another name.",
                      AgentPluginWarning, stacklevel=5)
        return
    earlier = found.get(entry.name)
    if earlier is not None and earlier.target != entry.target:
        warnings.warn(f"memopd.agents plugins {earlier.source!r} and {entry.source!r} both register "
                      f"{entry.name!r}; keeping {earlier.target} from {earlier.source!r}", AgentPluginWarning,
                      stacklevel=5)
        return
    found.setdefault(entry.name, entry)


# ------------------------------------------------------------------------------------------------
# resolving a spec to a class
# ------------------------------------------------------------------------------------------------

def resolve_agent(spec: str) -> type["MemoryPolicy"]:
    """The agent class a spec names (a registered name or ``module:Class``).

    Raises :class:`AgentSpecError` saying what is wrong and how to fix it."""
    spec = spec.strip()
    if ":" not in spec:
        entries = registered_agents()
        if spec not in entries:
            raise AgentSpecError(spec, f"unknown agent {spec!r}; available agents: {', '.join(sorted(entries))}; "
                                       "or give module:Class, a MemoryPolicy subclass importable from the current "
                                       "directory or an installed package (e.g. examples.notes_agent:NotesAgent)")
        entry = entries[spec]
        where = "" if entry.source == "built-in" else f" (registered by {entry.source!r} as {entry.target})"
        try:
            return _load(entry.target)
        except AgentSpecError as exc:
            raise AgentSpecError(spec, f"{exc.reason}{where}") from None
    return _load(spec)


def _load(target: str) -> type["MemoryPolicy"]:
    from agents.policy import MemoryPolicy

    module_name, _, qualname = target.partition(":")
    if not _TARGET.match(target):
        hint = (" Give the module as a dotted name from the current directory (examples/notes_agent.py -> "
                "examples.notes_agent:NotesAgent), not a file path." if "/" in module_name or "\\" in module_name
                or module_name.endswith(".py") else "")
        raise AgentSpecError(target, f"not module:Class (e.g. examples.notes_agent:NotesAgent).{hint}")
    obj: Any = _import(target, module_name)
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise AgentSpecError(target, f"module {module_name!r} has no attribute {part!r}"
                                         f"{_candidates(obj, MemoryPolicy)}")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, MemoryPolicy)):
        what = (f"class {obj.__module__}.{obj.__qualname__} is not derived from agents.MemoryPolicy"
                if isinstance(obj, type) else f"{qualname} is a {type(obj).__name__}, not a class")
        raise AgentSpecError(target, f"{what}; an agent is a MemoryPolicy subclass that implements step()")
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ()))) or "step"
        raise AgentSpecError(target, f"{obj.__qualname__} does not implement {missing}(); a MemoryPolicy subclass "
                                     "must define step(state, obs, info)")
    return obj


def _import(target: str, module_name: str) -> Any:
    """Import the module, with the current directory on ``sys.path`` as ``python -m`` has it."""
    for attempt in range(2):
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            own = exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + "."))
            if own and attempt == 0 and _add_cwd():
                continue
            if own:
                raise AgentSpecError(target, f"cannot import module {module_name!r} ({exc}); check the spelling, "
                                             "run from the directory that holds it, or pip install its package") \
                    from None
            raise AgentSpecError(target, f"module {module_name!r} imports {exc.name!r}, which is not installed; "
                                         f"install it ({exc})") from None
        except Exception as exc:  # noqa: BLE001 - user code: any error while importing it is reported
            raise AgentSpecError(target, f"importing module {module_name!r} failed: {type(exc).__name__}: {exc}") \
                from None
    raise AssertionError("unreachable")


def _add_cwd() -> bool:
    """Put the current directory first on ``sys.path`` (as ``python -m`` does); False if it is there."""
    cwd = os.getcwd()
    if any(os.path.abspath(p or os.curdir) == cwd for p in sys.path):
        return False
    sys.path.insert(0, cwd)
    importlib.invalidate_caches()
    return True


def _candidates(module: Any, base: type) -> str:
    names = sorted(n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, base)
                   and v.__module__ == getattr(module, "__name__", None)) if inspect.ismodule(module) else []
    return f"; its MemoryPolicy classes: {', '.join(names)}" if names else ""


# ------------------------------------------------------------------------------------------------
# building an agent by the constructor convention
# ------------------------------------------------------------------------------------------------

def constructor_params(cls: type) -> tuple[set[str], bool]:
    """The keyword arguments ``cls(...)`` takes, and whether it takes any others too.

    A constructor with ``**kwargs`` is read together with its base classes' constructors (the
    common ``def __init__(self, x, **kwargs): super().__init__(**kwargs)``); it counts as taking
    any keyword only when no base class in the chain names a closed set."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if klass is object:
            return names, False
        params = inspect.signature(init).parameters.values()
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return names, False
    return names, True


def check_convention(cls: type["MemoryPolicy"], spec: str) -> None:
    """Refuse a class whose constructor does not take what its kind must (see the module doc)."""
    names, open_ = constructor_params(cls)
    need = MODEL_ARGS if cls.calls_model else SCRIPTED_ARGS
    missing = [n for n in need if n not in names and not open_]
    if missing:
        kind = ("a model-backed agent (calls_model = True) takes backend= and sampling=" if cls.calls_model else
                "a scripted agent (calls_model = False) takes tokenizer=")
        raise AgentSpecError(spec, f"{cls.__qualname__}.__init__ takes no {', '.join(m + '=' for m in missing)}; "
                                   f"{kind} keyword arguments (see docs/extend.md, 'Bring your own agent')")


def check_trainable(cls: type["MemoryPolicy"], spec: str) -> None:
    """A trainer samples the agent's actions through its model: refuse a scripted agent."""
    if not cls.calls_model:
        raise AgentSpecError(spec, f"{cls.__qualname__} makes no model calls (calls_model = False: its actions are "
                                   "scripted, not sampled), so there is nothing to train; train a model-backed agent "
                                   f"({', '.join(n for n in agent_names() if _calls_model(n))} or your own taking "
                                   "backend= and sampling=). Scripted trajectories are SFT data: see memopd.sft")
    check_convention(cls, spec)


def _calls_model(name: str) -> bool:
    """Whether a built-in calls a model; plugins are not imported just to list names."""
    if name not in BUILTIN_AGENTS:
        return False
    try:
        return resolve_agent(name).calls_model
    except AgentSpecError:
        return False


def check_options(cls: type, spec: str, options: Mapping[str, Any], reserved: tuple[str, ...] = ()) -> None:
    """Refuse ``--agent-kwarg`` keys the CLI sets itself or the constructor does not take."""
    taken = sorted(set(options) & set(reserved))
    if taken:
        raise AgentSpecError(spec, f"--agent-kwarg {', '.join(taken)}: set by the command line itself "
                                   "(--model, --temperature, --max-new-tokens, ...), not an agent option")
    names, open_ = constructor_params(cls)
    unknown = sorted(set(options) - names)
    if unknown and not open_:
        raise AgentSpecError(spec, f"{cls.__qualname__} takes no option {', '.join(map(repr, unknown))} "
                                   f"(--agent-kwarg); it takes: {', '.join(sorted(names - set(reserved))) or 'none'}")


def build_agent(spec: str, required: Mapping[str, Any], optional: Mapping[str, Any] | None = None,
                options: Mapping[str, Any] | None = None) -> "MemoryPolicy":
    """Make the agent ``spec`` names, by the constructor convention.

    ``required``: what the convention hands over (``backend``/``sampling``, or ``tokenizer``),
    always passed. ``optional``: settings passed only when the constructor takes them (e.g.
    ``answer_max_new_tokens``, ``samples``). ``options``: the user's ``--agent-kwarg`` values,
    passed as given (they override ``optional``; they may not name a ``required`` key)."""
    cls = resolve_agent(spec)
    check_convention(cls, spec)
    options = dict(options or {})
    check_options(cls, spec, options, reserved=tuple(required))
    names, _ = constructor_params(cls)
    kwargs = {k: v for k, v in (optional or {}).items() if k in names}
    kwargs.update(options)
    kwargs.update(required)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # e.g. a required constructor argument the convention does not provide
        raise AgentSpecError(spec, f"{cls.__qualname__}(...) refused its arguments: {exc}; give missing options "
                                   "with --agent-kwarg KEY=VALUE") from None
    except ValueError as exc:  # the agent's own check of an option
        raise AgentSpecError(spec, f"{cls.__qualname__}: {exc}") from None


def make_agent(spec: str, **kwargs: Any) -> "MemoryPolicy":
    """Build an agent by its name or ``module:Class`` (see :func:`resolve_agent`); an unknown or
    broken spec raises :class:`AgentSpecError` (a ``ValueError``)."""
    return resolve_agent(spec)(**kwargs)


__all__ = ["make_agent", "AgentEntry", "AgentPluginWarning", "AgentSpecError", "BUILTIN_AGENTS", "ENTRY_POINT_GROUP", "MODEL_ARGS",
           "SCRIPTED_ARGS", "agent_names", "build_agent", "check_convention", "check_options", "check_trainable",
           "constructor_params", "registered_agents", "resolve_agent"]
