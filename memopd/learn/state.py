"""The trainer's own state between steps, as a checkpoint keeps it (besides the models, optimizers,
scheduler and RNG): a typed record instead of a grab-bag, read back from either layout.

A checkpoint's trainer state holds ``{"train_state": TrainState.to_dict(), ...}``. Checkpoints
written before the learner was split into components held the same facts as ``bad_steps``, a
``history`` dict (the evaluations, ``train_clock``), ``rows``, and the plugins' state in keys of
their own; :meth:`TrainState.from_checkpoint` reads them into this record (each plugin reads its
own: ``Plugin.legacy_state``), so such a run directory resumes as it is.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, ClassVar, Sequence

from memopd.learn.plugin import TrainingError


@dataclass
class TrainState:
    """Where a run is: its step, the non-finite steps in a row, the steps' cumulative clock
    (``--budget-clock``), the held-out evaluations (teacher, before, after and the step of the
    last one), the metrics rows logged at this step (saved with its checkpoint, so a resume
    neither loses nor duplicates one), and every plugin's state by name."""

    step: int = 0
    bad_steps: int = 0
    train_clock: float = 0.0
    eval_teacher: dict[str, float] | None = None
    eval_before: dict[str, float] | None = None
    eval_after: dict[str, float] | None = None
    eval_after_step: int | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    plugins: dict[str, dict[str, Any]] = field(default_factory=dict)

    legacy_plugins: ClassVar[Sequence[Any]] = ()
    """The plugins whose state an older checkpoint may hold in keys of their own."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def progress(self, steps: int, time_budget: float) -> float:
        """How far training is, in [0, 1]: the share of ``--time-budget`` spent when a budget is set
        (the steps it allows are not known in advance), else of ``--steps``."""
        if time_budget:
            return min(1.0, self.train_clock / time_budget)
        return self.step / max(1, steps)

    def count_bad_step(self, metrics: dict[str, float], most: int, last: Callable[[], Any]) -> None:
        """A step whose every minibatch had a non-finite loss changed nothing; ``most`` in a row end
        the run (:class:`memopd.learn.plugin.TrainingError`), its last good checkpoint (``last()``) intact."""
        if not math.isnan(metrics.get("loss", float("nan"))):
            self.bad_steps = 0
            return
        self.bad_steps += 1
        warnings.warn(f"step {self.step}: non-finite loss, update skipped ({self.bad_steps}/{most} in a row)",
                      RuntimeWarning, stacklevel=3)
        if self.bad_steps >= most:
            raise TrainingError(f"{self.bad_steps} steps in a row had a non-finite loss; stopped at step {self.step}. "
                                f"The last good checkpoint is intact: {last() or 'none'}. "
                                "Lower --lr or --opd-coef, or check the teacher, then --resume.")

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any], plugins: Sequence[Any] | None = None) -> TrainState:
        """The record in a loaded checkpoint's trainer state (``step`` from the checkpoint itself);
        in the older layout, ``plugins`` (default :attr:`legacy_plugins`) read their own state."""
        if "train_state" in state:
            names = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in state["train_state"].items() if k in names}, )
        history = state.get("history", {})
        return cls(step=state["step"], bad_steps=state.get("bad_steps", 0),
                   train_clock=history.get("train_clock", 0.0), eval_teacher=history.get("eval_teacher"),
                   eval_before=history.get("eval_before"), eval_after=history.get("eval_after"),
                   eval_after_step=history.get("eval_after_step"), rows=list(state.get("rows", [])),
                   plugins={p.name: p.legacy_state(state) for p in (cls.legacy_plugins if plugins is None else plugins)
                            if p.legacy_state(state) is not None})


__all__ = ["TrainState"]
