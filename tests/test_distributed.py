"""Training with several processes (CPU, gloo, 2 ranks, tiny presets): the loss is global, so two
ranks on a batch make the update one process makes on it (FSDP2 and DDP); a torchrun run writes
one run directory from rank 0; checkpoints resume at the same and at another world size; a rank
killed mid-run ends the job, and ``--resume`` continues it.

The 2-rank tests need both cores of a small machine and take 20-60 s each: they are marked slow.
"""

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memopd import checkpoint, distributed, train
from memopd.learn.actor import Actor
from memopd.runlog import read_metrics

FAST = ["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=2", "--questions-per-step", "2", "--group-size",
        "2", "--max-new-tokens", "12", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "1024", "--threads", "1"]
EQUIV = ["--ppo-epochs", "1", "--entropy-coef", "0.01", "--sample-episodes", "4"]
ARMS = {"fsdp-grpo": ["--parallel", "fsdp"], "ddp-grpo": ["--parallel", "ddp"],
        "fsdp-gae": ["--parallel", "fsdp", "--advantage", "gae", "--ref-beta", "0.1"],
        "fsdp-sharded-teacher": ["--parallel", "fsdp", "--teacher-parallel", "fsdp"]}
LAYOUT = {"tokens_per_s", "rollout_s", "step_s", "train_clock_s", "packing_efficiency"}  # timing and row layout differ


# ------------------------------------------------------------------------------------------------
# unit: shares and balance
# ------------------------------------------------------------------------------------------------

def test_question_shares_cover_the_step_once():
    for n, size in [(8, 2), (7, 3), (2, 2), (5, 1)]:
        shares = [distributed.question_share(n, distributed.World(r, size)) for r in range(size)]
        assert [f for f, _ in shares] == [sum(c for _, c in shares[:r]) for r in range(size)]
        assert sum(c for _, c in shares) == n and max(c for _, c in shares) - min(c for _, c in shares) <= 1


def test_episodes_are_balanced_by_tokens_and_every_rank_gets_one():
    shares = distributed.assign_episodes([100, 10, 10, 10, 90, 5], 2)
    assert sorted(i for s in shares for i in s) == list(range(6))
    loads = [sum([100, 10, 10, 10, 90, 5][i] for i in s) for s in shares]
    assert abs(loads[0] - loads[1]) <= 10
    assert all(distributed.assign_episodes([1, 1, 50], 3))
    with pytest.raises(distributed.DistributedError):
        distributed.assign_episodes([1], 2)


def test_a_batch_smaller_than_the_world_is_refused():
    with pytest.raises(distributed.DistributedError, match="questions-per-step"):
        distributed.check_batch(distributed.World(0, 4), 1, 2)


# ------------------------------------------------------------------------------------------------
# sharded checkpoints, read back in one process
# ------------------------------------------------------------------------------------------------

def _model_and_opt(seed: int):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    return m, torch.optim.AdamW(m.parameters(), lr=0.1)


def test_a_sharded_checkpoint_round_trips_and_a_fresh_optimizer_is_not_stepped(tmp_path):
    m, opt = _model_and_opt(0)
    state = distributed.ShardedState({"student": m}, {"optimizer": (m, opt)})
    checkpoint.save_sharded(tmp_path, 0, state, {"history": {}}, distributed.SINGLE)
    assert not opt.state  # saving before the first update leaves the optimizer as it was
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    checkpoint.save_sharded(tmp_path, 1, state, {"history": {"x": 1}}, distributed.SINGLE)
    m2, opt2 = _model_and_opt(1)
    saved, path = checkpoint.load_latest(tmp_path, {}, distributed.ShardedState({"student": m2},
                                                                                {"optimizer": (m2, opt2)}))
    assert (path.name, saved["step"], saved["format"], saved["history"]) == ("step-000001", 1, "dcp", {"x": 1})
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))
    for s, s2 in zip(opt.state.values(), opt2.state.values()):
        assert all(torch.equal(s[k], s2[k]) for k in s)
    # a damaged newest checkpoint: the previous one is loaded, with a warning; it holds no optimizer state
    for f in (path / checkpoint.DCP_DIR).glob("*.distcp"):
        f.write_bytes(b"garbage")
    m3, opt3 = _model_and_opt(2)
    with pytest.warns(RuntimeWarning, match="step-000001"):
        saved, path = checkpoint.load_latest(tmp_path, {}, distributed.ShardedState({"student": m3},
                                                                                    {"optimizer": (m3, opt3)}))
    assert path.name == "step-000000" and not opt3.state
    with pytest.raises(checkpoint.CheckpointError, match="sharded checkpoint"):
        checkpoint.load_latest(tmp_path, {"student": m3})


