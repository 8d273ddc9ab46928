"""Evaluate an agent on a memgym environment: ``python -m memopd.eval``.

Examples::

    python -m memopd.eval --env memgym/LongQA-v0 --agent oracle --episodes 20
    python -m memopd.eval --env memgym/LongQA-v0 --agent memagent --model tiny --episodes 20
    python -m memopd.eval --agent memagent --model smollm2 --episodes 4 --env-kwarg num_chunks=2

Episodes are the first ``--episodes`` samples of ``--split`` (sample indices ``--start-index``
onwards), so runs are comparable; ``--seed`` seeds the env resets and the model's sampling.
Prints an EM / F1 / sub-EM table with memory tokens, calls and peak context per episode, and
saves ``episodes.jsonl`` (every invocation, token-exact) and ``summary.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

MODEL_AGENTS = ("memagent", "fullcontext", "rag")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from agents.policy import AGENTS

    p = argparse.ArgumentParser(prog="python -m memopd.eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--env", default="memgym/LongQA-v0", help="environment id (see memgym.list_envs())")
    p.add_argument("--agent", default="memagent", help=f"one of: {', '.join(sorted(AGENTS))}")
    p.add_argument("--model", default=None,
                   help="model spec: preset (tiny, tiny-teacher, smollm2), model directory, .gguf file or hub id; "
                        "for --agent oracle it only picks the tokenizer of the records (default: tiny's)")
    p.add_argument("--episodes", type=int, default=20, help="episodes to run")
    p.add_argument("--seed", type=int, default=0, help="seed of env resets and of sampling")
    p.add_argument("--split", default="test", help="data split")
    p.add_argument("--start-index", type=int, default=0, help="first sample index of the split")
    p.add_argument("--group-size", type=int, default=1, help="episodes per question (samples per group)")
    p.add_argument("--batch-size", type=int, default=8, help="environments run in lockstep (model calls batched)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="new-token limit of memory calls (also capped at a token memory budget)")
    p.add_argument("--answer-max-new-tokens", type=int, default=32, help="new-token limit of answer calls")
    p.add_argument("--top-k", type=int, default=3, help="chunks retrieved by --agent rag")
    p.add_argument("--env-kwarg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra gymnasium.make kwarg (repeatable); VALUE is parsed as a Python literal when it "
                        "is one (8, 0.5, True, None), else kept as a string")
    p.add_argument("--device", default="cpu", help="torch device of the model")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads; 0 keeps torch's default. 1 is the safe choice on small shared "
                        "machines (two threads on a busy 2-core box ran 5-40x slower); raise it on free cores")
    p.add_argument("--out", default=None, help="output directory (default runs/eval/<env>-<agent>-<timestamp>)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p.parse_args(argv)


def parse_env_kwargs(items: Sequence[str]) -> dict[str, Any]:
    """``["hops=2", "fact_order=random"]`` -> ``{"hops": 2, "fact_order": "random"}``."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--env-kwarg {item!r} is not KEY=VALUE (e.g. --env-kwarg num_chunks=8)")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        out[key.strip()] = value
    return out


def check_choices(args: argparse.Namespace) -> str:
    """Validate env id, agent and model before anything heavy; returns the resolved env id."""
    import memgym
    from agents.policy import AGENTS

    envs = memgym.list_envs()
    env_id = args.env.split(":", 1)[1] if args.env.startswith("memgym:") else args.env
    if env_id not in envs:
        try:
            env_id = memgym.resolve_id(env_id)
        except Exception:  # noqa: BLE001 - any failure means: not a known env
            raise SystemExit(f"error: unknown env {args.env!r}; available envs: {', '.join(envs)}") from None
    if args.agent not in AGENTS:
        raise SystemExit(f"error: unknown agent {args.agent!r}; available agents: {', '.join(sorted(AGENTS))}")
    if args.agent in MODEL_AGENTS and not args.model:
        raise SystemExit(f"error: --agent {args.agent} needs --model (a preset such as tiny or smollm2, a model "
                         "directory, a .gguf file or a hub id); only --agent oracle runs without a model")
    if args.episodes < 1 or args.batch_size < 1 or args.group_size < 1:
        raise SystemExit("error: --episodes, --batch-size and --group-size must be >= 1")
    return env_id


