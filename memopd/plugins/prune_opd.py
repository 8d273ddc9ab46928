"""Prune-OPD (Yang et al., 2026, "Efficient and Reliable On-Policy Distillation for Long-Horizon
Reasoning"), the rule as the authors' released code computes it, on MemAgent's calls.

**Drift and reliability** (the learner, before the update). At every action token t of an
episode, in call order across its calls:

    o_t = |S_t ∩ T_t| / K          S_t, T_t: the student's and the teacher's K likeliest next tokens
    b_t = 1[o_t < δ]               a drift event (--prune-topk K, --prune-threshold δ)
    N_t = sum_{s <= t} b_s         the episode's events so far: its prefix's drift
    w_t = clip(1 - λ N_t, 0, 1)    (--prune-drop λ)
    ω_t = (w_t + β) / (1 + β)      the token's distillation weight (--prune-floor β)

The distillation loss divides by the supervised tokens' count, not by the weights' sum
(:class:`memopd.learn.plugin.LossWeights`), so ω lowers the drifted tokens' part of the loss, also
when every episode drifts. The student's top-K is the one its sampling distribution had (recorded
by the rollout, ``Backend.record_topk``); a backend that does not record it costs a forward.

**The window: truncation and expansion** (``--prune-window L0``, across steps). The rollouts are
cut at L model calls (a cut episode has no answer and no reward: distillation terms only). After
each step, with ℓ_e the calls of episode e before its reliability w reaches 0 (all of them if it
never does), B = max(L_min, L - m) and H the share of episodes with ℓ_e >= B (one that answered in
fewer calls is no hit):

    H >= h:  L <- min(L + Δ, L_max), misses <- 0         (compatibility holds: expand)
    else:    misses += 1; at P misses L <- max(L - Δ, L_min), misses <- 0

Where this departs from the paper (docs/methods.md): the window counts model calls, not generated
tokens (Δ = m = 1 call; the paper: 100 tokens of 1,024-12,288); ω is the paper's ``w + β``
divided by ``1 + β``, so that ``--opd-coef`` keeps its meaning; tokens where the student and the
teacher agree on a near-certain next token (both top-1 the same, both at least
``--prune-format-prob``: MemAgent's "." and end tokens, whose top-K tails are noise) are no drift
events (the paper counts every token; 0 does here too).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from agents.records import Episode
from memopd import distributed
from memopd.config import Config, ConfigError, field
from memopd.learn.actor import Rollout, RolloutLimits
from memopd.learn.needs import Need
from memopd.learn.plugin import LossWeights, Plugin, RolloutFn, StepResult, WeighContext
from memopd.scoring import ActionStates, map_chunks
from memopd.runlog import mean


# -- the maths ------------------------------------------------------------------------------------

def topk_overlap(logp_s: torch.Tensor, logp_t: torch.Tensor, k: int) -> torch.Tensor:
    """[n] the share of the student's k most likely next tokens that are also among the
    teacher's k most likely (1: the same top-k set, 0: disjoint). Inputs [n, V]."""
    k = min(k, logp_s.shape[-1])
    return topk_ids_overlap(logp_s.topk(k, dim=-1).indices, logp_t.topk(k, dim=-1).indices)


def topk_ids_overlap(top_s: torch.Tensor, top_t: torch.Tensor) -> torch.Tensor:
    """[n] ``|S ∩ T| / K`` of two top-K id sets per row (``[n, K]`` each, the same K)."""
    return (top_s[:, :, None] == top_t[:, None, :]).any(-1).float().mean(-1)