# ------------------------------------------------------------------------------------------------
# equivalence: 2 ranks == 1 process on identical episodes
# ------------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(run_dir: Path, extra: list[str]) -> train.Trainer:
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + EQUIV + ["--run-dir", str(run_dir)] + extra, "t", "")
    return train.Trainer(train.prepare(cfg), log=lambda m: None)


def _snapshot(trainer: train.Trainer, metrics: dict) -> dict:
    """Whole weights and gradients of the student (gathered from shards) and the step's metrics."""
    grads = {}
    for name, p in trainer.student.named_parameters():
        g = p.grad
        if g is not None and distributed._is_dtensor(g):
            g = g.full_tensor()
        grads[name] = None if g is None else g.detach().clone()
    return {"weights": distributed.full_state_dict(trainer.student), "grads": grads, "metrics": metrics}


def _episodes(path: Path):
    from agents.records import load_episodes

    return load_episodes(path, strict=True).episodes


def _rank_main(rank: int, world: int, port: int, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    tmp_path = Path(tmp)
    try:
        for arm, extra in ARMS.items():
            trainer = _trainer(tmp_path / f"run-{arm}", extra)
            if "--ref-beta" in extra:  # fit() makes it; learn() alone does not
                trainer.ref = copy.deepcopy(trainer.twin).requires_grad_(False)
            metrics = trainer.learn(_episodes(tmp_path / "episodes.jsonl"))
            snap = _snapshot(trainer, metrics)
            if rank == 0:
                torch.save(snap, tmp_path / f"{arm}.pt")
    finally:
        distributed.shutdown()


@pytest.fixture(scope="module")
def equivalence(tmp_path_factory):
    """One process's update on a step's episodes (rewards set to differ, so PPO has a signal),
    then the same episodes through 2 spawned ranks, per arm."""
    from agents.records import save_episodes

    tmp = tmp_path_factory.mktemp("equiv")
    ref_trainer = _trainer(tmp / "ref-episodes", [])
    episodes = ref_trainer.rollout()
    for e, f1 in zip(episodes, [0.0, 1.0, 0.5, 0.25]):
        e.metrics["f1"] = f1
    save_episodes(tmp / "episodes.jsonl", episodes)
    single = {}
    for arm, extra in ARMS.items():
        trainer = _trainer(tmp / f"single-{arm}", extra)  # --parallel means nothing to one process
        if "--ref-beta" in extra:
            trainer.ref = copy.deepcopy(trainer.twin).requires_grad_(False)
        metrics = trainer.learn(_episodes(tmp / "episodes.jsonl"))
        single[arm] = _snapshot(trainer, metrics)
    torch.multiprocessing.spawn(_rank_main, args=(2, _free_port(), str(tmp)), nprocs=2, join=True)
    return single, {arm: torch.load(tmp / f"{arm}.pt", weights_only=False) for arm in ARMS}, tmp


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a if a[k] is not None)


@pytest.mark.slow
@pytest.mark.parametrize("arm", list(ARMS))
def test_two_ranks_make_the_one_process_update(equivalence, arm):
    single, ranks, _ = equivalence
    one, two = single[arm], ranks[arm]
    assert _max_diff(one["grads"], two["grads"]) < 1e-5
    # Adam's first step moves a weight by lr * g / (|g| + eps): where the gradient is itself at float
    # noise (|g| ~ 1e-8) that ratio is noise too (two layouts sum in other orders), so weights are
    # compared where the gradient is real, and elsewhere bounded by what two first Adam steps can
    # differ by, 2 lr (measured: <= 3e-8 where real; up to 2.8e-4 at noise, lr 2e-3)
    for k, w1 in one["weights"].items():
        g, d = one["grads"].get(k), (w1 - two["weights"][k]).abs()
        if g is not None:
            assert float(torch.where(g.abs() > 1e-6, d, 0.0).max()) < 1e-5, k
        assert float(d.max()) <= 2 * train.TINY_LR * (1 + 1e-4), k
    assert max(float(g.abs().max()) for g in one["grads"].values() if g is not None) > 1e-3  # a real update
    m1, m2 = one["metrics"], two["metrics"]
    assert m1.keys() == m2.keys()
    for k in {k for k in m1 if not k.startswith("time/")} - LAYOUT:
        a, b = m1[k], m2[k]
        if isinstance(a, float) and a != a:
            assert b != b, k
        else:
            # rows differ (other packing per rank), so sums run in another order: float32 noise
            assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (k, a, b)
    assert m1["pg_loss"] != 0.0 and m1["opd_loss"] > 0 and m1["entropy"] > 0  # every term counted


