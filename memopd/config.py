"""Dataclass configs -> command-line flags and TOML files.

Every field of a config dataclass is a flag (``lr`` -> ``--lr``, ``opd_coef`` -> ``--opd-coef``);
its ``help`` metadata is the field's documentation. A ``bool`` field is a ``--x/--no-x`` pair; a
``dict`` field ``env_kwargs`` is the repeatable ``--env-kwarg KEY=VALUE`` (read by
:func:`memgym.cli.parse_kwargs`) and a table in TOML. ``--config FILE.toml`` loads values first
and flags given on the command line override them.

A config validates itself when it is made (``__post_init__``): a value of the wrong type, outside
its range or not among its choices raises :class:`ConfigError` saying what is allowed, whether
it came from a flag, a TOML file or Python code.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar, get_args, get_origin, get_type_hints

import tomli_w

from memgym.cli import CLIError, parse_kwargs
from memopd.attention import LOWERINGS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

C = TypeVar("C")

LR_SCHEDULES = ("constant", "cosine", "linear")
COMPUTE_DTYPES = ("float32", "bfloat16")
DEFAULT_THREADS = 1
THREADS_HELP = ("torch CPU threads (default 1: the first run was fastest so, on a quiet and on a busy 2-core "
                "machine, see docs/BENCHMARKS.md; 0: torch's choice, one per core, which a larger model on a quiet "
                "machine may prefer)")


class ConfigError(ValueError):
    """A config value or file is invalid; the message says which and what is allowed."""


def field(default: Any = dataclasses.MISSING, *, help: str | Callable[[], str], choices: Sequence[Any] | None = None,
          range: tuple[float | None, float | None] | None = None, default_factory: Any = dataclasses.MISSING,
          names: Callable[[], Sequence[str]] | None = None, repeat: bool = False,
          table: Callable[[dict], list] | None = None):
    """A dataclass field with documentation and optional validation metadata; ``help`` may be a
    function, called when ``--help`` is printed (e.g. to list installed plugins). ``names``: the
    names an open-ended option knows (a registry's), shown as its metavar like ``choices`` but not
    enforced (the field checks its value itself). ``repeat`` (a list field): the flag is repeated,
    one item per use (no comma split); ``table``: how a TOML table given for the list becomes its items."""
    meta = {"help": help, "choices": tuple(choices) if choices is not None else None, "range": range, "names": names,
            "repeat": repeat, "table": table}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class Config:
    """Base of the config dataclasses: every instance is validated when it is made (also by
    ``dataclasses.replace``), so a wrong value fails at once instead of silently running."""

    def __post_init__(self) -> None:
        validate(self)


@dataclass
class TrainingOptions(Config):
    """Shared with memopd.sft: env, model, seed, threads, optimiser, packing, attention, memory

    Options every trainer shares (``memopd.train`` and ``memopd.sft``): one name, one meaning,
    one set of choices."""

    env: str = field("memgym/LongQA-v0", help="memgym environment id (see memgym.list_envs())")
    env_kwargs: dict = field(default_factory=dict,
                             help="env option passed to gymnasium.make (repeatable); VALUE is read as a Python "
                                  "literal when it is one (8, 0.5, True), else kept as a string. In a TOML "
                                  "config: a table, env_kwargs = { num_chunks = 6 }")
    model: str = field("tiny", help="model to train: preset (tiny, tiny-teacher, smollm2), local model "
                                    "directory, training run directory or checkpoint, .gguf file or hub id")
    seed: int = field(0, help="random seed (sampling, data order, init)")
    threads: int = field(DEFAULT_THREADS, help=THREADS_HELP, range=(0, None))
    device: str = field("cpu", help="torch device")
    lr: float | None = field(None, help="peak learning rate (AdamW)", range=(0.0, 1.0))
    lr_schedule: str = field("constant", help="learning-rate schedule after the linear warm-up",
                             choices=LR_SCHEDULES)
    lr_floor: float = field(0.0, help="final learning rate of the cosine / linear schedule, as a fraction of "
                                      "the peak", range=(0.0, 1.0))
    warmup_steps: int = field(0, help="linear warm-up steps", range=(0, None))
    weight_decay: float = field(0.0, help="AdamW weight decay", range=(0.0, None))
    max_grad_norm: float = field(1.0, help="gradient clipping norm", range=(0.0, None))
    pack_tokens: int = field(4096, help="token budget of one packed row", range=(64, None))
    attn: str | None = field(None, help="attention lowering: sdpa, eager, blocks (CPU) or flex, flash (GPU); "
                                        "default by device", choices=LOWERINGS)
    dtype: str = field("float32", help="compute dtype of forward and backward passes: bfloat16 runs them under "
                                       "torch.autocast with the weights and optimizer state kept in fp32 (bf16 "
                                       "weights lose the small updates of fine-tuning); measured slower than "
                                       "float32 on a CPU without AMX (docs/BENCHMARKS.md)", choices=COMPUTE_DTYPES)
    gradient_checkpointing: bool | None = field(None, help="recompute each decoder layer's activations in the "
                                                           "backward pass instead of keeping them: far less memory "
                                                           "for a real model's packed rows, for more compute "
                                                           "(docs/BENCHMARKS.md); default on for a model of "
                                                           "10M parameters or more, off below (the tiny presets)")
    progress: bool = field(True, help="progress bars")


# ------------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------------

def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def kwarg_flag(name: str) -> str:
    """The flag of a dict field: ``env_kwargs`` -> ``--env-kwarg`` (one KEY=VALUE per use)."""
    return _flag(name[:-1] if name.endswith("s") else name)


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(inner type, optional?) for ``X | None``."""
    args = get_args(tp)
    if args and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return inner[0], True
    return tp, False


def _plain(tp: Any) -> Any:
    return get_origin(tp) or tp


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a table of "
               "KEY = VALUE", list: "a list"}


