"""Evaluate an agent on a memgym environment: ``python -m memopd.eval``.

Examples::

    python -m memopd.eval --env memgym/LongQA-v0 --agent oracle --episodes 20
    python -m memopd.eval --env memgym/LongQA-v0 --agent memagent --model tiny --episodes 20
    python -m memopd.eval --agent memagent --model smollm2 --episodes 4 --env-kwarg num_chunks=2
    python -m memopd.eval --agent rag --model tiny --agent-kwarg top_k=2
    python -m memopd.eval --agent examples.notes_agent:NotesAgent --model tiny   # your own MemoryPolicy

``--agent`` is a registered name (the built-ins and installed ``memopd.agents`` plugins, listed
below) or ``module:Class`` (a MemoryPolicy subclass, importable from the current directory or an
installed package); ``--agent-kwarg KEY=VALUE`` passes constructor options. A model-backed agent
gets ``backend=`` and ``sampling=`` (from --model, --temperature, --top-p, --max-new-tokens), and
``answer_max_new_tokens`` / ``top_k`` when its constructor takes them.

Episodes are the first ``--episodes`` samples of ``--split`` (sample indices ``--start-index``
onwards), so runs are comparable; ``--seed`` seeds the env resets and the model's sampling.
Prints an EM / F1 / sub-EM table with memory tokens, calls and peak context per episode, and
saves ``episodes.jsonl`` (every invocation, token-exact) and ``summary.json`` in ``--out``.
``--agent oracle`` calls no model: ``--model`` only picks the tokenizer of its records, and only
the tokenizer is loaded.

Bad input (an unknown env, agent or model, an agent that cannot be imported or is not a
MemoryPolicy, an option its constructor does not take, a missing model path, indices past the
end of the split, an env option the env does not take, a sampling flag out of range, an
``--env-kwarg`` for what ``--model`` or ``--split`` sets, a task folder that cannot be used, samples
the oracle cannot script, an output directory that cannot be written or a full disk) prints
``error: <what, where, how to fix>`` on stderr and exits 2 before any model loads where it can. A run that fails removes the output
it started, so no empty or half-written directory is left behind (Ctrl-C keeps the episodes
finished so far, one whole record per line).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from memgym.cli import CLIError, describe, parse_kwargs, run_main
from memopd import eval_sweep
from memopd.config import DEFAULT_THREADS, THREADS_HELP
from memopd.runtime import set_threads


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The whole module docstring as description, line breaks kept, and each default said once:
    appended only when the help text does not already say it and there is one to say."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        nothing = action.default is None or action.default is False or action.default == [] \
            or action.default is argparse.SUPPRESS  # `is`: a default of 0 is still worth saying
        if "default" in text or nothing or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from agents.registry import agent_names

    p = argparse.ArgumentParser(prog="python -m memopd.eval", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--env", default="memgym/LongQA-v0", help=f"environment id; one of: {', '.join(_env_ids())}")
    p.add_argument("--agent", default="memagent", metavar="NAME|module:Class",
                   help=f"the agent to evaluate: one of {{{','.join(agent_names())}}} (built-ins and installed "
                        "memopd.agents plugins), or module:Class, a MemoryPolicy subclass (e.g. "
                        "examples.notes_agent:NotesAgent, imported from the current directory)")
    p.add_argument("--agent-kwarg", action="append", default=[], metavar="KEY=VALUE",
                   help="agent constructor option (repeatable), e.g. top_k=5; VALUE is parsed as a Python literal "
                        "when it is one, else kept as a string")
    p.add_argument("--model", default=None,
                   help="model spec: preset (tiny, tiny-teacher, tiny-llama, tiny-teacher-bpe1k, tiny-digits, "
                        "tiny-teacher-digits, tiny-long, smollm2), model directory, training run directory, .gguf "
                        "file or hub id. Needed by every agent but oracle, for which it only picks the tokenizer of "
                        "the records (only the tokenizer is loaded; default: tiny's)")
    p.add_argument("--episodes", type=int, default=20, help="episodes to run")
    p.add_argument("--seed", type=int, default=0, help="seed of env resets and of sampling")
    p.add_argument("--split", default="test", metavar="SPLIT",
                   help="data split: train or test for generated tasks; a data task's own split names "
                        "(its task.toml); an unknown split is refused with the task's list")
    p.add_argument("--start-index", type=int, default=0, help="first sample index of the split")
    p.add_argument("--group-size", type=int, default=1, help="episodes per question (samples per group)")
    p.add_argument("--batch-size", type=int, default=64,
                   help="environments run in lockstep, their model calls batched (at most --episodes); each row "
                        "holds its prompt's keys/values, so lower it for a large model on little memory")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="new-token limit of memory calls (also capped at a token memory budget)")
    p.add_argument("--answer-max-new-tokens", type=int, default=32, help="new-token limit of answer calls")
    p.add_argument("--top-k", type=int, default=3, help="chunks retrieved by --agent rag (passed as top_k to an "
                                                        "agent that takes it; --agent-kwarg top_k=N overrides it)")
    p.add_argument("--env-kwarg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra gymnasium.make kwarg (repeatable); VALUE is parsed as a Python literal when it "
                        "is one (8, 0.5, True, None), else kept as a string")
    p.add_argument("--memory-perturbation", default=None, metavar="KIND[@N|@pP]",
                   help="the perturbed-memory control (memgym.perturb): replace the memory the next call reads by "
                        "drop (empty), stale (the memory before the write) or distractor (a wrong answer in it), "
                        "once per episode (KIND), after chunk N (KIND@N) or after each chunk with probability P "
                        "(KIND@pP); the summary reports recovery")
    p.add_argument("--device", default="cpu", help="torch device of the model")
    add_backend_args(p)
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP)
    p.add_argument("--out", default=None,
                   help="output directory (default: runs/eval/<env>-<agent>-<timestamp>); one that holds an "
                        "evaluation already is refused unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the evaluation an existing --out holds (default: refuse, keep it)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="progress bar of episodes and model calls (default: --progress)")
    p.add_argument("--lengths", default=None, metavar="N,N,...",
                   help="evaluate at each input length in chunks (the env's num_chunks), e.g. 6,12,24,48,96,192: "
                        "one run per length in --out/num_chunks-N/, then a table (sweep.json, sweep.md) and a plot "
                        "(sweep.png) of F1 against input tokens")
    p.add_argument("--sweep", default=None, metavar="KEY=V1,V2,...",
                   help="as --lengths, over any env option, e.g. --sweep memory_budget=8,16,32")
    p.add_argument("--compare", action="append", default=[], metavar="DIR",
                   help="with --lengths or --sweep: add an earlier sweep (its --out directory) to the table and the "
                        "plot, e.g. another policy on the same env (repeatable)")
    return p.parse_args(argv)


def add_backend_args(p: argparse.ArgumentParser) -> None:
    """--backend and the engine options of vllm / openai (docs/agents.md, "Backends")."""
    from agents.backends.factory import BACKENDS

    p.add_argument("--backend", default="hf", choices=BACKENDS,
                   help="what samples the model: hf (transformers, here), vllm (a vLLM engine, here), openai (a "
                        "model served by an OpenAI-compatible server at --base-url; --model names its tokenizer)")
    p.add_argument("--dtype", default="auto", help="vllm: engine dtype (auto, float32, bfloat16, float16)")
    p.add_argument("--max-model-len", type=int, default=None, help="vllm: most positions per sequence")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vllm: fraction of GPU memory")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm: GPUs one engine shards over")
    p.add_argument("--kv-cache-gib", type=float, default=None, help="vllm: KV cache GiB (default 1 on CPU)")
    p.add_argument("--base-url", default=None, help="openai: server base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--served-model", default=None, help="openai: served model name (default: the server's first)")
    p.add_argument("--server-logprobs-mode", default="raw_logprobs", choices=("raw_logprobs", "processed_logprobs"),
                   help="openai: the server's --logprobs-mode; raw_logprobs (vLLM's default) records exactly only "
                        "greedy or temperature-1 sampling")


def engine_options(args: argparse.Namespace) -> Any:
    from agents.backends.factory import EngineOptions

    return EngineOptions(dtype=args.dtype, max_model_len=args.max_model_len,
                         gpu_memory_utilization=args.gpu_memory_utilization,
                         tensor_parallel_size=args.tensor_parallel_size, kv_cache_gib=args.kv_cache_gib,
                         base_url=args.base_url, served_model=args.served_model,
                         server_logprobs_mode=args.server_logprobs_mode)


def _env_ids() -> list[str]:
    import memgym

    return memgym.list_envs()


def check_choices(args: argparse.Namespace) -> str:
    """Validate env id, agent, model and counts before anything heavy; returns the resolved env id."""
    import memgym

    env_id = args.env.split(":", 1)[1] if args.env.startswith("memgym:") else args.env
    if env_id not in memgym.list_envs():
        try:
            env_id = memgym.resolve_id(env_id)
        except Exception:  # noqa: BLE001 - any failure means: not a known env
            from memgym.registry import BROKEN

            broken = "; task folders that failed to load: " + "; ".join(BROKEN.values()) if BROKEN else ""
            raise CLIError(f"unknown env {args.env!r}; available envs: {', '.join(memgym.list_envs())}"
                           f"{broken}") from None
    agent = check_agent(args)
    if agent.calls_model and not args.model:
        raise CLIError(f"--agent {args.agent} needs --model (a preset such as tiny or smollm2, a model "
                       "directory, a .gguf file or a hub id); only a scripted agent such as --agent oracle runs "
                       "without a model")
    for flag in ("episodes", "batch_size", "group_size"):
        if getattr(args, flag) < 1:
            raise CLIError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.start_index < 0:
        raise CLIError(f"--start-index must be >= 0 (the first sample of the split is 0), got {args.start_index}")
    if args.threads < 0:
        raise CLIError(f"--threads must be >= 0 (0: torch's choice), got {args.threads}")
    check_sampling(args)
    if args.memory_perturbation is not None:
        from memgym.perturb import parse_spec

        try:
            parse_spec(args.memory_perturbation)
        except ValueError as exc:
            raise CLIError(f"--memory-perturbation: {exc}") from None
    return env_id


def check_sampling(args: argparse.Namespace) -> None:
    """The sampling flags, checked before any model loads (the backend would refuse them later)."""
    if not math.isfinite(args.temperature):
        raise CLIError(f"--temperature must be a finite number (0: greedy, e.g. 0.7 or 1.0), got {args.temperature}")
    if not 0 < args.top_p <= 1:  # also refuses nan
        raise CLIError(f"--top-p must be in (0, 1] (1.0: no nucleus truncation), got {args.top_p}")
    for flag in ("max_new_tokens", "answer_max_new_tokens"):
        if getattr(args, flag) < 1:
            raise CLIError(f"--{flag.replace('_', '-')} must be >= 1 (new tokens per call), got {getattr(args, flag)}")


# Settings memopd.eval gives gymnasium.make itself, and the flag that sets each.
OWN_ENV_KWARGS = {"tokenizer": "--model (for --agent oracle only its tokenizer is loaded)", "split": "--split"}


def check_env_kwargs(env_kwargs: dict[str, Any]) -> None:
    """Refuse an ``--env-kwarg`` for a setting this CLI already passes (gymnasium would say only
    "got multiple values for keyword argument")."""
    for key, flag in OWN_ENV_KWARGS.items():
        if key in env_kwargs:
            raise CLIError(f"--env-kwarg {key}={env_kwargs[key]}: memopd.eval gives the env its {key} from "
                           f"{flag}; set it there and drop --env-kwarg {key}")


def check_agent(args: argparse.Namespace) -> Any:
    """The agent class of ``--agent``, checked with its ``--agent-kwarg`` options before anything
    loads; stores the parsed options on ``args.agent_options``."""
    from agents.registry import (MODEL_ARGS, SCRIPTED_ARGS, AgentSpecError, check_convention, check_options,
                                 resolve_agent)

    args.agent_options = parse_kwargs(args.agent_kwarg, "--agent-kwarg")
    try:
        cls = resolve_agent(args.agent)
        check_convention(cls, args.agent)
        check_options(cls, args.agent, args.agent_options, MODEL_ARGS if cls.calls_model else SCRIPTED_ARGS)
    except AgentSpecError as exc:
        raise CLIError(f"--agent {exc}") from None
    return cls


def _agent(args: argparse.Namespace, required: dict[str, Any], optional: dict[str, Any]) -> Any:
    from agents.registry import AgentSpecError, build_agent

    try:
        return build_agent(args.agent, required, optional, args.agent_options)
    except AgentSpecError as exc:
        raise CLIError(f"--agent {exc}") from None


def build(args: argparse.Namespace, env_id: str, env_kwargs: dict[str, Any]) -> tuple[list[Any], Any, str]:
    """The envs, the agent and a model label."""
    from agents.registry import resolve_agent

    if not resolve_agent(args.agent).calls_model:
        from agents.models import load_tokenizer

        # a scripted agent (the oracle) calls no model: its tokenizer is all it needs (loading weights only costs time)
        tokenizer = _once(args, "tokenizer",
                          lambda: _guard_model(args.model or "tiny", lambda: load_tokenizer(args.model)))
        envs = make_envs(env_id, args, tokenizer, env_kwargs)
        agent = _agent(args, {"tokenizer": tokenizer}, {"samples": getattr(envs[0].unwrapped, "source", None)})
        return envs, agent, args.model or "-"

    from agents.backends.base import SamplingParams
    from agents.backends.factory import BackendOptionError, make_backend
    from agents.backends.openai import OpenAIBackendError
    from agents.backends.vllm import VLLMUnsupportedError
    from agents.models import load, load_tokenizer

    if args.backend != "hf" and args.top_p < 1.0:
        raise CLIError(f"--backend {args.backend} records untruncated log-probs only with --top-p 1.0 (the engine "
                       "returns the truncated distribution's); use --backend hf for nucleus sampling")
    set_threads(args.threads)
    keep_freed_memory()
    if args.backend == "openai":  # the server holds the weights: the tokenizer is all we load
        model, tokenizer = None, _once(args, "tokenizer", lambda: _guard_model(args.model,
                                                                               lambda: load_tokenizer(args.model)))
    else:
        model, tokenizer = _once(args, "model", lambda: _guard_model(args.model,
                                                                     lambda: load(args.model, device=args.device)))

    def make() -> Any:
        try:
            return make_backend(args.backend, model=model, tokenizer=tokenizer, options=engine_options(args),
                                device=args.device, seed=args.seed, max_batch_size=args.batch_size,
                                name=f"hf:{args.model}")
        except (BackendOptionError, VLLMUnsupportedError, OpenAIBackendError) as exc:
            raise CLIError(f"--backend {args.backend}: {exc}") from None

    backend = _once(args, "backend", make)
    greedy = args.temperature <= 0
    sampling = SamplingParams(temperature=1.0 if greedy else args.temperature, top_p=args.top_p, greedy=greedy,
                              max_new_tokens=args.max_new_tokens)
    agent = _agent(args, {"backend": backend, "sampling": sampling},
                   {"answer_max_new_tokens": args.answer_max_new_tokens, "top_k": args.top_k})
    return make_envs(env_id, args, tokenizer, env_kwargs), agent, args.model


def keep_freed_memory() -> bool:
    """Ask glibc's allocator to keep freed memory for reuse rather than hand it back to the
    system. Every forward of a batch allocates activations of megabytes; by default glibc maps
    each such block afresh and unmaps it when freed, so every forward pays page faults that zero
    the new pages (about a tenth of an evaluation's prefill time on one CPU thread, measured in
    docs/BENCHMARKS.md). The numbers computed are the same. Returns whether it was set (glibc only)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to set
        return False
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameters
    # blocks up to 32 MiB (glibc's most) come from the heap, and the heap is never trimmed below 1 GiB
    return bool(mallopt(m_mmap_threshold, 32 * 2**20)) and bool(mallopt(m_trim_threshold, 2**30))


