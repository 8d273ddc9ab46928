"""Rollout Context Equivalence (RCE) audit: packed execution must reproduce running each
invocation alone.

For every action token (the position before each sampled token), compare the full-vocabulary
logits of the packed batch with the logits of the same invocation run by itself (its own prompt,
its recorded positions, plain causal attention, no packing):
``max |l_pack - l_alone| <= eps`` (fp32 CPU: about 1e-5; the default tolerance is 1e-4).
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

from agents.records import Episode, Invocation
from memopd.attention import LOWERINGS, attn_implementation, base_model, choose_lowering
from memopd.contexts import MODES, build_units, episode_invocations
from memopd.packing import min_budget, pack_episodes
from memopd.scoring import ActionStates, action_states

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8, torch.bfloat16: 1e-1, torch.float16: 2e-2}


def default_tolerance(dtype: torch.dtype) -> float:
    """RCE tolerance per dtype (low-precision kernels reorder sums differently per layout)."""
    return TOLERANCE.get(dtype, 1e-4)


@dataclass
class AuditResult:
    """RCE of one context mode against running each invocation alone."""

    mode: str
    lowering: str
    max_abs_diff: float  # max over action tokens and vocabulary of |l_mode - l_alone|
    mean_abs_diff: float  # mean over action tokens of the per-token max
    worst: tuple[int, int, int]  # (episode, invocation, response token) of the max
    num_actions: int
    num_episodes: int
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance


def fitting_budget(episodes: Sequence[Episode | Sequence[Invocation]], mode: str, max_tokens: int) -> int:
    """``max_tokens``, raised if needed so the longest invocation (or transcript) fits one row."""
    return max(max_tokens, min_budget(build_units(episodes, mode)))


@torch.no_grad()
def alone_hidden_states(model: torch.nn.Module, episodes: Sequence[Episode | Sequence[Invocation]],
                        lowering: str | None = None) -> torch.Tensor:
    """[N, H] final hidden states before each sampled token, each invocation run by itself (in the
    canonical action order of :func:`memopd.packing.pack_episodes`), with plain causal attention
    (eager when ``lowering`` is eager, else sdpa)."""
    device = next(model.parameters()).device
    lowering = choose_lowering(device, lowering)
    base = base_model(model)
    out = []
    # The reference is plain causal attention of the same family: eager for eager, else sdpa (an
    # invocation alone needs no mask; flex would also recompile for every prompt length)
    with attn_implementation(model, "eager" if lowering == "eager" else "sdpa"):
        for invs in episode_invocations(episodes):
            for inv in invs:
                ids = torch.tensor([inv.input_ids], device=device)
                pos = torch.tensor([inv.position_ids], device=device)
                h = base(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[0]
                out.append(h[inv.prompt_len - 1: inv.total_len - 1])
    hidden = getattr(model.config, "hidden_size", 0)
    return torch.cat(out) if out else torch.zeros(0, hidden, device=device)


@torch.no_grad()
def logit_diff(a: ActionStates, b: ActionStates, chunk_size: int = 256) -> torch.Tensor:
    """[N] max over the vocabulary of |logits_a - logits_b| per action token, in chunks."""
    out = []
    for i in range(0, len(a), chunk_size):
        sl = slice(i, i + chunk_size)
        la = a.logits(a.hidden[sl], a.temperatures[sl])
        lb = b.logits(b.hidden[sl], b.temperatures[sl])
        out.append((la - lb).abs().amax(-1))
    return torch.cat(out) if out else a.hidden.new_zeros(0)


@torch.no_grad()
def rce_audit(model: torch.nn.Module, episodes: Sequence[Episode | Sequence[Invocation]], *,
              modes: Sequence[str] = ("aligned",), lowering: str | None = None, max_tokens: int = 4096,
              tolerance: float | None = None, chunk_size: int = 256) -> dict[str, AuditResult]:
    """Max |logit difference| between each mode's packed execution and each invocation alone,
    over every action token and the full vocabulary (raw logits, temperature 1)."""
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; choose from {MODES}")
    device = next(model.parameters()).device
    lowering = choose_lowering(device, lowering)
    tol = default_tolerance(next(model.parameters()).dtype) if tolerance is None else tolerance
    alone_h = alone_hidden_states(model, episodes, lowering)
    results = {}
    for mode in modes:
        batch = pack_episodes(episodes, fitting_budget(episodes, mode, max_tokens), mode=mode)
        packed = action_states(model, batch, lowering=lowering, apply_temperature=False)
        alone = ActionStates(alone_h, packed.head, packed.temperatures, packed.softcap)
        diff = logit_diff(packed, alone, chunk_size)
        k = int(diff.argmax()) if len(diff) else 0
        results[mode] = AuditResult(
            mode=mode, lowering=lowering, max_abs_diff=float(diff.max()) if len(diff) else 0.0,
            mean_abs_diff=float(diff.mean()) if len(diff) else 0.0,
            worst=tuple(batch.token_map[k].tolist()) if len(diff) else (-1, -1, -1),
            num_actions=len(diff), num_episodes=len(episodes), tolerance=tol)
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
        was_training = model.training
        model.eval()  # dropout would make the two runs differ for reasons other than packing
        try:
            res = rce_audit(model, list(episodes)[: self.max_episodes], lowering=self.lowering,
                            max_tokens=self.max_tokens, tolerance=self.tolerance)["aligned"]
        finally:
            model.train(was_training)
        if not res.passed:
            msg = (f"RCE audit failed at step {step}: max |logit diff| {res.max_abs_diff:.3g} > {res.tolerance:g} "
                   f"at (episode, invocation, token) {res.worst} with the {res.lowering} lowering")
            if self.strict:
                raise RuntimeError(msg)
            warnings.warn(msg, stacklevel=2)
        return res


def format_results(results: dict[str, AuditResult]) -> str:
    lines = [f"{'mode':<11} {'lowering':<8} {'actions':>8} {'max |dlogit|':>13} {'mean':>10}  {'tol':>7}  verdict"]
    for r in results.values():
        verdict = ("PASS" if r.passed else "FAIL") if r.mode == "aligned" else \
            ("differs (expected)" if not r.passed else "equal")
        lines.append(f"{r.mode:<11} {r.lowering:<8} {r.num_actions:>8} {r.max_abs_diff:>13.3e} "
                     f"{r.mean_abs_diff:>10.3e}  {r.tolerance:>7.0e}  {verdict}")
    return "\n".join(lines)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_cli_inputs(args: argparse.Namespace) -> tuple[torch.nn.Module, list[Episode]] | None:
    """Shared by the audit and alignment CLIs: set threads, read the episodes (reporting bad lines)
    and load the model. None (after printing why) when no episode is readable."""
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from agents.models import load  # lazy: loading pulls tokenizers/presets only for the CLI
    from agents.records import load_episodes

    report = load_episodes(args.episodes)
    for line, msg in report.errors:
        print(f"{args.episodes}:{line}: skipped: {msg}", file=sys.stderr)
    episodes = report.episodes[: args.max_episodes] if args.max_episodes else report.episodes
    if not episodes:
        print(f"error: no readable episodes in {args.episodes}", file=sys.stderr)
        return None
    model, _ = load(args.model, dtype=DTYPES[args.dtype], device=args.device)
    return model, episodes


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memopd.audit", description=__doc__.split("\n\n")[0])
    ap.add_argument("episodes", help="episodes JSONL (e.g. written by the eval CLI)")
    ap.add_argument("--model", required=True, help="model spec: preset (tiny, tiny-teacher, smollm2), directory, "
                                                   ".gguf file or hub id; must be the model that sampled them")
    ap.add_argument("--mode", choices=("aligned", "persistent", "both"), default="both")
    ap.add_argument("--attn", choices=LOWERINGS, default=None,
                    help="attention lowering (default: blocks on CPU, flex on CUDA)")
    ap.add_argument("--max-episodes", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=4096, help="row budget of the packed batch")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    ap.add_argument("--tolerance", type=float, default=None)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (0 keeps torch's default; 1 is safest on small shared machines)")
    ap.add_argument("--json", action="store_true", help="print results as JSON")
    args = ap.parse_args(argv)

    loaded = load_cli_inputs(args)
    if loaded is None:
        return 2
    model, episodes = loaded
    modes = ("aligned", "persistent") if args.mode == "both" else (args.mode,)
    results = rce_audit(model, episodes, modes=modes, lowering=args.attn, max_tokens=args.max_tokens,
                        tolerance=args.tolerance)
    if args.json:
        print(json.dumps({m: {**asdict(r), "passed": r.passed} for m, r in results.items()}, indent=2))  # as audit_episodes
    else:
        print(f"RCE audit of {len(episodes)} episodes, model {args.model}")
        print(format_results(results))
    return 0 if results.get("aligned") is None or results["aligned"].passed else 1


if __name__ == "__main__":
    sys.exit(main())