def _check_type(name: str, tp: Any, val: Any) -> Any:
    """``val`` as the field's type (an int is accepted for a float), or ConfigError."""
    base, optional = _base_type(tp)
    base = _plain(base)
    if val is None:
        if optional:
            return None
        raise ConfigError(f"{_flag(name)} needs a value ({_TYPE_NAMES.get(base, base)}), got none")
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str),
          dict: lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
          list: lambda v: isinstance(v, (list, tuple))}.get(base, lambda v: True)
    if not ok(val):
        raise ConfigError(f"{_flag(name)}={val!r} is {type(val).__name__}; expected {_TYPE_NAMES.get(base, base)}")
    return float(val) if base is float else val


def validate(cfg: Any) -> None:
    """Check types, choices and ranges declared on the fields (coercing an int to a float field)."""
    hints = get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        val = getattr(cfg, f.name)
        if isinstance(val, dict) and f.metadata.get("table") is not None:  # a TOML table for a list
            val = f.metadata["table"](val)
        val = _check_type(f.name, hints[f.name], val)
        object.__setattr__(cfg, f.name, val)
        if val is None:
            continue
        choices, rng = f.metadata.get("choices"), f.metadata.get("range")
        if choices is not None and val not in choices:
            raise ConfigError(f"{_flag(f.name)}={val!r} is not allowed; choose one of {list(choices)}")
        if rng is not None:
            lo, hi = rng
            if (isinstance(val, float) and math.isnan(val)) or (lo is not None and val < lo) or \
                    (hi is not None and val > hi):
                raise ConfigError(f"{_flag(f.name)}={val!r} is out of range; allowed: "
                                  f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]")


def from_dict(cls: type[C], values: dict[str, Any], source: str | None = "config") -> C:
    """``cls(**values)``, validated; errors name ``source`` (a file) when given."""
    where = f"{source}: " if source else ""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"{where}unknown option(s) {unknown}; known: {sorted(names)}")
    try:
        return cls(**values)
    except ConfigError as exc:
        raise ConfigError(f"{where}{exc}") from None


# ------------------------------------------------------------------------------------------------
# TOML
# ------------------------------------------------------------------------------------------------

def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    # keys may be written with dashes, as on the command line
    return {k.replace("-", "_"): v for k, v in data.items()}


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_toml(cfg: Any, header: Sequence[str] = ()) -> str:
    """The config as TOML (None values are left out: TOML has no null, and a missing key reads
    back as the default None). ``header`` lines are written first as comments."""
    values = {k: v for k, v in to_dict(cfg).items() if v is not None}
    for k, v in values.items():
        if isinstance(v, dict):
            nulls = sorted(key for key, x in v.items() if x is None)
            if nulls:
                raise ConfigError(f"{kwarg_flag(k)}: {nulls} = None cannot be saved in TOML (it has no null); "
                                  "leave the key out to get its default")
    text = tomli_w.dumps(values)
    return "".join(f"# {line}\n" for line in header) + text


