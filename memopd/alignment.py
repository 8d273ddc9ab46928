"""State-alignment check (the paper's verification of MemOPD's teacher context).

With teacher = student weights, scoring each sampled action must reproduce the log-probs
recorded at rollout. Aligned scoring (each invocation's own restored state) does so across
every context update (turns 1..n) up to float error (<= 1e-4 in fp32); persistent scoring (the
flattened history) does not, and its gap is what an OPD teacher would wrongly supervise with.
The result is a per-turn table of max and mean |log p_scored - log p_recorded| for each mode.
:func:`teacher_shift` measures the same thing from the teacher's side: per turn, how far the
persistent history moves a teacher's full next-token distribution from the one it has under the
student's exact state, KL(p_aligned || p_persistent) over the whole vocabulary.

CLI::

    python -m memopd.alignment EPISODES.jsonl --model SPEC [--attn blocks|sdpa|eager|flex|flash] [--max-episodes N] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Sequence

import torch

from agents.records import Episode, Invocation
from memgym.cli import run_main
from memopd.config import DEFAULT_THREADS, THREADS_HELP
from memopd.attention import LOWERINGS
from memopd.contexts import MODES, episode_invocations
from memopd.inputs import DTYPES, INPUT_ERRORS, load_cli_inputs
from memopd.losses import divergence_from_states
from memopd.packing import PackedBatch, fitting_budget, pack_episodes
from memopd.scoring import episode_states, score


@dataclass
class TurnGap:
    """|scored - recorded| log-prob statistics of one turn in one mode."""

    turn: int
    tokens: int
    max_gap: float
    mean_gap: float


@dataclass
class AlignmentReport:
    """Per mode, per turn gaps between re-scored and recorded log-probs."""

    turns: dict[str, list[TurnGap]] = field(default_factory=dict)  # mode -> rows by turn
    tolerance: float = 1e-4

    def max_gap(self, mode: str) -> float:
        return max((t.max_gap for t in self.turns[mode]), default=0.0)

    @property
    def aligned_ok(self) -> bool:
        return "aligned" in self.turns and self.max_gap("aligned") <= self.tolerance

    def table(self) -> str:
        modes = list(self.turns)
        head = f"{'turn':>4} {'tokens':>7}" + "".join(f"  {m + ' max':>15} {m + ' mean':>16}" for m in modes)
        lines = [head]
        by_turn = {m: {t.turn: t for t in rows} for m, rows in self.turns.items()}
        for turn in sorted({t for rows in by_turn.values() for t in rows}):
            cells = [f"{turn:>4} {by_turn[modes[0]][turn].tokens:>7}"]
            for m in modes:
                row = by_turn[m][turn]
                cells.append(f"  {row.max_gap:>15.3e} {row.mean_gap:>16.3e}")
            lines.append("".join(cells))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"tolerance": self.tolerance, "aligned_ok": self.aligned_ok,
                "turns": {m: [vars(t) for t in rows] for m, rows in self.turns.items()}}


@torch.no_grad()
def state_alignment(model: torch.nn.Module, episodes: Sequence[Episode | Sequence[Invocation]], *,
                    modes: Sequence[str] = MODES, lowering: str | None = None, max_tokens: int = 4096,
                    tolerance: float = 1e-4) -> AlignmentReport:
    """Re-score every sampled token with ``model`` (the weights that sampled the episodes) in each
    context mode and tabulate the gap to the recorded log-probs per turn (``Invocation.turn``)."""
    invs = episode_invocations(episodes)
    report = AlignmentReport(tolerance=tolerance)
    for mode in modes:
        batch = pack_episodes(episodes, fitting_budget(episodes, mode, max_tokens), mode=mode)
        scores = score(model, batch, lowering=lowering)
        gap = (scores.logprobs.double().cpu() - batch.old_logprobs.double()).abs()
        report.turns[mode] = per_turn(gap, batch, invs)
    return report


def per_turn(values: torch.Tensor, batch: PackedBatch, invs: list[list[Invocation]]) -> list[TurnGap]:
    """Max and mean of per-action ``values`` [N] grouped by the turn of each action's invocation."""
    turn = torch.tensor([invs[e][j].turn for e, j, _ in batch.token_map.tolist()], dtype=torch.long)
    return [TurnGap(t, int((turn == t).sum()), float(values[turn == t].max()), float(values[turn == t].mean()))
            for t in sorted(set(turn.tolist()))]


@torch.no_grad()
def teacher_shift(teacher: torch.nn.Module, episodes: Sequence[Episode | Sequence[Invocation]], *,
                  lowering: str | None = None, max_tokens: int = 4096) -> list[TurnGap]:
    """Per turn, max and mean of the full-vocabulary KL(p_aligned || p_persistent) of ``teacher``
    at every sampled position: the change in the distillation target that persistent-history
    scoring causes. Zero at turn 0 (no history yet); any model, not only the sampler."""
    invs = episode_invocations(episodes)
    states = {}
    for mode in MODES:
        states[mode], batch = episode_states(teacher, episodes, mode=mode, lowering=lowering,
                                             max_tokens=fitting_budget(episodes, mode, max_tokens))
    kl = divergence_from_states(states["aligned"], states["persistent"], "rkl").double().cpu()
    return per_turn(kl, batch, invs)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memopd.alignment", description=__doc__.split("CLI::")[0].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("episodes", help="episodes JSONL sampled by --model")
    ap.add_argument("--model", required=True, help="the model spec that sampled the episodes")
    ap.add_argument("--attn", choices=LOWERINGS, default=None,
                    help="attention lowering (default: the first that is exact for the model)")
    ap.add_argument("--max-episodes", type=int, default=None, help="check only the first N episodes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="torch device (default: cuda when available, else cpu)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="model dtype (default: float32)")
    ap.add_argument("--tolerance", type=float, default=1e-4, help="max aligned gap that passes (default: 1e-4)")
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)

    def run() -> int:
        model, episodes = load_cli_inputs(args)
        rep = state_alignment(model, episodes, lowering=args.attn, tolerance=args.tolerance)
        if args.json:
            print(json.dumps(rep.to_dict(), indent=2))
        else:
            print(f"state alignment of {len(episodes)} episodes, model {args.model} "
                  f"(|log p scored - log p recorded| per turn)")
            print(rep.table())
            print(f"aligned max gap {rep.max_gap('aligned'):.3e} "
                  f"({'<=' if rep.aligned_ok else '>'} {rep.tolerance:g}); "
                  f"persistent max gap {rep.max_gap('persistent'):.3e}")
        return 0 if rep.aligned_ok else 1

    return run_main(run, INPUT_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
