"""Rollouts: run an agent on many environments in lockstep, batching its model calls.

Every step, the observations of all running environments go to :meth:`MemoryPolicy.act_batch`
at once, so the model calls of all environments become one ``backend.generate`` per round.
When an environment's episode ends, the next episode of the plan starts in it right away
(episodes of different lengths do not leave slots idle while work remains).

Episode plan: episode ``k`` belongs to group ``g = k // group_size``. All members of a group
answer the same question: they reset with the same seed (``seed + g``) and, when ``indices`` is
given, with ``options={"index": indices[g]}``. ``group_id`` ties them together for group-relative
baselines (GRPO-style).

Environments: a list of ``gymnasium.Env`` (each stepped on its own) or a gymnasium
``VectorEnv`` (``SyncVectorEnv``/``AsyncVectorEnv``; sub-environments are reset one at a time
with ``options["reset_mask"]`` so each gets its own seed and sample, and every finished
sub-environment is reset at once, so any autoreset mode works).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from agents.policy import MemoryPolicy
from agents.records import Episode, Invocation, save_episodes


@dataclass(frozen=True)
class EpisodePlan:
    """One planned episode."""

    index: int
    """Position in the rollout (episodes come back in this order)."""
    group: int
    member: int
    seed: int
    options: dict[str, Any] | None
    episode_id: str
    group_id: str


def plan_episodes(num_episodes: int, group_size: int = 1, seed: int = 0, indices: Sequence[int] | None = None,
                  run_id: str | None = None) -> list[EpisodePlan]:
    """The episodes a rollout runs (see the module doc for the grouping rule)."""
    if num_episodes < 0:
        raise ValueError(f"num_episodes must be >= 0 (got {num_episodes})")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1 (got {group_size})")
    groups = -(-num_episodes // group_size)
    if indices is not None and len(indices) < groups:
        raise ValueError(f"{num_episodes} episodes in groups of {group_size} need {groups} sample indices, "
                         f"got {len(indices)}")
    run_id = run_id or f"seed{seed}"
    plans = []
    for k in range(num_episodes):
        g, m = divmod(k, group_size)
        options = {"index": int(indices[g])} if indices is not None else None
        plans.append(EpisodePlan(k, g, m, seed + g, options, f"{run_id}/{g}/{m}", f"{run_id}/{g}"))
    return plans


def rollout(envs: Any, agent: MemoryPolicy, num_episodes: int, *, group_size: int = 1, seed: int = 0,
            indices: Sequence[int] | None = None, out: str | Path | None = None, progress: bool = True,
            run_id: str | None = None, max_calls: int | None = None,
            monitor: Callable[[dict[int, tuple[str, Invocation]]], set[int]] | None = None) -> list[Episode]:
    """Run ``num_episodes`` episodes of ``agent`` over ``envs`` in lockstep.

    Args:
        envs: a list of environments (one slot each) or a gymnasium vector env.
        agent: any :class:`MemoryPolicy`.
        num_episodes: episodes to run in all.
        group_size: episodes per question (G samples for group baselines).
        seed: reset seed of group 0 (group g resets with ``seed + g``).
        indices: sample index per group (``options={"index": i}``); default: the env's seeded pick.
        out: append each finished episode to this JSONL file.
        progress: show a tqdm progress bar.
        run_id: prefix of episode and group ids (default ``seed<seed>``).
        max_calls: a rollout-depth budget: an episode still running after this many model calls
            is cut there (:meth:`MemoryPolicy.cut_episode`: no answer, no reward).
        monitor: called after each round of model calls with ``{slot: (episode_id, invocation)}``
            of the calls just made; the slots it returns have their episodes cut after this call
            (at the turn boundary; an episode that has just answered ends as usual).

    Returns:
        The episodes, in plan order.
    """
    slots = _slots(envs)
    plans = plan_episodes(num_episodes, group_size, seed, indices, run_id)
    queue: Iterator[EpisodePlan] = iter(plans)
    results: list[Episode | None] = [None] * len(plans)
    running: dict[int, tuple[EpisodePlan, str, dict[str, Any]]] = {}
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)

    from tqdm.auto import tqdm

    f1_sum, done = 0.0, 0
    bar = tqdm(total=len(plans), desc=f"rollout {agent.name}", unit="ep", disable=not progress)
    calls = _CallCount(bar)  # at length an episode takes hundreds of calls: say them as they go
    # the weights are fixed for the rollout: the backend may keep each episode's prefix between calls
    prefix_scope = getattr(getattr(agent, "backend", None), "prefix_scope", None)
    stack = contextlib.ExitStack()

    def start(slot: int) -> None:
        plan = next(queue, None)
        if plan is None:
            slots.idle(slot)
            running.pop(slot, None)
            return
        obs, info = slots.reset(slot, plan.seed, plan.options)
        agent.begin_episode(slot, episode_id=plan.episode_id, seed=plan.seed, group_id=plan.group_id)
        running[slot] = (plan, obs, info)

    try:
        if callable(prefix_scope):
            stack.enter_context(prefix_scope())
        for slot in range(slots.n):
            start(slot)
        while running:
            order = sorted(running)
            made = {s: len(agent.state(s).invocations) for s in order}
            actions = agent.act_batch([running[s][1:] for s in order], order)
            calls.add(sum(len(agent.state(s).invocations) - made[s] for s in order), f1_sum, done)
            stop: set[int] = set()
            if monitor is not None:
                new = {s: (agent.state(s).episode_id, agent.state(s).invocations[-1]) for s in order
                       if len(agent.state(s).invocations) > made[s]}
                stop = monitor(new) if new else set()
            for slot, (obs, reward, terminated, truncated, info) in slots.step(dict(zip(order, actions))).items():
                plan = running[slot][0]
                if truncated and not terminated:
                    raise RuntimeError(f"env slot {slot} truncated episode {plan.episode_id} without an answer; "
                                       "memgym episodes have a fixed length and should never truncate")
                if not terminated:
                    if slot not in stop and (max_calls is None or len(agent.state(slot).invocations) < max_calls):
                        running[slot] = (plan, obs, info)
                        continue
                    episode = agent.cut_episode(slot)
                    if "num_chunks" in info:  # the turns the whole episode has: a memory call a chunk, the answer
                        episode.turns = int(info["num_chunks"]) + 1
                else:
                    episode = agent.end_episode(info, reward, slot=slot)
                results[plan.index] = episode
                if out is not None:
                    save_episodes(out, [episode], append=True)
                f1_sum, done = f1_sum + episode.metrics.get("f1", 0.0), done + 1
                bar.update(1)
                calls.show(f1_sum, done, refresh=False)
                start(slot)
    finally:
        stack.close()
        bar.close()
        for slot in list(running):
            agent.abort_episode(slot)
    return results  # type: ignore[return-value]


class _CallCount:
    """The model calls of a rollout on its progress bar: how many, and how many a second."""

    EVERY_S = 0.5
    """Seconds between redraws between episodes."""

    def __init__(self, bar: Any) -> None:
        self.bar, self.n = bar, 0
        self.t0 = self.shown = time.perf_counter()

    def add(self, n: int, f1_sum: float, done: int) -> None:
        self.n += n
        if not self.bar.disable and time.perf_counter() - self.shown >= self.EVERY_S:
            self.show(f1_sum, done, refresh=True)

    def show(self, f1_sum: float, done: int, refresh: bool) -> None:
        self.shown = now = time.perf_counter()
        rate = self.n / (now - self.t0) if now > self.t0 else 0.0
        f1 = {"f1": f"{f1_sum / done:.3f}"} if done else {}
        self.bar.set_postfix(**f1, calls=f"{self.n:,}", calls_s=f"{rate:,.0f}", refresh=refresh)


def run_episode(env: Any, agent: MemoryPolicy, seed: int | None = None, options: dict[str, Any] | None = None,
                episode_id: str | None = None) -> Episode:
    """One episode of ``agent`` in a single env (the simplest loop)."""
    obs, info = env.reset(seed=seed, options=options)
    agent.begin_episode(0, episode_id=episode_id, seed=seed)
    try:
        while True:
            obs, reward, terminated, truncated, info = env.step(agent.act(obs, info))
            if terminated or truncated:
                return agent.end_episode(info, reward)
    except BaseException:
        agent.abort_episode(0)
        raise


# ---------------------------------------------------------------------- env adapters
class _EnvList:
    """Slots over a list of single environments."""

    def __init__(self, envs: Sequence[Any]):
        self.envs = list(envs)
        self.n = len(self.envs)

    def reset(self, slot: int, seed: int, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        return self.envs[slot].reset(seed=seed, options=dict(options) if options else None)

    def idle(self, slot: int) -> None:
        pass

    def step(self, actions: dict[int, str]) -> dict[int, tuple]:
        return {slot: self.envs[slot].step(action) for slot, action in actions.items()}


class _VectorSlots:
    """Slots over a gymnasium VectorEnv. Idle sub-environments are stepped with ``""`` (vector
    envs step all at once) and their results ignored; every finished sub-environment is reset
    right away with a one-hot ``reset_mask`` (per-env seed and options; no autoreset needed)."""

    def __init__(self, vec: Any):
        self.vec = vec
        self.n = int(vec.num_envs)
        mode = getattr(vec, "metadata", {}).get("autoreset_mode", getattr(vec, "autoreset_mode", None))
        self.same_step = getattr(mode, "value", mode) == "SameStep"
        self._started = False

    def _mask(self, slot: int) -> np.ndarray:
        mask = np.zeros(self.n, dtype=np.bool_)
        mask[slot] = True
        return mask

    def reset(self, slot: int, seed: int | None, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        if not self._started:  # a vector env must be reset as a whole once before masked resets
            self.vec.reset()
            self._started = True
        seeds = [None] * self.n
        seeds[slot] = seed
        obs, infos = self.vec.reset(seed=seeds, options={**(options or {}), "reset_mask": self._mask(slot)})
        return obs[slot], info_at(infos, slot)

    def idle(self, slot: int) -> None:
        self.reset(slot, None, None)  # keep it steppable (some autoreset modes refuse a finished env)

    def step(self, actions: dict[int, str]) -> dict[int, tuple]:
        batch = tuple(actions.get(i, "") for i in range(self.n))
        obs, rewards, terms, truncs, infos = self.vec.step(batch)
        final = infos.get("final_info") if self.same_step else None
        out = {}
        for i in range(self.n):
            done = bool(terms[i]) or bool(truncs[i])
            info = info_at(final, i) if (done and final is not None) else info_at(infos, i)
            if i in actions:
                out[i] = (obs[i], float(rewards[i]), bool(terms[i]), bool(truncs[i]), info)
            if done and i not in actions:  # an idle env finished a throwaway episode: restart it
                self.reset(i, None, None)
        return out


def info_at(infos: dict[str, Any], i: int) -> dict[str, Any]:
    """The info of sub-environment ``i`` from a vector env's batched info dict (plain Python values)."""
    out: dict[str, Any] = {}
    for key, value in infos.items():
        if key.startswith("_"):
            continue
        mask = infos.get(f"_{key}")
        if mask is not None and not bool(mask[i]):
            continue
        out[key] = info_at(value, i) if isinstance(value, dict) else _plain(value[i])
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _slots(envs: Any) -> _EnvList | _VectorSlots:
    import gymnasium as gym

    if isinstance(envs, gym.vector.VectorEnv):
        return _VectorSlots(envs)
    if isinstance(envs, gym.Env):
        return _EnvList([envs])
    envs = list(envs)
    if not envs:
        raise ValueError("rollout needs at least one environment")
    bad = [i for i, e in enumerate(envs) if not isinstance(e, gym.Env)]
    if bad:
        raise TypeError(f"envs[{bad[0]}] is a {type(envs[bad[0]]).__name__}, not a gymnasium.Env")
    return _EnvList(envs)
