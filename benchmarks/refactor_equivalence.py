"""Behaviour equivalence of two versions of the trainer: the same seeded training runs on a base
commit and on a head commit (or the current checkout), compared step by step.

    python benchmarks/refactor_equivalence.py --base main                  # head: this checkout
    python benchmarks/refactor_equivalence.py --base COMMIT --head COMMIT
    python benchmarks/refactor_equivalence.py --base main --only default resume --steps 2

Each tree is a detached ``git worktree`` of its commit (``--head .`` runs the checkout this script
is in, uncommitted changes included; a directory is run as it is). Every arm runs
``python -m memopd.train`` as a subprocess in each tree (cwd and ``PYTHONPATH`` the tree, so the
tree's own ``memgym``, ``agents`` and ``memopd`` are imported whatever is installed; checked before
the first run), one run at a time, with the same small seeded settings: :data:`COMMON`,
``--steps 4`` and ``--student-warmup-steps 20`` (see :data:`WARMUP_STEPS`), plus the arm's flags:

    default          the embedded default (auto teacher, warm-started tiny student, GRPO, forward KL)
    progressive      --opd-weighting progressive (opd/turn_share 0 -> 1 over the 4 steps)
    adaptive-depth   --adaptive-depth --depth-probe-every 2 --depth-warmup 1 --depth-coverage 0 (probes at
                     steps 1 and 3, depth-limited rollouts at 2 and 4)
    prune-opd        --prune-opd --prune-window 2 (drift events, reliability weights, and rollouts cut at
                     the window as it moves)
    staleness        --simulated-staleness 2 --freshness weight (lags 0, 1, 2, 2)
    gae              --advantage gae (a critic)
    persistent       --teacher-context persistent
    two-ranks        the default under torchrun --standalone --nproc_per_node 2 (gloo on CPU, one thread a rank)
    topk             --opd-estimator topk --opd-topk 8
    sampled          --opd-estimator sampled (the forward KL's estimate at the sampled token, a loss)
    sampled-adv      --opd-estimator sampled --opd-sampled-as advantage --opd-divergence rkl (PPO's advantage)
    lora             --lora-r 4 (adapters on the default targets; the merged final model compared)
    served           --teacher URL --opd-estimator topk --opd-topk 8 --teacher-concurrency 1: the tiny-teacher
                     preset behind a stock vllm serve, started once for both trees with --vllm-python (an
                     interpreter that has vLLM; skipped when there is none); one request at a time, so the
                     server answers the same requests in the same order for both
    resume           a run directory written by the base tree (steps 1-2, a checkpoint every step, a
                     finished run) is resumed by the head tree with ``--steps 4``; its steps 3-4 are
                     compared with the base tree's uninterrupted 4-step run (the default arm's), and
                     with the base tree resuming a copy of the same directory
    resume-methods   the same with --advantage gae, adaptive depth and simulated staleness (the arms' flags
                     above): the critic and its optimizer, TurnOPD's depth and the queue of stale episodes
                     are restored too; compared with both trees' uninterrupted runs of these flags

What is compared, per arm (base run against head run):

* ``metrics.jsonl``: the same rows in the same order (same steps), each with the same set of keys,
  and equal values for every key but the timing keys (:data:`TIMING_KEYS`, and any key ending in
  ``_s``: wall-clock measurements, which differ between any two runs);
* ``summary.json`` (the held-out evaluations before and after training, and the teacher's; its
  ``peak_rss_mb``, a measurement of the machine, is left out);
* ``episodes/step-*.jsonl``: every saved episode (all of a step's with the settings here), with
  its recorded prompt and response token ids, positions and sampling log-probs, rewards and
  metrics; only each invocation's ``timing`` (wall-clock start and latency) is left out;
* ``config.toml``: the resolved settings (``run_dir`` and ``resume`` left out): a setting both
  versions have must have the same value; one only a version has (a new option) is noted;
* ``model/model.safetensors``: the final student weights, tensor by tensor.

Tolerance: none by default (``--rtol 0``): exact equality. Both trees run the same arithmetic in
one process with ``--threads 1`` (one thread per rank under torchrun), so a refactor that changed
no behaviour gives bit-identical floats; any difference, however small, means an operation was
reordered or changed and is reported. ``--rtol R`` accepts ``|a - b| <= R * max(|a|, |b|)`` (to
read how far apart two versions are); the largest absolute difference is printed either way.

The auto teacher is built once (the first run that needs it, ~5 minutes on 2 cores) and cached
under ``agents.models.cache_dir()`` (``$MEMOPD_CACHE``, default ``~/.cache/memopd``, keyed by the
env, its options and the teacher's SFT settings); both trees then load that same cached teacher.
That is sound as long as the teacher-building code (``memopd.sft``, ``ensure_teacher``) is the same
in both trees; when it is not, give ``--separate-caches`` so each tree builds its own (5 more
minutes) and the teachers' held-out scores are compared too.

Determinism settings: ``--threads 1`` and ``OMP_NUM_THREADS=1`` (a thread pool's reduction order
depends on the threads it gets), ``PYTHONHASHSEED=0``, the same run-directory name in both trees
(``OUT/<tree>/<arm>``), no time budget and no progress bars. Runs go one at a time.

Prints a table (arm, steps, keys and values compared, max abs difference, verdict, the first
differing keys) and per-arm times, writes ``OUT/report.json``, and exits 1 when any arm differs
(2 when a run fails).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

# Timing metrics: wall-clock measurements, different in any two runs, so never compared (a key
# ending in "_s" counts as one too, see is_timing). Everything else in a row is compared.
TIMING_KEYS = (
    "tokens_per_s",            # update throughput (real tokens x epochs / learn seconds)
    "rollout_s",               # rollout seconds of the step
    "step_s",                  # rollout + learn seconds of the step
    "train_clock_s",           # cumulative step seconds (the --time-budget clock)
    "prune/rollout_saved_s",   # skipped calls times the rollout's mean seconds per call
    "async/wait_s",            # --async-rollouts: the learner's wait for episodes
    "async/episodes_per_s",    # --async-rollouts: delivery rate of the workers
)

# Keys of a saved episode that hold wall-clock data (an invocation's start time and latency).
EPISODE_TIMING_KEYS = ("timing",)

# Keys of summary.json that measure the machine, not the run's behaviour (the process's peak memory
# differs between two runs of one commit).
SUMMARY_MEASURED_KEYS = ("peak_rss_mb",)

# Settings that name the run's place on disk, not its behaviour.
CONFIG_PATH_KEYS = ("run_dir", "resume")

# Every arm: small and seeded, but each method still exercised (see ARMS).
COMMON = ["--seed", "0", "--threads", "1", "--questions-per-step", "2", "--group-size", "2",
          "--eval-every", "0", "--eval-episodes", "4", "--save-every", "1", "--audit-every", "1",
          "--sample-episodes", "4", "--no-progress"]

# The embedded default warms the student up with 100 SFT steps (~1 s each here); 20 run the same
# code for a fifth of the cost, and with seed 0 leave a student whose rewards differ within a group
# (so the PPO term is not zero).
WARMUP_STEPS = 20


def is_timing(key: str) -> bool:
    return key in TIMING_KEYS or key.endswith("_s")


# ------------------------------------------------------------------------------------------------
# comparison
# ------------------------------------------------------------------------------------------------

@dataclass
class Comparison:
    """What one comparison found. ``diffs`` holds the first differences, as ``where: a != b``."""

    rows: int = 0
    steps: list[int] = field(default_factory=list)
    keys: set[str] = field(default_factory=set)
    values: int = 0
    max_abs_diff: float = 0.0
    ndiffs: int = 0
    diffs: list[str] = field(default_factory=list)
    timing_keys: set[str] = field(default_factory=set)
    parts: dict[str, int] = field(default_factory=dict)  # values compared per file kind
    notes: list[str] = field(default_factory=list)  # not differences, but worth saying

    @property
    def equal(self) -> bool:
        return self.ndiffs == 0

    def differ(self, where: str, a: Any, b: Any, limit: int = 12) -> None:
        self.ndiffs += 1
        if len(self.diffs) < limit:
            self.diffs.append(f"{where}: {_short(a)} != {_short(b)}")

    def merge(self, other: "Comparison", part: str, prefix: str = "") -> None:
        self.parts[part] = other.values
        self.values += other.values
        self.max_abs_diff = max(self.max_abs_diff, other.max_abs_diff)
        self.ndiffs += other.ndiffs
        self.diffs += [prefix + d for d in other.diffs][: max(0, 12 - len(self.diffs))]

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(keys=sorted(self.keys), timing_keys=sorted(self.timing_keys), equal=self.equal)
        return d


def _short(v: Any, n: int = 80) -> str:
    s = repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def compare_values(a: Any, b: Any, where: str, out: Comparison, rtol: float = 0.0,
                   skip: Callable[[str], bool] = lambda k: False) -> None:
    """Compare two JSON-like values recursively into ``out`` (dict keys for which ``skip`` is true
    are left out of the values, but must be present in both)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            out.differ(f"{where} keys", sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys()))
        for k in (k for k in a if k in b):  # in the file's order: the first difference is the first shown
            if not skip(k):
                compare_values(a[k], b[k], f"{where}.{k}" if where else k, out, rtol, skip)
        return
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.differ(f"{where} length", len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b)):
            compare_values(x, y, f"{where}[{i}]", out, rtol, skip)
        return
    out.values += 1
    if _number(a) and _number(b):
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return
        d = abs(a - b)
        if not math.isnan(d):
            out.max_abs_diff = max(out.max_abs_diff, d)
        if not (a == b or d <= rtol * max(abs(a), abs(b))):
            out.differ(where, a, b)
        return
    if type(a) is not type(b) or a != b:
        out.differ(where, a, b)


