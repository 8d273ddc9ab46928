"""Write a trained model as a standard transformers directory (weights + tokenizer).

    python -m memopd.export runs/train/<run> --out models/student
    python -m memopd.export runs/train/<run>/checkpoints/step-000040 --out models/student-40
    python -m memopd.export runs/train/<run> --out models/student-bf16 --dtype bfloat16   # half the size

SRC is anything ``agents.models.load`` takes: a training run directory (its final ``model/``,
else its latest checkpoint), one of its ``checkpoints/step-N`` directories, a model directory,
a preset or a ``.gguf`` file. The output is written aside and renamed into place, so a failure
leaves nothing half-written; it loads with ``transformers.AutoModelForCausalLM.from_pretrained``
and with ``--model`` of every memopd CLI. ``--dtype bfloat16`` halves the files (SmolLM2-135M: 538
MB -> 269 MB); the weights are then rounded to bf16, and memopd loads them back as fp32.

A LoRA run (``--lora-r``) or one of its checkpoints exports as the merged model (the adapters
added into the weights, peft's ``merge_and_unload``), or with ``--adapter-only`` as an adapter
directory: the adapters as peft writes them (``adapter_config.json``,
``adapter_model.safetensors``), the tokenizer and ``base_model.json`` naming the base model spec.
``peft.PeftModel.from_pretrained(base, OUT)`` loads it, and so does ``--model OUT`` of every memopd
CLI (the base, then the adapters, merged).

    python -m memopd.export runs/train/<lora-run> --out models/student-merged
    python -m memopd.export runs/train/<lora-run> --out models/student-adapter --adapter-only
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from memgym.cli import CLIError, run_main

EXPORT_DTYPES = ("float32", "bfloat16")


def export(src: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False,
           dtype: str = "float32", adapter_only: bool = False) -> Path:
    """Load ``src`` and save it to ``out`` (model + tokenizer) in ``dtype``, atomically; with
    ``adapter_only`` (a LoRA ``src``) its adapter directory instead. An existing non-empty ``out``
    is replaced only with ``overwrite``."""
    import torch

    from agents.models import load, save_pretrained

    if dtype not in EXPORT_DTYPES:
        raise CLIError(f"--dtype {dtype!r}: choose one of {list(EXPORT_DTYPES)}")

    out = Path(out)
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise CLIError(f"--out {out} already exists and is not empty; choose another --out or pass --overwrite")
    if adapter_only:
        from agents.lora import AdapterWriter, has_adapters

        model, tokenizer = load(src, dtype=getattr(torch, dtype), merge_adapters=False)
        if not has_adapters(model):
            raise CLIError(f"--adapter-only: {src} holds no LoRA adapters (it was not trained with --lora-r); "
                           "export it without --adapter-only")
        return save_pretrained(out, AdapterWriter(model), tokenizer)
    model, tokenizer = load(src, dtype=getattr(torch, dtype))
    return save_pretrained(out, model, tokenizer)


def main(argv: Sequence[str] | None = None) -> int:
    from agents.models import ModelLoadError

    ap = argparse.ArgumentParser(prog="python -m memopd.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="training run directory, checkpoints/step-N directory, or any model spec")
    ap.add_argument("--out", required=True, help="directory to write the transformers model to")
    ap.add_argument("--overwrite", action="store_true", help="replace --out when it exists")
    ap.add_argument("--dtype", default="float32", choices=EXPORT_DTYPES,
                    help="dtype of the saved weights (bfloat16: half the size, weights rounded)")
    ap.add_argument("--adapter-only", action="store_true",
                    help="a LoRA run or checkpoint: write its adapter directory (adapters, tokenizer, the base model's "
                         "name) instead of the merged model")
    args = ap.parse_args(argv)

    def _main() -> int:
        path = export(args.src, args.out, overwrite=args.overwrite, dtype=args.dtype, adapter_only=args.adapter_only)
        print(f"exported {args.src} to {path}", file=sys.stderr)
        return 0

    return run_main(_main, errors=(ModelLoadError,))


if __name__ == "__main__":
    sys.exit(main())
