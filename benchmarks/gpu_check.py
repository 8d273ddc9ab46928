"""GPU check of the packed attention lowerings (FlexAttention, flash-attn varlen, blocks, dense sdpa).

For tiny Qwen2 and Llama models with grouped-query attention and episodes with every packing
hard case (shared prefixes, positions starting above 0 or continuing the previous block's,
several episodes per row, an episode split across rows), each lowering's packed logits are
compared with the model's own forward of every invocation alone (max |logit diff| over all action tokens
and the full vocabulary), and its gradient of the summed log-probs with the dense-mask sdpa
gradient. A short timing section then compares actor forward + backward of padded batches with
the packed lowerings on a MemAgent-like workload. Exits cleanly when CUDA, FlexAttention or
flash-attn is missing (what is missing is skipped and said).

With two or more GPUs it then trains a few steps with ``torchrun --nproc-per-node <GPUs> -m
memopd.train --device cuda`` for FSDP2 (bf16 compute, fp32 reduction) and for DDP, and checks
that every step has a finite loss, that the RCE audit of the gathered student passes and that
the final model was written; it prints the step times against one GPU.

    python benchmarks/gpu_check.py            # < 3 minutes on one GPU
    python benchmarks/gpu_check.py --no-timing
    python benchmarks/gpu_check.py --cpu-dry-run   # the same checks on CPU (gloo, 2 ranks)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

DEVICE = "cuda"


def episodes(vocab: int, seed: int = 0):
    from agents.records import Episode, Invocation

    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    eps = []
    for e in range(4):  # 4-7 calls with a shared prefix; episode 1's positions start at 7
        q, pos0, memory, invs = tok(rng.randint(8, 40)), 7 if e == 1 else 0, [], []
        for t in range(rng.randint(4, 7)):
            prompt = q + [1] + memory + [2] + tok(rng.randint(5, 60))
            resp = tok(rng.randint(2, 20))
            invs.append(Invocation(prompt_ids=prompt, response_ids=resp, logprobs=[-1.0] * len(resp),
                                   position_ids=list(range(pos0, pos0 + len(prompt) + len(resp))),
                                   prefix_len=len(q), turn=t))
            memory = resp
        eps.append(Episode(episode_id=str(e), task_id="gpu", sample_id=str(e), invocations=invs))
    for e, (n, pos0) in enumerate(((30, 0), (25, 34))):  # no prefix; positions 34.. continue 0..33
        ids = tok(n + 4)
        eps.append(Episode(episode_id=f"s{e}", task_id="gpu", sample_id="s", invocations=[Invocation(
            prompt_ids=ids[:n], response_ids=ids[n:], logprobs=[-1.0] * 4,
            position_ids=list(range(pos0, pos0 + n + 4)), prefix_len=0)]))
    return eps


def tiny(arch: str, vocab: int = 256):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    kw = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.1,
              attn_implementation="sdpa")
    cls, cfg = (Qwen2ForCausalLM, Qwen2Config) if arch == "qwen2" else (LlamaForCausalLM, LlamaConfig)
    return cls(cfg(**kw)).to(DEVICE).eval()


@torch.no_grad()
def alone_logits(model, eps) -> torch.Tensor:
    """[N, V] the model's own forward logits before each sampled token, each call run alone (sdpa),
    in the canonical action order of the packed batch."""
    out = []
    for ep in eps:
        for inv in ep.invocations:
            ids = torch.tensor([inv.input_ids], device=DEVICE)
            pos = torch.tensor([inv.position_ids], device=DEVICE)
            out.append(model(input_ids=ids, position_ids=pos, use_cache=False).logits[0, inv.prompt_len - 1:-1])
    return torch.cat(out).float()


def check(lowerings: list[str]) -> bool:
    from memopd.attention import packed_hidden_states
    from memopd.heads import output_head
    from memopd.packing import pack_episodes
    from memopd.scoring import action_states, token_logprobs

    eps = episodes(256)
    batch = pack_episodes(eps, 160)
    rows_of = {}
    for r, segs in enumerate(batch.segments):
        for s in segs:
            rows_of.setdefault(s.episode, set()).add(r)
    print(f"batch: {batch.num_rows} rows x {batch.row_len}, {batch.num_actions} action tokens, "
          f"split episodes {sum(len(v) > 1 for v in rows_of.values())}, "
          f"max episodes per row {max(len({s.episode for s in segs}) for segs in batch.segments)}")
    tol = {torch.float32: 1e-4, torch.bfloat16: 1e-1}
    ok = True
    print(f"\n{'model':<6} {'dtype':<8} {'lowering':<8} {'max|dlogit| vs alone':>21} {'tol':>6} "
          f"{'grad diff vs sdpa':>19}  verdict")
    for arch in ("qwen2", "llama"):
        model = tiny(arch)
        for dtype in (torch.float32, torch.bfloat16):
            model = model.to(dtype)
            head = output_head(model)
            ref = alone_logits(model, eps)
            grads = {}
            for low in ["sdpa"] + lowerings:
                if low == "flash" and dtype == torch.float32:
                    continue  # flash-attn kernels take fp16/bf16 only
                try:
                    with torch.no_grad():
                        diff = (head(packed_hidden_states(model, batch, low)).float() - ref).abs().max().item()
                    model.zero_grad(set_to_none=True)
                    lp, _, _ = token_logprobs(action_states(model, batch, lowering=low), batch.action_ids.to(DEVICE))
                    lp.float().sum().backward()
                    grads[low] = torch.cat([p.grad.float().flatten() for p in model.parameters()])
                except Exception as exc:  # report and go on: this is a diagnostic
                    print(f"{arch:<6} {str(dtype)[6:]:<8} {low:<8} ERROR {type(exc).__name__}: {exc}"[:300])
                    ok = False
                    continue
                g_ref = grads.get("sdpa")
                gdiff = ((grads[low] - g_ref).abs().max() / g_ref.abs().max()).item() if g_ref is not None \
                    else float("nan")
                passed = diff <= tol[dtype]
                ok &= passed
                print(f"{arch:<6} {str(dtype)[6:]:<8} {low:<8} {diff:>21.3e} {tol[dtype]:>6.0e} {gdiff:>19.3e}  "
                      f"{'PASS' if passed else 'FAIL'}")
    return ok


def timing(lowerings: list[str]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from packing import Workload, make_episodes, packed_step, padded_step, small_model  # benchmarks/packing.py

    from memopd.packing import pack_episodes

    w = Workload(episodes=8, calls=8)
    eps = make_episodes(w)
    model = small_model(w.vocab, 512, 4).to(DEVICE, torch.bfloat16)
    shared, private = pack_episodes(eps, 16384), pack_episodes(eps, 16384, share_prefix=False)
    layouts = {"(a) padded per call": lambda: padded_step(model, eps, 8)}
    for low in lowerings:
        layouts[f"(b) packed, prefix per call, {low}"] = lambda low=low: packed_step(model, private, low)
        layouts[f"(c) packed, shared prefix, {low}"] = lambda low=low: packed_step(model, shared, low)

    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)

    def run(fn):
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    print(f"\ntiming: Qwen2 hidden 512, 4 layers, bf16; {len(eps)} episodes x 9 calls; fwd+bwd, best of 3")
    base = None
    for name, fn in layouts.items():
        try:
            run(fn)  # warm-up / compile
            sec = min(run(fn) for _ in range(3))
        except Exception as exc:
            print(f"  {name:<40} ERROR {type(exc).__name__}: {exc}"[:300])
            continue
        base = base or sec
        print(f"  {name:<40} {sec * 1000:>8.1f} ms  speedup vs (a) {base / sec:>5.2f}")


def multi_gpu_check(ranks: int, device: str) -> bool:
    """A few training steps with ``ranks`` processes (FSDP2, DDP, FSDP2 with a sharded teacher) and
    with one."""
    import json
    import os
    import socket
    import subprocess
    import tempfile

    def train(tmp: str, name: str, n: int, parallel: str, extra: tuple[str, ...] = ()) -> list[dict] | None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        run = Path(tmp) / name
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port", str(port)]
        args = ["-m", "memopd.train", "--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=2", "--steps", "3",
                "--questions-per-step", "4", "--group-size", "2", "--max-new-tokens", "16", "--eval-episodes", "2",
                "--eval-every", "0", "--student-warmup-steps", "0", "--teacher", "tiny-teacher", "--audit-every", "3",
                "--no-progress", "--threads", "1", "--device", device, "--parallel", parallel, "--run-dir", str(run),
                *extra]
        done = subprocess.run((launch if n > 1 else [sys.executable]) + args, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode != 0:
            print(f"  {name}: FAILED\n{done.stderr[-2000:]}")
            return None
        ok = (run / "model" / "config.json").is_file()
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "step_s" in r]
        good = ok and len(rows) == 3 and all(r.get("loss") is not None for r in rows) and rows[-1].get("audit/passed")
        print(f"  {name:<14} {'ok' if good else 'FAILED'}  step s {[round(r['step_s'], 2) for r in rows]}  "
              f"loss {[round(r['loss'], 4) for r in rows if r.get('loss') is not None]}  "
              f"audit {rows[-1].get('audit/max_abs_diff') if rows else None}")
        return rows if good else None

    print(f"\nmulti-process training: {ranks} ranks on {device}")
    with tempfile.TemporaryDirectory() as tmp:
        results = [train(tmp, "1 process", 1, "fsdp")] + [train(tmp, f"{ranks} ranks {p}", ranks, p)
                                                          for p in ("fsdp", "ddp")]
        results.append(train(tmp, f"{ranks} ranks fsdp, sharded teacher", ranks, "fsdp",
                             ("--teacher-parallel", "fsdp")))
    return all(r is not None for r in results)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--cpu-dry-run", action="store_true", help="run the checks on CPU (sdpa and blocks only)")
    args = ap.parse_args()
    if args.cpu_dry_run:
        global DEVICE
        DEVICE = "cpu"
        ok = check(["blocks"]) and multi_gpu_check(2, "cpu")
        print("dry run:", "ok" if ok else "FAILED")
        return 0 if ok else 1
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available; nothing to check (the CPU lowerings are tested by pytest)")
        return 0
    from memopd.attention import flash_available, flex_available

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    lowerings = ["blocks"]
    for name, available, why in (("flex", flex_available(), "FlexAttention is not in this torch build"),
                                 ("flash", flash_available(), "flash-attn is not installed (pip install flash-attn)")):
        if available:
            lowerings.append(name)
        else:
            print(f"skipping {name}: {why}")
    t0 = time.perf_counter()
    ok = check(lowerings)
    if not args.no_timing:
        timing(lowerings)
    if torch.cuda.device_count() >= 2:
        ok = multi_gpu_check(torch.cuda.device_count(), "cuda") and ok
    else:
        print("\nskipping the multi-GPU FSDP2/DDP check: one GPU (two ranks cannot share a GPU with nccl)")
    print(f"\n{'all lowerings agree' if ok else 'SOME LOWERINGS FAILED'} ({time.perf_counter() - t0:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