def _once(args: argparse.Namespace, name: str, make: Any) -> Any:
    """``make()`` once per run: a sweep builds envs and an agent for each value, but loads the
    model and starts the backend once."""
    built = args.__dict__.setdefault("_built", {})
    if name not in built:
        built[name] = make()
    return built[name]


def _guard_model(spec: str, load: Any) -> Any:
    """Run a model / tokenizer load; the loader's errors become one ``error:`` line naming --model."""
    from agents.models import ModelLoadError

    try:
        return load()
    except (ModelLoadError, FileNotFoundError) as exc:
        raise CLIError(f"--model {spec}: {exc}") from None


def make_envs(env_id: str, args: argparse.Namespace, tokenizer: Any, env_kwargs: dict[str, Any]) -> list[Any]:
    """``--batch-size`` envs; a bad env option is a usage error, said without gymnasium's kwargs dump."""
    import gymnasium as gym

    from memgym.errors import MemgymError, TaskConfigError
    from memgym.generators.hotpot import DatasetUnavailableError

    try:
        envs = [gym.make(env_id, split=args.split, tokenizer=tokenizer, **env_kwargs)
                for _ in range(min(args.batch_size, args.episodes))]
    except TaskConfigError as exc:  # the task folder is wrong, not the flags: the message names file and key
        raise CLIError(f"{env_id}: {exc}") from None
    except (ValueError, TypeError, KeyError, MemgymError, DatasetUnavailableError) as exc:
        message = str(exc).split(" was raised from the environment creator")[0]  # drop the repr of every kwarg
        raise CLIError(f"{env_id}: {message} (check --env-kwarg and --split)") from None
    if getattr(args, "memory_perturbation", None):
        from memgym.perturb import MemoryPerturbation

        envs = [MemoryPerturbation(env, args.memory_perturbation) for env in envs]
    return envs


