"""Task folders: discovery, ``task.toml`` validation, sample sources and Gymnasium registration.

A task is a folder holding a ``task.toml``::

    name = "MyTask"            # registered as memgym/MyTask-v0
    version = 0
    description = "..."
    data = "data.jsonl"        # one JSONL file for every split, or
    # [data]  train = "train.jsonl"  test = "test.jsonl"
    # source = "generator.py:make_source"   # instead of data: a generator in the folder,
    #                                       # or "package.module:make_source"
    [env]                      # default gymnasium.make kwargs
    chunk_size = 128
    [source_kwargs]            # default kwargs for make_source (generated tasks)
    hops = 1

(TOML cannot hold both ``source = "..."`` and a ``[source]`` table, hence ``[source_kwargs]``.)

Folders are searched in every directory of ``$MEMGYM_TASKS`` (``os.pathsep``-separated), then
``./tasks``, then the ``tasks/`` folder next to the memgym package; the first folder giving an
id wins. ``import memgym`` registers all of them.

Sizing protocol: a ``make_source`` that names any of the parameters ``chunk_size``,
``num_chunks``, ``context_length`` or ``counter`` receives the environment's values for them,
so it can size its input (LongQA plans its documents to fill exactly ``num_chunks`` chunks).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Protocol

from memgym.data import Sample, load_jsonl_samples
from memgym.errors import TaskConfigError, UnknownEnvError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

NAMESPACE = "memgym"
ENTRY_POINT = "memgym.env:MemoryQAEnv"
SIZING_KWARGS = ("chunk_size", "num_chunks", "context_length", "counter")
# Keys allowed in a task.toml [env] table, with their expected types.
ENV_KEYS: dict[str, tuple[type, ...]] = {
    "split": (str,), "chunk_size": (int,), "num_chunks": (int,), "context_length": (int,),
    "memory_budget": (int,), "tokenizer": (str,), "scorer": (str,), "max_text_length": (int,),
    "hotpot_rules": (bool,),
}
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


class SampleSource(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Sample: ...

    def index_of(self, sample_id: str) -> int: ...


class ListSource:
    """A ``SampleSource`` over a list of samples (handy in a task's ``generator.py``)."""

    def __init__(self, samples: list[Sample], origin: str = "the source"):
        self.samples = list(samples)
        self.origin = origin
        self._index = {s.id: i for i, s in enumerate(self.samples)}
        if len(self._index) != len(self.samples):
            raise ValueError(f"duplicate sample ids in {origin}")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        return self.samples[index]

    def index_of(self, sample_id: str) -> int:
        if sample_id not in self._index:
            raise KeyError(f"no sample with id {sample_id!r} in {self.origin}")
        return self._index[sample_id]


class JsonlSource(ListSource):
    """Samples loaded (and validated) from a JSONL file."""

    def __init__(self, path: Path):
        super().__init__(load_jsonl_samples(path), str(path))
        self.path = path


@dataclass(frozen=True)
class TaskSpec:
    """A validated task folder."""

    name: str
    version: int
    folder: Path
    description: str = ""
    source: str | None = None  # "package.module:function" or "file.py:function"
    data: dict[str, str] = field(default_factory=dict)  # split -> file ("*" = every split)
    env: dict[str, Any] = field(default_factory=dict)
    source_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{NAMESPACE}/{self.name}-v{self.version}"

    @property
    def config_path(self) -> Path:
        return self.folder / "task.toml"

    def source_factory(self) -> Callable[..., SampleSource]:
        """The ``make_source`` callable of a generated task."""
        assert self.source is not None
        target, _, attr = self.source.rpartition(":")
        if target.endswith(".py"):
            module = _load_file_module(str((self.folder / target).resolve()), f"{self.name}_v{self.version}")
        else:
            module = importlib.import_module(target)
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise TaskConfigError(f"{self.config_path}: key 'source': {target} has no callable {attr!r}")
        return factory

    def make_source(self, split: str, seed: int = 0, **kwargs: Any) -> SampleSource:
        """The task's samples for ``split``; sizing kwargs reach only sources that name them."""
        if self.source is None:
            if kwargs:
                raise TypeError(f"task {self.name} reads its samples from data files; it takes no source "
                                f"options, got {sorted(kwargs)}")
            return self._data_source(split)
        factory = self.source_factory()
        params = inspect.signature(factory).parameters
        for name in SIZING_KWARGS:
            if name not in params:
                kwargs.pop(name, None)
        return factory(split, seed, **kwargs)

    def accepts(self, name: str) -> bool:
        """Whether the task's source takes the sizing kwarg ``name``."""
        return self.source is not None and name in inspect.signature(self.source_factory()).parameters

    def _data_source(self, split: str) -> SampleSource:
        file = self.data.get(split, self.data.get("*"))
        if file is None:
            raise ValueError(f"task {self.name} has no split {split!r}; its splits are {sorted(self.data)} "
                             f"(see [data] in {self.config_path})")
        path = (self.folder / file).resolve()
        return _load_jsonl(str(path), path.stat().st_mtime_ns if path.exists() else 0)


@lru_cache(maxsize=64)
def _load_jsonl(path: str, mtime_ns: int) -> JsonlSource:
    """Parsed once per file version: every env of a task shares it (e.g. make_vec copies)."""
    return JsonlSource(Path(path))


@lru_cache(maxsize=None)
def _load_file_module(path: str, name: str) -> Any:
    module_name = f"memgym_tasks.{name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise TaskConfigError(f"cannot import generator file {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def _expect(ok: bool, path: Path, key: str, msg: str) -> None:
    if not ok:
        raise TaskConfigError(f"{path}: key '{key}': {msg}")


def load_task(folder: str | Path) -> TaskSpec:
    """Read and validate ``folder/task.toml``; raises :class:`TaskConfigError` naming file and key."""
    folder = Path(folder)
    path = folder / "task.toml"
    if not path.is_file():
        raise TaskConfigError(f"{path}: not found (a task folder needs a task.toml)")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise TaskConfigError(f"{path}: invalid TOML: {exc}") from None
    allowed = {"name", "version", "description", "source", "data", "env", "source_kwargs"}
    for key in raw:
        _expect(key in allowed, path, key, f"unknown key; allowed keys are {sorted(allowed)}")
    name = raw.get("name")
    _expect(isinstance(name, str) and bool(_NAME_RE.match(name)), path, "name",
            f"must be a name of letters, digits and '_' starting with a letter, got {name!r}")
    version = raw.get("version", 0)
    _expect(isinstance(version, int) and not isinstance(version, bool) and version >= 0, path, "version",
            f"must be an integer >= 0, got {version!r}")
    description = raw.get("description", "")
    _expect(isinstance(description, str), path, "description", "must be a string")
    source = raw.get("source")
    if source is not None:
        _expect(isinstance(source, str) and bool(re.match(r"^[\w./-]+:\w+$", source)), path, "source",
                f"must be a string like 'package.module:make_source' or 'generator.py:make_source', got {source!r}"
                " (default kwargs for it go in a [source_kwargs] table)")
        file = source.split(":")[0]
        if file.endswith(".py"):
            _expect((folder / file).is_file(), path, "source", f"file {file!r} not found in {folder}")
    source_kwargs = raw.get("source_kwargs", {})
    _expect(isinstance(source_kwargs, dict), path, "source_kwargs", "must be a table [source_kwargs]")
    data = raw.get("data")
    data_files: dict[str, str] = {}
    if isinstance(data, str):
        data_files = {"*": data}
    elif isinstance(data, dict):
        for split, file in data.items():
            _expect(isinstance(file, str), path, f"data.{split}", f"must be a file name string, got {file!r}")
        data_files = dict(data)
    elif data is not None:
        _expect(False, path, "data", "must be a file name or a table of split = file")
    _expect((source is None) != (not data_files), path, "source" if source else "data",
            "give exactly one of 'source' (a generator) or 'data' (JSONL files)")
    for split, file in data_files.items():
        key = "data" if split == "*" else f"data.{split}"
        _expect((folder / file).is_file(), path, key, f"file {file!r} not found in {folder}")
    env = raw.get("env", {})
    _expect(isinstance(env, dict), path, "env", "must be a table [env]")
    for key, value in env.items():
        _expect(key in ENV_KEYS, path, f"env.{key}", f"unknown env setting; known: {sorted(ENV_KEYS)}")
        types = ENV_KEYS[key]
        _expect(isinstance(value, types) and (bool not in types or isinstance(value, bool))
                and not (isinstance(value, bool) and bool not in types), path, f"env.{key}",
                f"must be {' or '.join(t.__name__ for t in types)}, got {value!r}")
    return TaskSpec(name=name, version=version, folder=folder.resolve(), description=description, source=source,
                    data=data_files, env=dict(env), source_kwargs=source_kwargs)


def search_path() -> list[Path]:
    """Directories searched for task folders, in priority order."""
    dirs = [Path(p) for p in os.environ.get("MEMGYM_TASKS", "").split(os.pathsep) if p]
    dirs += [Path.cwd() / "tasks", Path(__file__).resolve().parent.parent / "tasks"]
    seen, out = set(), []
    for d in dirs:
        key = d.resolve() if d.exists() else d
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


# Registered tasks (id -> spec) and folders that failed to load (path -> error message).
TASKS: dict[str, TaskSpec] = {}
BROKEN: dict[str, str] = {}


def discover_tasks(dirs: list[Path] | None = None) -> tuple[dict[str, TaskSpec], dict[str, str]]:
    """Find every task folder; returns ``(specs by id, errors by folder)``."""
    specs: dict[str, TaskSpec] = {}
    errors: dict[str, str] = {}
    for d in search_path() if dirs is None else dirs:
        if not d.is_dir():
            continue
        for folder in sorted(p for p in d.iterdir() if (p / "task.toml").is_file()):
            try:
                spec = load_task(folder)
            except TaskConfigError as exc:
                errors[str(folder)] = str(exc)
                continue
            specs.setdefault(spec.id, spec)  # earlier directories win
    return specs, errors


def register_tasks(dirs: list[str | Path] | None = None) -> list[str]:
    """(Re)scan task folders and register each as a Gymnasium env; returns the new ids.

    Folders that fail validation are skipped with a warning (their error is kept and shown
    when their id is requested), so one broken task does not break ``import memgym``.
    """
    import gymnasium as gym

    specs, errors = discover_tasks(None if dirs is None else [Path(d) for d in dirs])
    for folder, msg in errors.items():
        if folder not in BROKEN:
            warnings.warn(f"memgym: skipping task folder: {msg}", stacklevel=2)
    BROKEN.update(errors)
    new = []
    for task_id, spec in specs.items():
        if task_id in TASKS and TASKS[task_id].folder == spec.folder:
            continue
        if task_id in TASKS:  # an earlier scan already registered this id from another folder
            continue
        TASKS[task_id] = spec
        gym.register(id=task_id, entry_point=ENTRY_POINT, kwargs={"task_dir": str(spec.folder)})
        new.append(task_id)
    return new


def list_envs() -> list[str]:
    """Sorted ids of every registered memgym env."""
    return sorted(TASKS)


def resolve_id(env_id: str) -> str:
    """Normalise ``LongQA``, ``LongQA-v0``, ``memgym/LongQA-v0`` or ``memgym:memgym/LongQA-v0``.

    Raises :class:`UnknownEnvError` listing the available ids (and broken task folders).
    """
    if not isinstance(env_id, str):
        raise TypeError(f"env id must be a string like 'memgym/LongQA-v0', got {type(env_id).__name__}")
    name = env_id.split(":", 1)[1] if env_id.startswith(f"{NAMESPACE}:") else env_id
    if not name.startswith(f"{NAMESPACE}/"):
        name = f"{NAMESPACE}/{name}"
    if not re.search(r"-v\d+$", name):
        versions = sorted((s.version, i) for i, s in TASKS.items() if i.rsplit("-v", 1)[0] == name)
        if versions:
            name = versions[-1][1]
    if name in TASKS:
        return name
    msg = f"unknown memgym env {env_id!r}. Available: {', '.join(list_envs()) or '(none)'}"
    if BROKEN:
        msg += ". Task folders that failed to load: " + "; ".join(BROKEN.values())
    raise UnknownEnvError(msg)


def get_task(env_id: str) -> TaskSpec:
    return TASKS[resolve_id(env_id)]
