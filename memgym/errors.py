"""Errors memgym raises on bad input; each message says what was wrong and how to fix it."""

from __future__ import annotations

from gymnasium.error import NameNotFound

from memgym.data import TaskDataError


class MemgymError(Exception):
    """Base class of memgym's own errors."""


class EpisodeEndedError(MemgymError, RuntimeError):
    """``step()`` was called after the episode terminated; call ``reset()`` first."""


class ResetNeededError(MemgymError, RuntimeError):
    """``step()`` was called before the first ``reset()``."""


class TaskConfigError(MemgymError, ValueError):
    """A task folder's ``task.toml`` is malformed, or the source it names cannot be imported or
    called; the message names the file and the key."""


class UnknownEnvError(MemgymError, NameNotFound):
    """An env or task id that is not registered; the message lists the available ids."""


class TaskShadowedWarning(UserWarning):
    """A task folder gives an id that an earlier-scanned folder gives too, and replaces it."""


__all__ = ["MemgymError", "EpisodeEndedError", "ResetNeededError", "TaskConfigError", "TaskDataError",
           "TaskShadowedWarning", "UnknownEnvError"]
