"""The distillation estimators side by side on the same recorded calls: what each needs of the
teacher (bytes per action token), what computing it costs (teacher time per step), and how far
its per-token value is from the full-vocabulary divergence.

    python benchmarks/estimators.py [--episodes 32] [--out docs/data/estimators.json]

The calls are MemAgent episodes of the embedded default's task (LongQA at its defaults) sampled
by the embedded default's student at the start of RL (the tiny preset after its 100-step warm
start), scored in their aligned states by its teacher (the auto teacher: the tiny-teacher preset
fine-tuned on oracle trajectories, built and cached on first use). For each estimator, over every
action token of the batch:

- bytes a token: full = V float32; top-k = k token ids (int32) + k log-probs (float32); sampled =
  one float32 (what a server returning the sampled token's log-prob sends);
- teacher time: the teacher's packed forward at the action tokens (shared by all) plus the
  estimator's own projection (full: the log-softmax over V kept [N, V]; top-k: log-softmax and
  top-k per chunk; sampled: the log-prob of the sampled token), medians of 5 repeats;
- distance to the full reverse KL: the mean and the largest |estimate - full| over the tokens,
  and the mean signed difference (the bias; top-k can only be below: a lower bound), and for the
  sampled estimators (one sample per token) also the spread of their error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # opd_calls

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

KS = (1, 8, 20, 64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warmup-steps", type=int, default=100, help="SFT steps of the tiny student's warm start")
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)

    from memopd.learn import estimators as est
    from memopd import losses
    from memopd.scoring import action_states
    from opd_calls import opd_calls

    calls = opd_calls(args.warmup_steps, args.episodes)
    student, teacher, batch = calls.student, calls.teacher, calls.batch
    with torch.no_grad():
        s_states = action_states(student, batch)
        logp_s = F.log_softmax(s_states.logits(s_states.hidden, s_states.temperatures), -1)

    def teacher_states():
        with torch.no_grad():
            return action_states(teacher, batch).detach()

    t_states = teacher_states()
    logp_t = losses.teacher_logprobs(t_states)
    full = losses.divergence_from_logprobs(logp_s, logp_t, "rkl")
    n, vocab = logp_t.shape

    def timed(fn) -> float:
        out = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    forward_s = timed(teacher_states)
    rows = [{"estimator": "full", "bytes_per_token": 4 * vocab, "teacher_s": forward_s + timed(
        lambda: losses.teacher_logprobs(t_states)), "mean_abs_err": 0.0, "max_abs_err": 0.0, "bias": 0.0}]
    for k in KS:
        top = est.teacher_topk(logp_t, k)
        err = est.topk_divergence(logp_s, top, "rkl") - full
        rows.append({"estimator": f"topk k={k}", "bytes_per_token": 8 * min(k, vocab),
                     "teacher_s": forward_s + timed(lambda: est.teacher_targets(t_states, batch.action_ids, "topk", k)),
                     "mean_abs_err": float(err.abs().mean()), "max_abs_err": float(err.abs().max()),
                     "bias": float(err.mean())})
    sampled_s = forward_s + timed(lambda: est.teacher_targets(t_states, batch.action_ids, "sampled", 0))
    # one fresh sample a token from the student's distribution (the rollout's own tokens were sampled by it too)
    a = torch.multinomial(logp_s.exp(), 1, generator=torch.Generator().manual_seed(0))[:, 0]
    for kind in ("k1", "k3"):
        value = est.sampled_estimate(logp_s.gather(-1, a[:, None])[:, 0], logp_t.gather(-1, a[:, None])[:, 0], kind)
        err = value - full
        rows.append({"estimator": f"sampled {kind}", "bytes_per_token": 4, "teacher_s": sampled_s,
                     "mean_abs_err": float(err.abs().mean()), "max_abs_err": float(err.abs().max()),
                     "bias": float(err.mean()), "err_sd": float(err.std())})
    report = {"student": f"tiny, {args.warmup_steps} warm-start SFT steps", "teacher": "auto", "episodes": args.episodes, "action_tokens": n,
              "vocab": vocab, "full_rkl_mean": float(full.mean()), "teacher_forward_s": forward_s,
              "torch": torch.__version__, "rows": rows}
    print(f"{n} action tokens, vocabulary {vocab}, mean full reverse KL {full.mean():.4f} nats/token, "
          f"teacher forward {forward_s * 1e3:.1f} ms")
    print(f"{'estimator':<14} {'bytes/token':>11} {'teacher ms':>10} {'mean |err|':>10} {'max |err|':>10} {'bias':>9}")
    for r in rows:
        print(f"{r['estimator']:<14} {r['bytes_per_token']:>11} {r['teacher_s'] * 1e3:>10.1f} {r['mean_abs_err']:>10.4f} "
              f"{r['max_abs_err']:>10.4f} {r['bias']:>+9.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
