"""Where a SmolLM2 training step's time goes, and how close its update is to this machine's
matrix-multiply rate.

    python benchmarks/step_profile.py --teacher DIR [--steps 3] [--out docs/data/step_profile.json]

Runs ``--steps`` training steps of the SmolLM2 example's arm (``examples/smollm2_memopd.py``:
LongQA with natural facts, 2 chunks of 64 tokens, 4 questions x 2 samples, memory calls up to 16
tokens and answers up to 8, PPO + MemOPD, 1 PPO epoch, fp32, the memory defaults) with
``--teacher`` (the example's SFT teacher directory, or any SmolLM2-vocabulary model), one torch
thread, and reads each step's profile (``time/<phase>_s``, logged by every run): the rollout,
packing, advantages, the teacher's scoring, the old log-probs' pass, the plugins' weights, and
the update (student forward + backward, inside it the optimizer step). Medians over the steps
after the first (the first warms the allocator and the caches).

Achieved rate: the update's matrix-multiply work counted from the model's shapes (per packed
token, 2 x the decoder's matmul weights for a forward, 2 x that for the backward, one more forward
with gradient checkpointing; the LM head only at action tokens, plus the attention scores and
values over each token's visible columns), divided by the update's time, against a measured
``torch.mm`` rate at the decoder's own shapes on the same thread count.

``--rollout-ab N``: then N more rollouts of one step with the backend's episode-prefix cache off
and on, interleaved (the same seeds, so the same episodes: checked token for token, log-probs
within 1e-4), timed side by side; reports the rollout's before/after ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

PHASES = ("rollout", "pack", "advantages", "teacher", "prepare", "weigh", "update")
ENV_KWARGS = {"fact_style": "natural", "num_chunks": 2, "chunk_size": 64, "memory_budget": 16}


def matmul_rate(hidden: int, inter: int, tokens: int = 2048, repeats: int = 5) -> float:
    """Measured FLOP/s of ``torch.mm`` at the decoder's shapes ([tokens, H] x [H, I] and back)."""
    a, w1, w2 = torch.randn(tokens, hidden), torch.randn(hidden, inter), torch.randn(inter, hidden)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(torch.mm(a, w1), w2)
        best = min(best, time.perf_counter() - t0)
    return 2 * 2 * tokens * hidden * inter / best


def update_flops(model: Any, tokens: int, actions: int, attn_pairs: int, checkpointing: bool) -> float:
    """Matrix-multiply FLOPs of one forward + backward over ``tokens`` packed tokens."""
    c = model.config
    h, inter, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    per_token = layers * (2 * (h * h + 2 * h * kv + h * h) + 2 * 3 * h * inter)  # q, k, v, o; gate, up, down
    attention = layers * 2 * 2 * attn_pairs * h  # scores and values: each visible (query, key) pair
    head = 2 * h * c.vocab_size * actions
    forward = per_token * tokens + attention + head
    return forward * (3 + (1 if checkpointing else 0))


def visible_pairs(batch: Any) -> int:
    """(query, key) pairs the packed visibility allows: a prefix attends to itself causally, a
    block to its whole prefix and to itself causally."""
    pairs = 0
    for row in batch.segments:
        size = {seg.block: seg.end - seg.start for seg in row}
        for seg in row:
            n = seg.end - seg.start
            pairs += n * (n + 1) // 2 + (n * size[seg.prefix] if seg.prefix >= 0 and not seg.is_prefix else 0)
    return pairs


