"""The RL objectives to a plateau from the mid-plateau start, against PPO + MemOPD.

    python examples/rl_plateau.py --out runs/ppo-collapse          # resumable; the start is shared
    python examples/rl_plateau.py --out runs/ppo-collapse --seeds 0,1 --arms ppo,memopd

Arms (each from the start of examples/ppo_collapse.py, 4 questions x 8 samples a step, 2 epochs):

  ppo      PPO alone, the default objective, lr 2e-4 (the learning rate at which PPO learns)
  dapo     DAPO: token-mean aggregation, clip-higher 0.28, dynamic sampling, overlong shaping, lr 2e-4
  gspo     GSPO: the per-call sequence ratio, its clip (3e-4 / 4e-4), sequence-mean aggregation, lr 2e-4
  memopd   PPO + MemOPD at lr 2e-3, the teacher `tiny-teacher` fine-tuned on oracle calls of the
           3-chunk task in both contexts (the baselines study's fair teacher, rebuilt); its fine-tuning
           wall-clock is recorded as MemOPD's fixed cost

Seeds run in order, every arm of a seed before the next seed; each arm's results JSON
(docs/data/rl_plateau/<arm>.json by default) is rewritten after every run, so a partial study has its
finished runs on disk. A killed study resumes where it stopped (finished runs are kept, an unfinished
one resumes from its last checkpoint).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ppo_collapse, beside this file

ARMS = {
    "ppo": ("2e-4", []),
    "dapo": ("2e-4", ["--loss-agg", "token", "--clip-eps-high", "0.28", "--dynamic-sampling", "--overlong-buffer", "8"]),
    "gspo": ("2e-4", ["--importance-level", "sequence", "--loss-agg", "sequence", "--clip-eps", "0.0003",
                      "--clip-eps-high", "0.0004"]),
    "memopd": ("2e-3", ["--opd-coef", "1"]),
}


def build_teacher(out: Path, threads: int) -> tuple[Path, float]:
    """The fair teacher (reused when it exists) and its fine-tuning wall-clock seconds."""
    from memopd.sft import SFTConfig, run as run_sft

    from ppo_collapse import ENV, ENV_KWARGS

    path, cost = out / "teacher-both", out / "teacher-both.json"
    if not (path / "config.json").is_file():
        t0 = time.perf_counter()
        run_sft(SFTConfig(model="tiny-teacher", out=str(path), env=ENV, env_kwargs={**ENV_KWARGS, "num_chunks": 3},
                          num_episodes=1000, steps=250, batch_episodes=32, lr=3e-3, warmup_steps=20, seed=1000,
                          threads=threads, context="both"), progress=False)
        cost.write_text(json.dumps({"sft_s": time.perf_counter() - t0}))
    return path, json.loads(cost.read_text())["sft_s"]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/ppo-collapse", help="experiment directory (its start is shared)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms out of {list(ARMS)}")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated RL seeds")
    ap.add_argument("--steps", type=int, default=400, help="steps per run")
    ap.add_argument("--eval-every", type=int, default=20, help="held-out evaluation every N steps")
    ap.add_argument("--eval-episodes", type=int, default=128, help="held-out episodes per evaluation")
    ap.add_argument("--data", default="docs/data/rl_plateau", help="where each arm's results JSON goes")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)
    import ppo_collapse

    out, seeds = Path(args.out), [s for s in args.seeds.split(",")]
    for k in range(len(seeds)):
        for arm in args.arms.split(","):
            lr, flags = ARMS[arm]
            extra = list(flags)
            cost = None
            if arm == "memopd":
                teacher, cost = build_teacher(out, args.threads)
                extra += ["--teacher", str(teacher)]
            dest = Path(args.data) / f"{arm}.json"
            ppo_collapse.main(["--out", str(out), "--name", f"plateau-{arm}", "--lrs", lr,
                               "--seeds", ",".join(seeds[:k + 1]), "--steps", str(args.steps),
                               "--eval-every", str(args.eval_every), "--eval-episodes", str(args.eval_episodes),
                               "--threads", str(args.threads), "--results", str(dest), "--", *extra])
            data = json.loads(dest.read_text())
            data.update({"arm": arm, "teacher_sft_s": cost,
                         "command": "python examples/rl_plateau.py " + " ".join(sys.argv[1:])})
            dest.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
