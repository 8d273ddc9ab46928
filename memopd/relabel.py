"""The teacher's actions in the student's states: DAgger's labels for recorded episodes.

DAgger (Ross, Gordon and Bagnell, 2011) trains a policy on the states its own rollouts reach, each
labelled with the expert's action in that state, and aggregates every round's data. For a memory
agent a state is one call's prompt (the question, the memory the student wrote, the chunk read), and
the label is the teacher's greedy response to that prompt. :func:`relabel` keeps every call of a
recorded episode, so the memory each call read stays the student's, and replaces each call's
response by the teacher's; :mod:`memopd.sft` on the result trains the student on the teacher's
actions in its own states (``--teacher-context aligned``'s states, as actions, not distributions).

    python -m memopd.relabel --episodes runs/student/episodes.jsonl --teacher runs/teacher --out dagger.jsonl

A relabelled call keeps its prompt, prefix length, role, turn, spans and prompt positions; its
response ids, log-probs, positions, finish reason and text are the teacher's, and ``meta["relabelled_by"]`` names the
teacher. The episode's reward, prediction and metrics stay the student's (what its rollout scored).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Sequence

from agents.backends.base import Backend, GenerationRequest, SamplingParams
from agents.records import Episode


def relabel(episodes: Sequence[Episode], teacher: Backend, *, max_new_tokens: int = 32,
            name: str = "teacher") -> list[Episode]:
    """Each episode with every call's response replaced by ``teacher``'s greedy response to the same
    prompt (all calls of all episodes in one batched generate); the inputs are left unchanged."""
    calls = [(e, k, inv) for e in episodes for k, inv in enumerate(e.invocations)]
    requests = [GenerationRequest(prompt_ids=list(inv.prompt_ids), prefix_len=inv.prefix_len, role=inv.role,
                                  turn=inv.turn, position_offset=inv.position_ids[0] if inv.position_ids else 0,
                                  spans={s: list(v) for s, v in inv.spans.items()})
                for _, _, inv in calls]
    answers = teacher.generate(requests, SamplingParams(greedy=True, max_new_tokens=max_new_tokens))
    out = {id(e): dataclasses.replace(e, invocations=list(e.invocations)) for e in episodes}
    for (episode, k, inv), got in zip(calls, answers):
        out[id(episode)].invocations[k] = dataclasses.replace(
            inv, response_ids=list(got.response_ids), logprobs=list(got.logprobs), position_ids=list(got.position_ids),
            topk_ids=got.topk_ids, topk_logprobs=got.topk_logprobs, finish_reason=got.finish_reason,
            response_text=got.response_text, sampling={"greedy": True, "max_new_tokens": max_new_tokens},
            meta={**inv.meta, "relabelled_by": name})
    return [out[id(e)] for e in episodes]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m memopd.relabel", description=__doc__.splitlines()[0])
    p.add_argument("--episodes", required=True,
                   help="the student's episodes (JSONL, e.g. memopd.eval's episodes.jsonl)")
    p.add_argument("--teacher", required=True, help="the teacher: a preset name, a model directory or a hub id")
    p.add_argument("--out", required=True, help="where the relabelled episodes go (JSONL)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="the teacher's longest response (tokens)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from agents.backends.hf import HFBackend
    from agents.models import ModelLoadError, load
    from agents.records import load_episodes, save_episodes
    from memgym.cli import CLIError, run_main

    def _main() -> int:
        args = parse_args(argv)
        if args.max_new_tokens < 1:
            raise CLIError(f"--max-new-tokens must be at least 1 (got {args.max_new_tokens})")
        if not Path(args.episodes).is_file():
            raise CLIError(f"--episodes {args.episodes}: no such file (pass memopd.eval's episodes.jsonl)")
        report = load_episodes(args.episodes)
        for line, msg in report.errors:
            print(f"warning: {args.episodes}:{line}: skipped ({msg})", file=sys.stderr)
        if not report.episodes:
            raise CLIError(f"--episodes {args.episodes}: no readable episode in it")
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        model, tokenizer = load(args.teacher)
        got = relabel(report.episodes, HFBackend(model, tokenizer), max_new_tokens=args.max_new_tokens,
                      name=str(args.teacher))
        save_episodes(args.out, got)
        calls = sum(len(e.invocations) for e in got)
        print(f"relabelled {calls} calls of {len(got)} episodes with {args.teacher}: {args.out}")
        return 0

    return run_main(_main, errors=(ModelLoadError,))  # a teacher that cannot be loaded says why


__all__ = ["relabel"]


if __name__ == "__main__":
    sys.exit(main())

