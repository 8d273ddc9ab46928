"""Simulated staleness (``--simulated-staleness S``): asynchronous rollouts' lag, made synchronously.

Each step's rollouts join a queue and the step trains on the batch made S steps before; a fresh
run's queue starts with S batches of the initial policy (steps -S..-1), so the lag grows to S over
the first S steps. The queue is checkpointed, so a resumed run trains on exactly the batches it
would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agents.records import Episode
from memopd.config import Config, field
from memopd.learn.actor import Rollout, RolloutLimits
from memopd.learn.plugin import Plugin, RolloutFn


@dataclass
class StalenessOptions(Config):
    """Simulated staleness"""

    simulated_staleness: int = field(0, help="train each step on the rollouts of S steps before (made by the "
                                             "policy S updates back): asynchronous rollouts' staleness, simulated "
                                             "synchronously (0: on-policy)", range=(0, None))


class SimulatedStaleness(Plugin):
    name = "staleness"
    Options = StalenessOptions
    order = 40
    requires = ("freshness",)  # stale samples: their lag and drift are logged

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.queue: list[list[Episode]] = []  # the batches made, oldest first

    @classmethod
    def enabled(cls, options: StalenessOptions) -> bool:
        return options.simulated_staleness > 0

    @classmethod
    def legacy_state(cls, saved: Any) -> dict[str, Any]:
        return {"queue": saved.get("stale_queue", [])}

    def wrap_rollout(self, rollout: RolloutFn) -> RolloutFn:
        def stale(step: int, limits: RolloutLimits) -> Rollout:
            fresh = rollout(step, limits)
            if not self.queue:  # a fresh start: S earlier batches, as asynchronous workers would hold
                self.queue = [rollout(-k, limits).episodes for k in range(self.options.simulated_staleness, 0, -1)]
            self.queue.append(fresh.episodes)
            return Rollout(self.queue.pop(0), fresh.seconds, fresh.metrics)
        return stale

    def state_dict(self) -> dict[str, Any]:
        return {"queue": [[e.to_dict() for e in b] for b in self.queue]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.queue = [[Episode.from_dict(e) for e in b] for b in state.get("queue", [])]


__all__ = ["SimulatedStaleness", "StalenessOptions"]
