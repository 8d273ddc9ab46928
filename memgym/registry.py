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
    # splits = ["train", "test"]   # splits a generated task accepts (this is the default)
    [train]                    # recommended memopd.train settings for this task (e.g.
    student_warmup_steps = 300 # a longer warm start); a flag given on the command line wins

(TOML cannot hold both ``source = "..."`` and a ``[source]`` table, hence ``[source_kwargs]``.)

Folders are scanned in this order: the built-in tasks (``memgym/builtin_tasks`` in an installed
wheel, the repository's ``tasks/`` in a source checkout), then ``./tasks``, then every directory
of ``$MEMGYM_TASKS`` (``os.pathsep``-separated) in order. A later folder giving an id already
given shadows the earlier one, with one :class:`TaskShadowedWarning` naming both folders.
``import memgym`` registers all of them.

A task folder is code, like any plugin: its ``generator.py`` runs when its env is made. Relative
``source`` and ``data`` paths must stay inside the folder; an absolute path or an importable
module is an explicit choice and is followed.

Sizing protocol: a ``make_source`` that names any of the parameters ``chunk_size``,
``num_chunks``, ``context_length``, ``counter``, ``numbering`` or ``memory_budget`` receives the
environment's values for them, so it can size its input (LongQA plans its documents to fill
exactly ``num_chunks`` chunks, with the document labels ``numbering`` gives) or state the budget
in its question (the memory tasks).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.resources
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
from memgym.errors import TaskConfigError, TaskShadowedWarning, UnknownEnvError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