def compare_rows(rows_a: Sequence[dict], rows_b: Sequence[dict], rtol: float = 0.0) -> Comparison:
    """Metrics rows of two runs: the same rows (steps, in order), each with the same keys, and
    equal values for every non-timing key (within ``rtol``; 0 = exact)."""
    out = Comparison(rows=min(len(rows_a), len(rows_b)))
    if len(rows_a) != len(rows_b):
        out.differ("rows", len(rows_a), len(rows_b))
    out.steps = sorted({r.get("step") for r in rows_a} | {r.get("step") for r in rows_b},
                       key=lambda s: (s is None, s))
    for i, (ra, rb) in enumerate(zip(rows_a, rows_b)):
        where = f"row {i} (step {ra.get('step')})"
        if ra.get("step") != rb.get("step"):
            out.differ(f"{where} step", ra.get("step"), rb.get("step"))
        if ra.keys() != rb.keys():
            out.differ(f"{where} keys", sorted(ra.keys() - rb.keys()), sorted(rb.keys() - ra.keys()))
        for k in (k for k in ra if k in rb):
            if is_timing(k):
                out.timing_keys.add(k)
                continue
            out.keys.add(k)
            compare_values(ra[k], rb[k], f"step {ra.get('step')} {k}", out, rtol)
    return out


