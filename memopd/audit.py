"""Rollout Context Equivalence (RCE) audit: packed execution must reproduce running each
invocation alone.

For every action token (the position before each sampled token), compare the full-vocabulary
log-probs of packed scoring with those of the **model's own forward** on the same invocation run
by itself: ``model(prompt + response, position_ids)`` with eager attention, its ``.logits`` as
the model returns them (so anything the model does after its decoder — logit scaling,
soft-capping — is in the reference, never taken from the packer's own head):
``max |log p_pack - log p_alone| <= eps`` (fp32 CPU: about 1e-5; the default tolerance is 1e-4).
This is an audit, not a loss. Mode ``persistent`` runs the same comparison on the flattened
history, where large differences are expected (it scores actions under other states).

CLI::

    python -m memopd.audit EPISODES.jsonl --model SPEC [--mode aligned|persistent|both]
        [--attn blocks|sdpa|eager|flex|flash] [--max-episodes N] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from agents.records import Episode, Invocation
from memgym.cli import run_main
from memopd.config import DEFAULT_THREADS, THREADS_HELP
from memopd.attention import LOWERINGS, attn_implementation, resolve_lowering
from memopd.contexts import MODES, episode_invocations
from memopd.inputs import DTYPES, INPUT_ERRORS, load_cli_inputs
from memopd.packing import fitting_budget, pack_episodes
from memopd.scoring import action_states

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8, torch.bfloat16: 1e-1, torch.float16: 2e-2}


def default_tolerance(dtype: torch.dtype) -> float:
    """RCE tolerance per dtype (low-precision kernels reorder sums differently per layout)."""
    return TOLERANCE.get(dtype, 1e-4)


@dataclass
class AuditResult:
    """RCE of one context mode against each invocation run alone through the model's own forward."""

    mode: str
    lowering: str
    max_abs_diff: float  # max over action tokens and vocabulary of |log p_mode - log p_alone|
    mean_abs_diff: float  # mean over action tokens of the per-token max
    worst: tuple[int, int, int]  # (episode, invocation, response token) of the max
    num_actions: int
    num_episodes: int
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance


@torch.no_grad()
def alone_logprobs(model: torch.nn.Module, inv: Invocation) -> torch.Tensor:
    """[n_response, V] float32 full-vocabulary log-probs (temperature 1) predicting each sampled
    token, from the model's own forward of the invocation alone with eager attention: plain
    causal attention as the model defines it (sliding windows and attention soft-capping
    included), its own logits. Independent of the packing and scoring code."""
    device = next(model.parameters()).device
    ids = torch.tensor([inv.input_ids], device=device)
    pos = torch.tensor([inv.position_ids], device=device)
    with attn_implementation(model, "eager"):
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    return F.log_softmax(logits[inv.prompt_len - 1: inv.total_len - 1].float(), dim=-1)


@torch.no_grad()
def rce_audit(model: torch.nn.Module, episodes: Sequence[Episode | Sequence[Invocation]], *,
              modes: Sequence[str] = ("aligned",), lowering: str | None = None, max_tokens: int = 4096,
              tolerance: float | None = None) -> dict[str, AuditResult]:
    """Max |log-prob difference| between each mode's packed scoring and each invocation run alone
    through the model's own forward, over every action token and the full vocabulary (T = 1)."""
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; choose from {MODES}")
    was_training = model.training
    model.eval()  # dropout would make the two runs differ for reasons other than packing
    try:
        return _audit(model, episodes, modes, lowering, max_tokens, tolerance)
    finally:
        model.train(was_training)


def _audit(model: torch.nn.Module, episodes: Sequence[Episode | Sequence[Invocation]], modes: Sequence[str],
           lowering: str | None, max_tokens: int, tolerance: float | None) -> dict[str, AuditResult]:
    device = next(model.parameters()).device
    tol = default_tolerance(next(model.parameters()).dtype) if tolerance is None else tolerance
    invs = episode_invocations(episodes)
    packed, where, used = {}, {}, {}
    for mode in modes:
        batch = pack_episodes(episodes, fitting_budget(episodes, mode, max_tokens), mode=mode)
        used[mode] = resolve_lowering(model, device, lowering, batch)
        packed[mode] = action_states(model, batch, lowering=used[mode], apply_temperature=False)
        where[mode] = batch.per_invocation(torch.arange(batch.num_actions))
    diffs: dict[str, list[torch.Tensor]] = {m: [] for m in modes}
    srcs: list[tuple[int, int, int]] = []
    for e, calls in enumerate(invs):
        for j, inv in enumerate(calls):
            if not inv.response_ids:
                continue
            ref = alone_logprobs(model, inv)
            srcs += [(e, j, k) for k in range(len(inv.response_ids))]
            for mode in modes:
                idx = where[mode][(e, j)]
                st = packed[mode].select(idx)
                logp = F.log_softmax(st.logits(st.hidden, st.temperatures), dim=-1)
                diffs[mode].append((logp - ref.to(logp.device)).abs().amax(-1).cpu())
    results = {}
    for mode in modes:
        d = torch.cat(diffs[mode]) if diffs[mode] else torch.zeros(0)
        k = int(d.argmax()) if len(d) else 0
        results[mode] = AuditResult(
            mode=mode, lowering=used[mode], max_abs_diff=float(d.max()) if len(d) else 0.0,
            mean_abs_diff=float(d.mean()) if len(d) else 0.0, worst=srcs[k] if len(d) else (-1, -1, -1),
            num_actions=len(d), num_episodes=len(invs), tolerance=tol)
    return results


