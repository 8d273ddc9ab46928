"""Inputs of the learner's CLIs (audit, alignment): an episodes file and the model that sampled it.

Bad input becomes a :class:`memgym.cli.CLIError` that names the file and says what to do, so the
CLIs print ``error: ...`` instead of a traceback.
"""

from __future__ import annotations

import argparse
import sys

import torch

from agents.models import ModelLoadError, load
from agents.records import Episode, RecordError, load_episodes
from memgym.cli import CLIError
from memopd.runtime import set_threads
from memopd.attention import UnsupportedLoweringError
from memopd.contexts import PackingError
from memopd.heads import UnsupportedModelError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


INPUT_ERRORS: tuple[type[BaseException], ...] = (ModelLoadError, UnsupportedLoweringError, UnsupportedModelError,
                                                  PackingError, RecordError)
"""The error types the learner CLIs report as ``error: ...`` rather than a traceback."""


def read_episodes(path: str, max_episodes: int | None = None) -> list[Episode]:
    """Episodes of a JSONL file; bad lines are reported on stderr and skipped; no readable
    episode at all is an error."""
    report = load_episodes(path)
    for line, msg in report.errors[:20]:
        print(f"{path}:{line}: skipped: {msg}", file=sys.stderr)
    if len(report.errors) > 20:
        print(f"{path}: ... and {len(report.errors) - 20} more bad lines", file=sys.stderr)
    episodes = report.episodes[:max_episodes] if max_episodes else report.episodes
    if not episodes:
        what = f"none of its {len(report.errors)} lines is an episode" if report.errors else "it is empty"
        raise CLIError(f"no readable episodes in {path}: {what}; pass an episodes.jsonl written by "
                       "python -m memopd.eval or a training run's episodes/step-N.jsonl")
    return episodes


def load_cli_inputs(args: argparse.Namespace) -> tuple[torch.nn.Module, list[Episode]]:
    """Set threads, read the episodes (``args.episodes``, ``args.max_episodes``) and load the
    model (``args.model``, ``args.dtype``, ``args.device``)."""
    set_threads(args.threads)
    if args.max_episodes is not None and args.max_episodes < 1:
        raise CLIError(f"--max-episodes must be >= 1 (got {args.max_episodes})")
    episodes = read_episodes(args.episodes, args.max_episodes)
    model, _ = load(args.model, dtype=DTYPES[args.dtype], device=args.device)
    vocab = model.get_input_embeddings().weight.shape[0]
    for i, ep in enumerate(episodes):
        for j, inv in enumerate(ep.invocations):
            top = max(inv.input_ids)
            if top >= vocab:
                raise CLIError(f"{args.episodes}: episode {i} ({ep.episode_id}) invocation {j} has token id {top}, "
                               f"outside the vocabulary of {args.model} ({vocab} tokens); pass the model that "
                               "sampled these episodes")
    return model, episodes


__all__ = ["DTYPES", "INPUT_ERRORS", "load_cli_inputs", "read_episodes"]