def check_range(envs: Sequence[Any], args: argparse.Namespace, env_id: str, groups: int) -> None:
    """The episodes must lie inside the split: a clear message instead of an error mid-run."""
    try:
        n = len(envs[0].unwrapped.source)
    except (AttributeError, TypeError):
        return  # an env without a sized sample source: the env checks its own indices
    if args.start_index + groups > n:
        raise CLIError(f"--start-index {args.start_index} with {groups} questions needs samples "
                       f"{args.start_index}..{args.start_index + groups - 1}, but split {args.split!r} of {env_id} "
                       f"has {n} (indices 0..{n - 1}); lower --start-index or --episodes")


class OutputDir:
    """The output directory, made up front (a read-only or missing place fails before any model
    loads) and removed again, with every missing parent it made, when the run fails."""

    FILES = ("episodes.jsonl", "summary.json")

    def __init__(self, path: Path, overwrite: bool = False, files: Sequence[str] = FILES) -> None:
        self.path, self.FILES = path, tuple(files)
        self.made = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
        held = [name for name in self.FILES if (path / name).is_file() and (path / name).stat().st_size]
        if held and not overwrite:
            raise CLIError(f"--out {path} already holds an evaluation ({', '.join(held)}); choose another --out, or "
                           "pass --overwrite to replace it")
        try:
            path.mkdir(parents=True, exist_ok=True)
            for name in self.FILES:  # --overwrite: the new run's results replace the old
                (path / name).unlink(missing_ok=True)
            (path / self.FILES[0]).touch()  # proves the directory takes files before the slow part
        except (FileExistsError, NotADirectoryError):
            self.discard()
            raise CLIError(f"--out {path}: {path if path.exists() else 'a parent'} is a file, not a directory; "
                           "give a directory for the results") from None
        except OSError as exc:
            self.discard()
            raise CLIError(f"--out {path}: {describe(exc)}") from None

    def discard(self) -> None:
        for name in self.FILES:
            try:
                (self.path / name).unlink(missing_ok=True)
            except OSError:
                pass  # not there to remove (a file in place of the directory, a read-only place)
        for folder in self.made:
            try:
                folder.rmdir()
            except OSError:
                break  # not empty (someone else's files) or already gone: leave it