def build(args: argparse.Namespace, env_id: str) -> tuple[list[Any], Any, str]:
    """The envs, the agent and a model label."""
    import gymnasium as gym

    from agents.policy import make_agent

    env_kwargs = parse_env_kwargs(args.env_kwarg)
    if args.agent == "oracle":
        from agents.oracle import default_tokenizer

        tokenizer = _load(args.model, args.device)[1] if args.model else default_tokenizer()
        envs = [gym.make(env_id, split=args.split, tokenizer=tokenizer, **env_kwargs) for _ in range(args.batch_size)]
        return envs, make_agent("oracle", samples=envs[0].unwrapped.source, tokenizer=tokenizer), args.model or "-"

    import torch

    from agents.backends.base import SamplingParams
    from agents.backends.hf import HFBackend

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    model, tokenizer = _load(args.model, args.device)
    backend = HFBackend(model, tokenizer, device=args.device, max_batch_size=args.batch_size, seed=args.seed,
                        name=f"hf:{args.model}")
    greedy = args.temperature <= 0
    sampling = SamplingParams(temperature=1.0 if greedy else args.temperature, top_p=args.top_p, greedy=greedy,
                              max_new_tokens=args.max_new_tokens)
    kwargs: dict[str, Any] = {"backend": backend, "sampling": sampling,
                              "answer_max_new_tokens": args.answer_max_new_tokens}
    if args.agent == "rag":
        kwargs["top_k"] = args.top_k
    envs = [gym.make(env_id, split=args.split, tokenizer=tokenizer, **env_kwargs) for _ in range(args.batch_size)]
    return envs, make_agent(args.agent, **kwargs), args.model


def _load(spec: str, device: str) -> tuple[Any, Any]:
    from agents.models import load

    return load(spec, device=device)


def summarize(episodes: Sequence[Any], wall_s: float | None = None) -> dict[str, Any]:
    """Mean scores and per-episode costs of a list of :class:`agents.records.Episode`.

    ``memory_tokens``: mean tokens per memory write (stop token excluded); ``calls``: model
    invocations per episode; ``peak_context``: the longest prompt + response of an episode;
    ``generated_tokens``: response tokens per episode. Each is averaged over episodes.
    """
    from memgym.scoring import aggregate

    from agents.policy import strip_stop

    scores = aggregate([{k: e.metrics.get(k, 0.0) for k in ("em", "f1", "sub_em")} for e in episodes])
    per_ep = []
    for e in episodes:
        writes = [len(strip_stop(i)) for i in e.invocations if i.role == "memory"]
        per_ep.append({
            "memory_tokens": sum(writes) / len(writes) if writes else 0.0,
            "calls": len(e.invocations),
            "peak_context": max((i.total_len for i in e.invocations), default=0),
            "generated_tokens": sum(len(i.response_ids) for i in e.invocations),
        })
    n = max(1, len(per_ep))
    out: dict[str, Any] = dict(scores)
    for key in ("memory_tokens", "calls", "peak_context", "generated_tokens"):
        out[key] = sum(p[key] for p in per_ep) / n
    out["max_peak_context"] = max((p["peak_context"] for p in per_ep), default=0)
    if wall_s is not None:
        out["wall_s"] = wall_s
        gen = sum(p["generated_tokens"] for p in per_ep)
        out["generated_tokens_per_s"] = gen / wall_s if wall_s > 0 else 0.0
    return out


def format_table(summary: dict[str, Any], header: str) -> str:
    """The summary as a two-column text table under ``header``."""
    rows = [("EM", f"{summary['em']:.3f}"), ("F1", f"{summary['f1']:.3f}"), ("sub-EM", f"{summary['sub_em']:.3f}"),
            ("memory tokens / write", f"{summary['memory_tokens']:.1f}"),
            ("calls / episode", f"{summary['calls']:.1f}"),
            ("peak context / episode", f"{summary['peak_context']:.1f}"),
            ("generated tokens / episode", f"{summary['generated_tokens']:.1f}")]
    if "generated_tokens_per_s" in summary:
        rows.append(("generated tokens / s", f"{summary['generated_tokens_per_s']:.1f}"))
    width = max(len(r[0]) for r in rows)
    lines = [header, f"{'metric':<{width}}  value", f"{'-' * width}  -----"]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    env_id = check_choices(args)
    try:
        envs, agent, model_label = build(args, env_id)
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"error: {exc}") from None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else Path("runs") / "eval" / f"{env_id.replace('/', '_')}-{args.agent}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    episodes_path = out / "episodes.jsonl"
    if episodes_path.exists():
        episodes_path.unlink()  # a rerun into the same directory replaces its episodes

    from agents.rollout import rollout

    groups = -(-args.episodes // args.group_size)
    t0 = time.perf_counter()
    episodes = rollout(envs, agent, args.episodes, group_size=args.group_size, seed=args.seed,
                       indices=range(args.start_index, args.start_index + groups), out=episodes_path,
                       progress=not args.no_progress)
    wall = time.perf_counter() - t0
    summary = summarize(episodes, wall_s=wall)
    summary.update({"env": env_id, "agent": args.agent, "model": model_label, "split": args.split,
                    "episodes": len(episodes), "seed": args.seed, "start_index": args.start_index,
                    "group_size": args.group_size, "temperature": args.temperature,
                    "env_kwargs": parse_env_kwargs(args.env_kwarg)})
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    header = f"{env_id}  agent={args.agent}  model={model_label}  split={args.split}  episodes={len(episodes)}"
    print(format_table(summary, header))
    print(f"saved {episodes_path} and {out / 'summary.json'}")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