NAMESPACE = "memgym"
ENTRY_POINT = "memgym.env:MemoryQAEnv"
SIZING_KWARGS = ("chunk_size", "num_chunks", "context_length", "counter", "numbering", "memory_budget")
# The one list of environment settings: name -> (default, types a task.toml [env] table may
# give). A task's [env] table overrides the defaults, make kwargs override both; every other
# make kwarg goes to the task's make_source. ``env.ENV_DEFAULTS`` and ``ENV_KEYS`` derive from it.
ENV_SETTINGS: dict[str, tuple[Any, tuple[type, ...]]] = {
    "split": ("train", (str,)),
    "chunk_size": (256, (int,)),
    "num_chunks": (None, (int,)),
    "context_length": (None, (int,)),
    "memory_budget": (64, (int,)),
    "tokenizer": (None, (str,)),
    "scorer": ("f1", (str,)),
    "max_text_length": (1 << 20, (int,)),
    "hotpot_rules": (False, (bool,)),
    "data_seed": (0, (int,)),
    "numbering": ("sequential", (str,)),
}
# Keys allowed in a task.toml [env] table, with their expected types.
ENV_KEYS: dict[str, tuple[type, ...]] = {key: types for key, (_, types) in ENV_SETTINGS.items()}
# Splits a generated task accepts unless its task.toml says otherwise (``splits = [...]``).
DEFAULT_SPLITS = ("train", "test")
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
    splits: tuple[str, ...] = DEFAULT_SPLITS  # the splits a generated task accepts
    train: dict[str, Any] = field(default_factory=dict)  # recommended training settings (memopd.train reads them)

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
        where = f"{self.config_path}: key 'source'"
        if target.endswith(".py"):
            file = (self.folder / target).resolve()
            module = _load_file_module(str(file), f"{self.name}_v{self.version}", where)
        else:
            try:
                module = importlib.import_module(target)
            except ImportError as exc:
                if exc.name is not None and (target == exc.name or target.startswith(exc.name + ".")):
                    raise TaskConfigError(f"{where}: cannot import {target!r} for {self.source!r} (no module named "
                                          f"{exc.name!r}); fix the module name, install the package that provides "
                                          "it, or give a generator file in the task folder "
                                          "('generator.py:make_source')") from None
                raise TaskConfigError(f"{where}: importing module {target!r} failed: {_error_line(exc)}; fix the "
                                      f"module or install what it needs") from None
            except Exception as exc:  # noqa: BLE001 - the module is plugin code: any failure is reported
                raise TaskConfigError(f"{where}: importing module {target!r} failed: {_error_line(exc)}") from None
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise TaskConfigError(f"{where}: {target} has no callable {attr!r}")
        return factory

    def check_split(self, split: Any) -> None:
        """Raise ``ValueError`` for a split the task does not have (before any code of it runs)."""
        if not isinstance(split, str):
            raise TypeError(f"split must be a string such as 'train' or 'test', got {split!r}")
        known = self.splits if self.source is not None else tuple(sorted(self.data))
        if "*" not in known and split not in known:
            where = "splits" if self.source is not None else "[data]"
            raise ValueError(f"task {self.name} has no split {split!r}; its splits are {list(known)} "
                             f"(see {where} in {self.config_path})")

    def make_source(self, split: str, seed: int = 0, **kwargs: Any) -> SampleSource:
        """The task's samples for ``split``; sizing kwargs reach only sources that name them."""
        self.check_split(split)
        if self.source is None:
            if kwargs:
                raise TypeError(f"task {self.name} reads its samples from data files; it takes no source "
                                f"options, got {sorted(kwargs)}")
            return self._data_source(split)
        factory = self.source_factory()
        params = _parameters(factory)
        for name in SIZING_KWARGS:
            if name not in params:
                kwargs.pop(name, None)
        self._check_callable(factory, split, seed)
        source = factory(split, seed, **kwargs)
        if not all(hasattr(source, a) for a in ("__len__", "__getitem__", "index_of")):
            raise TaskConfigError(f"{self.config_path}: key 'source': {self.source} returned "
                                  f"{type(source).__name__} {source!r:.60}, not a sample source; make_source must "
                                  "return a memgym.ListSource (or anything with __len__, __getitem__ and index_of)")
        return source

    def _check_callable(self, factory: Callable[..., Any], split: str, seed: int) -> None:
        """A source that cannot be called as ``make_source(split, seed)`` is a wrong ``source`` key,
        said so before the call fails inside it."""
        try:
            signature = inspect.signature(factory)
        except (TypeError, ValueError):
            return  # no signature to read (some builtins): the call itself will tell
        try:
            signature.bind_partial(split, seed)
        except TypeError as exc:
            raise TaskConfigError(f"{self.config_path}: key 'source': {self.source} cannot be called as "
                                  f"make_source(split, seed, **options) ({exc}); name a function with that "
                                  "signature") from None

    def fingerprint(self) -> str:
        """A digest of the folder's files (names and contents; files over 16 MiB by size and
        modification time), so caches built from a task (e.g. a trained teacher) notice an edit."""
        h = hashlib.sha256()
        for path in sorted(p for p in self.folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            st = path.stat()
            size, data = st.st_size, path.read_bytes() if st.st_size <= 16 << 20 else str(st.st_mtime_ns).encode()
            if path == self.config_path and self.train:
                data = _without_train(data)
                size = len(data)
            h.update(f"{path.relative_to(self.folder).as_posix()}\0{size}\0".encode())
            h.update(data)
        return h.hexdigest()[:16]

    def accepts(self, name: str) -> bool:
        """Whether the task's source takes the sizing kwarg ``name``."""
        return self.source is not None and name in _parameters(self.source_factory())

    def _data_source(self, split: str) -> SampleSource:
        file = self.data[split] if split in self.data else self.data["*"]  # check_split ran
        path = (self.folder / file).resolve()
        return _load_jsonl(str(path), path.stat().st_mtime_ns if path.exists() else 0)


def _without_train(toml_bytes: bytes) -> bytes:
    """A task.toml's text without its ``[train]`` table: the recommended training settings do not
    change the task's samples, so a teacher built from the task is still valid when they change (a
    task.toml without the table hashes as it always did)."""
    kept, skipping = [], False
    for line in toml_bytes.decode("utf-8").splitlines(keepends=True):
        header = re.match(r"^\s*\[([^\[\]]+)\]\s*(#.*)?$", line)
        if header:
            skipping = header.group(1).strip() == "train"
            while skipping and kept and not kept[-1].strip():  # the blank lines that set the table apart
                kept.pop()
        if not skipping:
            kept.append(line)
    return "".join(kept).encode("utf-8")


def _parameters(factory: Callable[..., Any]) -> Any:
    """The parameters of ``factory`` by name (none when it has no readable signature)."""
    try:
        return inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}