def read_rows(run: Path, after: int | None = None) -> list[dict]:
    path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return [r for r in rows if after is None or r.get("step", 0) > after]


def _episode_files(run: Path, after: int | None) -> dict[str, Path]:
    files = sorted((run / "episodes").glob("step-*.jsonl"))
    return {p.name: p for p in files if after is None or int(p.stem.split("-")[1]) > after}


def compare_episodes(a: Path, b: Path, rtol: float = 0.0, after: int | None = None) -> Comparison:
    out = Comparison()
    fa, fb = _episode_files(a, after), _episode_files(b, after)
    if fa.keys() != fb.keys():
        out.differ("episode files", sorted(fa.keys() - fb.keys()), sorted(fb.keys() - fa.keys()))
    for name in sorted(fa.keys() & fb.keys()):
        la, lb = fa[name].read_text().splitlines(), fb[name].read_text().splitlines()
        compare_values([json.loads(x) for x in la], [json.loads(x) for x in lb], name, out, rtol,
                       skip=lambda k: k in EPISODE_TIMING_KEYS)
    return out


def _toml(path: Path) -> dict[str, Any]:
    import tomllib

    values = tomllib.loads(path.read_text()) if path.is_file() else {}
    return {k: v for k, v in values.items() if k not in CONFIG_PATH_KEYS}


