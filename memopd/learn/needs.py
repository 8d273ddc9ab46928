"""What the run needs of its teacher, and the one check of it against what the teacher provides.

A teacher declares what it can give at each action token (:attr:`Teacher.provides
<memopd.learn.teachers.base.Teacher.provides>`), as capabilities:

``distribution``  its whole next-token distribution over the student's vocabulary (its states
                  and output head in this process)
``topk``          its k most likely tokens and their log-probs
``sampled``       its log-prob of the token the student sampled
``persistent``    a score of every call in the flattened-history control (a local teacher with the
                  student's tokenizer)
``sharded``       no whole copy of it on each rank (``--teacher-parallel fsdp`` under torchrun)

Whatever reads the teacher declares a :class:`Need`: the estimator (``Estimator.needs``), a plugin
(``Plugin.teacher_needs``), the teacher context and the parallel options. :func:`check_needs` runs
once at the start, before the teacher is built, and refuses the first unmet need with one line
that names what the teacher lacks, who needs it, and what would work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence, Union

from memopd.config import ConfigError

if TYPE_CHECKING:
    from memopd.learn.teachers.base import Teacher

CAPABILITIES = ("distribution", "topk", "sampled", "persistent", "sharded")


@dataclass(frozen=True)
class Need:
    """A capability of the teacher that something of the run reads: ``why`` says who needs it and
    what for (one clause), ``instead`` how to do without it (e.g. ``pass --teacher-context aligned``), or a
    function of the teacher's class that says it (e.g. the estimators that teacher can feed)."""

    capability: str
    why: str
    instead: Union[str, Callable[[type["Teacher"]], str]]

    def __post_init__(self) -> None:
        if self.capability not in CAPABILITIES:
            raise ValueError(f"unknown teacher capability {self.capability!r}; one of {CAPABILITIES}")


def check_needs(teacher: type[Teacher], spec: str, needs: Sequence[Need], note: str = "") -> None:
    """Refuse the run when ``teacher`` (the class the run would build for ``--teacher spec``) lacks
    a capability of ``needs``: one :class:`ConfigError` naming what is missing and what would work.
    ``note``: what the loader found out about this teacher (e.g. its tokenizer differs)."""
    for need in needs:
        if need.capability in teacher.provides:
            continue
        lacks = teacher.lacks.get(need.capability, f"this teacher does not give {need.capability}")
        head = f"{note}. {_capital(lacks)}" if note else lacks
        instead = need.instead if isinstance(need.instead, str) else need.instead(teacher)
        raise ConfigError(f"--teacher {spec}: {head}; {need.why}: use {teacher.instead}, or {instead}")


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


__all__ = ["CAPABILITIES", "Need", "check_needs"]
