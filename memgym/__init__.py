"""memgym: a Gymnasium gym of long-horizon QA tasks for compact-memory LLM agents.

``import memgym`` registers every task folder found (see :mod:`memgym.registry`) as
``memgym/<Name>-v<N>``; ``gymnasium.make("memgym/LongQA-v0")`` then builds the environment.
memgym never imports torch.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from memgym.data import Document, Sample, TaskDataError
from memgym.errors import (EpisodeEndedError, MemgymError, ResetNeededError, TaskConfigError, TaskShadowedWarning,
                           UnknownEnvError)
from memgym.registry import ListSource, list_envs, load_task, register_tasks, resolve_id

__version__ = "0.1.0"


def make(env_id: str = "memgym/LongQA-v0", **kwargs: Any) -> gym.Env:
    """``gymnasium.make`` for memgym ids, accepting short forms (``"LongQA"``, ``"LongQA-v0"``).

    An unknown id raises :class:`UnknownEnvError` listing the available ones.
    """
    return gym.make(resolve_id(env_id), **kwargs)


register_tasks()

__all__ = ["Document", "Sample", "TaskDataError", "EpisodeEndedError", "MemgymError", "ResetNeededError",
           "TaskConfigError", "TaskShadowedWarning", "UnknownEnvError", "ListSource", "list_envs", "load_task", "make", "register_tasks", "resolve_id"]