def audit_episodes(model: torch.nn.Module, episodes: Sequence[Episode | Sequence[Invocation]],
                   **kwargs) -> dict[str, dict]:
    """:func:`rce_audit` as plain dicts for logging: ``{mode: {"max_abs_diff": ..., "passed": ...}}``."""
    return {m: {**asdict(r), "passed": r.passed} for m, r in rce_audit(model, episodes, **kwargs).items()}


class RCEAuditHook:
    """Trainer hook: run the aligned RCE audit every ``every`` steps on (a few of) the step's
    episodes. A failure warns and is returned for logging, or raises with ``strict=True``
    (absolute tolerances grow with depth and logit scale: 30-layer SmolLM2 in fp32 audits at
    ~7e-5 against the 1e-4 default).

    Usage: ``hook = RCEAuditHook(every=50); result = hook(step, model, episodes)``.
    """

    def __init__(self, every: int = 50, *, max_episodes: int = 4, tolerance: float | None = None,
                 lowering: str | None = None, max_tokens: int = 4096, strict: bool = False):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every, self.max_episodes, self.tolerance = every, max_episodes, tolerance
        self.lowering, self.max_tokens, self.strict = lowering, max_tokens, strict

    def __call__(self, step: int, model: torch.nn.Module,
                 episodes: Sequence[Episode | Sequence[Invocation]]) -> AuditResult | None:
        if step % self.every:
            return None
        res = rce_audit(model, list(episodes)[: self.max_episodes], lowering=self.lowering,
                        max_tokens=self.max_tokens, tolerance=self.tolerance)["aligned"]
        if not res.passed:
            msg = (f"RCE audit failed at step {step}: max |log-prob diff| {res.max_abs_diff:.3g} > {res.tolerance:g} "
                   f"at (episode, invocation, token) {res.worst} with the {res.lowering} lowering")
            if self.strict:
                raise RuntimeError(msg)
            warnings.warn(msg, stacklevel=2)
        return res


def format_results(results: dict[str, AuditResult]) -> str:
    lines = [f"{'mode':<11} {'lowering':<8} {'actions':>8} {'max |dlogp|':>12} {'mean':>10}  {'tol':>7}  verdict"]
    for r in results.values():
        verdict = ("PASS" if r.passed else "FAIL") if r.mode == "aligned" else \
            ("differs (expected)" if not r.passed else "equal")
        lines.append(f"{r.mode:<11} {r.lowering:<8} {r.num_actions:>8} {r.max_abs_diff:>12.3e} "
                     f"{r.mean_abs_diff:>10.3e}  {r.tolerance:>7.0e}  {verdict}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m memopd.audit", description=__doc__.split("CLI::")[0].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("episodes", help="episodes JSONL (e.g. written by the eval CLI)")
    ap.add_argument("--model", required=True, help="model spec: preset (tiny, tiny-teacher, smollm2), directory, "
                                                   ".gguf file or hub id; must be the model that sampled them")
    ap.add_argument("--mode", choices=("aligned", "persistent", "both"), default="both",
                    help="context mode(s) to audit (default: both)")
    ap.add_argument("--attn", choices=LOWERINGS, default=None,
                    help="attention lowering (default: the first that is exact for the model: blocks on CPU, "
                         "flex on CUDA)")
    ap.add_argument("--max-episodes", type=int, default=None, help="audit only the first N episodes")
    ap.add_argument("--max-tokens", type=int, default=4096, help="row budget of the packed batch (default: 4096)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="torch device (default: cuda when available, else cpu)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="model dtype (default: float32)")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="max |log-prob diff| that passes (default: by dtype, 1e-4 in float32)")
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP)
    ap.add_argument("--json", action="store_true", help="print results as JSON")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def run() -> int:
        model, episodes = load_cli_inputs(args)
        modes = ("aligned", "persistent") if args.mode == "both" else (args.mode,)
        results = rce_audit(model, episodes, modes=modes, lowering=args.attn, max_tokens=args.max_tokens,
                            tolerance=args.tolerance)
        if args.json:
            print(json.dumps({m: {**asdict(r), "passed": r.passed} for m, r in results.items()}, indent=2))
        else:
            print(f"RCE audit of {len(episodes)} episodes, model {args.model}")
            print(format_results(results))
        return 0 if results.get("aligned") is None or results["aligned"].passed else 1

    return run_main(run, INPUT_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
