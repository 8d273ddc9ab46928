"""Asynchronous actor-learner rollouts on Ray (``python -m memopd.train --async-rollouts``).

Rollout workers (Ray actors, each with a CPU copy of the student on the transformers backend and
its own envs) generate episodes continuously with the latest published weights into a bounded
buffer; the learner (:class:`memopd.learn.trainer.Trainer`) takes a step's batch from it, trains,
and publishes the new weights with their version. :class:`AsyncRollouts` is the plugin that puts
this in place of the step's rollout. Three actors' worth of parts:

    learner  (RolloutPool)            hub (one actor)                  workers (N actors)
    publish(v, ray.put(weights)) -->  version v, weights ref   <-- claim(): units, v, weights ref
    take(B groups, v)            <--  buffer of groups         <-- put(units, episodes)

Work units. Unit ``u`` is one question of one step: step ``b = u // B``, question ``q = u % B``
(B = ``--questions-per-step``), played ``G`` times (``--group-size``, one group for the
group-relative advantages). Its env seed is ``seed * 1_000_003 + u``, the synchronous run's seed
of that question, and its episodes are ``step{b}/{q}/{m}``: an asynchronous run samples the same
questions as a synchronous one (not the same answers: those depend on the weights each worker
holds). The learner uses every unit at most once (checked by unit and episode id); a unit that
is not used (dropped as stale, lost with a dead worker, in the buffer at a resume) is generated
again from scratch with the same seed and ids.

Staleness. A sample's lag is the learner's version (updates made) minus the ``policy_version``
the worker sampled it with. Workers may claim units only while the units claimed, buffered and
in training number fewer than ``(S + 1) * B`` (``S`` = ``--max-staleness``): whatever is claimed
at version ``v`` is among the next ``S + 1`` batches, so it is used at version ``v + S`` or
earlier when units are used in order. Out of order (several workers, a restart) a sample can be
staler than that: the learner drops every buffered group whose lag exceeds ``S`` (counted in
``async/dropped_stale``, in episodes) and its unit is generated again.

Reliability. A worker whose loop ends (killed, crashed, raised) is killed for good, its claimed
units go back to the queue (its unfinished episodes are dropped, a late delivery of them is
refused), and a new worker takes its place, up to ``--max-worker-restarts`` times in a run
(``async/worker_restarts`` counts them). :meth:`RolloutPool.close` stops the workers, kills every
actor and shuts down the Ray instance it started. A checkpoint keeps the units used
(:meth:`RolloutPool.state`); buffered episodes are not saved, so a resume generates them again.

Ray is imported only here and only when the mode is on (``pip install 'memopd[ray]'``). A test
hook, ``MEMOPD_ASYNC_WORKER_FAIL=exit:N`` (or ``raise:N``), makes the first worker exit the
process (or raise) before delivering its first batch after N episodes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import heapq
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memopd import distributed
from memopd.config import Config, ConfigError, field
from memopd.learn.actor import SEED_STRIDE, Actor, Rollout, RolloutLimits
from memopd.learn.plugin import Plugin, RolloutFn, StepResult, TrainingError
from memopd.runtime import compute_dtype

if TYPE_CHECKING:  # the run's options, for the annotations
    from memopd.learn.options import CoreConfig

RAY_HINT = "pip install 'memopd[ray]'"
POLL_S = 0.02
"""Seconds between polls of the hub while a worker is gated or the learner waits for a batch."""
STOP_WAIT_S = 5.0
"""Seconds :meth:`RolloutPool.close` lets the workers finish before it kills them."""
FAIL_HOOK = "MEMOPD_ASYNC_WORKER_FAIL"
STOP = "stop"


class RolloutError(RuntimeError):
    """The rollout workers cannot go on (too many restarts, the hub died); the message says why."""


def import_ray() -> Any:
    """``ray``, or a :class:`ModuleNotFoundError` that says how to install it."""
    try:
        import ray
    except ImportError:
        raise ModuleNotFoundError(f"--async-rollouts needs Ray: {RAY_HINT}") from None
    return ray


def ray_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


# ------------------------------------------------------------------------------------------------
# Units
# ------------------------------------------------------------------------------------------------

def unit_ids(unit: int, questions_per_step: int) -> str:
    """The group id of a unit, as the synchronous run names that question: ``step{b}/{q}``."""
    b, q = divmod(unit, questions_per_step)
    return f"step{b}/{q}"


def runs(units: list[int]) -> list[list[int]]:
    """Sorted units split into runs of consecutive ones (each run is one batched rollout)."""
    out: list[list[int]] = []
    for u in sorted(units):
        if out and out[-1][-1] == u - 1:
            out[-1].append(u)
        else:
            out.append([u])
    return out


def pack_used(used: set[int]) -> dict[str, Any]:
    """The units used, compactly: every unit below ``below``, and ``extra`` above it."""
    below = 0
    while below in used:
        below += 1
    return {"below": below, "extra": sorted(u for u in used if u > below)}


def unpack_used(state: dict[str, Any] | None, version: int, questions_per_step: int) -> set[int]:
    """The units a resumed run has used; a run without saved state (a fresh start, or a resume of a
    synchronous run) has used the units of its ``version`` steps."""
    if not state:
        return set(range(version * questions_per_step))
    return set(range(int(state["below"]))) | {int(u) for u in state["extra"]}


# ------------------------------------------------------------------------------------------------
# The hub: published weights, work units, the buffer
# ------------------------------------------------------------------------------------------------

class Hub:
    """The one place workers and the learner meet (a Ray actor; every method is short and runs
    alone). Holds the published (version, weights ref), hands out units under the staleness
    gate, and buffers finished groups until the learner takes them."""

    def __init__(self, questions_per_step: int, max_staleness: int, used: list[int]):
        self.batch, self.staleness = questions_per_step, max_staleness
        self.version, self.weights = -1, None  # nothing published yet: workers wait
        self.used = set(used)
        self.next_unit = 0
        self.pending: list[int] = []  # units to generate again (dropped, lost with a worker), lowest first
        self.claims: dict[int, list[int]] = {}  # worker id -> units it is generating
        self.buffer: dict[int, tuple[int, list]] = {}  # unit -> (policy version, its G episodes)
        self.training = 0  # units the learner took and has not published an update for yet
        self.produced = 0  # episodes delivered since the start
        self.retired: set[int] = set()
        self.stopped = False

    def _outstanding(self) -> int:
        return sum(map(len, self.claims.values())) + len(self.buffer) + self.training

    def _taken(self, u: int) -> bool:
        return u in self.used or u in self.buffer or any(u in c for c in self.claims.values())

    def _next(self) -> int:
        while self.pending:
            u = heapq.heappop(self.pending)
            if not self._taken(u):
                return u
        while self._taken(self.next_unit):
            self.next_unit += 1
        self.next_unit += 1
        return self.next_unit - 1

    def claim(self, worker: int, most: int) -> Any:
        """Up to ``most`` units for ``worker`` with the weights to sample them: ``(units, version,
        [weights ref])``; None while the gate is closed (wait and ask again); STOP at the end."""
        if self.stopped or worker in self.retired:
            return STOP
        room = (self.staleness + 1) * self.batch - self._outstanding()
        if self.weights is None or room <= 0:
            return None
        units = [self._next() for _ in range(min(most, room))]
        self.claims.setdefault(worker, []).extend(units)
        return units, self.version, self.weights

    def put(self, worker: int, version: int, groups: dict[int, list]) -> int:
        """A worker's finished groups (unit -> episodes); those it no longer holds a claim on (it
        was declared dead) are refused. Returns the groups accepted."""
        mine = self.claims.get(worker, [])
        accepted = 0
        for u, episodes in groups.items():
            if u in mine:
                mine.remove(u)
                self.buffer[u] = (version, episodes)
                self.produced += len(episodes)
                accepted += 1
        return accepted

    def take(self, n: int, version: int) -> tuple[list[tuple[int, int, list]], int]:
        """Drop buffered groups staler than the bound (their units are generated again), then the
        ``n`` lowest buffered units as ``(unit, policy version, episodes)`` once ``n`` are there
        (else none). Returns them and the number of episodes dropped."""
        dropped = 0
        for u, (v, episodes) in sorted(self.buffer.items()):
            if version - v > self.staleness:
                del self.buffer[u]
                heapq.heappush(self.pending, u)
                dropped += len(episodes)
        if len(self.buffer) < n:
            return [], dropped
        units = sorted(self.buffer)[:n]
        self.used.update(units)
        self.training = n
        return [(u, *self.buffer.pop(u)) for u in units], dropped

    def publish(self, version: int, weights: list) -> None:
        """New weights (``[ref]``: a ref nested in a list is passed on, not fetched) at ``version``."""
        self.version, self.weights, self.training = version, weights, 0

    def release(self, worker: int) -> int:
        """A dead worker: its claimed units go back to the queue; returns how many."""
        units = self.claims.pop(worker, [])
        self.retired.add(worker)
        for u in units:
            heapq.heappush(self.pending, u)
        return len(units)

    def stats(self) -> dict[str, int]:
        return {"buffer": sum(len(e) for _, e in self.buffer.values()), "produced": self.produced}

    def stop(self) -> None:
        self.stopped = True


# ------------------------------------------------------------------------------------------------
# A rollout worker
# ------------------------------------------------------------------------------------------------

class RolloutWorker:
    """A Ray actor: a CPU copy of the student (transformers backend, one torch thread) and the
    train envs; :meth:`run` claims units, samples them with the weights that came with the claim
    and delivers the groups, until the hub says stop."""

    def __init__(self, cfg: CoreConfig, model: Any, tokenizer: Any, worker_id: int, hub: Any, fail: str | None = None):
        import torch

        torch.set_num_threads(1)
        self.cfg = dataclasses.replace(cfg, device="cpu", backend="hf", eval_episodes=1, progress=False)
        self.actor = Actor(self.cfg, model.requires_grad_(False), tokenizer)
        self.id, self.hub, self.fail = worker_id, hub, _parse_fail(fail)
        self.version = -1
        self.produced = 0

    def run(self) -> int:
        """The worker's loop; returns the episodes it delivered when the hub says stop."""
        import ray

        while True:
            grant = ray.get(self.hub.claim.remote(self.id, self.cfg.questions_per_step))
            if grant == STOP:
                return self.produced
            if grant is None:
                time.sleep(POLL_S)
                continue
            units, version, (weights,) = grant
            self._load(version, weights)
            groups = self.generate(units)
            self._maybe_fail(sum(map(len, groups.values())))
            ray.get(self.hub.put.remote(self.id, version, groups))
            self.produced += sum(map(len, groups.values()))

    def _load(self, version: int, weights: Any) -> None:
        import ray

        if version != self.version:
            self.actor.load_weights(ray.get(weights), version)
            self.version = version

    def generate(self, units: list[int]) -> dict[int, list]:
        """unit -> its G episodes, each run of consecutive units in one batched rollout seeded as
        the synchronous run seeds that step; ids as the synchronous run's."""
        cfg, g = self.cfg, self.cfg.group_size
        out: dict[int, list] = {}
        for run in runs(units):
            with compute_dtype(cfg.dtype, "cpu"):
                episodes = self.actor.sample(cfg.seed * SEED_STRIDE + run[0], len(run), "unit")
            for k, e in enumerate(episodes):
                _relabel(e, run[k // g], k % g, cfg.questions_per_step, self.id)
            out.update({u: episodes[i * g:(i + 1) * g] for i, u in enumerate(run)})
        return out

    def _maybe_fail(self, coming: int) -> None:
        """The test hook (see the module doc)."""
        if self.fail is None or self.produced + coming <= self.fail[1]:
            return
        if self.fail[0] == "exit":
            os._exit(1)
        raise RuntimeError(f"rollout worker {self.id}: failure injected by {FAIL_HOOK}")


def _parse_fail(spec: str | None) -> tuple[str, int] | None:
    if not spec:
        return None
    how, _, n = spec.partition(":")
    if how not in ("exit", "raise") or not n.isdigit():
        raise ValueError(f"{FAIL_HOOK}={spec!r}: expected exit:N or raise:N")
    return how, int(n)


def _relabel(episode: Any, unit: int, member: int, questions_per_step: int, worker: int) -> None:
    """Give an episode its unit's ids (``step{b}/{q}/{m}``) and record where it came from."""
    episode.group_id = unit_ids(unit, questions_per_step)
    episode.episode_id = f"{episode.group_id}/{member}"
    episode.meta = {**episode.meta, "unit": unit, "worker": worker}
    for inv in episode.invocations:
        if "episode_id" in inv.meta:
            inv.meta["episode_id"] = episode.episode_id


# ------------------------------------------------------------------------------------------------
# The learner's side
# ------------------------------------------------------------------------------------------------

@dataclass
class _Slot:
    worker_id: int
    actor: Any
    run: Any  # the ObjectRef of its run(): ready when the worker's loop ended, for whatever reason


class RolloutPool:
    """The learner's handle on the workers: starts Ray (unless it is running) and the actors,
    publishes weights, takes batches, restarts dead workers, and shuts everything down.

    Args:
        cfg: the run's config (the workers' actors are built from it).
        options: the plugin's :class:`AsyncOptions` (``rollout_workers``, ``max_staleness``, ...).
        model: the student with whole weights (copied to the workers once, on the CPU).
        tokenizer: the student's tokenizer.
        version: the learner's version now (its step: 0, or a resumed step).
        state: :meth:`state` of a checkpoint (None: a fresh start).
        log: where messages go.
    """

    def __init__(self, cfg: CoreConfig, options: AsyncOptions, model: Any, tokenizer: Any, version: int,
                 state: dict | None = None, log=print):
        self.ray = import_ray()
        self.cfg, self.options, self.log = cfg, options, log
        self.used = unpack_used(state, version, cfg.questions_per_step)
        self.slots: list[_Slot] = []
        self.restarts, self.next_id, self.closed = 0, 0, False
        self.weights_ref = None
        nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
        self.started = self._init_ray(nbytes)
        try:
            used = sorted(self.used)
            self.hub = self.ray.remote(num_cpus=0)(Hub).remote(cfg.questions_per_step, options.max_staleness, used)
            self.publish(version, model)
            self.model_ref = self.ray.put(_cpu_copy(model))
            self.tokenizer = tokenizer
            self.worker_cls = self.ray.remote(num_cpus=1)(RolloutWorker)
            for slot in range(options.rollout_workers):
                self.slots.append(self._spawn())
            self.last_produced, self.last_t = 0, time.perf_counter()
        except BaseException:
            self.close()
            raise

    def _init_ray(self, nbytes: int) -> bool:
        """Start a local Ray instance sized for the workers (or join ``--ray-address``); False when
        Ray was running already (then it is left running)."""
        ray = self.ray
        if ray.is_initialized():
            return False
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # offline: no usage reports
        if self.options.ray_address:
            ray.init(address=self.options.ray_address, log_to_driver=True)
        else:  # the weights of two versions and a model copy in flight, and room for episodes
            store = max(200 * 2**20, 4 * nbytes + 64 * 2**20)
            ray.init(num_cpus=self.options.rollout_workers + 1, include_dashboard=False, object_store_memory=store,
                     log_to_driver=True)
        return True

    def _spawn(self) -> _Slot:
        wid = self.next_id
        self.next_id += 1
        fail = os.environ.get(FAIL_HOOK) if wid == 0 else None
        actor = self.worker_cls.remote(self.cfg, self.model_ref, self.tokenizer, wid, self.hub, fail)
        return _Slot(wid, actor, actor.run.remote())

    # -- weights -------------------------------------------------------------------------------
    def publish(self, version: int, model: Any) -> None:
        """The learner's weights at ``version`` for every later claim (CPU tensors in the object
        store; the previous version's are freed once no worker holds them)."""
        if self.closed:
            return
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        self.weights_ref = self.ray.put(state)
        self._hub(self.hub.publish.remote(version, [self.weights_ref]))

    # -- batches -------------------------------------------------------------------------------
    def take(self, version: int) -> tuple[list, dict[str, float]]:
        """The next batch (B groups, lowest units first) for the learner at ``version``, waiting
        for the workers (and restarting dead ones) as long as it takes; and the step's
        ``async/*`` metrics."""
        t0 = time.perf_counter()
        dropped = 0
        while True:
            self.check_workers()
            groups, d = self._hub(self.hub.take.remote(self.cfg.questions_per_step, version))
            dropped += d
            if groups:
                break
            time.sleep(POLL_S)
        wait_s = time.perf_counter() - t0
        self._mark_used(groups)
        lags = [version - v for _, v, episodes in groups for _ in episodes]
        stats = self._hub(self.hub.stats.remote())
        now = time.perf_counter()
        rate = (stats["produced"] - self.last_produced) / max(1e-9, now - self.last_t)
        self.last_produced, self.last_t = stats["produced"], now
        metrics = {"async/lag_mean": sum(lags) / len(lags), "async/lag_max": float(max(lags)),
                   "async/dropped_stale": float(dropped), "async/episodes_per_s": rate,
                   "async/buffer": float(stats["buffer"]), "async/worker_restarts": float(self.restarts),
                   "async/wait_s": wait_s}
        return [e for _, _, episodes in groups for e in episodes], metrics

    def _hub(self, ref: Any) -> Any:
        """The result of a call on the hub; its death ends the rollouts."""
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayActorError as exc:
            raise RolloutError(f"the rollout hub died ({_summary(exc)})") from None

    def _mark_used(self, groups: list) -> None:
        """Every unit is used once: a second use is a bug, never trained on."""
        units = [u for u, _, _ in groups]
        again = sorted(set(units) & self.used)
        if again or len(set(units)) != len(units):
            raise RolloutError(f"units {again or units} were handed to the learner twice")
        self.used.update(units)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the units used (buffered episodes are generated again)."""
        return pack_used(self.used)

    # -- workers -------------------------------------------------------------------------------
    def check_workers(self) -> None:
        """Restart every worker whose loop has ended."""
        ray = self.ray
        runs_ = {slot.run: i for i, slot in enumerate(self.slots)}
        ended, _ = ray.wait(list(runs_), num_returns=len(runs_), timeout=0)
        for ref in ended:
            try:
                ray.get(ref)
                why = "its loop returned"
            except Exception as exc:  # noqa: BLE001  (killed, crashed or raised: all restart it)
                why = _summary(exc)
            self._restart(runs_[ref], why)

    def _restart(self, i: int, why: str) -> None:
        old = self.slots[i]
        lost = self._hub(self.hub.release.remote(old.worker_id))
        self.ray.kill(old.actor, no_restart=True)
        self.restarts += 1
        if self.restarts > self.options.max_worker_restarts:
            raise RolloutError(f"rollout worker {old.worker_id} died ({why}); {self.restarts} worker deaths in "
                               f"this run, over --max-worker-restarts {self.options.max_worker_restarts}")
        self.log(f"rollout worker {old.worker_id} died ({why}); {lost} unfinished groups dropped and queued "
                 f"again; starting worker {self.next_id} in its place")
        self.slots[i] = self._spawn()

    def close(self) -> None:
        """Stop the workers (a short grace, then killed), kill every actor, and shut down the Ray
        instance this pool started. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        ray = self.ray
        try:
            hub = getattr(self, "hub", None)
            if hub is not None:
                hub.stop.remote()
                if self.slots:
                    ray.wait([s.run for s in self.slots], num_returns=len(self.slots), timeout=STOP_WAIT_S)
            for actor in [s.actor for s in self.slots] + ([hub] if hub is not None else []):
                with contextlib.suppress(Exception):  # already dead
                    ray.kill(actor, no_restart=True)
        finally:
            self.slots, self.weights_ref = [], None
            if self.started:
                ray.shutdown()


def _cpu_copy(model: Any) -> Any:
    """A CPU copy of the student for the workers (the learner's may be on a GPU)."""
    twin = copy.deepcopy(model).to("cpu")
    return twin.requires_grad_(False).eval()


def _summary(exc: BaseException) -> str:
    """An exception's type and the last line of its message (Ray's carry the remote traceback)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    if len(last) > 160 and ". " in last:  # Ray's own errors are one long paragraph: its first sentence
        last = last.split(". ")[0] + "."
    return f"{type(exc).__name__}: {last}"[:300]


# ------------------------------------------------------------------------------------------------
# The plugin
# ------------------------------------------------------------------------------------------------

@dataclass
class AsyncOptions(Config):
    """Asynchronous rollouts on Ray"""

    async_rollouts: bool = field(False, help="asynchronous actor-learner mode on Ray (pip install 'memopd[ray]'): "
                                             "--rollout-workers Ray actors sample episodes continuously with the "
                                             "latest published student weights into a bounded buffer; each step "
                                             "trains on a batch from it and publishes the new weights")
    max_staleness: int = field(1, help="async rollouts: the most policy versions a sample used may lag the trained "
                                       "policy (workers wait when this far ahead; staler samples are dropped and "
                                       "generated again; 0: every step waits for its own rollouts)", range=(0, None))
    rollout_workers: int = field(1, help="async rollouts: Ray actors sampling episodes (each a CPU copy of the "
                                         "student, one torch thread)", range=(1, None))
    max_worker_restarts: int = field(3, help="async rollouts: a dead worker is replaced (its unfinished episodes "
                                             "dropped) up to this many times in a run; one more death ends it",
                                     range=(0, None))
    ray_address: str | None = field(None, help="async rollouts: the Ray cluster to join (ray start ...); default: "
                                               "a local instance started and shut down by the run")



class AsyncRollouts(Plugin):
    """Puts the workers' batches in place of the step's rollout, and publishes the weights after
    every update; the workers run from :meth:`start` to :meth:`close` (or the last batch taken,
    so that the final evaluation runs alone)."""

    name = "async"
    Options = AsyncOptions
    order = 50
    requires = ("freshness",)  # stale samples: their lag and drift are logged
    excludes = {"staleness": "--async-rollouts and --simulated-staleness exclude each other: the simulation is the "
                             "synchronous stand-in for asynchronous workers; bound real staleness with --max-staleness",
                "adaptive_depth": "--async-rollouts does not support --adaptive-depth yet (the workers roll out full "
                                  "episodes)"}

    @classmethod
    def check(cls, options: AsyncOptions, cfg: CoreConfig) -> None:
        """One learner process, one env, workers on transformers, and Ray installed."""
        if distributed.launched_size() > 1:
            raise ConfigError("--async-rollouts runs in one learner process in this version, not under torchrun")
        if cfg.backend != "hf":
            raise ConfigError(f"--async-rollouts: the rollout workers sample with transformers (--backend hf), "
                              f"not --backend {cfg.backend}")
        if cfg.env_mix:  # a worker's units are questions of one env
            raise ConfigError("--async-rollouts samples one env in this version; give one --env")
        if not ray_available():
            raise ConfigError(f"--async-rollouts needs Ray, which is not installed: {RAY_HINT}")

    @classmethod
    def legacy_state(cls, saved: Any) -> dict[str, Any]:
        return {"units": saved.get("async")}

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.pool: RolloutPool | None = None
        self.saved: dict[str, Any] | None = None  # the units used, as checkpointed

    @classmethod
    def enabled(cls, options: AsyncOptions) -> bool:
        return options.async_rollouts

    def start(self, step: int) -> None:
        if step < self.ctx.cfg.steps:
            self.pool = RolloutPool(self.ctx.cfg, self.options, self.ctx.student, self.ctx.tokenizer, step,
                                    self.saved, log=self.ctx.log)

    def wrap_rollout(self, rollout: RolloutFn) -> RolloutFn:
        def take(step: int, limits: RolloutLimits) -> Rollout:
            t0 = time.perf_counter()
            with self._fatal():
                episodes, metrics = self.pool.take(step)
            if step + 1 >= self.ctx.cfg.steps:
                self.close()
            return Rollout(episodes, time.perf_counter() - t0, metrics)
        return take

    def end_step(self, result: StepResult) -> dict[str, float]:
        if self.pool is not None:
            with self._fatal():
                self.pool.publish(result.step + 1, self.ctx.student)  # the weights' version after this update
        return {}

    @contextlib.contextmanager
    def _fatal(self) -> Any:
        """The workers cannot go on: the run ends, its last checkpoint intact."""
        try:
            yield
        except RolloutError as exc:
            raise TrainingError(f"{exc}; the last checkpoint is intact: continue with --resume "
                                f"{self.ctx.run_dir}") from exc

    def close(self) -> None:
        if self.pool is not None:
            self.saved = self.pool.state()
            self.pool.close()
            self.pool = None

    def state_dict(self) -> dict[str, Any]:
        return {"units": self.pool.state() if self.pool is not None else self.saved}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = state.get("units")


__all__ = ["AsyncOptions", "AsyncRollouts", "Hub", "RAY_HINT", "RolloutError", "RolloutPool", "RolloutWorker",
           "import_ray", "ray_available"]