def topk_from_states(states: ActionStates, k: int, chunk_size: int = 1024,
                     logp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k likeliest tokens at each action of ``states`` (or of a kept log-distribution ``logp``
    [N, V]) and their log-probs, most likely first: ([N, k] long, [N, k] float), no grad."""
    if logp is not None:
        vals, idx = logp.topk(min(k, logp.shape[-1]), dim=-1)
        return idx, vals.float()

    def fn(h: torch.Tensor, temp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lp = F.log_softmax(states.logits(h, temp), dim=-1)
        vals, idx = lp.topk(min(k, lp.shape[-1]), dim=-1)
        return idx, vals.float()

    with torch.no_grad():
        parts = map_chunks(fn, (states.hidden.detach(), states.temperatures), chunk_size)
    if not parts:
        return torch.zeros(0, k, dtype=torch.long), torch.zeros(0, k)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def reliability(low: torch.Tensor, episode: torch.Tensor, drop: float) -> torch.Tensor:
    """[N] ``w_t = clip(1 - drop * N_t, 0, 1)``, ``N_t`` the episode's drift events up to and
    including token t (tokens in call order, each episode's together)."""
    counts = torch.zeros(len(low), dtype=torch.float64)
    seen: dict[int, float] = {}
    for i, (e, b) in enumerate(zip(episode.tolist(), low.tolist())):
        seen[e] = seen.get(e, 0.0) + float(b)
        counts[i] = seen[e]
    return (1.0 - drop * counts).clamp(0.0, 1.0).float()


@dataclass
class PruneOPDOptions(Config):
    """Prune-OPD: drift detection, reliability weights and the rollout window"""

    prune_opd: bool = field(False, help="Prune-OPD: count drift events (the student's and the teacher's top-k "
                                        "next tokens overlap below --prune-threshold), lower each episode's later "
                                        "distillation weights by them, and cut rollouts at a window of calls that "
                                        "grows while compatibility holds")
    prune_topk: int = field(16, help="Prune-OPD: K of the top-K overlap", range=(1, None))
    prune_threshold: float = field(0.7, help="Prune-OPD: a token whose overlap is below this is a drift event",
                                   range=(0.0, 1.0))
    prune_drop: float = field(0.01, help="Prune-OPD: reliability lost per drift event of the episode so far "
                                         "(w = 1 - drop * events, at least 0)", range=(0.0, 1.0))
    prune_floor: float = field(0.5, help="Prune-OPD: the weight is (w + floor) / (1 + floor): an unreliable "
                                         "token keeps floor / (1 + floor)", range=(0.0, None))
    prune_format_prob: float = field(0.9, help="Prune-OPD: a token where the student and the teacher put at least "
                                               "this on the same next token is a format token, no drift event (0: "
                                               "every token counts, as in the paper)", range=(0.0, 1.0))
    prune_window: int = field(2, help="Prune-OPD: the rollout window's start, in model calls (rollouts are cut "
                                      "there; 0: no window, full rollouts)", range=(0, None))
    prune_window_min: int = field(1, help="Prune-OPD: the smallest window (calls)", range=(1, None))
    prune_window_max: int = field(0, help="Prune-OPD: the largest window (calls; 0: the longest episode seen)",
                                  range=(0, None))
    prune_window_step: int = field(1, help="Prune-OPD: calls the window grows or shrinks by", range=(1, None))
    prune_window_margin: int = field(1, help="Prune-OPD: an episode is a hit when it stays reliable for the "
                                             "window less this many calls", range=(0, None))
    prune_hit_ratio: float = field(0.1, help="Prune-OPD: the window grows when at least this share of the step's "
                                             "episodes are hits", range=(0.0, 1.0))
    prune_shrink_patience: int = field(3, help="Prune-OPD: steps in a row below the hit ratio before the window "
                                               "shrinks", range=(1, None))

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]
        if self.prune_opd and self.prune_window and self.prune_window < self.prune_window_min:
            raise ConfigError(f"--prune-window {self.prune_window} is below --prune-window-min "
                              f"{self.prune_window_min}")
        if self.prune_window_max and self.prune_window_max < self.prune_window_min:
            raise ConfigError(f"--prune-window-max {self.prune_window_max} is below --prune-window-min "
                              f"{self.prune_window_min}")


class Window:
    """Prune-OPD's rollout window (model calls) and its update from a step's hits."""

    def __init__(self, start: int, least: int, most: int, step: int, margin: int, hit_ratio: float,
                 patience: int) -> None:
        self.size, self.least, self.most = start, least, most
        self.step, self.margin, self.hit_ratio, self.patience = step, margin, hit_ratio, patience
        self.misses = 0
        self.longest = 0  # the most calls an uncut episode has had (the top when --prune-window-max is 0)

    def bound(self) -> int:
        """B: the reliable calls an episode needs to count as a hit."""
        return max(self.least, self.size - self.margin)

    def limit(self) -> int | None:
        """The rollouts' call cap (None: the window covers every episode's calls)."""
        return None if self.longest and self.size >= self.longest else self.size

    def update(self, hits: float, episodes: float, longest: int = 0) -> None:
        """A step's hit count out of its episodes in; the window for the next step."""
        self.longest = max(self.longest, longest)
        top = self.most or self.longest or self.size + self.step
        if episodes and hits / episodes >= self.hit_ratio:
            self.size, self.misses = min(self.size + self.step, max(top, self.least)), 0
            return
        self.misses += 1
        if self.misses >= self.patience:
            self.size, self.misses = max(self.size - self.step, self.least), 0

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "misses": self.misses, "longest": self.longest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.size = int(state.get("size", self.size))
        self.misses, self.longest = int(state.get("misses", 0)), int(state.get("longest", 0))


def reliable_calls(w: torch.Tensor, token_map: torch.Tensor, episodes: int, calls: Sequence[int]) -> list[int]:
    """ℓ_e per episode: its calls before the first one holding a token whose reliability is 0
    (``calls[e]``, all of them, when none does). ``w`` [N] and ``token_map`` [N, 3] in call order."""
    out = list(calls)
    for (e, j, _), v in zip(token_map.tolist(), w.tolist()):
        if v <= 1e-8 and j < out[e]:
            out[e] = j
    return out


def is_hit(reliable: int, calls: int, answered: bool, bound: int) -> bool:
    """An episode that stayed reliable up to the bound; one that answered before it is no hit."""
    return reliable >= bound and not (answered and calls < bound)


class PruneOPD(Plugin):
    name = "prune_opd"
    Options = PruneOPDOptions
    order = 30
    teacher_needs = (Need("distribution", "--prune-opd compares the teacher's whole distribution with the student's "
                          "at every token, so it needs a teacher with the student's vocabulary in this process",
                          "drop --prune-opd"),)

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        o = self.options
        self.window = (Window(o.prune_window, o.prune_window_min, o.prune_window_max, o.prune_window_step,
                              o.prune_window_margin, o.prune_hit_ratio, o.prune_shrink_patience)
                       if o.prune_window else None)
        self.pending: tuple[float, float] | None = None  # this step's (hits, episodes), every rank's

    @classmethod
    def enabled(cls, options: PruneOPDOptions) -> bool:
        return options.prune_opd

    def wrap_rollout(self, rollout: RolloutFn) -> RolloutFn:
        k = self.options.prune_topk

        def recorded(step: int, limits: RolloutLimits) -> Rollout:
            cap = limits.max_calls
            if self.window is not None and self.window.limit() is not None:
                cap = self.window.limit() if cap is None else min(cap, self.window.limit())
            return rollout(step, dataclasses.replace(limits, max_calls=cap, record_topk=max(k, limits.record_topk)))
        return recorded

    @torch.no_grad()
    def weigh(self, weights: LossWeights, ctx: WeighContext) -> dict[str, float]:
        """The overlap at every action (the student's recorded top-K against the teacher's), the
        drift events, the reliability weights of the distillation terms, and the window's hits.
        Stats over every rank."""
        o = self.options
        if not ctx.scored:
            return {}  # no teacher (--opd-coef 0): nothing to compare
        batch = ctx.batch
        overlap, fmt, recorded = drift_inputs(ctx, o.prune_topk, o.prune_format_prob, self.ctx.cfg.kl_chunk)
        low = (overlap < o.prune_threshold) & ~fmt
        w = reliability(low, batch.token_map[:, 0], o.prune_drop)
        weights.opd = weights.opd * (w + o.prune_floor) / (1.0 + o.prune_floor)
        sup = batch.teacher
        calls = [len(e.invocations) for e in ctx.episodes]
        reliable = reliable_calls(w, batch.token_map, len(calls), calls)
        bound = self.window.bound() if self.window is not None else 0
        hits = sum(is_hit(r, c, e.cut is None, bound) for r, c, e in zip(reliable, calls, ctx.episodes))
        drifted = len(set(batch.token_map[low, 0].tolist()))
        n_sup, ov_sum, n_low, n_fmt, n_ep, n_drift, n_hit, w_sum = distributed.all_sum(
            [float(sup.sum()), float(overlap[sup].sum()), float(low[sup].sum()), float(fmt[sup].sum()),
             len(calls), drifted, hits, float(w[sup].sum())], ctx.world)
        self.pending = (n_hit, n_ep)
        return {"prune/overlap": ov_sum / max(n_sup, 1.0), "prune/drift_tokens": n_low / max(n_sup, 1.0),
                "prune/format_tokens": n_fmt / max(n_sup, 1.0), "prune/drift_episodes": n_drift / max(n_ep, 1.0),
                "prune/reliability": w_sum / max(n_sup, 1.0), "prune/hit_ratio": n_hit / max(n_ep, 1.0),
                "prune/recorded_topk": float(recorded)}

    def end_step(self, result: StepResult) -> dict[str, float]:
        if self.window is None:
            return {}
        out = {"prune/window": float(self.window.size)}
        if self.pending is not None:
            longest = max((len(e.invocations) for e in result.episodes if e.cut is None), default=0)
            self.window.update(*self.pending, longest=longest)
            self.pending = None
        out["prune/cut_episodes"] = mean([float(e.cut is not None) for e in result.episodes])
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window.state_dict()} if self.window is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.window is not None and isinstance(state.get("window"), dict):
            self.window.load_state_dict(state["window"])


