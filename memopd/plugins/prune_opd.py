"""Prune-OPD: detect the student's prefix drift from the teacher, down-weight the distillation terms
after it, and stop the drifting episode's rollout.

The rule (one detector, :class:`DriftDetector`, used by both sides): at every action token the
student's and the teacher's k most likely next tokens overlap (:func:`memopd.losses.topk_overlap`);
an episode *drifts* at the first of ``--prune-patience`` consecutive tokens (in call order, across
calls) whose overlap is below ``--prune-threshold``.

- **Weights** (the learner, before the update): from the drift event on, the episode's tokens
  weigh ``--prune-decay`` in the drifting call and ``decay ** (1 + c)`` in the c-th call after it
  (monotonically less); an episode that never drifts keeps weight 1.
- **Rollout stop** (``--prune-stop``, the default): the same detector runs while the episode is
  generated: after each round of model calls the calls just made are packed, the student and the
  teacher score them (each call's own state-aligned context), and an episode whose run reaches
  the patience stops after that call; it trains like an episode cut by a rollout-depth budget (no
  answer and no reward, distillation terms only). An episode that never drifts runs to its answer.

Both sides score with the weights of the rollout, so the learner finds the rollout's events (up to
float noise at the threshold).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from agents.records import Episode, Invocation
from memopd import distributed, losses
from memopd.config import ConfigError, field
from memopd.learn.actor import Rollout, RolloutLimits
from memopd.learn.models import pad_id
from memopd.learn.plugin import LossWeights, Plugin, RolloutFn, WeighContext
from memopd.packing import PackedBatch, pack_episodes
from memopd.scoring import ActionStates, action_states

States = Callable[[PackedBatch], ActionStates]


@dataclass
class PruneOPDOptions:
    """Prune-OPD: drift detection, down-weighting and rollout stops"""

    prune_opd: bool = field(False, help="Prune-OPD: down-weight the distillation terms of an episode after its "
                                        "prefix drifts from the teacher (the student's and the teacher's top-k next "
                                        "tokens overlap below --prune-threshold for --prune-patience tokens in a row)")
    prune_topk: int = field(8, help="Prune-OPD: k of the top-k overlap", range=(1, None))
    prune_threshold: float = field(0.25, help="Prune-OPD: overlap below which a token counts towards a drift",
                                   range=(0.0, 1.0))
    prune_patience: int = field(4, help="Prune-OPD: consecutive low-overlap tokens that make a drift event",
                                range=(1, None))
    prune_decay: float = field(0.5, help="Prune-OPD: weight of the drifting call's later tokens; each later "
                                         "call's tokens weigh this times less again", range=(0.0, 1.0))
    prune_stop: bool = field(True, help="Prune-OPD: also stop a drifting episode's rollout after the call it "
                                        "drifts in (the student and the teacher score each round of calls as it "
                                        "is made; the episode then trains on distillation terms only); "
                                        "--no-prune-stop keeps full rollouts")

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]
        if self.prune_opd and self.prune_stop:
            self._check_prune_stop()

    def _check_prune_stop(self) -> None:
        """The rollout stop scores each call as it is made, in its state-aligned context, with
        whole-weight models in this process."""
        off = "; pass --no-prune-stop to keep full rollouts (the distillation weights still decay after a drift)"
        cfg: Any = self
        if cfg.teacher_context != "aligned":
            raise ConfigError("--prune-opd stops rollouts by scoring each call in its state-aligned context, which "
                              f"--teacher-context {cfg.teacher_context} does not train on" + off)
        if cfg.async_rollouts:
            raise ConfigError("--prune-opd cannot stop the rollouts of --async-rollouts workers" + off)
        if cfg.teacher_parallel == "fsdp" and distributed.launched_size() > 1:
            raise ConfigError("--prune-opd scores rollouts with a whole teacher on each rank; use --teacher-parallel "
                              "replicate" + off)


class DriftDetector:
    """Prune-OPD's drift rule over an episode's action tokens, fed a call at a time in call order:
    ``patience`` consecutive low-overlap tokens (overlap below the threshold) make a drift event."""

    def __init__(self, patience: int) -> None:
        self.patience = patience
        self.runs: dict[Any, tuple[int, tuple[int, int]]] = {}  # episode -> (run length, where the run started)
        self.events: dict[Any, tuple[int, int]] = {}  # episode -> (call, token) where its drifting run started

    def feed(self, episode: Any, call: int, tokens: Sequence[int], low: Sequence[bool]) -> bool:
        """One call's tokens (their indices in the call, in order) and whether each one's overlap
        is low; True when the episode's drift event completes in this call."""
        if episode in self.events:
            return False
        run, start = self.runs.get(episode, (0, (call, 0)))
        for t, is_low in zip(tokens, low):
            run = run + 1 if is_low else 0
            if run == 1:
                start = (call, t)
            if run >= self.patience:
                self.events[episode] = start
                return True
        self.runs[episode] = (run, start)
        return False