def evaluate(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the CLI and return the summary; bad input raises :class:`CLIError` (or ``OSError``)."""
    args = parse_args(argv)
    env_id = check_choices(args)
    env_kwargs = parse_kwargs(args.env_kwarg, "--env-kwarg")
    check_env_kwargs(env_kwargs)
    sweep = check_sweep(args, env_kwargs)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(args.out) if args.out else \
        Path("runs") / "eval" / f"{env_id.replace('/', '_')}-{_label(args.agent)}-{stamp}"
    out = OutputDir(path, overwrite=args.overwrite, files=OutputDir.FILES if sweep is None else eval_sweep.FILES)
    made: list[OutputDir] = []  # a sweep's directory per value, each made before any model loads
    try:
        if sweep is None:
            return _run(args, env_id, env_kwargs, out.path)[0]
        for value in sweep[1]:
            made.append(OutputDir(eval_sweep.value_dir(out.path, sweep[0], value), overwrite=args.overwrite))
        return _run_sweep(args, env_id, env_kwargs, out.path, sweep, made)
    except Exception:
        for d in [*made, out]:
            d.discard()  # no half-written results: a failed run leaves nothing behind
        raise


def check_sweep(args: argparse.Namespace, env_kwargs: dict[str, Any]) -> tuple[str, list[Any], list] | None:
    """``--lengths`` / ``--sweep`` / ``--compare``, checked before any model loads: the swept env
    option, its values and the compared sweeps (None: one run)."""
    parsed = eval_sweep.parse_sweep(args.lengths, args.sweep)
    if parsed is None:
        if args.compare:
            raise CLIError("--compare adds earlier sweeps to this run's sweep table: give --lengths or --sweep too")
        return None
    key, values = parsed
    if key in env_kwargs:
        raise CLIError(f"--env-kwarg {key}={env_kwargs[key]} and the sweep both set {key}; drop the --env-kwarg")
    if key in OWN_ENV_KWARGS:
        raise CLIError(f"--sweep {key}: memopd.eval sets {key} from {OWN_ENV_KWARGS[key]}; sweep an env option")
    return key, values, eval_sweep.read_compared(args.compare)


def _run_sweep(args: argparse.Namespace, env_id: str, env_kwargs: dict[str, Any], out: Path,
               sweep: tuple[str, list[Any], list], made: list[OutputDir]) -> dict[str, Any]:
    """One run per value of the swept option into its directory of ``made`` (model and backend
    loaded once), then the table and the plot."""
    key, values, compared = sweep
    rows = []
    for value, place in zip(values, made):
        print(f"{key}={value}")
        summary, episodes, envs = _run(args, env_id, {**env_kwargs, key: value}, place.path)
        first = range(args.start_index, args.start_index + min(eval_sweep.MEASURED_EPISODES, len(episodes)))
        tokens = eval_sweep.input_tokens(envs[0], first, args.seed)
        rows.append(eval_sweep.row(value, summary, tokens, [e.metrics.get("f1", 0.0) for e in episodes]))
    policy = args.agent if args.model is None else f"{args.agent} ({args.model})"
    result = {"policy": policy, "env": env_id, "key": key, "rows": rows, "agent": args.agent, "model": args.model,
              "agent_kwargs": args.agent_options, "env_kwargs": env_kwargs, "split": args.split, "seed": args.seed,
              "start_index": args.start_index, "temperature": args.temperature, "batch_size": args.batch_size}
    with _writing(out / "sweep.json"):
        eval_sweep.write(out, result, compared)
    print(eval_sweep.markdown([result, *compared]))
    print(f"saved {out / 'sweep.json'}, {out / 'sweep.md'} and {out / 'sweep.png'}")
    return result


def _label(spec: str) -> str:
    """``--agent`` as a directory-name part (``examples.notes_agent:NotesAgent`` -> ``NotesAgent``)."""
    return re.sub(r"[^\w.-]+", "_", spec.rpartition(":")[2] or spec)


# Errors only a write raises (a full disk, a quota, a file too large, a file system turned read-only).
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """A write error that names no file (a full disk raises ``[Errno 28]`` from ``write``) is
    reported on ``path``, the file being written, with what to do."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno not in WRITE_ERRNOS:
            raise
        raise CLIError(f"--out {path.parent}: {describe(OSError(exc.errno, exc.strerror, str(path)))}") from None


def _run(args: argparse.Namespace, env_id: str, env_kwargs: dict[str, Any], out: Path
         ) -> tuple[dict[str, Any], list[Any], list[Any]]:
    """One evaluation into ``out``: its summary, episodes and envs."""
    from agents.oracle import OracleDataError
    from agents.rollout import rollout

    envs, agent, model_label = build(args, env_id, env_kwargs)
    groups = -(-args.episodes // args.group_size)
    check_range(envs, args, env_id, groups)
    episodes_path = out / "episodes.jsonl"
    t0 = time.perf_counter()
    try:
        with _writing(episodes_path):
            episodes = rollout(envs, agent, args.episodes, group_size=args.group_size, seed=args.seed,
                               indices=range(args.start_index, args.start_index + groups), out=episodes_path,
                               progress=args.progress)
    except OracleDataError as exc:
        raise CLIError(f"--agent {args.agent}: {exc}; or evaluate an agent that calls a model "
                       "(e.g. --agent memagent --model tiny)") from None
    wall = time.perf_counter() - t0
    summary = summarize(episodes, wall_s=wall)
    summary.update({"env": env_id, "agent": args.agent, "agent_kwargs": args.agent_options, "model": model_label,
                    "split": args.split, "episodes": len(episodes), "seed": args.seed, "start_index": args.start_index,
                    "group_size": args.group_size, "temperature": args.temperature, "env_kwargs": env_kwargs})
    if args.memory_perturbation:
        summary["memory_perturbation"] = {"spec": args.memory_perturbation, **recovery(episodes)}
    with _writing(out / "summary.json"):
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    header = f"{env_id}  agent={args.agent}  model={model_label}  split={args.split}  episodes={len(episodes)}"
    print(format_table(summary, header))
    print(f"saved {episodes_path} and {out / 'summary.json'}")
    warn_dropped(episodes)
    return summary, episodes, envs


def warn_dropped(episodes: Sequence[Any]) -> None:
    """Say when a scripted oracle's memory could not hold what its answers needed (those episodes
    score less: the oracle answers from its memory alone)."""
    short = [e for e in episodes if getattr(e, "dropped_facts", None) and not e.perturbations]  # not perturbed away
    if short:
        print(f"warning: in {len(short)} of {len(episodes)} episodes the memory budget cannot hold what the "
              f"answer needs (e.g. {short[0].dropped_facts[0]!r}; see dropped_facts in episodes.jsonl); the oracle "
              "answers only from its memory: raise --env-kwarg memory_budget", file=sys.stderr)


def recovery(episodes: Sequence[Any]) -> dict[str, Any]:
    """The perturbed-memory control's reading: F1 of the perturbed episodes where a supporting fact
    was read again after the (last) perturbation (recovery was possible), of those where it was not,
    and of the episodes left unperturbed; each with its count (F1 None when there are none)."""
    def f1(group: list[Any]) -> float | None:
        return sum(e.metrics.get("f1", 0.0) for e in group) / len(group) if group else None

    perturbed = [e for e in episodes if e.perturbations]
    again = [e for e in perturbed if e.perturbations[-1].reappears]
    never = [e for e in perturbed if e.perturbations[-1].reappears is False]
    plain = [e for e in episodes if not e.perturbations]
    return {"perturbed": len(perturbed), "f1_perturbed": f1(perturbed), "fact_read_again": len(again),
            "f1_recovery": f1(again), "fact_not_read_again": len(never), "f1_not_read_again": f1(never),
            "unperturbed": len(plain), "f1_unperturbed": f1(plain)}


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
        out["calls_per_s"] = sum(p["calls"] for p in per_ep) / wall_s if wall_s > 0 else 0.0
    return out


def format_table(summary: dict[str, Any], header: str) -> str:
    """The summary as a two-column text table under ``header``."""
    rows = [("EM", f"{summary['em']:.3f}"), ("F1", f"{summary['f1']:.3f}"), ("sub-EM", f"{summary['sub_em']:.3f}"),
            ("memory tokens / write", _count(summary["memory_tokens"])),
            ("calls / episode", _count(summary["calls"])),
            ("peak context / episode", _count(summary["peak_context"])),
            ("generated tokens / episode", _count(summary["generated_tokens"]))]
    if "generated_tokens_per_s" in summary:
        rows.append(("generated tokens / s", f"{summary['generated_tokens_per_s']:.1f}"))
    if "calls_per_s" in summary:
        rows.append(("model calls / s", f"{summary['calls_per_s']:.1f}"))
    if "memory_perturbation" in summary:  # the perturbed-memory control: recovery against no perturbation
        r = summary["memory_perturbation"]
        rows += [(f"F1 perturbed ({r['spec']})", _f1_of(r["f1_perturbed"], r["perturbed"])),
                 ("F1 recovery (fact read again)", _f1_of(r["f1_recovery"], r["fact_read_again"])),
                 ("F1 fact not read again", _f1_of(r["f1_not_read_again"], r["fact_not_read_again"])),
                 ("F1 unperturbed", _f1_of(r["f1_unperturbed"], r["unperturbed"]))]
    width = max(len(r[0]) for r in rows)
    lines = [header, f"{'metric':<{width}}  value", f"{'-' * width}  -----"]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


def _f1_of(value: float | None, n: int) -> str:
    return f"{value:.3f} ({n} episodes)" if value is not None else f"- ({n} episodes)"


def _count(value: float) -> str:
    """A mean count: ``4`` when whole (every episode made 4 calls), else one decimal (``4.5``)."""
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: 0 on success; bad input prints ``error: ...`` on stderr and returns 2."""
    def run() -> int:
        evaluate(argv)
        return 0

    return run_main(run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
