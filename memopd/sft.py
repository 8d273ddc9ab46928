"""Supervised fine-tuning on recorded episodes (e.g. OracleAgent trajectories).

The episodes go through the same state-aligned packing as RL: every invocation is restored with
its own prompt and positions, and the loss is the negative log-likelihood of the action tokens
only (prompts are context, never targets). This is how the embedded default builds a teacher
that is stronger than the student.

    python -m memopd.sft --model tiny-teacher --env memgym/LongQA-v0 --out runs/sft/teacher
    python -m memopd.sft --model tiny --episodes oracle.jsonl --out runs/sft/student
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from agents.records import Episode, load_episodes
from memgym.cli import run_main
from memopd import config as cfgmod
from memopd.config import LR_SCHEDULES, ConfigError, TrainingOptions, field
from memopd.learn.lora import LoRAOptions, lora_on, trainable_parameters
from memopd.runtime import compute_dtype, lr_lambda, prepare_model, set_threads
from memopd.packing import fitting_budget, pack_episodes
from memopd.scoring import action_states, token_logprobs


@dataclass
class SFTConfig(LoRAOptions, TrainingOptions):
    """Supervised fine-tuning on recorded episodes. Every field is a flag: ``batch_episodes`` ->
    ``--batch-episodes``; the options shared with ``memopd.train`` mean the same in both."""

    model: str = field("tiny-teacher", help="model to fine-tune: preset (tiny, tiny-teacher, smollm2), local "
                                            "model directory, training run directory or checkpoint, .gguf file "
                                            "or hub id")
    lr: float = field(3e-3, help="peak learning rate (AdamW)", range=(0.0, 1.0))
    lr_schedule: str = field("cosine", help="learning-rate schedule after the linear warm-up",
                             choices=LR_SCHEDULES)
    lr_floor: float = field(0.1, help="final learning rate of the cosine / linear schedule, as a fraction of "
                                      "the peak", range=(0.0, 1.0))
    warmup_steps: int = field(20, help="linear warm-up steps", range=(0, None))
    out: str = field("runs/sft/model", help="directory the fine-tuned model and tokenizer are saved to "
                                            "(replaced atomically when it exists)")
    episodes: str | None = field(None, help="episodes JSONL to train on; default: generate oracle "
                                            "trajectories on --env")
    num_episodes: int = field(2000, help="oracle trajectories to generate when --episodes is not given",
                              range=(1, None))
    context: str = field("aligned", help="the context each action is trained in: aligned (its call's own prompt, "
                                         "as the agent runs), persistent (the episode's flattened transcript, as a "
                                         "persistent-history teacher scores it), or both (each step the mean of the "
                                         "two losses on the same episodes: a teacher fit for both kinds of state)",
                         choices=("aligned", "persistent", "both"))
    steps: int = field(300, help="optimizer steps", range=(1, None))
    batch_episodes: int = field(32, help="episodes per optimizer step", range=(1, None))
    checkpoint_every: int = field(0, help="save the fine-tuning's whole state (weights, optimizer, data order) to "
                                          "OUT.partial every N steps; a rerun with the same options resumes there "
                                          "and ends where an uninterrupted run would (0: off)", range=(0, None))


def oracle_episodes(env_id: str, env_kwargs: dict[str, Any], tokenizer: Any, num_episodes: int, seed: int,
                    split: str = "train", progress: bool = True, template: str | None = None) -> list[Episode]:
    """Gold MemAgent-format trajectories from the OracleAgent (no model); ``template``: the
    prompt template by name (default: MemAgent's)."""
    import gymnasium as gym

    import memgym  # noqa: F401  (registers the envs)
    from agents.oracle import OracleAgent
    from agents.rollout import rollout

    kwargs = {"split": split, **env_kwargs, "tokenizer": tokenizer}
    envs = [gym.make(env_id, **kwargs) for _ in range(8)]
    agent = OracleAgent.for_env(envs[0], tokenizer=tokenizer, **({"template": template} if template else {}))
    try:
        return rollout(envs, agent, num_episodes, seed=seed, progress=progress, run_id=f"oracle-{split}-{seed}")
    finally:
        for e in envs:
            e.close()


def nll_loss(model: torch.nn.Module, episodes: Sequence[Episode], pack_tokens: int,
             pad_token_id: int = 0, lowering: str | None = None, context: str = "aligned") -> tuple[torch.Tensor, int]:
    """Mean negative log-likelihood of the action tokens of ``episodes``, packed in ``context``:
    ``aligned`` (each call's own prompt), ``persistent`` (each episode's flattened transcript; rows
    widened to hold the longest) or ``both`` (the mean of the two means)."""
    if context == "both":
        parts = [nll_loss(model, episodes, pack_tokens, pad_token_id, lowering, c) for c in ("aligned", "persistent")]
        return (parts[0][0] + parts[1][0]) / 2, parts[0][1]
    budget = fitting_budget(episodes, context, pack_tokens) if context == "persistent" else pack_tokens
    batch = pack_episodes(episodes, budget, mode=context, pad_token_id=pad_token_id)
    states = action_states(model, batch, lowering=lowering, apply_temperature=False)
    logp, _, _ = token_logprobs(states, batch.action_ids)
    return -logp.mean(), batch.num_actions


STATE_FILE = "sft_state.pt"
"""The file of a resumable fine-tuning's state, in its ``OUT.partial`` directory."""
_NOT_RESULTS = ("progress", "threads", "out", "checkpoint_every")
"""Options that do not change what a fine-tuning computes: a state saved under others still resumes."""


def _state_key(cfg: SFTConfig, num_episodes: int) -> dict[str, Any]:
    return {**{k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_RESULTS}, "episodes": num_episodes}


def _save_state(state_dir: Path, key: dict[str, Any], step: int, model: torch.nn.Module, opt: Any, sched: Any,
                rng: random.Random, order: list[int], history: list[dict[str, float]]) -> None:
    """Everything a rerun needs to go on exactly, written atomically (a kill mid-write keeps the last)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / (STATE_FILE + ".tmp")
    torch.save({"key": key, "step": step, "model": model.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict(), "rng": rng.getstate(), "torch_rng": torch.get_rng_state(),
                "order": order, "history": history}, tmp)
    os.replace(tmp, state_dir / STATE_FILE)


def _load_state(state_dir: Path | None, key: dict[str, Any], log) -> dict[str, Any] | None:
    path = None if state_dir is None else state_dir / STATE_FILE
    if path is None or not path.is_file():
        return None
    try:
        state = torch.load(path, weights_only=False)
    except Exception as exc:  # a file another version wrote, or a truncated one: start over
        log(f"sft: {path} is unreadable ({type(exc).__name__}); starting over")
        return None
    if state.get("key") != key:
        log(f"sft: {path} was saved with other options; starting over")
        return None
    log(f"sft: resuming from step {state['step']} ({path})")
    return state


def train_sft(model: torch.nn.Module, episodes: Sequence[Episode], cfg: SFTConfig, *, pad_token_id: int = 0,
              progress: bool = True, log=None, state_dir: Path | None = None) -> list[dict[str, float]]:
    """Fine-tune ``model`` in place on the action tokens of ``episodes``; returns per-step stats.
    Without ``progress``, ``log`` (default: stderr) gets the loss every tenth of the steps. With
    ``state_dir`` and ``cfg.checkpoint_every``, the state is saved there every that many steps and
    a state found there (saved with the same options) is resumed."""
    from tqdm.auto import tqdm

    if not episodes:
        raise ValueError("SFT needs at least one episode")
    log = log or _stderr
    rng = random.Random(cfg.seed)
    params = trainable_parameters(model)  # a LoRA model: its adapters only
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, cfg.steps, cfg.lr_floor))
    model.train()
    history: list[dict[str, float]] = []
    order: list[int] = []
    key = _state_key(cfg, len(episodes))
    start = 0
    state = _load_state(state_dir, key, log) if cfg.checkpoint_every else None
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        start, order, history = state["step"], list(state["order"]), list(state["history"])
    bar = tqdm(range(start, cfg.steps), desc="sft", unit="step", disable=not progress, initial=start,
               total=cfg.steps)
    for step in bar:
        if len(order) < cfg.batch_episodes:
            fresh = list(range(len(episodes)))
            rng.shuffle(fresh)
            order += fresh
        idx, order = order[:cfg.batch_episodes], order[cfg.batch_episodes:]
        t0 = time.perf_counter()
        loss, n_tok = nll_loss(model, [episodes[i] for i in idx], cfg.pack_tokens, pad_token_id, cfg.attn,
                               cfg.context)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"SFT loss is {loss.item()} at step {step}; lower --lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        sched.step()
        dt = time.perf_counter() - t0
        row = {"step": step + 1, "loss": loss.item(), "grad_norm": float(gnorm), "tokens_per_s": n_tok / dt,
               "lr": sched.get_last_lr()[0]}
        history.append(row)
        bar.set_postfix(loss=f"{row['loss']:.3f}", refresh=False)
        if not progress and (step + 1) % max(1, cfg.steps // 10) == 0:  # a real model takes minutes: say so
            log(f"sft step {step + 1}/{cfg.steps}: loss {row['loss']:.4f}, "
                f"{dt:.1f} s, {row['tokens_per_s']:.1f} action tokens/s")
        if state_dir is not None and cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 \
                and step + 1 < cfg.steps:
            _save_state(state_dir, key, step + 1, model, opt, sched, rng, order, history)
    bar.close()
    model.eval()
    return history


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def check_writable(directory: Path) -> None:
    """Fail now, not after training, when ``directory`` cannot take the output (read-only, full,
    or not a directory); makes the directory when it is missing."""
    for p in (directory, *directory.parents):
        if p.exists():
            if not p.is_dir():
                raise ConfigError(f"--out: {p} is a file, not a directory; choose another --out")
            break
    directory.mkdir(parents=True, exist_ok=True)
    tempfile.TemporaryDirectory(prefix=".write-check-", dir=directory).cleanup()


def run(cfg: SFTConfig, progress: bool | None = None) -> Path:
    """Load the model, get episodes (file or oracle), fine-tune, save to ``cfg.out`` atomically
    (model, tokenizer, ``sft_config.json``, ``sft_metrics.jsonl``)."""
    from agents.models import load, save_pretrained

    progress = cfg.progress if progress is None else progress
    set_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load(cfg.model, device=cfg.device)
    prepare_model(model, cfg)
    if cfg.episodes:
        report = load_episodes(cfg.episodes)
        for line, msg in report.errors:
            print(f"warning: {cfg.episodes}:{line}: skipped ({msg})", file=sys.stderr)
        episodes = report.episodes
        if not episodes:
            raise ConfigError(f"--episodes {cfg.episodes}: no readable episode in it; pass a JSONL of episodes "
                              "(e.g. the episodes.jsonl of memopd.eval)")
    else:
        _check_env(cfg.env, {**cfg.env_kwargs, "tokenizer": tokenizer})
    out = Path(cfg.out)
    check_writable(out.parent)
    if not cfg.episodes:
        print(f"Generating {cfg.num_episodes} oracle trajectories on {cfg.env} ...", file=sys.stderr)
        episodes = oracle_episodes(cfg.env, cfg.env_kwargs, tokenizer, cfg.num_episodes, cfg.seed, progress=progress)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    state_dir = partial_dir(out) if cfg.checkpoint_every else None
    with compute_dtype(cfg.dtype, cfg.device):
        history = train_sft(model, episodes, cfg, pad_token_id=pad, progress=progress, state_dir=state_dir)
    extra = []
    if lora_on(cfg):  # the merged model in --out (loads anywhere), the adapters in --out/adapter
        from agents.lora import AdapterWriter, merged_copy

        extra, model = [AdapterWriter(model, "adapter")], merged_copy(model)
    save_pretrained(out, model, tokenizer, *extra, files={
        "sft_config.json": json.dumps(dataclasses.asdict(cfg), indent=2),
        "sft_metrics.jsonl": "".join(json.dumps(r) + "\n" for r in history)})
    if state_dir is not None:
        shutil.rmtree(state_dir, ignore_errors=True)
    print(f"SFT done: final loss {history[-1]['loss']:.4f}; model saved to {out}", file=sys.stderr)
    return out


def partial_dir(out: Path) -> Path:
    """Where a resumable fine-tuning into ``out`` keeps its state until it is done."""
    return out.with_name(out.name + ".partial")


def _check_env(env_id: str, env_kwargs: dict[str, Any]) -> None:
    """An unknown env id or env option is a usage error, reported before any work."""
    import gymnasium as gym

    import memgym

    try:
        memgym.resolve_id(env_id)
    except memgym.UnknownEnvError as exc:
        raise ConfigError(str(exc)) from None
    try:
        gym.make(env_id, split="train", **env_kwargs).close()
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"--env-kwarg: {env_id} refused {env_kwargs}: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    from agents.models import ModelLoadError

    def _main() -> int:
        cfg = cfgmod.parse_args(SFTConfig, argv, "python -m memopd.sft", __doc__)
        run(cfg)
        return 0

    return run_main(_main, errors=(ConfigError, ModelLoadError, ValueError))


if __name__ == "__main__":
    sys.exit(main())