@lru_cache(maxsize=64)
def _load_jsonl(path: str, mtime_ns: int) -> JsonlSource:
    """Parsed once per file version: every env of a task shares it (e.g. make_vec copies)."""
    return JsonlSource(Path(path))


@lru_cache(maxsize=None)
def _load_file_module(path: str, name: str, where: str = "") -> Any:
    """Import a task's generator file; a failure is a :class:`TaskConfigError` naming the file
    and the line that raised (``where`` names the task.toml key that points at it)."""
    module_name = f"memgym_tasks.{name}"
    prefix = f"{where}: " if where else ""
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise TaskConfigError(f"{prefix}cannot import generator file {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - a generator file is plugin code: any failure is reported
        sys.modules.pop(module_name, None)
        raise TaskConfigError(f"{prefix}importing {path}{_line_in(exc, path)} failed: {_error_line(exc)}; fix "
                              f"{os.path.basename(path)}") from None
    return module


def _error_line(exc: BaseException) -> str:
    """``Type: message`` of an exception, on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _line_in(exc: BaseException, path: str) -> str:
    """``, line N`` of ``path`` where ``exc`` was raised (its innermost frame in that file)."""
    if isinstance(exc, SyntaxError) and exc.filename == path and exc.lineno:
        return f", line {exc.lineno}"
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    return f", line {line}" if line else ""


def _expect(ok: bool, path: Path, key: str, msg: str) -> None:
    if not ok:
        raise TaskConfigError(f"{path}: key '{key}': {msg}")


def _expect_inside(file: str, path: Path, key: str) -> None:
    """A relative path in a task.toml may not climb out of its folder; an absolute one is explicit."""
    if os.path.isabs(file):
        return
    parts = Path(os.path.normpath(file)).parts
    _expect(not parts or parts[0] != os.pardir, path, key,
            f"{file!r} climbs out of the task folder; move the file into the folder, or give an absolute "
            f"path (or an importable 'package.module:function') to use a file elsewhere on purpose")


def _not_found(file: str, folder: Path) -> str:
    """What to say of a ``source`` / ``data`` file that is not there."""
    if os.path.isabs(file):
        return (f"file {file!r} not found (an absolute path is used as given); fix the path, or put the file "
                "in the task folder and give its name relative to the folder")
    return f"file {file!r} not found in {folder}"


def _load_splits(raw: dict[str, Any], path: Path, generated: bool) -> tuple[str, ...]:
    if "splits" not in raw:
        return DEFAULT_SPLITS
    splits = raw["splits"]
    _expect(generated, path, "splits", "only a generated task ('source') takes 'splits'; a data task's "
            "splits are the keys of its [data] table")
    _expect(isinstance(splits, list) and bool(splits) and all(isinstance(x, str) and x for x in splits), path,
            "splits", f"must be a non-empty list of split names such as [\"train\", \"test\"], got {splits!r}")
    return tuple(splits)


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
    except UnicodeDecodeError:
        raise TaskConfigError(f"{path}: not UTF-8 text; a task.toml is a UTF-8 TOML file") from None
    except OSError as exc:
        raise TaskConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    allowed = {"name", "version", "description", "source", "data", "env", "source_kwargs", "splits", "train"}
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
            _expect_inside(file, path, "source")
            _expect((folder / file).is_file(), path, "source", _not_found(file, folder))
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
        _expect_inside(file, path, key)
        _expect((folder / file).is_file(), path, key, _not_found(file, folder))
    splits = _load_splits(raw, path, source is not None)
    env = raw.get("env", {})
    _expect(isinstance(env, dict), path, "env", "must be a table [env]")
    for key, value in env.items():
        _expect(key in ENV_KEYS, path, f"env.{key}", f"unknown env setting; known: {sorted(ENV_KEYS)}")
        types = ENV_KEYS[key]
        _expect(isinstance(value, types) and (bool not in types or isinstance(value, bool))
                and not (isinstance(value, bool) and bool not in types), path, f"env.{key}",
                f"must be {' or '.join(t.__name__ for t in types)}, got {value!r}")
    train = raw.get("train", {})
    _expect(isinstance(train, dict), path, "train", "must be a table [train] of memopd.train settings")
    for key, value in train.items():
        _expect(isinstance(value, (bool, int, float, str)), path, f"train.{key}",
                f"must be a number, a string or a boolean (a memopd.train option's value), got {value!r}")
    return TaskSpec(name=name, version=version, folder=folder.resolve(), description=description, source=source,
                    data=data_files, env=dict(env), source_kwargs=source_kwargs, splits=splits, train=dict(train))


def builtin_tasks_dir() -> Path:
    """The built-in task folders: shipped inside the installed package (a wheel puts the
    repository's ``tasks/`` at ``memgym/builtin_tasks``), else a source checkout's ``tasks/``."""
    shipped = importlib.resources.files(__package__).joinpath("builtin_tasks")
    if isinstance(shipped, Path) and shipped.is_dir():
        return shipped
    return Path(__file__).resolve().parent.parent / "tasks"


def search_path() -> list[Path]:
    """Directories scanned for task folders, in order: built-in, ``./tasks``, ``$MEMGYM_TASKS``.

    A later directory shadows an earlier one for an id both give; a directory listed twice is
    scanned once, at its first place."""
    dirs = [builtin_tasks_dir(), Path.cwd() / "tasks"]
    dirs += [Path(p) for p in os.environ.get("MEMGYM_TASKS", "").split(os.pathsep) if p]
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
# (id, shadowed folder, shadowing folder) already warned about: each is said once.
_SHADOWS_WARNED: set[tuple[str, Path, Path]] = set()


def _warn_shadow(task_id: str, earlier: Path, later: Path) -> None:
    if (task_id, earlier, later) in _SHADOWS_WARNED:
        return
    _SHADOWS_WARNED.add((task_id, earlier, later))
    warnings.warn(f"memgym: task folder {later} shadows {earlier}: {task_id} now runs the task in {later} "
                  f"(rename its 'name' or remove the folder to use {earlier})", TaskShadowedWarning, stacklevel=3)


def discover_tasks(dirs: list[Path] | None = None) -> tuple[dict[str, TaskSpec], dict[str, str]]:
    """Find every task folder; returns ``(specs by id, errors by folder)``.

    Directories are scanned in order and a later folder shadows an earlier one for the same id,
    with one :class:`TaskShadowedWarning` naming both folders."""
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
            if spec.id in specs and specs[spec.id].folder != spec.folder:
                _warn_shadow(spec.id, specs[spec.id].folder, spec.folder)
            specs[spec.id] = spec
    return specs, errors


def register_tasks(dirs: list[str | Path] | None = None) -> list[str]:
    """(Re)scan task folders and register each as a Gymnasium env; returns the new ids.

    Folders that fail validation are skipped with a warning (their error is kept and shown
    when their id is requested), so one broken task does not break ``import memgym``. A
    folder giving an id already registered from another folder replaces it, with one
    :class:`TaskShadowedWarning` naming both folders.
    """
    import gymnasium as gym

    specs, errors = discover_tasks(None if dirs is None else [Path(d) for d in dirs])
    for folder, msg in errors.items():
        if folder not in BROKEN:
            warnings.warn(f"memgym: skipping task folder: {msg}", stacklevel=2)
    BROKEN.update(errors)
    new = []
    for task_id, spec in specs.items():
        old = TASKS.get(task_id)
        if old is not None and old.folder == spec.folder:
            continue
        if old is not None:
            _warn_shadow(task_id, old.folder, spec.folder)
            gym.registry.pop(task_id, None)  # replaced on purpose: no gymnasium "overriding" warning
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