def compare_weights(a: Path, b: Path) -> Comparison:
    out = Comparison()
    pa, pb = a / "model" / "model.safetensors", b / "model" / "model.safetensors"
    if not (pa.is_file() and pb.is_file()):
        out.differ("model/model.safetensors present", pa.is_file(), pb.is_file())
        return out
    from safetensors.torch import load_file

    wa, wb = load_file(str(pa)), load_file(str(pb))
    if wa.keys() != wb.keys():
        out.differ("weights keys", sorted(wa.keys() - wb.keys()), sorted(wb.keys() - wa.keys()))
    for k in sorted(wa.keys() & wb.keys()):
        out.values += 1
        if wa[k].shape != wb[k].shape or wa[k].dtype != wb[k].dtype:
            out.differ(f"weight {k}", (tuple(wa[k].shape), str(wa[k].dtype)), (tuple(wb[k].shape), str(wb[k].dtype)))
            continue
        d = float((wa[k].double() - wb[k].double()).abs().max()) if wa[k].numel() else 0.0
        out.max_abs_diff = max(out.max_abs_diff, d)
        if d != 0.0:
            out.differ(f"weight {k} max abs diff", d, 0.0)
    return out


def compare_runs(a: Path, b: Path, rtol: float = 0.0, after: int | None = None) -> Comparison:
    """Everything a run directory records that does not measure time (see the module docstring).
    ``after``: only the rows and episode files of later steps (the rest of a resumed run)."""
    out = compare_rows(read_rows(a, after), read_rows(b, after), rtol)
    out.parts["metrics.jsonl"] = out.values
    if not out.rows:
        out.differ("metrics rows", "none", "none")
    sa, sb = a / "summary.json", b / "summary.json"
    summary = Comparison()
    compare_values(json.loads(sa.read_text()) if sa.is_file() else None,
                   json.loads(sb.read_text()) if sb.is_file() else None, "", summary, rtol,
                   skip=lambda k: k in SUMMARY_MEASURED_KEYS)
    out.merge(summary, "summary.json", "summary.json ")
    out.merge(compare_episodes(a, b, rtol, after), "episodes")
    # settings: a value that changed is a difference; a setting only one version has (an option
    # added or removed) is a note, since the runs' metrics say whether behaviour changed
    ca, cb = _toml(a / "config.toml"), _toml(b / "config.toml")
    if ca.keys() != cb.keys():
        out.notes.append(f"config.toml: only in base {sorted(ca.keys() - cb.keys())}, "
                         f"only in head { {k: cb[k] for k in sorted(cb.keys() - ca.keys())} }")
    config = Comparison()
    compare_values({k: ca[k] for k in ca if k in cb}, {k: cb[k] for k in cb if k in ca}, "", config, rtol)
    out.merge(config, "config.toml", "config.toml ")
    out.merge(compare_weights(a, b), "model weights")
    return out


# ------------------------------------------------------------------------------------------------
# arms
# ------------------------------------------------------------------------------------------------

def _any(key: str, pred: Callable[[float], bool]) -> Callable[[list[dict]], bool]:
    return lambda rows: any(isinstance(r.get(key), (int, float)) and pred(r[key]) for r in rows)


@dataclass
class Arm:
    name: str
    flags: list[str]
    kind: str = "train"  # train | torchrun | resume
    # a check on the base run's rows that the arm's method did something (else its equality says little)
    exercised: Callable[[list[dict]], bool] | None = None
    what: str = ""