def changed_options(cfg: Any) -> str:
    """The options of ``cfg`` that differ from its class's defaults, as flags on one line (what a
    run prints at start; every option is in its ``config.toml``)."""
    out = []
    for f in dataclasses.fields(cfg):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        value = getattr(cfg, f.name)
        if value == default or (value is False and default is None):
            continue
        if isinstance(value, bool):
            out.append(_flag(f.name) if value else "--no-" + _flag(f.name)[2:])
        elif isinstance(value, dict):
            out.extend(f"{kwarg_flag(f.name)} {k}={v!r}" for k, v in value.items())
        else:
            if isinstance(value, (list, tuple)) and f.metadata.get("repeat"):  # one flag per item
                out.extend(f"{_flag(f.name)} {v}" for v in value)
                continue
            out.append(f"{_flag(f.name)} {','.join(map(str, value)) if isinstance(value, (list, tuple)) else value}")
    return " ".join(out) or "(the defaults)"


def toml_header(path: str | Path) -> list[str]:
    """The leading comment lines of a TOML file (without ``# ``), e.g. a run's resume history."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        if not line.startswith("#"):
            break
        out.append(line[1:].strip())
    return out


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` via a temporary sibling and a rename: a kill leaves the old file
    or the new one, never half of one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_toml(cfg: Any, path: str | Path, header: Sequence[str] = ()) -> Path:
    """Write ``cfg`` as TOML atomically."""
    return write_text_atomic(path, dump_toml(cfg, header))


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------

def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None if f.default is dataclasses.MISSING else f.default


def _owner(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO that declares field ``name`` (the most derived one): its slice."""
    for klass in cls.__mro__:
        if name in vars(klass).get("__annotations__", {}):
            return klass
    return cls


class OptionParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line (``error: ...``, with the closest flag for
    a mistyped one) instead of the whole usage, and whose ``--help`` is short when the config
    names its common options (``COMMON_OPTIONS``); ``--help-all`` prints every option's help."""

    def __init__(self, *args: Any, common: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, add_help=False, **kwargs)
        self.common = tuple(common)
        self.add_argument("-h", "--help", action="store_true", default=argparse.SUPPRESS,
                          help="the common options, and every option group's flags" if self.common
                          else "show this help and exit")
        if self.common:
            self.add_argument("--help-all", action="store_true", default=argparse.SUPPRESS,
                              help="every option with its help")

    def error(self, message: str) -> Any:  # type: ignore[override]
        """One line on stderr and exit 2 (argparse's code), the closest flag named for a mistyped one."""
        if message.startswith("unrecognized arguments: "):
            known = [o for a in self._actions for o in a.option_strings]
            hints = [f"{close[0]} for {flag}" for flag in message.split(": ", 1)[1].split() if flag.startswith("-")
                     for close in [difflib.get_close_matches(flag.split("=")[0], known, n=1, cutoff=0.6)] if close]
            if hints:
                message += f" (did you mean {', '.join(hints)}?)"
        self.exit(2, f"error: {message}; {self.prog} --help lists the options\n")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:
        ns = super().parse_args(args, namespace)
        if getattr(ns, "help_all", False):
            self.print_help()
            self.exit()
        if getattr(ns, "help", False):
            print(self.short_help() if self.common else self.format_help(), end="")
            self.exit()
        return ns

    def short_help(self) -> str:
        """The description's first paragraph, the common options with their help, and every other
        group's flags by name."""
        intro = (self.description or "").strip().split("\n\n")[0]
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, [a for a in self._actions if a.dest in self.common], [])
        formatter.add_text(intro)
        formatter.start_section("Common options")
        formatter.add_arguments([a for a in self._actions if a.dest in self.common or a.dest in ("help", "help_all")])
        formatter.end_section()
        out = [formatter.format_help()]
        out.append(f"\nEvery option, by group ({self.prog} --help-all gives each one's help):\n")
        for group in self._action_groups:
            flags = [a.option_strings[0] for a in group._group_actions if a.dest not in ("help", "help_all")]
            if flags:
                title = "Configuration file" if group.title in ("options", "optional arguments") else group.title
                out.append(textwrap.fill(" ".join(flags), width=100, initial_indent="    ", subsequent_indent="    ",
                                         break_on_hyphens=False).join([f"  {title}:\n", "\n"]))
        return "".join(out)