def drift_weights(overlap: torch.Tensor, token_map: torch.Tensor, threshold: float, patience: int,
                  decay: float) -> tuple[torch.Tensor, dict[int, tuple[int, int]]]:
    """Prune-OPD's weights of the distillation terms from the per-token overlap of a step.

    ``overlap`` [N] and ``token_map`` [N, 3] (episode, invocation, token) list the action tokens in
    canonical order. Returns (weights [N], {episode: (invocation, token) of its drift event})."""
    rows = token_map.tolist()
    low = (overlap < threshold).tolist()
    detector = DriftDetector(patience)
    calls: dict[int, list[int]] = {}  # episode -> its calls in order
    i = 0
    while i < len(rows):  # one call's tokens at a time (canonical order keeps them together)
        e, j = rows[i][0], rows[i][1]
        k = i
        while k < len(rows) and rows[k][:2] == [e, j]:
            k += 1
        detector.feed(e, j, [r[2] for r in rows[i:k]], low[i:k])
        calls.setdefault(e, []).append(j)
        i = k
    weights = torch.ones(len(overlap))
    for i, (e, j, t) in enumerate(rows):
        if e in detector.events and (j, t) >= detector.events[e]:
            ej = detector.events[e][0]
            weights[i] = decay ** (1 + calls[e].index(j) - calls[e].index(ej))
    return weights, dict(detector.events)


class DriftMonitor:
    """The ``monitor`` of :func:`agents.rollout.rollout` for the rollout stop: ``student`` and
    ``teacher`` map a packed batch to the model's states at its action tokens (no grad)."""

    def __init__(self, student: States, teacher: States, *, k: int, threshold: float, patience: int,
                 pack_tokens: int, pad_token_id: int = 0, chunk_size: int = 1024) -> None:
        self.student, self.teacher = student, teacher
        self.k, self.threshold, self.patience = k, threshold, patience
        self.pack_tokens, self.pad_token_id, self.chunk_size = pack_tokens, pad_token_id, chunk_size
        self.reset()

    def reset(self) -> None:
        """Forget the episodes of the previous rollout."""
        self.detector = DriftDetector(self.patience)
        self.calls: dict[str, int] = {}  # episode id -> calls scored
        self.events: dict[str, int] = {}  # episode id -> the call (index in the episode) it drifted in
        self.seconds = 0.0  # spent scoring (this rollout)

    @property
    def runs(self) -> dict[str, int]:
        """Episode id -> its current run of low-overlap tokens (episodes that have not drifted)."""
        return {e: run for e, (run, _) in self.detector.runs.items()}

    @torch.no_grad()
    def __call__(self, new: dict[int, tuple[str, Invocation]]) -> set[int]:
        """Score the calls just made; returns the slots whose episodes drifted in them."""
        t0 = time.perf_counter()
        slots = [s for s in new if new[s][1].response_ids]
        if not slots:
            return set()
        batch = pack_episodes([[new[s][1]] for s in slots], max(self.pack_tokens, max(
            len(new[s][1].input_ids) for s in slots)), mode="aligned", pad_token_id=self.pad_token_id)
        overlap = losses.overlap_from_states(self.student(batch), self.k, self.chunk_size,
                                             teacher=self.teacher(batch)).float().cpu()
        per_call: dict[int, list[tuple[int, bool]]] = {}
        for (e, _, t), is_low in zip(batch.token_map.tolist(), (overlap < self.threshold).tolist()):
            per_call.setdefault(e, []).append((t, is_low))
        stop = set()
        for e, toks in per_call.items():
            episode = new[slots[e]][0]
            self.calls[episode] = self.calls.get(episode, 0) + 1
            toks.sort()
            if self.detector.feed(episode, self.calls[episode] - 1, [t for t, _ in toks], [f for _, f in toks]):
                self.events[episode] = self.calls[episode] - 1
                stop.add(slots[e])
        self.seconds += time.perf_counter() - t0
        return stop


