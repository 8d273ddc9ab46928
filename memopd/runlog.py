"""What a training run writes as it goes: metrics JSONL, sample episodes, curves PNG, and
optional TensorBoard / W&B mirrors.

    RUN_DIR/config.toml           the resolved config
    RUN_DIR/metrics.jsonl         one JSON object per logged step
    RUN_DIR/episodes/step-N.jsonl sample episodes of that step
    RUN_DIR/curves.png            reward / F1, KL to teacher, entropy (redrawn as training goes)
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

# curves drawn in curves.png: (title, metric keys)
PANELS = (
    ("reward / F1", ("reward", "f1", "eval/f1")),
    ("KL to teacher", ("kl/all", "kl/memory", "kl/answer")),
    ("entropy", ("entropy",)),
    ("tokens/s", ("tokens_per_s",)),
)


def run_panels(rows: Iterable[dict[str, Any]]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """:data:`PANELS`, and for a run of several envs (:mod:`memopd.learn.mix`) or a routing table
    (:mod:`memopd.learn.teachers.routing`) the curves split by env and by route: each env's training
    and held-out F1 (``env/TAG/f1``, ``eval/TAG/f1``) and KL (``env/TAG/kl``), each route's
    supervised share (``teacher/ROUTE/supervised_share``)."""
    keys = sorted({k for r in rows for k in r})
    tags = [k[len("env/"):-len("/f1")] for k in keys if k.startswith("env/") and k.endswith("/f1")]
    routes = [k for k in keys if k.startswith("teacher/") and k.endswith("/supervised_share") and k.count("/") == 2]
    extra = []
    if tags:
        extra += [("F1 by env", tuple(k for t in tags for k in (f"env/{t}/f1", f"eval/{t}/f1"))),
                  ("KL by env", tuple(f"env/{t}/kl" for t in tags))]
    if routes:
        extra.append(("supervised share by route", (*routes, "teacher/unrouted_share")))
    return PANELS + tuple(extra)


def mean(xs: Sequence[float]) -> float:
    """The mean of a step's values (NaN for none: a metric with nothing to average)."""
    return float(sum(xs) / len(xs)) if xs else float("nan")


class LoggingSetupError(RuntimeError):
    """A requested logging mirror is not installed; the message says what to install."""


def check_mirrors(tensorboard: bool = False, wandb_project: str | None = None) -> None:
    """Raise :class:`LoggingSetupError` when a requested mirror's package is missing (checked before
    a run directory is made, so a failed start leaves nothing behind)."""
    import importlib.util

    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise LoggingSetupError("--tensorboard needs the tensorboard package: pip install 'memopd[logging]' "
                                "(or leave out --tensorboard)")
    if wandb_project and importlib.util.find_spec("wandb") is None:
        raise LoggingSetupError("--wandb-project needs the wandb package: pip install 'memopd[logging]' "
                                "(or leave out --wandb-project)")


class RunLogger:
    """Appends metrics to ``metrics.jsonl`` and mirrors them to TensorBoard / W&B when asked.

    ``fresh=True`` starts ``metrics.jsonl`` empty (a new run in a directory whose earlier start died
    before its first checkpoint); otherwise rows are appended (a resume rewrites them first with
    :meth:`rewrite`)."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = False, wandb_project: str | None = None,
                 config: dict[str, Any] | None = None, fresh: bool = False):
        check_mirrors(tensorboard, wandb_project)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        if fresh:
            self.path.unlink(missing_ok=True)
        self._tb = self._wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if wandb_project:
            import wandb

            self._wandb = wandb.init(project=wandb_project, dir=str(self.run_dir), config=config or {})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = self.clean_row(step, metrics)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def truncate_after(self, step: int) -> None:
        """Drop rows logged after ``step`` (atomically: a kill leaves the old file or the new one)."""
        self.rewrite([r for r in read_metrics(self.path) if r["step"] <= step])

    def rewrite(self, rows: Iterable[dict[str, Any]]) -> None:
        """Replace ``metrics.jsonl`` with ``rows``, written aside and renamed into place."""
        fd, tmp = tempfile.mkstemp(prefix=".metrics.jsonl.tmp-", dir=self.run_dir)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                for r in rows:
                    fh.write(json.dumps(r) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def clean_row(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """The row :meth:`log` writes for ``metrics`` (JSON-safe)."""
        return {"step": step, **{k: _clean(v) for k, v in metrics.items()}}

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; a gap in the curve says it
    return v


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a kill
    return rows


def heldout_curve(path: str | Path) -> dict[str, list[float]]:
    """A run's held-out F1 by step and by training wall-clock (the steps' rollout + update seconds,
    evaluations excluded): ``{"step": [...], "seconds": [...], "f1": [...]}``."""
    steps, secs, f1 = [], [], []
    clock = {0: 0.0}
    for r in read_metrics(path):
        if "step_s" in r:
            clock[r["step"]] = clock.get(r["step"] - 1, 0.0) + r["step_s"]
        if "eval/f1" in r:
            steps.append(r["step"])
            secs.append(clock.get(r["step"], 0.0))
            f1.append(r["eval/f1"])
    return {"step": steps, "seconds": secs, "f1": f1}


def plot_curves(rows: Iterable[dict[str, Any]], out: str | Path, title: str = "") -> Path | None:
    """Draw the training curves to a PNG; returns its path (None when there is nothing to draw)."""
    rows = list(rows)
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = run_panels(rows)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2))
    for ax, (name, keys) in zip(axes, panels):
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, ms=3, label=key)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out = Path(out)
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(out)
    return out
