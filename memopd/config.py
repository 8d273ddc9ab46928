"""Dataclass configs -> command-line flags and TOML files.

Every field of a config dataclass is a flag (``lr`` -> ``--lr``, ``opd_coef`` -> ``--opd-coef``);
its ``help`` metadata is the field's documentation. ``--config FILE.toml`` loads values first and
flags given on the command line override them. Out-of-range values are refused with the range.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Sequence, TypeVar, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

C = TypeVar("C")


class ConfigError(ValueError):
    """A config value or file is invalid; the message says which and what is allowed."""


def field(default: Any = dataclasses.MISSING, *, help: str, choices: Sequence[Any] | None = None,
          range: tuple[float | None, float | None] | None = None, default_factory: Any = dataclasses.MISSING):
    """A dataclass field with documentation and optional validation metadata."""
    meta = {"help": help, "choices": choices, "range": range}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(inner type, optional?) for ``X | None``."""
    args = get_args(tp)
    if args and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return inner[0], True
    return tp, False


def _parse_value(tp: Any, raw: str) -> Any:
    base, optional = _base_type(tp)
    if optional and raw.lower() in ("none", "null", ""):
        return None
    if base is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true/false, got {raw!r}")
    if base in (int, float, str):
        return base(raw)
    if get_origin(base) is dict or base is dict:
        return json.loads(raw)
    if get_origin(base) is list or base is list:
        return [s for s in raw.split(",") if s]
    return raw


def validate(cfg: Any) -> None:
    """Check choices and ranges declared in field metadata."""
    for f in dataclasses.fields(cfg):
        val = getattr(cfg, f.name)
        choices, rng = f.metadata.get("choices"), f.metadata.get("range")
        if val is None:
            continue
        if choices is not None and val not in choices:
            raise ConfigError(f"{_flag(f.name)}={val!r} is not allowed; choose one of {list(choices)}")
        if rng is not None:
            lo, hi = rng
            if (lo is not None and val < lo) or (hi is not None and val > hi):
                raise ConfigError(f"{_flag(f.name)}={val!r} is out of range; allowed: "
                                  f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]")


def from_dict(cls: type[C], values: dict[str, Any], source: str = "config") -> C:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"{source}: unknown option(s) {unknown}; known: {sorted(names)}")
    cfg = cls(**values)
    validate(cfg)
    return cfg


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


def build_parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", metavar="FILE.toml", help="read options from a TOML file; flags override it")
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        parser.add_argument(_flag(f.name), dest=f.name, default=argparse.SUPPRESS, metavar=f.name.upper(),
                            help=f"{f.metadata.get('help', '')} (default: {default!r})".replace("%", "%%"))
    parser.set_defaults(_hints=hints)
    return parser


def parse_args(cls: type[C], argv: Sequence[str] | None, prog: str, description: str) -> C:
    """Parse ``argv`` into a validated ``cls`` instance (TOML file first, then flags)."""
    parser = build_parser(cls, prog, description)
    ns = vars(parser.parse_args(argv))
    hints = ns.pop("_hints")
    values: dict[str, Any] = load_toml(ns.pop("config")) if ns.get("config") else {}
    ns.pop("config", None)
    for name, raw in ns.items():
        try:
            values[name] = _parse_value(hints[name], raw)
        except (ValueError, json.JSONDecodeError) as exc:
            parser.error(f"{_flag(name)}: {exc}")
    try:
        return from_dict(cls, values, source="options")
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_toml(cfg: Any) -> str:
    """Write a config as TOML (flat keys; None values are left out, as TOML has no null)."""
    lines = []
    for k, v in to_dict(cfg).items():
        if v is None:
            continue
        lines.append(f"{k} = {json.dumps(v) if not isinstance(v, dict) else _toml_inline(v)}")
    return "\n".join(lines) + "\n"


def _toml_inline(d: dict[str, Any]) -> str:
    return "{ " + ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in d.items()) + " }"
