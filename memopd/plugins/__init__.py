"""The built-in training methods, each a :class:`memopd.learn.plugin.Plugin` behind the one step,
each wholly in its module (its maths, options, checks, metrics and checkpoint state):

- :mod:`~memopd.plugins.turn_opd` (TurnOPD: turn-level loss budgeting, adaptive rollout depth);
- :mod:`~memopd.plugins.freshness` (f-OPD: freshness of stale samples);
- :mod:`~memopd.plugins.prune_opd` (Prune-OPD: drift detection, down-weighting, rollout stops);
- :mod:`~memopd.plugins.staleness` (simulated staleness: train on the batch of S steps before);
- :mod:`~memopd.plugins.dynamic_sampling` (DAPO's dynamic sampling: drop groups of equal rewards, draw more);
- :mod:`~memopd.plugins.async_ray` (asynchronous rollout workers on Ray).

Each switches itself on from its own options (``Plugin.enabled``), and says as data where it runs
(``order``: the list above), what it switches on (``requires``: the stale-sample methods require
f-OPD's freshness, which logs their lag) and what it cannot run with (``excludes``). The command
line (:mod:`memopd.train`) composes their options into its config; making a method built-in is
adding its class here.
"""

from __future__ import annotations

from memopd.plugins.async_ray import AsyncRollouts
from memopd.plugins.dynamic_sampling import DynamicSampling
from memopd.plugins.freshness import Freshness
from memopd.plugins.prune_opd import PruneOPD
from memopd.plugins.staleness import SimulatedStaleness
from memopd.plugins.turn_opd import TurnOPD

BUILTIN_PLUGINS = (TurnOPD, Freshness, PruneOPD, SimulatedStaleness, DynamicSampling, AsyncRollouts)

__all__ = ["BUILTIN_PLUGINS", "AsyncRollouts", "DynamicSampling", "Freshness", "PruneOPD", "SimulatedStaleness", "TurnOPD"]