def rollout_ab(trainer: Any, repeats: int) -> dict[str, Any]:
    """The same step's rollout with the prefix cache off and on, interleaved; the records of
    the two agree (tokens equal, log-probs within 1e-4)."""
    backend, times = trainer.actor.backend, {"off": [], "on": []}
    default = backend.prefix_cache_mb
    runs: dict[str, Any] = {}
    try:
        for _ in range(repeats):
            for arm, mb in (("off", 0), ("on", default)):
                backend.prefix_cache_mb = mb
                t0 = time.perf_counter()
                runs[arm] = trainer.rollout()
                times[arm].append(time.perf_counter() - t0)
    finally:
        backend.prefix_cache_mb = default
    calls = [(a, b) for ea, eb in zip(runs["off"], runs["on"]) for a, b in zip(ea.invocations, eb.invocations)]
    same = all(a.response_ids == b.response_ids for a, b in calls)
    gap = max(max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) for a, b in calls)
    med = {arm: statistics.median(t) for arm, t in times.items()}
    return {"rollout_s": med, "raw_s": times, "speedup": med["off"] / med["on"], "same_tokens": same,
            "max_logprob_diff": gap, "calls": len(calls),
            "prompt_tokens": sum(len(a.prompt_ids) for a, _ in calls),
            "prefix_tokens": sum(a.prefix_len for a, _ in calls)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--teacher", required=True, help="the teacher's model directory (SmolLM2 vocabulary)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--extra", default="", help="more memopd.train flags, space-separated (e.g. "
                    "'--no-gradient-checkpointing')")
    ap.add_argument("--rollout-ab", type=int, default=0, metavar="N",
                    help="then N rollouts with the episode-prefix cache off and on, interleaved")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.rollout_ab < 0:
        ap.error(f"--rollout-ab must be >= 0 (got {args.rollout_ab})")
    from memopd import train

    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--model", args.model, "--teacher", args.teacher, "--student-warmup-steps", "0", "--run-dir",
                 str(Path(tmp) / "run"), "--steps", str(args.steps), "--questions-per-step", "4", "--group-size", "2",
                 "--ppo-epochs", "1", "--lr", "5e-5", "--max-new-tokens", "16", "--agent-kwarg",
                 "answer_max_new_tokens=8", "--eval-every", "0", "--eval-episodes", "1", "--sample-episodes", "0",
                 "--audit-every", "0", "--threads", str(args.threads), "--no-progress"]
        for k, v in ENV_KWARGS.items():
            flags += ["--env-kwarg", f"{k}={v}"]
        flags += args.extra.split()
        cfg = train.prepare(train.cfgmod.parse_args(train.TrainConfig, flags, "step_profile", ""))
        trainer = train.Trainer(cfg, log=lambda m: None)
        rows, flops = [], []
        for step in range(args.steps):  # the trainer's step, phase by phase (train_step without plugins)
            t0 = time.perf_counter()
            episodes = trainer.rollout()
            result = trainer.update(episodes, rollout_s=time.perf_counter() - t0)
            trainer.step += 1
            m = {**result.metrics, "time/rollout_s": result.metrics["rollout_s"], "wall_s": time.perf_counter() - t0}
            rows.append(m)
            b = result.batch
            flops.append(update_flops(trainer.student, b.num_real_tokens, b.num_actions, visible_pairs(b),
                                      bool(trainer.cfg.gradient_checkpointing)))
            print(f"step {step}: {m['wall_s']:.1f} s " + ", ".join(
                f"{p} {m.get(f'time/{p}_s', 0.0):.1f}" for p in PHASES), file=sys.stderr)
        ab = rollout_ab(trainer, args.rollout_ab) if args.rollout_ab else None
        c = trainer.student.config
        rate = matmul_rate(c.hidden_size, c.intermediate_size)
        settings = {k: getattr(trainer.cfg, k) for k in ("micro_batch_rows", "gradient_checkpointing", "kl_chunk",
                                                         "pack_tokens", "attn")}
    later = rows[1:] or rows
    med = {p: statistics.median(r.get(f"time/{p}_s", 0.0) for r in later) for p in PHASES + ("optimizer",)}
    wall = statistics.median(r["wall_s"] for r in later)
    med["other"] = max(0.0, wall - sum(med[p] for p in PHASES))
    report: dict[str, Any] = {
        "model": args.model, "steps": args.steps, "threads": args.threads, "settings": settings,
        "step_s": wall, "phase_s": med,
        "share": {p: med[p] / wall for p in (*PHASES, "other")},
        "update": {"forward_backward_s": med["update"] - med["optimizer"], "optimizer_s": med["optimizer"]},
        "matmul_flops_per_s": rate,
        "versions": {"torch": torch.__version__},
        "command": "python benchmarks/step_profile.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    if flops:
        f = statistics.median(flops[1:] or flops)
        fb = report["update"]["forward_backward_s"]
        report["update"].update(flops=f, achieved_flops_per_s=f / fb, of_matmul_rate=f / fb / rate)
    if ab is not None:
        report["rollout_prefix_cache"] = ab
        if not ab["same_tokens"] or ab["max_logprob_diff"] > 1e-4:
            print("error: the rollouts with and without the prefix cache differ", file=sys.stderr)
            return 1
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
