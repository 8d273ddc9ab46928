"""Play a memgym episode at the terminal: read each chunk, type your memory, then your answer.

    python -m memgym.play memgym/LongQA-v0 --seed 0 --chunk-size 48 --hops 2

Every ``--some-option VALUE`` the parser does not know becomes the make kwarg ``some_option``
(values are read as JSON when they parse, so ``--num-chunks 3`` is an int, ``--fact-order
random`` a string). Each memory or answer is one line; end of input stops the episode cleanly.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence, TextIO


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m memgym.play", description=__doc__.split("\n\n")[0],
                                     epilog="Any other --key value pair is passed to gymnasium.make as key=value.")
    parser.add_argument("env_id", nargs="?", default="memgym/LongQA-v0", help="env id (default: memgym/LongQA-v0)")
    parser.add_argument("--seed", type=int, default=None, help="reset seed (picks the sample)")
    parser.add_argument("--sample-id", default=None, help="play this sample id")
    parser.add_argument("--index", type=int, default=None, help="play the sample at this index")
    args, extra = parser.parse_known_args(argv)
    kwargs: dict[str, Any] = {}
    i = 0
    while i < len(extra):
        flag = extra[i]
        if not flag.startswith("--") or len(flag) < 3:
            parser.error(f"unexpected argument {flag!r}; options look like --chunk-size 64")
        key, eq, value = flag[2:].partition("=")
        if not eq:
            if i + 1 >= len(extra) or extra[i + 1].startswith("--"):
                parser.error(f"option {flag} needs a value")
            value = extra[i + 1]
            i += 1
        kwargs[key.replace("-", "_")] = _parse_value(value)
        i += 1
    return args, kwargs


def play(argv: Sequence[str] | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """Run one interactive episode; returns the process exit code."""
    import memgym

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    args, kwargs = parse_args(argv)
    try:
        env = memgym.make(args.env_id, render_mode="ansi", **kwargs)
    except Exception as exc:  # any failure to build the env is reported, not dumped as a traceback
        print(f"error: could not make {args.env_id}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    options = {k: v for k, v in (("sample_id", args.sample_id), ("index", args.index)) if v is not None}
    try:
        obs, info = env.reset(seed=args.seed, options=options or None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"Playing {info['task_id']}: type one line per step. End of input (Ctrl-D) stops.\n", file=stdout)
    while True:
        print(obs, file=stdout)
        prompt = "memory> " if info["phase"] == "memory" else "answer> "
        print(prompt, end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line:
            print("\n(end of input: episode stopped before the answer)", file=stdout)
            return 0
        obs, reward, terminated, _, info = env.step(line.rstrip("\n"))
        if info.get("memory_truncated"):
            print(f"(memory cut to the budget: {info['memory_cut']} {info['budget_unit']} removed)\n", file=stdout)
        if terminated:
            print(obs, file=stdout)
            print(f"\nReward ({env.unwrapped.scorer}): {reward:.3f}", file=stdout)
            return 0


def main() -> None:
    try:
        sys.exit(play())
    except KeyboardInterrupt:
        print("\n(interrupted)")
        sys.exit(130)


if __name__ == "__main__":
    main()
