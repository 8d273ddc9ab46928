"""Why PPO alone collapses at lr 2e-3 from the mid-plateau start: its update measured step by step.

    python examples/ppo_collapse.py --out runs/ppo-collapse                 # start, then the arms
    python examples/ppo_collapse.py --out runs/ppo-collapse --lrs 2e-3 --seeds 0,1
    python examples/ppo_collapse.py --out runs/ppo-collapse --name runs-token --lrs 2e-3 -- --loss-agg token

The start is the baselines study's mid-plateau recipe (docs/RESULTS.md, "PPO with a signal"): the
`tiny` preset fine-tuned by memopd.sft on oracle trajectories of the 3-chunk task (32 episodes a step,
lr 3e-3) for ``--start-steps`` steps, evaluated on the 6-chunk task. From it, PPO alone (``--opd-coef
0``, 4 questions x 8 samples a step, 2 epochs) runs at each learning rate, logging per step: the
reward; the importance ratio's mean and its clipped share below and above (over both epochs); the
policy's entropy at its sampled tokens; the KL of each epoch's update (k3, old -> new); and the KL of
the policy that sampled the step to the start (:class:`KLToStart`, k3 on the step's sampled tokens).
Held-out F1 every ``--eval-every`` steps. Runs resume (a finished one is kept); the results JSON is
rewritten after every run.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from memopd.learn.plugin import Plugin, StepResult

ENV = "memgym/LongQA-v0"
ENV_KWARGS = {"num_chunks": 6, "chunk_size": 48, "memory_budget": 16}
LOGGED = ("reward", "ratio_mean", "clip_frac", "clip_frac_low", "clip_frac_high", "entropy", "approx_kl",
          "kl_to_start", "grad_norm", "memory_tokens_per_call", "step_s", "eval/f1")


class KLToStart(Plugin):
    """Logs ``kl_to_start``: KL(pi_sampling || pi_start) on the step's sampled tokens (the k3 estimate,
    ``(r - 1) - log r`` with ``r = pi_start / pi_sampling``), pi_start the student as training began."""

    name = "kl_to_start"

    def start(self, step: int) -> None:
        self.start_model = copy.deepcopy(self.ctx.student).eval()

    @torch.no_grad()
    def end_step(self, result: StepResult) -> dict[str, float]:
        from memopd.scoring import action_states, token_logprobs

        lp, _, _ = token_logprobs(action_states(self.start_model, result.batch, lowering=self.ctx.cfg.attn),
                                  result.batch.action_ids)
        log_r = lp.float().cpu() - result.batch.old_logprobs.float()
        return {"kl_to_start": float(((log_r.exp() - 1.0) - log_r).mean())}


def build_start(out: Path, steps: int, threads: int) -> Path:
    """The mid-plateau start (reused when it exists): SFT of `tiny` on the 3-chunk task's oracle calls."""
    from memopd.sft import SFTConfig, run as run_sft

    path = out / f"start-sft{steps}"
    if not (path / "config.json").is_file():
        run_sft(SFTConfig(model="tiny", out=str(path), env=ENV, env_kwargs={**ENV_KWARGS, "num_chunks": 3},
                          num_episodes=1000, steps=steps, batch_episodes=32, lr=3e-3, warmup_steps=min(20, steps // 5),
                          seed=7, threads=threads), progress=False)
    return path


def run_arm(start: Path, run_dir: Path, lr: float, seed: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """PPO alone from ``start`` at ``lr``; its per-step rows (the logged metrics)."""
    from memopd import train
    from memopd.runlog import read_metrics

    if not (run_dir / "summary.json").is_file():
        flags = ["--env", ENV, *[f for k, v in ENV_KWARGS.items() for f in ("--env-kwarg", f"{k}={v}")],
                 "--model", str(start), "--student-warmup-steps", "0", "--opd-coef", "0", "--teacher", "tiny-teacher",
                 "--lr", str(lr), "--seed", str(seed), "--steps", str(args.steps), "--questions-per-step", "4",
                 "--group-size", "8", "--ppo-epochs", "2", "--warmup-steps", "5", "--eval-every", str(args.eval_every),
                 "--eval-episodes", str(args.eval_episodes), "--threads", str(args.threads), "--no-progress",
                 "--audit-every", "0", "--sample-episodes", "0", "--save-every", "5",
                 "--plugin", "examples.ppo_collapse:KLToStart", *args.extra]
        flags += ["--resume", str(run_dir)] if (run_dir / "checkpoints").is_dir() else ["--run-dir", str(run_dir)]
        if train.main(flags) != 0:
            raise SystemExit(f"error: the run in {run_dir} failed")
    return [{k: r[k] for k in ("step", *LOGGED) if k in r} for r in read_metrics(run_dir)]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/ppo-collapse", help="experiment directory")
    ap.add_argument("--lrs", default="2e-3,2e-4", help="comma-separated learning rates")
    ap.add_argument("--seeds", default="0", help="comma-separated RL seeds")
    ap.add_argument("--steps", type=int, default=20, help="PPO steps per run")
    ap.add_argument("--start-steps", type=int, default=210, help="SFT steps of the start")
    ap.add_argument("--eval-every", type=int, default=5, help="held-out evaluation every N steps")
    ap.add_argument("--eval-episodes", type=int, default=64, help="held-out episodes per evaluation")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--results", default=None, help="results JSON (default OUT/results.json)")
    ap.add_argument("--name", default="runs", help="the runs' folder under OUT (one per setting of the extra flags)")
    ap.add_argument("extra", nargs="*", help="more memopd.train flags for every run (after --)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    start = build_start(out, args.start_steps, args.threads)
    results: dict[str, Any] = {"env": ENV, "env_kwargs": ENV_KWARGS, "start": {"sft_steps": args.start_steps},
                               "rl": {"questions_per_step": 4, "group_size": 8, "ppo_epochs": 2, "opd_coef": 0.0,
                                      "steps": args.steps, "eval_episodes": args.eval_episodes,
                                      "extra": args.extra},
                               "runs": {}}
    dest = Path(args.results) if args.results else out / "results.json"
    for lr in [float(x) for x in args.lrs.split(",")]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            key = f"lr{lr:g}-seed{seed}"
            results["runs"][key] = {"lr": lr, "seed": seed,
                                    "rows": run_arm(start, out / args.name / key, lr, seed, args)}
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(json.dumps(results, indent=1) + "\n")
            print(f"{key}: written to {dest}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