class PruneOPD(Plugin):
    name = "prune_opd"
    Options = PruneOPDOptions

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        cfg = ctx.cfg
        self.monitor = None
        if cfg.prune_stop and ctx.teacher is not None:  # both models with whole weights (checked by the options)
            self.monitor = DriftMonitor(lambda b: action_states(ctx.student, b, lowering=cfg.attn),
                                        lambda b: action_states(ctx.teacher.model, b, lowering=cfg.attn),
                                        k=cfg.prune_topk, threshold=cfg.prune_threshold, patience=cfg.prune_patience,
                                        pack_tokens=cfg.pack_tokens, pad_token_id=pad_id(ctx.tokenizer),
                                        chunk_size=cfg.kl_chunk)

    @classmethod
    def enabled(cls, cfg: Any) -> bool:
        return cfg.prune_opd

    def wrap_rollout(self, rollout: RolloutFn) -> RolloutFn:
        monitor = self.monitor
        if monitor is None:
            return rollout

        def monitored(step: int, limits: RolloutLimits) -> Rollout:
            monitor.reset()
            out = rollout(step, RolloutLimits(limits.max_calls, monitor))
            out.metrics.update(stop_stats(monitor, out.episodes, out.seconds))
            return out
        return monitored

    @torch.no_grad()
    def weigh(self, weights: LossWeights, ctx: WeighContext) -> dict[str, float]:
        """The student's top-k overlap with the teacher at every action before the update (a forward
        pass of its own), each episode's drift event, and the weights of the distillation terms
        after it. Stats over every rank."""
        cfg = self.ctx.cfg
        if ctx.teacher_states is None:
            return {}
        batch = ctx.batch
        overlap = torch.zeros(batch.num_actions)
        for mb in ctx.minibatches:
            uid = mb.action_uid
            t, t_lp = ((None, ctx.teacher_logp[uid]) if ctx.teacher_logp is not None
                       else (ctx.teacher_states.select(uid), None))
            overlap[uid] = losses.overlap_from_states(ctx.student_states(mb), cfg.prune_topk, cfg.kl_chunk, t,
                                                      t_lp).float().cpu()
        w, events = drift_weights(overlap, batch.token_map, cfg.prune_threshold, cfg.prune_patience, cfg.prune_decay)
        weights.opd = weights.opd * w
        sup = batch.teacher
        episodes = len(set(batch.token_map[:, 0].tolist()))
        n_sup, ov_sum, n_low, n_ep, n_drift = distributed.all_sum(
            [float(sup.sum()), float(overlap[sup].sum()), float((w[sup] < 1).sum()), episodes, len(events)],
            ctx.world)
        return {"prune/overlap": ov_sum / max(n_sup, 1.0), "prune/downweighted_tokens": n_low / max(n_sup, 1.0),
                "prune/drift_episodes": n_drift / max(n_ep, 1.0)}


def stop_stats(monitor: DriftMonitor, episodes: Sequence[Episode], rollout_s: float) -> dict[str, float]:
    """A rollout's stops: episodes stopped, the calls they did not make (the env's turns left: a
    memory call per chunk and the answer), and the rollout time spent scoring calls;
    ``prune/rollout_saved_s`` estimates the time the skipped calls would have taken at this
    rollout's mean time per call."""
    calls = [len(e.invocations) for e in episodes]
    skipped = sum(max(0, int(e.turns or c) - c) for e, c in zip(episodes, calls) if e.cut is not None)
    per_call = rollout_s / max(1, sum(calls))
    stopped = [float(e.cut is not None) for e in episodes]
    return {"prune/stopped_episodes": sum(stopped) / len(stopped) if stopped else float("nan"),
            "prune/calls_skipped": float(skipped), "prune/monitor_s": monitor.seconds,
            "prune/rollout_saved_s": skipped * per_call}


__all__ = ["DriftDetector", "DriftMonitor", "PruneOPD", "PruneOPDOptions", "drift_weights", "stop_stats"]
