"""The command-line grammar every memgym / memopd CLI shares.

- Env options are ``--env-kwarg KEY=VALUE`` (repeatable); agent options ``--agent-kwarg KEY=VALUE``.
  VALUE is read as a Python literal when it is one (``8``, ``0.5``, ``True``, ``None``,
  ``{"train": "a.jsonl"}``), else kept as a string.
- A failure prints ``error: <what, where, how to fix>`` on stderr, never a traceback, and exits
  with :data:`EXIT_USAGE` (2) for bad input; :func:`run_main` does this for a ``main``.
"""

from __future__ import annotations

import ast
import sys
from typing import Any, Callable, Sequence

EXIT_USAGE = 2


class CLIError(Exception):
    """Bad input to a CLI; the message says what, where and how to fix it (printed as ``error: ...``)."""


def parse_kwargs(items: Sequence[str], flag: str = "--env-kwarg") -> dict[str, Any]:
    """``["hops=2", "fact_order=random"]`` -> ``{"hops": 2, "fact_order": "random"}``.

    A repeated key keeps the last value. Raises :class:`CLIError` for an item without ``=``."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise CLIError(f"{flag} {item!r} is not KEY=VALUE (e.g. {flag} num_chunks=8)")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            value = raw
        out[key] = value
    return out


def format_kwargs(kwargs: dict[str, Any], flag: str = "--env-kwarg") -> str:
    """The flags that :func:`parse_kwargs` reads back as ``kwargs``."""
    return " ".join(f"{flag} {k}={v!r}" if not isinstance(v, str) else f"{flag} {k}={v}" for k, v in kwargs.items())


def fail(message: str, code: int = EXIT_USAGE) -> int:
    """Print ``error: message`` on stderr and return the exit code."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def run_main(main: Callable[[], int], errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run a CLI's ``main``: :class:`CLIError`, ``OSError`` (unreadable input, read-only or full
    output) and the given error types become ``error: ...`` and exit 2; Ctrl-C exits 130."""
    try:
        return main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (CLIError, OSError, *errors) as exc:
        return fail(describe(exc))


def describe(exc: BaseException) -> str:
    """One line for an error: OSErrors name their file and what to do."""
    if isinstance(exc, OSError) and exc.filename is not None:
        what = exc.strerror or str(exc)
        hint = {"Read-only file system": "choose a writable output directory",
                "Permission denied": "choose a path you may write (or read)",
                "No space left on device": "free some disk space or choose another output directory",
                "No such file or directory": "check the path",
                "Not a directory": "a part of the path is a file, not a directory; choose another path",
                "Is a directory": "give a file path, not a directory"}.get(what, "")
        return f"{exc.filename}: {what}" + (f"; {hint}" if hint else "")
    return str(exc) or type(exc).__name__


__all__ = ["CLIError", "EXIT_USAGE", "describe", "fail", "format_kwargs", "parse_kwargs", "run_main"]