ARMS = [
    Arm("default", [], exercised=_any("pg_loss", lambda v: v != 0), what="pg_loss != 0 (rewards differ in a group)"),
    Arm("progressive", ["--opd-weighting", "progressive"],
        exercised=lambda rows: len({r["opd/turn_share"] for r in rows if "opd/turn_share" in r}) > 1,
        what="opd/turn_share takes more than one value"),
    # --depth-coverage 0: the KL centroid alone sets the depth (the coverage floor keeps every call
    # of a task whose successful episodes all read to the end)
    Arm("adaptive-depth", ["--adaptive-depth", "--depth-probe-every", "2", "--depth-warmup", "1",
                           "--depth-coverage", "0"],
        exercised=_any("depth/cut_episodes", lambda v: v > 0), what="cut episodes (depth/cut_episodes > 0)"),
    Arm("prune-opd", ["--prune-opd", "--prune-window", "2"],
        exercised=lambda rows: (_any("prune/drift_episodes", lambda v: v > 0)(rows)
                                and _any("prune/cut_episodes", lambda v: 0 < v)(rows)),
        what="drift events and rollouts cut at the window"),
    Arm("staleness", ["--simulated-staleness", "2", "--freshness", "weight"],
        exercised=_any("fresh/lag", lambda v: v > 0), what="fresh/lag > 0"),
    Arm("gae", ["--advantage", "gae"], exercised=_any("value_loss", lambda v: v > 0), what="value_loss > 0"),
    Arm("persistent", ["--teacher-context", "persistent"], exercised=_any("kl/all", lambda v: v > 0),
        what="kl/all > 0"),
    Arm("two-ranks", [], kind="torchrun", exercised=_any("kl/all", lambda v: v > 0), what="kl/all > 0"),
    Arm("topk", ["--opd-estimator", "topk", "--opd-topk", "8"], exercised=_any("kl/all", lambda v: v > 0),
        what="kl/all > 0"),
    Arm("sampled", ["--opd-estimator", "sampled"], exercised=_any("opd_loss", lambda v: v != 0),
        what="opd_loss != 0"),
    Arm("sampled-adv", ["--opd-estimator", "sampled", "--opd-sampled-as", "advantage", "--opd-divergence", "rkl"],
        exercised=_any("pg_loss", lambda v: v != 0), what="pg_loss != 0"),
    Arm("lora", ["--lora-r", "4"], exercised=_any("kl/all", lambda v: v > 0), what="kl/all > 0"),
    Arm("served", ["--opd-estimator", "topk", "--opd-topk", "8", "--teacher-concurrency", "1"], kind="served",
        exercised=_any("teacher/requests", lambda v: v > 0), what="teacher/requests > 0"),
    Arm("resume", [], kind="resume"),
    # a resume that restores more than the default's state: the critic and its optimizer (GAE),
    # TurnOPD's depth, the staleness queue of episodes waiting to be learnt from
    Arm("resume-methods", ["--advantage", "gae", "--adaptive-depth", "--depth-probe-every", "2", "--depth-warmup",
                           "1", "--depth-coverage", "0", "--simulated-staleness", "2", "--freshness", "weight"],
        kind="resume"),
]
ARM_NAMES = [a.name for a in ARMS]


# ------------------------------------------------------------------------------------------------
# running
# ------------------------------------------------------------------------------------------------

class RunFailed(RuntimeError):
    pass


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@dataclass
class Tree:
    label: str     # base | head
    spec: str      # what was asked for
    path: Path
    commit: str
    dirty: bool
    made: bool     # a worktree this script added (removed at the end)


def make_tree(repo: Path, spec: str, label: str, out: Path) -> Tree:
    """``.``: this checkout; an existing directory: that tree; else a commit, checked out detached."""
    if spec == ".":
        path = repo
    elif Path(spec).is_dir():
        path = Path(spec).resolve()
    else:
        path = out / "trees" / label
        if path.exists():
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(path)], capture_output=True)
            shutil.rmtree(path, ignore_errors=True)
        git(repo, "worktree", "prune")
        commit = git(repo, "rev-parse", "--verify", f"{spec}^{{commit}}")
        git(repo, "worktree", "add", "--detach", str(path), commit)
        return Tree(label, spec, path, commit, False, True)
    commit = git(path, "rev-parse", "HEAD")
    dirty = bool(git(path, "status", "--porcelain", "--untracked-files=no"))
    return Tree(label, spec, path, commit, dirty, False)


