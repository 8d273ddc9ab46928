"""Prune-OPD's rollout side: stop an episode's rollout at the turn boundary after its drift event.

The learner's side (:func:`memopd.losses.drift_weights`) down-weights the distillation terms after
an episode's drift event. Here the same detector runs while the episode is generated: after each
round of model calls, the calls just made (one per running environment) are packed together, the
student and the teacher score them (each call's own state-aligned context, as the learner's teacher
does), and every action token's top-k overlap extends its episode's run of low-overlap tokens.
An episode whose run reaches the patience has drifted: its rollout stops after this call, and it
trains like an episode cut by a rollout-depth budget (no answer and no reward, distillation terms
only). An episode that never drifts runs to its answer: the window stays the whole episode.

Both models score with their weights of the rollout; the learner recomputes the overlaps with the
same weights before its update, so it finds the same events (up to float noise at the threshold).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from agents.records import Invocation
from memopd import losses
from memopd.packing import PackedBatch, pack_episodes
from memopd.scoring import ActionStates

States = Callable[[PackedBatch], ActionStates]


class DriftMonitor:
    """The ``monitor`` of :func:`agents.rollout.rollout` for Prune-OPD (``--prune-opd``).

    ``student`` and ``teacher`` map a packed batch to the model's states at its action tokens (no
    grad is taken). A drift event: ``patience`` consecutive action tokens, across an episode's
    calls in order, whose top-``k`` overlap is below ``threshold`` (the learner's rule)."""

    def __init__(self, student: States, teacher: States, *, k: int, threshold: float, patience: int,
                 pack_tokens: int, pad_token_id: int = 0, chunk_size: int = 1024) -> None:
        self.student, self.teacher = student, teacher
        self.k, self.threshold, self.patience = k, threshold, patience
        self.pack_tokens, self.pad_token_id, self.chunk_size = pack_tokens, pad_token_id, chunk_size
        self.runs: dict[str, int] = {}  # episode id -> its current run of low-overlap tokens
        self.events: dict[str, int] = {}  # episode id -> the call (index in the episode) it drifted in
        self.calls: dict[str, int] = {}  # episode id -> calls scored
        self.seconds = 0.0  # spent scoring (this rollout)

    def reset(self) -> None:
        """Forget the episodes of the previous rollout."""
        self.runs, self.events, self.calls, self.seconds = {}, {}, {}, 0.0

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
        stop = set()
        for e, low in _runs_in_order(batch, overlap < self.threshold).items():
            episode = new[slots[e]][0]
            self.calls[episode] = self.calls.get(episode, 0) + 1
            if episode in self.events:
                continue
            run = self.runs.get(episode, 0)
            for is_low in low:
                run = run + 1 if is_low else 0
                if run >= self.patience:
                    self.events[episode] = self.calls[episode] - 1
                    stop.add(slots[e])
                    break
            self.runs[episode] = run
        self.seconds += time.perf_counter() - t0
        return stop


def _runs_in_order(batch: PackedBatch, low: torch.Tensor) -> dict[int, list[bool]]:
    """Per packed episode (here: one call each), its action tokens' flags in token order."""
    out: dict[int, list[tuple[int, bool]]] = {}
    for (e, _, t), flag in zip(batch.token_map.tolist(), low.tolist()):
        out.setdefault(e, []).append((t, flag))
    return {e: [f for _, f in sorted(v)] for e, v in out.items()}


__all__ = ["DriftMonitor"]
