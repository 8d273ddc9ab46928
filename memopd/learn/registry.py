"""Classes by name: a built-in name, ``module:Class`` (imported from the current directory too, as
``--agent`` is), or a name an installed package registers under an entry-point group. The plugins
(``--plugin``, group ``memopd.plugins``) and the distillation estimators (``--opd-estimator``, group
``memopd.estimators``) are found this way."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping


class SpecError(ValueError):
    """A spec that names nothing importable, or not a class of the expected kind."""


@dataclass(frozen=True)
class Registry:
    """Where the classes of one kind come from. ``flag``: the option that names them (in errors);
    ``kind``: what one is called (``plugin``); ``base``: the class every one subclasses;
    ``builtin``: the names memopd knows without any entry point (``name -> module:Class``)."""

    flag: str
    kind: str
    group: str
    base: type
    builtin: Mapping[str, str] = field(default_factory=dict)

    def names(self) -> list[str]:
        """The built-in names, then the installed ones (a broken entry point is skipped)."""
        return list(dict.fromkeys([*self.builtin, *self._entry_points()]))

    def resolve(self, spec: str) -> type:
        """``spec`` -> its class, or :class:`SpecError` with one line saying what to give."""
        target = spec if ":" in spec else self.builtin.get(spec) or self._entry_points().get(spec)
        if target is None:
            builtin = f", a built-in name ({', '.join(self.builtin)})" if self.builtin else ""
            raise SpecError(f"{self.flag} {spec}: no such {self.kind}; give module:Class{builtin}, or install a "
                            f"package that registers {spec!r} under the {self.group!r} entry points")
        module_name, _, attr = target.partition(":")
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # examples.mine:Mine from the working directory
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise SpecError(f"{self.flag} {spec}: cannot import {module_name!r} ({exc}); give module:Class "
                            "importable from the current directory or installed") from None
        cls = getattr(module, attr, None)
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            base = f"{self.base.__module__}.{self.base.__qualname__}"
            raise SpecError(f"{self.flag} {spec}: {module_name}.{attr} is not a {base} subclass")
        if not getattr(cls, "name", ""):
            raise SpecError(f"{self.flag} {spec}: {cls.__name__} has no `name` (a class attribute naming it in "
                            "metrics and checkpoints)")
        return cls

    def _entry_points(self) -> dict[str, str]:
        try:
            return {e.name: e.value for e in importlib.metadata.entry_points(group=self.group)}
        except Exception as exc:  # noqa: BLE001 - broken package metadata must not break the built-ins
            warnings.warn(f"cannot read the {self.group!r} entry points ({exc}); only the built-in "
                          f"{self.kind}s are known", RuntimeWarning, stacklevel=3)
            return {}


def options_of(cls: Any, values: Mapping[str, Any], source: str, kwarg: str) -> Any:
    """``cls.Options`` made from ``values`` (the fields it declares; None without Options). Errors
    name each option as it is given: ``kwarg`` (e.g. ``--plugin-kwarg``) ``NAME=VALUE``."""
    import dataclasses

    from memopd.config import ConfigError, from_dict

    if getattr(cls, "Options", None) is None:
        return None
    names = {f.name for f in dataclasses.fields(cls.Options)}
    try:
        return from_dict(cls.Options, {k: v for k, v in values.items() if k in names}, source=source)
    except ConfigError as exc:
        message = str(exc)
        for name in names:  # its options are KEY=VALUE pairs of one flag, not flags of their own
            message = message.replace(f"--{name.replace('_', '-')}=", f"{kwarg} {name}=")
        raise ConfigError(message) from None


__all__ = ["Registry", "SpecError", "options_of"]
