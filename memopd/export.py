"""Write a trained model as a standard transformers directory (weights + tokenizer).

    python -m memopd.export runs/train/<run> --out models/student
    python -m memopd.export runs/train/<run>/checkpoints/step-000040 --out models/student-40

SRC is anything ``agents.models.load`` takes: a training run directory (its final ``model/``,
else its latest checkpoint), one of its ``checkpoints/step-N`` directories, a model directory,
a preset or a ``.gguf`` file. The output is written aside and renamed into place, so a failure
leaves nothing half-written; it loads with ``transformers.AutoModelForCausalLM.from_pretrained``
and with ``--model`` of every memopd CLI.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from memgym.cli import CLIError, run_main


def export(src: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Load ``src`` and save it to ``out`` (model + tokenizer), atomically. An existing non-empty
    ``out`` is replaced only with ``overwrite``."""
    from agents.models import load, save_pretrained

    out = Path(out)
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise CLIError(f"--out {out} already exists and is not empty; choose another --out or pass --overwrite")
    model, tokenizer = load(src)
    return save_pretrained(out, model, tokenizer)


def main(argv: Sequence[str] | None = None) -> int:
    from agents.models import ModelLoadError

    ap = argparse.ArgumentParser(prog="python -m memopd.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="training run directory, checkpoints/step-N directory, or any model spec")
    ap.add_argument("--out", required=True, help="directory to write the transformers model to")
    ap.add_argument("--overwrite", action="store_true", help="replace --out when it exists")
    args = ap.parse_args(argv)

    def _main() -> int:
        path = export(args.src, args.out, overwrite=args.overwrite)
        print(f"exported {args.src} to {path}", file=sys.stderr)
        return 0

    return run_main(_main, errors=(ModelLoadError,))


if __name__ == "__main__":
    sys.exit(main())
