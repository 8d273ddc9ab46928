"""The teacher as the learner sees it: a scorer of a step's packed invocations that declares what
it provides.

Every teacher subclasses :class:`Teacher`: :meth:`Teacher.score` returns
:class:`~memopd.learn.estimators.base.TeacherScores` for the N actions of a packed batch, in the
batch's action order, and the class says what those scores hold (``provides``: capabilities of
:mod:`memopd.learn.needs`), what it lacks and why (``lacks``), and which teacher would give what it
lacks (``instead``). The start-up check (:func:`memopd.learn.needs.check_needs`) reads these
before the teacher is built. The kinds, one module each: local and FSDP-sharded
(:mod:`~memopd.learn.teachers.local`), another tokenizer
(:mod:`~memopd.learn.teachers.other_tokenizer`), served (:mod:`~memopd.learn.teachers.served`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Mapping, Sequence

from agents.records import Episode
from memopd.learn.estimators.base import TeacherScores
from memopd.packing import PackedBatch


class Teacher(ABC):
    """Scores a step's packed invocations. ``model`` and ``tokenizer``: the teacher's whole weights
    and tokenizer where it has them in this process (None: a served teacher)."""

    provides: ClassVar[frozenset[str]] = frozenset()
    """What its scores hold at every action (capabilities of :mod:`memopd.learn.needs`)."""
    lacks: ClassVar[Mapping[str, str]] = {}
    """Why it lacks a capability it does not provide (one clause each)."""
    instead: ClassVar[str] = "another teacher"
    """Which teacher would provide what it lacks."""

    model: Any = None
    tokenizer: Any = None

    @abstractmethod
    def score(self, episodes: Sequence[Episode], batch: PackedBatch) -> TeacherScores:
        """The teacher at the action tokens of ``batch`` (the packed ``episodes``)."""

    def evaluate(self, actor: Callable[[Any, Any], Any], log: Callable[[str], None]) -> dict[str, float] | None:
        """Its held-out figures as the run's agent: ``actor(model, tokenizer)`` makes the rollout
        worker that plays them (None: it is not evaluated here)."""
        return actor(self.model, self.tokenizer).evaluate()


__all__ = ["Teacher"]
