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
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from agents.records import Episode, load_episodes
from memopd import config as cfgmod
from memopd.config import field
from memopd.packing import pack_episodes
from memopd.scoring import action_states, token_logprobs


@dataclass
class SFTConfig:
    """Supervised fine-tuning on recorded episodes."""

    model: str = field("tiny-teacher", help="model spec to fine-tune: preset (tiny, tiny-teacher), local dir, "
                                            "hub id or .gguf")
    out: str = field("runs/sft/model", help="directory the fine-tuned model and tokenizer are saved to")
    episodes: str | None = field(None, help="episodes JSONL to train on; default: generate oracle "
                                            "trajectories on --env")
    env: str = field("memgym/LongQA-v0", help="environment for generated oracle trajectories")
    env_kwargs: dict = field(default_factory=dict, help="JSON object of env kwargs, e.g. '{\"num_chunks\": 6}'")
    num_episodes: int = field(2000, help="oracle trajectories to generate when --episodes is not given",
                              range=(1, None))
    steps: int = field(300, help="optimizer steps", range=(1, None))
    batch_episodes: int = field(32, help="episodes per optimizer step", range=(1, None))
    lr: float = field(3e-3, help="peak learning rate (AdamW)", range=(0.0, 1.0))
    warmup_steps: int = field(20, help="linear warm-up steps", range=(0, None))
    weight_decay: float = field(0.0, help="AdamW weight decay", range=(0.0, None))
    max_grad_norm: float = field(1.0, help="gradient clipping norm", range=(0.0, None))
    pack_tokens: int = field(4096, help="token budget of one packed row", range=(64, None))
    attn: str | None = field(None, help="attention lowering (sdpa, eager, blocks; flex, flash on GPU); "
                                        "default by device", choices=("sdpa", "eager", "blocks", "flex", "flash"))
    seed: int = field(0, help="random seed")
    threads: int | None = field(None, help="torch CPU threads (default: torch's choice)")


def oracle_episodes(env_id: str, env_kwargs: dict[str, Any], tokenizer: Any, num_episodes: int, seed: int,
                    split: str = "train", progress: bool = True) -> list[Episode]:
    """Gold MemAgent-format trajectories from the OracleAgent (no model)."""
    import gymnasium as gym

    import memgym  # noqa: F401  (registers the envs)
    from agents.oracle import OracleAgent
    from agents.rollout import rollout

    kwargs = {"split": split, **env_kwargs, "tokenizer": tokenizer}
    envs = [gym.make(env_id, **kwargs) for _ in range(8)]
    agent = OracleAgent.for_env(envs[0], tokenizer=tokenizer)
    try:
        return rollout(envs, agent, num_episodes, seed=seed, progress=progress, run_id=f"oracle-{split}-{seed}")
    finally:
        for e in envs:
            e.close()


def lr_lambda(warmup: int, total: int):
    """Linear warm-up then cosine decay to 10% of the peak."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return f


def nll_loss(model: torch.nn.Module, episodes: Sequence[Episode], pack_tokens: int,
             pad_token_id: int = 0, lowering: str | None = None) -> tuple[torch.Tensor, int]:
    """Mean negative log-likelihood of the action tokens of ``episodes`` (packed, state-aligned)."""
    batch = pack_episodes(episodes, pack_tokens, mode="aligned", pad_token_id=pad_token_id)
    states = action_states(model, batch, lowering=lowering, apply_temperature=False)
    logp, _, _ = token_logprobs(states, batch.action_ids)
    return -logp.mean(), batch.num_actions


def train_sft(model: torch.nn.Module, episodes: Sequence[Episode], cfg: SFTConfig, *, pad_token_id: int = 0,
              progress: bool = True, log=print) -> list[dict[str, float]]:
    """Fine-tune ``model`` in place on the action tokens of ``episodes``; returns per-step stats."""
    from tqdm.auto import tqdm

    if not episodes:
        raise ValueError("SFT needs at least one episode")
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.warmup_steps, cfg.steps))
    model.train()
    history = []
    order: list[int] = []
    bar = tqdm(range(cfg.steps), desc="sft", unit="step", disable=not progress)
    for step in bar:
        if len(order) < cfg.batch_episodes:
            fresh = list(range(len(episodes)))
            rng.shuffle(fresh)
            order += fresh
        idx, order = order[:cfg.batch_episodes], order[cfg.batch_episodes:]
        t0 = time.perf_counter()
        loss, n_tok = nll_loss(model, [episodes[i] for i in idx], cfg.pack_tokens, pad_token_id, cfg.attn)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"SFT loss is {loss.item()} at step {step}; lower --lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        sched.step()
        dt = time.perf_counter() - t0
        row = {"step": step + 1, "loss": loss.item(), "grad_norm": float(gnorm), "tokens_per_s": n_tok / dt,
               "lr": sched.get_last_lr()[0]}
        history.append(row)
        bar.set_postfix(loss=f"{row['loss']:.3f}", refresh=False)
    bar.close()
    model.eval()
    return history


def run(cfg: SFTConfig, progress: bool = True) -> Path:
    """Load the model, get episodes (file or oracle), fine-tune, save to ``cfg.out``."""
    from agents.models import load

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load(cfg.model)
    if cfg.episodes:
        report = load_episodes(cfg.episodes)
        for line, msg in report.errors:
            print(f"warning: {cfg.episodes}:{line}: skipped ({msg})", file=sys.stderr)
        episodes = report.episodes
    else:
        print(f"Generating {cfg.num_episodes} oracle trajectories on {cfg.env} ...", file=sys.stderr)
        episodes = oracle_episodes(cfg.env, cfg.env_kwargs, tokenizer, cfg.num_episodes, cfg.seed, progress=progress)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    history = train_sft(model, episodes, cfg, pad_token_id=pad, progress=progress)
    out = Path(cfg.out)
    save_model(model, tokenizer, out)
    (out / "sft_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    (out / "sft_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    print(f"SFT done: final loss {history[-1]['loss']:.4f}; model saved to {out}", file=sys.stderr)
    return out


def save_model(model: torch.nn.Module, tokenizer: Any, out: Path) -> None:
    """Save a model + tokenizer directory atomically (written aside, then renamed)."""
    import shutil
    import tempfile

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = cfgmod.parse_args(SFTConfig, argv, "python -m memopd.sft", __doc__.splitlines()[0])
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
