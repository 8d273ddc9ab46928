"""--async-rollouts: the hub's staleness gate, stale drops and restarts without Ray (hand-checked
sequences), refused combinations, and end-to-end runs on a local Ray instance: a run whose worker
dies mid-run completes with the restart counted, every sample used once within the staleness
bound, a resume continues with fresh units, and no Ray process outlives the run."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memopd.plugins import async_ray as ar
from memopd import train
from memopd.config import ConfigError
from memopd.runlog import read_metrics

needs_ray = pytest.mark.skipif(not ar.ray_available(), reason=f"Ray is not installed ({ar.RAY_HINT})")

FAST = ["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=2", "--questions-per-step", "2", "--group-size",
        "2", "--max-new-tokens", "8", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "1024", "--threads", "1", "--ppo-epochs", "1",
        "--sample-episodes", "4", "--audit-every", "0"]


# -- the hub, without Ray ----------------------------------------------------------------------

def test_units_runs_and_used_state_round_trip():
    assert ar.runs([5, 1, 2, 7, 6]) == [[1, 2], [5, 6, 7]]
    assert ar.unit_ids(7, 3) == "step2/1"  # unit 7 of 3 questions a step: step 2, question 1
    used = {0, 1, 2, 5, 9}
    assert ar.pack_used(used) == {"below": 3, "extra": [5, 9]}
    assert ar.unpack_used(ar.pack_used(used), 4, 2) == used
    assert ar.unpack_used(None, 3, 2) == set(range(6))  # a synchronous run's steps: their units are used


def test_hub_gate_bounds_the_lag_by_the_staleness():
    hub = ar.Hub(questions_per_step=2, max_staleness=1, used=[])
    assert hub.claim(0, 2) is None  # nothing published yet
    hub.publish(0, ["w0"])
    assert hub.claim(0, 2) == ([0, 1], 0, ["w0"])
    assert hub.claim(0, 2) == ([2, 3], 0, ["w0"])
    assert hub.claim(0, 2) is None  # (S + 1) * B = 4 units outstanding: the worker waits
    hub.put(0, 0, {u: [f"e{u}a", f"e{u}b"] for u in (0, 1, 2, 3)})
    groups, dropped = hub.take(2, 0)
    assert [(u, v) for u, v, _ in groups] == [(0, 0), (1, 0)] and dropped == 0
    assert hub.claim(0, 2) is None  # the batch in training still counts until its update is published
    hub.publish(1, ["w1"])
    assert hub.claim(0, 2) == ([4, 5], 1, ["w1"])  # used at step 2 at the latest: lag <= 1
    assert [u for u, _, _ in hub.take(2, 1)[0]] == [2, 3]
    assert hub.stats() == {"buffer": 0, "produced": 8}


def test_hub_drops_stale_groups_and_requeues_them_and_a_dead_workers_units():
    hub = ar.Hub(questions_per_step=1, max_staleness=1, used=[0])  # unit 0 was used before a resume
    hub.publish(3, ["w3"])
    assert hub.claim(7, 1) == ([1], 3, ["w3"])
    assert hub.claim(8, 1) == ([2], 3, ["w3"])
    assert hub.release(7) == 1  # worker 7 died: unit 1 goes back to the queue
    assert hub.put(7, 3, {1: ["late"]}) == 0 and hub.claim(7, 1) == ar.STOP  # a dead worker's delivery is refused
    hub.put(8, 3, {2: ["a"]})
    hub.publish(5, ["w5"])  # the learner moved on: unit 2 (version 3) now lags 2 > S
    assert hub.take(1, 5) == ([], 1)
    assert hub.claim(9, 2) == ([1, 2], 5, ["w5"])  # both generated again, lowest first, fresh weights


def test_async_rollouts_refuses_what_it_cannot_combine_with(monkeypatch):
    def cfg(*extra):
        return train.cfgmod.parse_args(train.TrainConfig, ["--async-rollouts", *extra], "t", "")

    with pytest.raises(ConfigError, match="--simulated-staleness"):
        cfg("--simulated-staleness", "1")
    with pytest.raises(ConfigError, match="adaptive-depth"):
        cfg("--adaptive-depth")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="torchrun"):
        cfg()
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setattr(ar, "ray_available", lambda: False)
    with pytest.raises(ConfigError, match=r"pip install 'memopd\[ray\]'"):
        cfg()


# -- end to end on a local Ray instance -------------------------------------------------------

def _ray_processes(exclude: set[int]) -> list[str]:
    """Command lines of the Ray processes (raylet, GCS, workers) not in ``exclude``."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in exclude:
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "ray::" in cmd or "/ray/" in cmd or "raylet" in cmd or "gcs_server" in cmd:
            found.append(cmd[:200])
    return found