@pytest.mark.slow
def test_two_ranks_write_the_sample_episodes_with_teacher_kl_once(equivalence):
    _, _, tmp = equivalence
    run = tmp / "run-fsdp-grpo"
    lines = (run / "episodes" / "step-000001.jsonl").read_text().splitlines()
    assert len(lines) == 4
    kls = [inv["meta"].get("teacher_kl") for line in lines for inv in json.loads(line)["invocations"]]
    assert all(kl is not None and len(kl) > 0 for kl in kls)  # every rank's episodes got their values


# ------------------------------------------------------------------------------------------------
# torchrun: a run, kill and resume, another world size
# ------------------------------------------------------------------------------------------------

def _torchrun(n: int, args: list[str], max_restarts: int = 0, **kw) -> subprocess.Popen:
    # c10d rendezvous (as on several machines): every restart round gets fresh store keys
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--max-restarts", str(max_restarts),
           "-m", "memopd.train", *FAST, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tempfile.NamedTemporaryFile("w+", prefix="torchrun-", suffix=".log", delete=False)  # a pipe could fill
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, **kw)
    p.log = Path(log.name)
    return p


def _finish(p: subprocess.Popen, timeout: float) -> str:
    """Wait for a torchrun job; its output."""
    p.wait(timeout=timeout)
    return p.log.read_text()


def _train_rows(run: Path) -> list[dict]:
    return [r for r in read_metrics(run) if "loss" in r]


def _same(a: list[dict], b: list[dict], tol: float = 1e-6) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        for k in {k for k in x if not k.startswith("time/")} - LAYOUT - {"tokens_per_s"}:
            if isinstance(x[k], float):
                assert abs(x[k] - y[k]) <= tol * max(1.0, abs(x[k])), (x["step"], k, x[k], y[k])


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("torchrun") / "run"
    p = _torchrun(2, ["--steps", "3", "--save-every", "1", "--audit-every", "3", "--teacher-parallel", "fsdp",
                      "--run-dir", str(run)])
    out = _finish(p, 600)
    assert p.returncode == 0, out[-3000:]
    return run, out


