"""Play a memgym episode at the terminal: read each chunk, type your memory, then your answer.

    python -m memgym.play memgym/LongQA-v0 --seed 0 --env-kwarg chunk_size=48 --env-kwarg hops=2

Make kwargs are ``--env-kwarg KEY=VALUE`` (repeatable; VALUE is read as a Python literal when it
is one, so ``num_chunks=3`` is an int and ``fact_order=random`` a string). Each memory or
answer is one line; end of input stops the episode cleanly. Bad input prints ``error: ...`` on
stderr and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence, TextIO

from memgym.cli import CLIError, describe, parse_kwargs, run_main

DEFAULT_ENV = "memgym/LongQA-v0"


def _parser() -> argparse.ArgumentParser:
    import memgym

    ids = ", ".join(memgym.list_envs()) or "(none registered)"
    parser = argparse.ArgumentParser(prog="python -m memgym.play", description=__doc__.split("\n\n")[0],
                                     epilog=f"available envs: {ids}")
    parser.add_argument("env_id", nargs="?", default=DEFAULT_ENV,
                        help=f"env id or short name (LongQA); one of: {ids} (default: {DEFAULT_ENV})")
    parser.add_argument("--seed", type=int, default=None, help="reset seed (picks the sample)")
    parser.add_argument("--sample-id", default=None, help="play this sample id")
    parser.add_argument("--index", type=int, default=None, help="play the sample at this index")
    parser.add_argument("--env-kwarg", action="append", default=[], metavar="KEY=VALUE",
                        help="a gymnasium.make kwarg, repeatable (e.g. --env-kwarg hops=2 --env-kwarg "
                             "fact_order=random); see the environment kwargs in docs/gym.md")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, dict[str, Any]]:
    """``(args, make kwargs)``; raises :class:`CLIError` for a malformed ``--env-kwarg``."""
    args = _parser().parse_args(argv)
    return args, parse_kwargs(args.env_kwarg)


def _make(env_id: str, kwargs: dict[str, Any]) -> Any:
    import memgym

    try:
        return memgym.make(env_id, render_mode="ansi", **kwargs)
    except Exception as exc:  # a task's generator is plugin code: any failure is reported, not dumped
        raise CLIError(f"could not make {env_id}: {describe(exc)}") from None


def play(argv: Sequence[str] | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """Run one interactive episode; returns the process exit code. Raises :class:`CLIError` for bad input."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    args, kwargs = parse_args(argv)
    env = _make(args.env_id, kwargs)
    options = {k: v for k, v in (("sample_id", args.sample_id), ("index", args.index)) if v is not None}
    try:
        obs, info = env.reset(seed=args.seed, options=options or None)
    except (ValueError, TypeError) as exc:
        raise CLIError(f"could not reset {args.env_id}: {exc}") from None
    print(f"Playing {info['task_id']}: type one line per step. End of input (Ctrl-D) stops.\n", file=stdout)
    while True:
        print(obs, file=stdout)
        prompt = "memory> " if info["phase"] == "memory" else "answer> "
        print(prompt, end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line:
            print("\n(end of input: episode stopped before the answer)", file=stdout)
            return 0
        try:
            obs, reward, terminated, _, info = env.step(line.rstrip("\n"))
        except ValueError as exc:  # refused before the episode moved on: type it again
            print(f"(refused: {exc})\n", file=stdout)
            continue
        if info.get("memory_truncated"):
            print(f"(memory cut to the budget: {info['memory_cut']} {info['budget_unit']} removed)\n", file=stdout)
        if terminated:
            print(obs, file=stdout)
            print(f"\nReward ({env.unwrapped.scorer}): {reward:.3f}", file=stdout)
            return 0


def main() -> None:
    sys.exit(run_main(play))


if __name__ == "__main__":
    main()