def drift_inputs(ctx: WeighContext, k: int, format_prob: float, chunk: int
                 ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Per action token: the top-K overlap of the student's sampling distribution with the
    teacher's, whether it is a format token, and whether the student's top-K came from the
    rollout's records (else from a forward of the student before the update)."""
    batch = ctx.batch
    n = batch.num_actions
    s_ids, s_lp = recorded_topk(ctx.episodes, batch.token_map, k)
    recorded = s_ids is not None
    if s_ids is None:
        s_ids, s_lp = torch.zeros(n, k, dtype=torch.long), torch.zeros(n, k)
        for mb in ctx.minibatches:
            s_ids[mb.action_uid], s_lp[mb.action_uid] = topk_from_states(ctx.student_states(mb), k, chunk)
    t_ids, t_lp = topk_from_states(ctx.teacher_states, k, chunk, ctx.teacher_logp)  # weigh checked one is there
    overlap = topk_ids_overlap(s_ids, t_ids)
    fmt = torch.zeros(n, dtype=torch.bool)
    if format_prob > 0:
        fmt = (s_ids[:, 0] == t_ids[:, 0]) & (s_lp[:, 0].exp() >= format_prob) & (t_lp[:, 0].exp() >= format_prob)
    return overlap, fmt, recorded


def recorded_topk(episodes: Sequence[Episode], token_map: torch.Tensor, k: int
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The student's top-K at each action token as the rollout recorded it ([N, K] ids and
    log-probs), or (None, None) when any call lacks it or recorded fewer than K."""
    ids, lps = [], []
    for e, j, t in token_map.tolist():
        inv = episodes[e].invocations[j]
        if inv.topk_ids is None or len(inv.topk_ids[t]) < k:
            return None, None
        ids.append(inv.topk_ids[t][:k])
        lps.append(inv.topk_logprobs[t][:k])
    if not ids:
        return torch.zeros(0, k, dtype=torch.long), torch.zeros(0, k)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(lps, dtype=torch.float32)



__all__ = ["PruneOPD", "PruneOPDOptions", "Window", "drift_inputs", "is_hit", "recorded_topk", "reliability",
           "reliable_calls", "topk_from_states", "topk_ids_overlap", "topk_overlap"]