def build_parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    """One flag per field, grouped by the config slice (base dataclass) that declares it, under the
    first line of that slice's docstring; each help line says the default once and the choices of
    an enumerated option (as its metavar). A config with ``COMMON_OPTIONS`` gets a short ``--help``
    (those options, and every group's flags by name) and ``--help-all``."""
    parser = OptionParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                          common=getattr(cls, "COMMON_OPTIONS", ()))
    parser.add_argument("--config", metavar="FILE.toml",
                        help="read options from a TOML file (keys as the flags, e.g. opd_coef = 0.5); "
                             "flags given here override it")
    hints = get_type_hints(cls)
    groups: dict[type, Any] = {}
    for f in dataclasses.fields(cls):
        owner = _owner(cls, f.name)
        if owner not in groups:
            title = (owner.__doc__ or owner.__name__).strip().splitlines()[0] if owner is not cls else "options"
            groups[owner] = parser.add_argument_group(title.rstrip("."))
        group = groups[owner]
        base = _plain(_base_type(hints[f.name])[0])
        default, choices = _default(f), f.metadata.get("choices")
        if choices is None and f.metadata.get("names") is not None:
            choices = f.metadata["names"]()
        text = f.metadata.get("help", "")
        text = text() if callable(text) else text  # help that lists what is installed: made when asked
        if base is bool:
            text += f" (default: {_flag(f.name) if default else '--no-' + _flag(f.name)[2:]})"
            group.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=text.replace("%", "%%"))
        elif base is dict:
            group.add_argument(kwarg_flag(f.name), dest=f.name, action="append", metavar="KEY=VALUE",
                                default=argparse.SUPPRESS, help=text.replace("%", "%%"))
        elif base is list and f.metadata.get("repeat"):
            group.add_argument(_flag(f.name), dest=f.name, action="append", metavar=f.name.upper(),
                                default=argparse.SUPPRESS, help=text.replace("%", "%%"))
        else:
            if default is not None and "default" not in text:  # said once, by the help itself if it does
                text += f" (default: {default})"
            metavar = "{" + ",".join(map(str, choices)) + "}" if choices else f.name.upper()
            group.add_argument(_flag(f.name), dest=f.name, default=argparse.SUPPRESS, metavar=metavar,
                                help=text.replace("%", "%%"))
    return parser


def _parse_value(tp: Any, raw: str) -> Any:
    base, optional = _base_type(tp)
    base = _plain(base)
    if optional and raw.lower() in ("none", "null", ""):
        return None
    if base is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"expected an integer, got {raw!r}") from None
    if base is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"expected a number, got {raw!r}") from None
    if base is list:
        return [s for s in raw.split(",") if s]
    return raw


def parse_known(cls: type[C], argv: Sequence[str] | None, prog: str, description: str) -> tuple[C, set[str]]:
    """Parse ``argv`` into a validated ``cls`` (TOML file first, then flags) and the names of the
    options that were given (by flag or in the TOML file).

    Raises :class:`ConfigError` for a bad value; argparse exits with 2 for unknown flags."""
    parser = build_parser(cls, prog, description)
    ns = vars(parser.parse_args(argv))
    hints = get_type_hints(cls)
    path = ns.pop("config", None)
    values: dict[str, Any] = {}
    if path:
        values = load_toml(path)
        from_dict(cls, values, source=str(path))  # a bad value is reported with its file
    given = set(ns) | set(values)
    for name, raw in ns.items():
        base = _plain(_base_type(hints[name])[0])
        if base is bool or (base is list and isinstance(raw, list)):  # a repeated flag: one item per use
            values[name] = raw
        elif base is dict:
            try:
                extra = parse_kwargs(raw, flag=kwarg_flag(name))
            except CLIError as exc:
                raise ConfigError(str(exc)) from None
            values[name] = {**(values.get(name) or {}), **extra}  # per key, flags override the file
        else:
            try:
                values[name] = _parse_value(hints[name], raw)
            except ValueError as exc:
                raise ConfigError(f"{_flag(name)}: {exc}") from None
    return from_dict(cls, values, source=None), given


def parse_args(cls: type[C], argv: Sequence[str] | None, prog: str, description: str) -> C:
    """:func:`parse_known` without the given names."""
    return parse_known(cls, argv, prog, description)[0]
