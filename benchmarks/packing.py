"""Packing benchmark: actor forward + backward on a MemAgent-like workload, and the peak memory of
full-vocabulary KL, chunked vs unchunked.

Layouts of the same recorded invocations (log-probs of every sampled token, summed, backward;
each forward/backward step holds about 8k tokens: 8 padded calls in (a), one packed row else):
  (a) per-invocation padded micro-batches (the usual trainer layout), sdpa with a padding mask
  (a') the same, micro-batches grouped by length (less padding)
  (b) packed rows, every call with its own copy of the prefix, ``blocks`` lowering
  (c) packed rows, the episode prefix stored once per row, ``blocks`` lowering
  (c-dense) as (c), with the dense additive ``[L, L]`` mask (sdpa) instead
  (d) the persistent flattened history, one causal sequence per episode
Figures are ratios to (a), measured in one run on one thread. The speedup is given in process
CPU time (the compute itself, stable on a shared machine) and in wall time. "attn x(a)" counts
attention score entries the kernels compute, relative to (a).

    python benchmarks/packing.py                 # about 5 minutes on one CPU thread
    python benchmarks/packing.py --quick         # a smaller smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from agents.records import Episode, Invocation
from memopd.attention import base_model
from memopd.packing import PackedBatch, pack_episodes
from memopd.losses import divergence_from_states
from memopd.scoring import ActionStates, action_states, token_logprobs


@dataclass
class Workload:
    """MemAgent-like episodes: prefix q, then calls [q, template, memory, template, chunk] -> memory."""

    episodes: int = 4
    calls: int = 8  # memory writes per episode; one answer call follows
    prefix: tuple[int, int] = (130, 170)
    chunk: tuple[int, int] = (384, 512)  # the last chunk of an episode: 100..512
    memory: tuple[int, int] = (64, 128)  # memory writes (responses)
    answer: tuple[int, int] = (8, 32)
    vocab: int = 8192
    seed: int = 0


def make_episodes(w: Workload) -> list[Episode]:
    rng = random.Random(w.seed)
    tok = lambda n: [rng.randrange(10, w.vocab) for _ in range(n)]  # noqa: E731
    eps = []
    for e in range(w.episodes):
        q = tok(rng.randint(*w.prefix))
        memory: list[int] = []
        invs = []
        for t in range(w.calls + 1):
            answer = t == w.calls
            chunk = [] if answer else tok(rng.randint(100 if t == w.calls - 1 else w.chunk[0], w.chunk[1]))
            prompt = q + [1, 2, 3, 4] + memory + [5, 6, 7, 8] + chunk
            resp = tok(rng.randint(*(w.answer if answer else w.memory)))
            invs.append(Invocation(prompt_ids=prompt, response_ids=resp, logprobs=[-1.0] * len(resp),
                                   position_ids=list(range(len(prompt) + len(resp))), prefix_len=len(q),
                                   role="answer" if answer else "memory", turn=t,
                                   spans={"memory": [len(q) + 4, len(q) + 4 + len(memory)]}))
            memory = resp
        eps.append(Episode(episode_id=str(e), task_id="bench", sample_id=str(e), invocations=invs))
    return eps


def small_model(vocab: int, hidden: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                      num_hidden_layers=layers, num_attention_heads=hidden // 32, num_key_value_heads=2,
                      max_position_embeddings=32768, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).train()


# --------------------------------------------------------------------------------------------
# one actor step per layout; each returns (tokens computed, real tokens, attention score entries)
# --------------------------------------------------------------------------------------------

def padded_step(model, eps: list[Episode], batch_size: int, by_length: bool = False) -> tuple[int, int, int]:
    """(a): micro-batches of ``batch_size`` invocations in record order, right-padded
    (``by_length``: sorted by length first, the usual trick against padding)."""
    invs = [inv for ep in eps for inv in ep.invocations]
    if by_length:
        invs.sort(key=lambda inv: inv.total_len)
    base, head = base_model(model), model.get_output_embeddings()
    computed = real = attn = 0
    for i in range(0, len(invs), batch_size):
        group = invs[i:i + batch_size]
        L = max(inv.total_len for inv in group)
        ids = torch.zeros(len(group), L, dtype=torch.long)
        pos = torch.zeros(len(group), L, dtype=torch.long)
        mask = torch.zeros(len(group), L, dtype=torch.long)
        rows, cols, targets = [], [], []
        for r, inv in enumerate(group):
            n = inv.total_len
            ids[r, :n] = torch.tensor(inv.input_ids)
            pos[r, :n] = torch.tensor(inv.position_ids)
            mask[r, :n] = 1
            rows += [r] * len(inv.response_ids)
            cols += list(range(inv.prompt_len - 1, n - 1))
            targets += inv.response_ids
        dev = head.weight.device
        h = base(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                 use_cache=False).last_hidden_state
        states = ActionStates(h[rows, cols], head, torch.ones(len(rows), device=dev))
        lp, _, _ = token_logprobs(states, torch.tensor(targets))
        (-lp.sum()).backward()
        computed += len(group) * L
        real += int(mask.sum())
        attn += len(group) * L * L
    return computed, real, attn


def packed_step(model, batch: PackedBatch, lowering: str, rows_per_step: int = 1) -> tuple[int, int, int]:
    """(b), (c), (c-dense), (d): forward + backward over micro-batches of ``rows_per_step`` rows
    (gradients accumulate), so each step holds about as many tokens as a padded micro-batch."""
    for part in batch.micro_batches(rows_per_step):
        lp, _, _ = token_logprobs(action_states(model, part, lowering=lowering, apply_temperature=False),
                                  part.action_ids)
        (-lp.sum()).backward()
    if lowering == "blocks":  # a causal triangle over each segment (with its prefix, for a block)
        n = lambda s, segs: s.end - s.start + (segs[s.prefix].end - segs[s.prefix].start if s.prefix >= 0 else 0)  # noqa: E731
        attn = sum(n(s, segs) * (n(s, segs) + 1) / 2 for segs in batch.segments for s in segs)
    else:
        attn = batch.num_rows * batch.row_len ** 2
    return batch.block_ids.numel(), batch.num_real_tokens, int(attn)


def measure(fns: dict[str, Callable[[], tuple]], repeats: dict[str, int]) -> dict[str, tuple[float, float, tuple]]:
    """Per layout: (min process CPU seconds, min wall seconds, result), the layouts timed round-robin
    so that drifting load hits them alike. With one thread, CPU time is the compute itself; wall
    time also counts waiting for the core on a shared machine."""
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    wall: dict[str, list[float]] = {k: [] for k in fns}
    out: dict[str, tuple] = {}
    for rep in range(max(repeats.values())):
        for name, fn in fns.items():
            if rep >= repeats[name]:
                continue
            c0, t0 = time.process_time(), time.perf_counter()
            out[name] = fn()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - t0)
            print(f"  {name}: {cpu[name][-1]:.2f} s CPU, {wall[name][-1]:.2f} s wall", flush=True)
    return {k: (min(cpu[k]), min(wall[k]), out[k]) for k in fns}


# --------------------------------------------------------------------------------------------
# full-vocab KL peak memory, measured in a child process (peak RSS over the inputs)
# --------------------------------------------------------------------------------------------

def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def kl_child(tokens: int, vocab: int, hidden: int, chunk: int) -> None:
    torch.manual_seed(0)
    head_s = torch.nn.Linear(hidden, vocab, bias=False)
    head_t = torch.nn.Linear(hidden, vocab, bias=False)
    h_s = torch.randn(tokens, hidden, requires_grad=True)
    h_t = torch.randn(tokens, hidden)
    ones = torch.ones(tokens)
    student, teacher = ActionStates(h_s, head_s, ones), ActionStates(h_t, head_t, ones)
    before = _rss_kib("VmRSS")
    t0 = time.perf_counter()
    if chunk > 0:
        kl = divergence_from_states(student, teacher, "rkl", chunk_size=chunk)
    else:  # the naive way: [tokens, vocab] log-distributions of both models, one autograd graph
        logp_s = torch.log_softmax(head_s(h_s), -1)
        with torch.no_grad():
            logp_t = torch.log_softmax(head_t(h_t), -1)
        kl = (logp_s.exp() * (logp_s - logp_t)).sum(-1)
    kl.mean().backward()
    print(f"{(_rss_kib('VmHWM') - before) / 1024:.0f} {time.perf_counter() - t0:.1f}")


def kl_memory(tokens: int, vocab: int, hidden: int, chunk: int) -> tuple[float, float]:
    """(peak MiB above the inputs, seconds) of one full-vocab RKL forward + backward."""
    out = subprocess.run([sys.executable, __file__, "--kl-child", str(tokens), str(vocab), str(hidden), str(chunk)],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
    mib, sec = out.stdout.split()
    return float(mib), float(sec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=4)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--budget", type=int, default=8192,
                    help="packed row budget (tokens); one row per forward, about the tokens of one padded "
                         "micro-batch of (a)")
    ap.add_argument("--batch-size", type=int, default=8, help="invocations per padded micro-batch in (a)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kl-tokens", type=int, default=8192)
    ap.add_argument("--kl-vocab", type=int, default=49152)
    ap.add_argument("--kl-hidden", type=int, default=64,
                    help="hidden size of the KL inputs; the peak is the [tokens, vocab] tensors, so a small "
                         "hidden size keeps the run short without changing it much")
    ap.add_argument("--kl-chunk", type=int, default=1024)
    ap.add_argument("--skip-dense", action="store_true", help="skip (c-dense), the slowest layout")
    ap.add_argument("--skip-kl", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--kl-child", nargs=4, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.kl_child:
        kl_child(*args.kl_child)
        return
    if args.quick:
        args.episodes, args.calls, args.hidden, args.repeats = 2, 4, 128, 1
        args.kl_tokens, args.kl_vocab = 1024, 8192

    w = Workload(episodes=args.episodes, calls=args.calls)
    eps = make_episodes(w)
    model = small_model(w.vocab, args.hidden, args.layers)
    layouts = {
        "(a) padded per call": lambda: padded_step(model, eps, args.batch_size),
        "(a') padded, length-grouped": lambda: padded_step(model, eps, args.batch_size, by_length=True),
        "(b) packed, prefix per call": (pack_episodes(eps, args.budget, share_prefix=False), "blocks"),
        "(c) packed, shared prefix": (pack_episodes(eps, args.budget), "blocks"),
        "(c-dense) shared, dense mask": (pack_episodes(eps, args.budget), "sdpa"),
        "(d) persistent history": (pack_episodes(eps, max(args.budget, 1), mode="persistent"), "blocks"),
    }
    if args.skip_dense:
        del layouts["(c-dense) shared, dense mask"]
    n_calls = sum(len(ep.invocations) for ep in eps)
    print(f"workload: {len(eps)} episodes x {args.calls + 1} calls = {n_calls} invocations, "
          f"{sum(len(i.response_ids) for ep in eps for i in ep.invocations)} action tokens; "
          f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {w.vocab}; "
          f"threads {args.threads}, budget {args.budget}, (a) batch {args.batch_size}, best of {args.repeats} "
          "(dense: 1)")
    padded_step(model, eps[:1], args.batch_size)  # warm-up (allocator, kernels)
    model.zero_grad(set_to_none=True)
    fns = {}
    for name, spec in layouts.items():
        step = spec if callable(spec) else (lambda b=spec[0], low=spec[1]: packed_step(model, b, low))
        fns[name] = lambda step=step: (model.zero_grad(set_to_none=True), step())[1]
    res = measure(fns, {k: 1 if "dense" in k else args.repeats for k in fns})
    rows = [(name, *res[name][2], res[name][0], res[name][1]) for name in fns]
    a = rows[0]
    print(f"\n{'layout':<30} {'tokens':>7} {'x(a)':>5} {'padding':>8} {'attn x(a)':>10} {'CPU s':>7} "
          f"{'speedup':>8} {'wall s':>7} {'speedup':>8}")
    for name, computed, real, attn, cpu, wall in rows:
        print(f"{name:<30} {computed:>7} {computed / a[1]:>5.2f} {1 - real / computed:>8.1%} {attn / a[3]:>10.2f} "
              f"{cpu:>7.2f} {a[4] / cpu:>8.2f} {wall:>7.2f} {a[5] / wall:>8.2f}")

    report = {"episodes": len(eps), "invocations": n_calls,
              "action_tokens": sum(len(i.response_ids) for ep in eps for i in ep.invocations),
              "hidden": args.hidden, "layers": args.layers, "vocab": w.vocab, "threads": args.threads,
              "budget": args.budget, "batch_size": args.batch_size, "repeats": args.repeats,
              "layouts": [{"layout": name, "tokens": computed, "real_tokens": real, "attn_entries": attn,
                           "cpu_s": cpu, "wall_s": wall} for name, computed, real, attn, cpu, wall in rows],
              "kl": [], "versions": {"torch": torch.__version__},
              "command": "python benchmarks/packing.py " + " ".join(sys.argv[1:])}
    if not args.skip_kl:
        print(f"\nfull-vocab RKL forward+backward, {args.kl_tokens} action tokens, vocab {args.kl_vocab}, "
              f"hidden {args.kl_hidden} (peak RSS above the inputs):")
        for label, chunk in ((f"chunked ({args.kl_chunk})", args.kl_chunk), ("unchunked", 0)):
            mib, sec = kl_memory(args.kl_tokens, args.kl_vocab, args.kl_hidden, chunk)
            print(f"  {label:<16} {mib:>8.0f} MiB  {sec:>6.1f} s")
            report["kl"].append({"chunk": chunk, "peak_mib": mib, "seconds": sec, "tokens": args.kl_tokens,
                                 "vocab": args.kl_vocab, "hidden": args.kl_hidden})
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