def _run(args, env_extra=None, timeout=300):
    """Run memopd.train; returns its output once it exits, after checking that no Ray process it
    started remains."""
    before = {int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()}
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    proc = subprocess.run([sys.executable, "-m", "memopd.train", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    deadline = time.time() + 10
    while _ray_processes(before) and time.time() < deadline:
        time.sleep(0.2)
    assert not _ray_processes(before), _ray_processes(before)  # no orphans: Ray shut down with the run
    return out


def _used(run_dir: Path) -> dict[int, list[tuple[str, int]]]:
    """step -> (episode id, policy version) of every episode it trained on (all are saved)."""
    out = {}
    for f in sorted((run_dir / "episodes").glob("step-*.jsonl")):
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        out[int(f.stem.split("-")[1])] = [(r["episode_id"], max(i["policy_version"] for i in r["invocations"]))
                                          for r in rows]
    return out


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """A 4-step async run at S = 2 with freshness weights whose first worker exits mid-run (before
    delivering its second batch): the run must replace it and finish."""
    run = tmp_path_factory.mktemp("async") / "run"
    out = _run(FAST + ["--run-dir", str(run), "--async-rollouts", "--max-staleness", "2", "--steps", "4",
                       "--save-every", "2", "--freshness", "weight"], {ar.FAIL_HOOK: "exit:4"})
    return run, out


@needs_ray
def test_async_run_survives_a_dead_worker_and_keeps_the_staleness_bound(async_run):
    run, out = async_run
    assert "rollout worker 0 died" in out and "starting worker 1 in its place" in out
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["async/worker_restarts"] == 1.0
    for r in rows:
        assert 0 <= r["async/lag_mean"] <= r["async/lag_max"] <= 2 and r["fresh/lag"] == r["async/lag_mean"]
        assert 0 < r["fresh/score"] <= 1 and r["fresh/drift"] >= 0
        assert r["async/episodes_per_s"] >= 0 and r["async/buffer"] >= 0 and r["async/dropped_stale"] >= 0
    used = _used(run)
    ids = [i for step in used.values() for i, _ in step]
    assert len(ids) == 16 and len(set(ids)) == 16  # 4 steps x 2 questions x 2 samples, none used twice
    for step, episodes in used.items():  # the file of step s holds what version s - 1 trained on
        assert all(0 <= (step - 1) - v <= 2 for _, v in episodes), (step, episodes)
    # the units are the synchronous run's questions: steps 0..3, each question once
    assert sorted({i.rsplit("/", 1)[0] for i in ids}) == [f"step{b}/{q}" for b in range(4) for q in range(2)]
    assert json.loads((run / "summary.json").read_text())["steps"] == 4


@needs_ray
def test_async_resume_continues_with_fresh_units(async_run):
    run, _ = async_run
    before = {i for step in _used(run).values() for i, _ in step}
    out = _run(["--resume", str(run), "--steps", "6", "--no-progress"], {ar.FAIL_HOOK: "raise:2"})
    assert "resumed from" in out and "rollout worker 0 died" in out and "failure injected" in out
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["async/worker_restarts"] == 1.0  # counted in this process's run
    later = [i for s, step in _used(run).items() if s > 4 for i, _ in step]
    assert len(later) == 8 and not set(later) & before  # the buffered units of the first run were not saved
    assert sorted({i.rsplit("/", 1)[0] for i in later}) == [f"step{b}/{q}" for b in (4, 5) for q in range(2)]


def _episodes(run_dir: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "episodes" / f"step-{step:06d}.jsonl").read_text().splitlines()]


@needs_ray
def test_async_at_staleness_0_trains_on_the_synchronous_runs_samples(tmp_path):
    """At S = 0 a worker samples each step's units with that step's weights and seeds: the same
    episodes as the synchronous run (log-probs up to float noise), and the same updates."""
    common = FAST + ["--steps", "2"]
    _run(common + ["--run-dir", str(tmp_path / "sync")])
    _run(common + ["--run-dir", str(tmp_path / "async"), "--async-rollouts", "--max-staleness", "0"])
    for step in (1, 2):
        a, b = _episodes(tmp_path / "sync", step), _episodes(tmp_path / "async", step)
        assert [e["episode_id"] for e in a] == [e["episode_id"] for e in b]
        for x, y in zip(a, b):
            for i, j in zip(x["invocations"], y["invocations"], strict=True):
                assert i["response_ids"] == j["response_ids"] and i["policy_version"] == j["policy_version"]
                assert i["logprobs"] == pytest.approx(j["logprobs"], abs=1e-5)
    rows = {r["step"]: r for r in read_metrics(tmp_path / "async") if "loss" in r}
    for r in read_metrics(tmp_path / "sync"):
        if "loss" in r:
            assert rows[r["step"]]["loss"] == pytest.approx(r["loss"], rel=1e-5)
            assert rows[r["step"]]["async/lag_max"] == 0.0
