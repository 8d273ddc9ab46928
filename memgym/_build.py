"""Build hook (used by setuptools only, never at run time): ship the top-level ``tasks/`` in the wheel.

The repository keeps task folders at its top level; an installed package has no top level, so
``build_py`` copies ``tasks/`` to ``memgym/builtin_tasks/`` inside the built package, where
:func:`memgym.registry.builtin_tasks_dir` finds them. Editable installs read ``tasks/`` in place.
Named in ``pyproject.toml`` as ``[tool.setuptools.cmdclass] build_py``.
"""

from __future__ import annotations

import os
import shutil

from setuptools.command.build_py import build_py

TASKS_SOURCE = "tasks"
TASKS_TARGET = os.path.join("memgym", "builtin_tasks")


def task_files(root: str = TASKS_SOURCE) -> list[str]:
    """Every file of every task folder under ``root`` (caches left out), sorted."""
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        files += [os.path.join(folder, n) for n in sorted(names) if not n.endswith((".pyc", ".pyo"))]
    return files


class BuildPy(build_py):
    """``build_py`` that also copies the built-in task folders into the package."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:  # an editable install reads tasks/ from the checkout
            self._copy_tasks()

    def _target(self, src: str) -> str:
        return os.path.join(self.build_lib, TASKS_TARGET, os.path.relpath(src, TASKS_SOURCE))

    def _copy_tasks(self) -> None:
        shutil.rmtree(os.path.join(self.build_lib, TASKS_TARGET), ignore_errors=True)  # no stale tasks
        for src in task_files():
            dest = self._target(src)
            self.mkpath(os.path.dirname(dest))
            self.copy_file(src, dest, preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        extra = [] if self.editable_mode else [self._target(src) for src in task_files()]
        return list(super().get_outputs(include_bytecode)) + extra

    def get_source_files(self) -> list[str]:
        return list(super().get_source_files()) + task_files()  # so an sdist carries tasks/ too