@pytest.mark.slow
def test_torchrun_two_ranks_train_and_rank_zero_alone_writes(two_rank_run):
    run, out = two_rank_run
    rows = _train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["kl/all"] > 0 and r["action_tokens"] > 0 for r in rows)
    assert rows[-1]["audit/passed"] is True
    assert out.count("held-out before training") == 1  # one log, from rank 0
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.toml", "curves.png", "episodes",
                                                     "metrics.jsonl", "model", "summary.json"]
    assert [p.name for p in checkpoint.list_checkpoints(run)] == ["step-000003", "step-000002"]
    assert (run / "model" / "config.json").is_file()
    # sharded checkpoints: every rank wrote its shards (Distributed Checkpoint) and its RNG state
    ckpt = run / "checkpoints" / "step-000003"
    assert checkpoint.is_sharded(ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["dcp", "meta.json", "rng-00000.pt", "rng-00001.pt",
                                                      "trainer.pt"]
    assert sorted(p.name for p in (ckpt / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not list((run / "checkpoints").glob(".tmp-*"))


@pytest.mark.slow
def test_held_out_evaluation_split_across_ranks_equals_one_process(two_rank_run, tmp_path):
    """Each rank evaluates its share of the test episodes (episode g keeps its seed): the gathered
    scores are those one process gets on all of them, for the student and the teacher."""
    run, _ = two_rank_run
    summary = json.loads((run / "summary.json").read_text())
    trainer = _trainer(tmp_path / "one", [])
    assert trainer.actor.evaluate() == pytest.approx(summary["eval_before"])
    judge = Actor(trainer.cfg, trainer.teacher.model, trainer.teacher.tokenizer)
    assert judge.evaluate() == pytest.approx(summary["eval_teacher"])


def test_each_rank_evaluates_its_own_test_episodes(tmp_path, monkeypatch):
    """Test episode g resets with seed 10_000 + g: rank r of 2 runs its share, no other."""
    import agents.rollout

    trainer = _trainer(tmp_path / "r", ["--eval-episodes", "5"])
    calls = []
    monkeypatch.setattr(agents.rollout, "rollout", lambda envs, agent, n, seed, **kw: calls.append((n, seed)) or [])
    monkeypatch.setattr(distributed, "gather_objects", lambda obj, world: [obj] * world.size)
    for rank in range(2):
        trainer.actor.world = distributed.World(rank, 2)
        trainer.actor.evaluate()
    assert calls == [(3, 10_000), (2, 10_003)]


def _truncate(run: Path, dest: Path, step: int) -> Path:
    """A copy of ``run`` as it was when checkpoint ``step`` was its newest (later ones removed)."""
    import shutil

    shutil.copytree(run, dest)
    for p in checkpoint.list_checkpoints(dest):
        if int(p.name.split("-")[1]) > step:
            shutil.rmtree(p)
    (dest / "checkpoints" / "latest").write_text(f"step-{step:06d}")
    shutil.rmtree(dest / "model")
    return dest


@pytest.mark.slow
def test_sharded_resume_at_the_same_world_size_is_exact(two_rank_run, tmp_path):
    """Killed after checkpoint 2 and resumed with 2 ranks: step 3 is the uninterrupted run's step 3."""
    run, _ = two_rank_run
    again = _truncate(run, tmp_path / "again", 2)
    p = _torchrun(2, ["--resume", str(again)])
    out = _finish(p, 600)
    assert p.returncode == 0, out[-3000:]
    _same(_train_rows(again), _train_rows(run))
    a, b = load_file(str(again / "model" / "model.safetensors")), load_file(str(run / "model" / "model.safetensors"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


@pytest.mark.slow
def test_resume_at_another_world_size_in_both_directions(two_rank_run, tmp_path):
    """A sharded checkpoint resumes in one process (DCP reshards it whole), and a one-process
    checkpoint resumes under torchrun: 2 ranks -> 1 process -> 2 ranks."""
    run, _ = two_rank_run
    one = _truncate(run, tmp_path / "one", 3)
    cfg = train.prepare(train.cfgmod.parse_args(train.TrainConfig, ["--resume", str(one), "--no-progress",
                                                                      "--steps", "4"], "t", ""), {"progress", "steps"})
    trainer = train.Trainer(cfg, log=lambda m: None)
    trainer.restore()  # what fit() does first
    # the reference: the whole weights the 2-rank run exported at step 3 (gathered, not read by DCP)
    final = load_file(str(run / "model" / "model.safetensors"))
    assert all(torch.equal(v, final[k]) for k, v in trainer.student.state_dict().items() if k in final)
    opt = trainer.updater.opt.state_dict()["state"]
    assert len(opt) == len(list(trainer.student.parameters()))
    assert {float(s["step"]) for s in opt.values()} == {3.0 * cfg.ppo_epochs}  # one minibatch an epoch
    assert all(s["exp_avg_sq"].abs().sum() > 0 for s in opt.values())
    trainer._train()
    assert [r["step"] for r in _train_rows(one)] == [1, 2, 3, 4]
    assert not checkpoint.is_sharded(checkpoint.list_checkpoints(one)[0])  # one process writes safetensors
    # 1 -> 2: the one-process checkpoint resumed by 2 ranks for one more step
    p = _torchrun(2, ["--resume", str(one), "--steps", "5"])
    out = _finish(p, 600)
    assert p.returncode == 0, out[-3000:]
    assert [r["step"] for r in _train_rows(one)] == [1, 2, 3, 4, 5]
    # the one-process reader of a run directory (memopd.eval --model RUN) takes a sharded checkpoint
    from agents.models import load

    model, _ = load(_truncate(run, tmp_path / "read", 3))
    assert all(torch.equal(v, final[k]) for k, v in model.state_dict().items() if k in final)


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_and_resume_continues(tmp_path):
    run = tmp_path / "run"
    p = _torchrun(2, ["--steps", "6", "--save-every", "1", "--dist-timeout", "60", "--run-dir", str(run)],
                  start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and len(checkpoint.list_checkpoints(run)) < 2:
        time.sleep(0.5)
    assert checkpoint.list_checkpoints(run), "no checkpoint before the kill"
    workers = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    os.kill(int(workers[1]), signal.SIGKILL)  # one rank dies mid-run
    start = time.time()
    out = _finish(p, 180)
    assert p.returncode != 0 and time.time() - start < 120, out[-2000:]  # the job ends, no hang
    done = _train_rows(run)[-1]["step"] if _train_rows(run) else 0
    assert done < 6
    p = _torchrun(2, ["--resume", str(run)])
    out = _finish(p, 600)
    assert p.returncode == 0, out[-3000:]
    assert [r["step"] for r in _train_rows(run)] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_max_restarts_resumes_by_itself_after_a_killed_rank(tmp_path):
    run = tmp_path / "run"
    p = _torchrun(2, ["--steps", "5", "--save-every", "1", "--dist-timeout", "60", "--run-dir", str(run)],
                  max_restarts=1, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and len(checkpoint.list_checkpoints(run)) < 2:
        time.sleep(0.5)
    workers = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
    os.kill(int(workers[0]), signal.SIGKILL)
    out = _finish(p, 600)
    assert p.returncode == 0, out[-3000:]
    assert "resumed from" in out
    assert [r["step"] for r in _train_rows(run)] == [1, 2, 3, 4, 5]