def tree_env(tree: Tree, cache: Path | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(tree.path), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false"}
    if cache is not None:
        env["MEMOPD_CACHE"] = str(cache)
    return env


def check_imports(tree: Tree, cache: Path | None) -> None:
    """The tree's own packages are imported (not an installed copy)."""
    code = "import memopd, agents, memgym; print(memopd.__file__); print(agents.__file__); print(memgym.__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=tree.path, env=tree_env(tree, cache),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RunFailed(f"{tree.label}: cannot import the packages:\n{done.stderr[-2000:]}")
    for f in done.stdout.split():
        if not Path(f).resolve().is_relative_to(tree.path.resolve()):
            raise RunFailed(f"{tree.label}: {f} is imported from outside {tree.path}")


def train(tree: Tree, args: list[str], log: Path, cache: Path | None, ranks: int = 1, timeout: float = 1800) -> float:
    """One ``memopd.train`` run in ``tree``; its seconds."""
    launch = [sys.executable]
    if ranks > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    cmd = launch + ["-m", "memopd.train", *args]
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as fh:
        fh.write(" ".join(cmd) + "\n")
        fh.flush()
        done = subprocess.run(cmd, cwd=tree.path, env=tree_env(tree, cache), stdout=fh, stderr=subprocess.STDOUT,
                              timeout=timeout)
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise RunFailed(f"{tree.label}: exit {done.returncode}: {' '.join(args)}\n(log {log})\n{tail}")
    return time.perf_counter() - t0


@dataclass
class Result:
    arm: str
    comparisons: dict[str, Comparison]
    seconds: dict[str, float]
    exercised: bool | None = None
    exercised_what: str = ""
    error: str | None = None

    @property
    def equal(self) -> bool:
        return self.error is None and all(c.equal for c in self.comparisons.values())


def fresh_dir(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def served_teacher(arm: Arm, vllm_python: str | None) -> Iterator[list[str]]:
    """The ``--teacher URL`` flags of a served arm (the tiny-teacher preset behind vllm serve, run by
    ``vllm_python``), or none for any other arm."""
    if arm.kind != "served":
        yield []
        return
    if not vllm_python:
        raise RunFailed("no interpreter with vLLM (--vllm-python): the served arm cannot run")
    from agents import models
    from agents.backends.vllm_serve import VLLMServer

    model, _ = models.load("tiny-teacher")
    server = VLLMServer(model.config._name_or_path, max_logprobs=64, python=vllm_python, startup_s=900)
    server.start()
    try:
        yield ["--teacher", server.url]
    finally:
        server.stop()


def run_arm(arm: Arm, base: Tree, head: Tree, out: Path, settings: list[str], rtol: float,
            caches: dict[str, Path | None], done: dict[str, dict[str, Path]],
            vllm_python: str | None = None) -> Result:
    """Both trees' runs of ``arm`` (into OUT/runs/<tree>/<arm>, the same leaf name in both), compared.
    ``done`` collects the run directories by arm (the resume arm reuses the default arm's)."""
    if arm.kind == "resume":
        return run_resume(arm, base, head, out, settings, rtol, caches, done)
    seconds: dict[str, float] = {}
    dirs = {}
    with served_teacher(arm, vllm_python) as teacher:
        for tree in (base, head):
            run_dir = fresh_dir(out / "runs" / tree.label / arm.name)
            seconds[tree.label] = train(tree, [*settings, *arm.flags, *teacher, "--run-dir", str(run_dir)],
                                        out / "logs" / tree.label / f"{arm.name}.log", caches[tree.label],
                                        ranks=2 if arm.kind == "torchrun" else 1)
            dirs[tree.label] = run_dir
    done[arm.name] = dirs
    cmp = compare_runs(dirs["base"], dirs["head"], rtol)
    exercised = arm.exercised(read_rows(dirs["base"])) if arm.exercised else None
    return Result(arm.name, {"base vs head": cmp}, seconds, exercised, arm.what)


def run_resume(arm: Arm, base: Tree, head: Tree, out: Path, settings: list[str], rtol: float,
               caches: dict[str, Path | None], done: dict[str, dict[str, Path]]) -> Result:
    """A run directory the base tree wrote (the first half of the steps, a checkpoint every step,
    then its final evaluation and export, as a finished run leaves it) is copied and resumed by
    the head tree to all the steps; the rows and episodes of the resumed steps are compared with
    the base tree's uninterrupted run (the default arm's, reused when it ran). The base tree
    resumes a copy too: the reference of what a resume gives with no change of code."""
    runs, logs, seconds = out / "runs", out / "logs", {}
    total = int(settings[settings.index("--steps") + 1])
    first = total // 2
    name = arm.name
    written = fresh_dir(runs / "base" / f"{name}-written")
    seconds["base write"] = train(base, [*settings, *arm.flags, "--steps", str(first), "--run-dir", str(written)],
                                  logs / "base" / f"{name}-written.log", caches["base"])
    resumed = {}
    for tree in (head, base):
        d = fresh_dir(runs / tree.label / f"{name}-resumed" / "default")  # the default arm's leaf name
        shutil.copytree(written, d)
        seconds[f"{tree.label} resume"] = train(tree, ["--resume", str(d), "--steps", str(total)],
                                                logs / tree.label / f"{name}-resumed.log", caches[tree.label])
        resumed[tree.label] = d
    whole = done.get("default")
    if whole is None or arm.flags:
        whole = {}
        for tree in (base, head):
            d = fresh_dir(runs / tree.label / f"{name}-uninterrupted" / "default")
            seconds[f"{tree.label} uninterrupted"] = train(
                tree, [*settings, *arm.flags, "--run-dir", str(d)], logs / tree.label / f"{name}-uninterrupted.log",
                caches[tree.label])
            whole[tree.label] = d
    comparisons = {
        "head resumed vs base uninterrupted": compare_runs(whole["base"], resumed["head"], rtol, after=first),
        "head resumed vs base resumed": compare_runs(resumed["base"], resumed["head"], rtol, after=first),
        "base resumed vs base uninterrupted": compare_runs(whole["base"], resumed["base"], rtol, after=first),
    }
    if "default" not in done:  # else the default arm compared them
        comparisons["head vs base uninterrupted"] = compare_runs(whole["base"], whole["head"], rtol)
    return Result(name, comparisons, seconds)


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------

def print_table(results: Iterable[Result], rtol: float) -> None:
    results = list(results)
    head = f"{'arm':<16} {'comparison':<36} {'steps':<11} {'keys':>4} {'values':>7} {'max |diff|':>10}  verdict"
    print(f"\ntolerance: {'exact equality' if rtol == 0 else f'rtol {rtol:g}'}; timing keys not compared")
    print(head)
    print("-" * len(head))
    for r in results:
        if r.error:
            print(f"{r.arm:<16} {'-':<36} {'-':<11} {'-':>4} {'-':>7} {'-':>10}  FAILED: {r.error.splitlines()[0]}")
            continue
        for what, c in r.comparisons.items():
            steps = [s for s in c.steps if s is not None]
            span = f"{min(steps)}-{max(steps)}" if steps else "-"
            verdict = "EQUAL" if c.equal else f"DIFFERENT ({c.ndiffs})"
            print(f"{r.arm:<16} {what:<36} {span:<11} {len(c.keys):>4} {c.values:>7} {c.max_abs_diff:>10.3g}  "
                  f"{verdict}")
            for d in c.diffs[:5]:
                print(f"{'':<18}first: {d}")
            for n in c.notes:
                print(f"{'':<18}note: {n}")
        if r.exercised is False:
            print(f"{'':<18}warning: the base run shows no sign of the method ({r.exercised_what})")
    print("\nseconds per run:")
    for r in results:
        print(f"  {r.arm:<16} " + "  ".join(f"{k} {v:.0f}" for k, v in r.seconds.items()))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit before the change")
    ap.add_argument("--head", default=".",
                    help="the commit after it, or a directory (a worktree); '.' (default): this checkout")
    ap.add_argument("--only", nargs="+", choices=ARM_NAMES, metavar="NAME",
                    help=f"run only these arms ({', '.join(ARM_NAMES)})")
    ap.add_argument("--steps", type=int, default=4,
                    help="training steps of each arm (the resume arm: the first half written by the base tree, "
                         "the rest after the resume) (default: 4)")
    ap.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS,
                    help=f"--student-warmup-steps of every run (default: {WARMUP_STEPS}; the embedded default's "
                         "is 100)")
    ap.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: exact equality)")
    ap.add_argument("--out", type=Path, default=Path("runs/refactor-equivalence"), help="runs, logs, report.json")
    ap.add_argument("--separate-caches", action="store_true",
                    help="give each tree its own model cache (OUT/cache-<tree>), so each builds its own auto teacher")
    ap.add_argument("--keep-trees", action="store_true", help="leave the worktrees made for --base/--head")
    ap.add_argument("--vllm-python", default=None,
                    help="an interpreter that has vLLM, for the served arm's vllm serve (default: .venv-vllm/bin/python "
                         "of this checkout when it exists; without one the served arm fails)")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the resume arm stops half-way)")
    settings = [*COMMON, "--steps", str(args.steps), "--student-warmup-steps", str(args.warmup_steps)]

    repo = Path(git(Path(__file__).resolve().parent, "rev-parse", "--show-toplevel"))
    local_vllm = repo / ".venv-vllm" / "bin" / "python"
    vllm_python = args.vllm_python or (str(local_vllm) if local_vllm.is_file() else None)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    arms = [a for a in ARMS if not args.only or a.name in args.only]
    caches = ({"base": out / "cache-base", "head": out / "cache-head"} if args.separate_caches
              else {"base": None, "head": None})
    trees = []
    results: list[Result] = []
    done: dict[str, dict[str, Path]] = {}
    t_all = time.perf_counter()
    try:
        base = make_tree(repo, args.base, "base", out)
        trees.append(base)
        head = make_tree(repo, args.head, "head", out)
        trees.append(head)
        for t in (base, head):
            print(f"{t.label}: {t.spec} = {t.commit[:12]}{' (with uncommitted changes)' if t.dirty else ''}  {t.path}")
            check_imports(t, caches[t.label])
        for arm in arms:
            t0 = time.perf_counter()
            print(f"[{arm.name}] ...", flush=True)
            try:
                r = run_arm(arm, base, head, out, settings, args.rtol, caches, done, vllm_python)
            except (RunFailed, subprocess.TimeoutExpired) as exc:
                r = Result(arm.name, {}, {}, error=str(exc))
            results.append(r)
            verdict = "FAILED" if r.error else "EQUAL" if r.equal else "DIFFERENT"
            print(f"[{arm.name}] {verdict} in {time.perf_counter() - t0:.0f} s"
                  + (f"\n{r.error}" if r.error else ""), flush=True)
    finally:
        if not args.keep_trees:
            for t in trees:
                if t.made:
                    subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(t.path)],
                                   capture_output=True)
    total = time.perf_counter() - t_all
    print_table(results, args.rtol)
    print(f"  total {total:.0f} s")
    report = {
        "base": {"spec": base.spec, "commit": base.commit, "dirty": base.dirty},
        "head": {"spec": head.spec, "commit": head.commit, "dirty": head.dirty},
        "rtol": args.rtol, "steps": args.steps, "settings": settings, "timing_keys": list(TIMING_KEYS),
        "timing_rule": "a key in timing_keys or ending in _s", "episode_timing_keys": list(EPISODE_TIMING_KEYS),
        "summary_measured_keys": list(SUMMARY_MEASURED_KEYS),
        "seconds": total,
        "arms": [{"arm": r.arm, "flags": next(a.flags for a in ARMS if a.name == r.arm),
                  "kind": next(a.kind for a in ARMS if a.name == r.arm), "equal": r.equal, "error": r.error,
                  "seconds": r.seconds, "exercised": r.exercised, "exercised_check": r.exercised_what,
                  "comparisons": {k: c.summary() for k, c in r.comparisons.items()}} for r in results],
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"report: {out / 'report.json'}")
    if any(r.error for r in results):
        return 2
    return 0 if all(r.equal for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
