"""Smoke tests of the reproduction's follow-up studies (docs/RESULTS.md): the imperfect teacher, the
memory ladder and the 2-hop setting, each on a tiny budget. They check the pipelines (what runs
where, what is reused, what the reports hold), not the results."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    """One smoke experiment directory the studies share, as they share runs/reproduce."""
    return tmp_path_factory.mktemp("studies")


@pytest.mark.slow
def test_imperfect_teacher_smoke(exp):
    it = load("imperfect_teacher")
    assert it.main(["--smoke", "--exp", str(exp), "--seeds", "0", "--no-progress"]) == 0
    blind = set(it.blind_companies(3))
    assert len(blind) >= 10
    # the teacher never saw a blind company: none of its training trajectories answers with one
    lines = (exp / "teacher-blind-data" / "episodes.jsonl").read_text().splitlines()
    assert lines and all(not blind & set(json.loads(line)["answers"]) for line in lines)
    sft = json.loads((exp / "teacher-blind" / "sft_config.json").read_text())
    assert sft["episodes"].endswith("episodes.jsonl")
    for arm in it.ARMS:
        run_dir = exp / "runs-imperfect" / "fkl" / arm / "seed-0"
        assert (run_dir / "summary.json").is_file()
        assert 'teacher-blind"' in (run_dir / "config.toml").read_text()
    res = json.loads((exp / "imperfect.json").read_text())
    assert set(res["table"]) == {"teacher (blind)", "warm student", *it.ARMS}
    for rows in res["rows"].values():
        for r in rows:
            assert 0.0 <= r["all"] <= 1.0 and 0 <= r["n_blind"] <= 4
    assert "| teacher (blind) |" in (exp / "imperfect.md").read_text()


@pytest.mark.slow
def test_partial_blind_spot_smoke(exp):
    """--blind-share 0.5: the teacher's data keeps every second blind-company trajectory of those
    drawn, in its own teacher-blind-0.5/; the study is named imperfect-0.5; --rep-arg reaches the
    reproduction's budget."""
    it = load("imperfect_teacher")
    assert it.main(["--smoke", "--exp", str(exp), "--seeds", "0", "--no-progress", "--blind-share", "0.5",
                    "--arms", "opd-only", "--rep-arg=--group-size=3"]) == 0
    data = [json.loads(x) for x in (exp / "teacher-blind-0.5-data" / "episodes.jsonl").read_text().splitlines()]
    assert data  # the smoke draws too few for a blind one to reach the kept 8; keep_share is checked here
    assert it.keep_share("abBcBBdB", str.isupper, 0.5) == list("abcBdB")  # the 2nd and 4th blind kept
    assert it.keep_share("abBcBBdB", str.isupper, 0.0) == list("abcd")
    assert it.keep_share("BBBBBBBBBB", str.isupper, 0.1) == ["B"]  # the 10th
    cfg = (exp / "runs-imperfect-0.5" / "fkl" / "opd-only" / "seed-0" / "config.toml").read_text()
    assert 'teacher-blind-0.5"' in cfg and "group_size = 3" in cfg
    assert set(json.loads((exp / "imperfect-0.5.json").read_text())["table"]) == {"teacher (blind)", "warm student",
                                                                                  "opd-only"}


@pytest.mark.slow
def test_memory_ladder_smoke(exp, capsys):
    ml = load("memory_ladder")
    assert ml.main(["--smoke", "--exp", str(exp), "--budgets", "8,16", "--seeds", "0", "--no-progress"]) == 0
    assert (exp / "runs-fair" / "fkl" / "ppo+memopd" / "seed-0" / "summary.json").is_file()  # budget 16 = fair
    for arm in ml.ARMS:
        cfg = (exp / "runs-mem8" / "fkl" / arm / "seed-0" / "config.toml").read_text()
        assert "memory_budget = 8" in cfg and 'teacher-both"' in cfg
    res = json.loads((exp / "memory-ladder.json").read_text())
    assert [int(m) for m in res["rows"]] == [8, 16]
    assert res["rows"]["16"]["study"] == "fair" and res["rows"]["8"]["study"] == "mem8"
    for row in res["rows"].values():
        assert row["gap"][0] == pytest.approx(row["aligned"][0] - row["persistent"][0])
        assert row["teacher_kl"] > 0
    assert (exp / "memory-ladder.png").read_bytes()[:4] == b"\x89PNG"
    # a rerun trains nothing: every run is found finished
    capsys.readouterr()
    mtime = (exp / "runs-mem8" / "fkl" / "ppo+memopd" / "seed-0" / "summary.json").stat().st_mtime
    assert ml.main(["--smoke", "--exp", str(exp), "--budgets", "8", "--seeds", "0", "--no-progress"]) == 0
    assert "== ppo" not in capsys.readouterr().err
    assert (exp / "runs-mem8" / "fkl" / "ppo+memopd" / "seed-0" / "summary.json").stat().st_mtime == mtime


@pytest.mark.slow
def test_two_hop_smoke(tmp_path):
    """The 2-hop study: the reproduction with --env-kwarg hops=2 in its own directory, its teacher
    taught by a curriculum from the 1-hop teacher; the SFTs and every arm see 2-hop questions."""
    th = load("two_hop")
    rep = load("reproduce_memopd")
    exp, one = tmp_path / "2hop", tmp_path / "1hop"
    assert th.main(["--smoke", "--exp", str(exp), "--one-hop-exp", str(one), "--seeds", "0", "--no-progress"]) == 0
    sft = {d: json.loads((exp / d / "sft_config.json").read_text())
           for d in ("teacher", "teacher-from-1hop", "teacher-from-1hop-500", "student")}
    assert all(c["env_kwargs"]["hops"] == 2 and c["env_kwargs"]["num_chunks"] == 3 for c in sft.values())
    assert "hops" not in json.loads((one / "teacher" / "sft_config.json").read_text())["env_kwargs"]
    assert sft["teacher-from-1hop"]["model"] == str(one / "teacher")  # the curriculum starts from the 1-hop teacher
    assert sft["teacher-from-1hop-500"]["model"] == str(exp / "teacher-from-1hop")
    for arm in rep.ARMS:
        cfg = (exp / "runs" / "fkl" / arm / "seed-0" / "config.toml").read_text()
        assert "hops = 2" in cfg and 'teacher-from-1hop-500"' in cfg
    assert json.loads((exp / "results-fkl.json").read_text())["env_kwargs"]["hops"] == 2
    # the curriculum student: the 1-hop MemOPD student runs the same arms on 2-hop
    cur = (exp / "runs-curriculum" / "fkl" / "ppo" / "seed-0" / "config.toml").read_text()
    assert "hops = 2" in cur and str(one / "runs-fair" / "fkl" / "ppo+memopd" / "seed-0" / "model") in cur
    assert json.loads((exp / "results-curriculum-fkl.json").read_text())["env_kwargs"]["hops"] == 2
    res = json.loads((exp / "two-hop.json").read_text())
    assert set(res["teacher_f1_2hop"]) == {"1-hop teacher", "2-hop from scratch", "curriculum stage 1",
                                           "curriculum stage 2"}
    assert (exp / "teacher" / "heldout-hops=2.json").is_file()  # per-setting caches
    assert (exp / "two-hop-sft.png").read_bytes()[:4] == b"\x89PNG"


def test_given_models_must_exist(tmp_path, capsys):
    rep = load("reproduce_memopd")
    with pytest.raises(SystemExit, match="--teacher .*no model there"):
        rep.main(["--smoke", "--out", str(tmp_path), "--teacher", str(tmp_path / "nope"), "--no-progress"])


@pytest.mark.slow
def test_baselines_smoke(tmp_path):
    """examples/reproduce_baselines.py: the off-policy arms beside the fair control's curves, the
    mid-plateau warm start and the PPO-with-a-signal arms with 8 samples a question."""
    rep = load("reproduce_memopd")
    bl = load("reproduce_baselines")
    assert rep.main(["--smoke", "--teacher-sft-context", "both", "--arms", "ppo+opd-persist,ppo+memopd", "--seeds", "0",
                     "--out", str(tmp_path), "--name", "fair120", "--no-progress"]) == 0
    assert bl.main(["--smoke", "--exp", str(tmp_path), "--seeds", "0", "--no-progress"]) == 0
    res = json.loads((tmp_path / "offpolicy.json").read_text())
    assert set(res["curves"]) == {"sft-oracle", "sft-teacher", "ppo+memopd", "ppo+opd-persist"}  # + the control's
    for arm in bl.OFFPOLICY_ARMS:
        curve = res["curves"][arm]["0"]
        assert curve["step"] == [0, 1, 2] and curve["episodes"] == [0, 32, 64]
        # each step trained on its own fresh episodes: the cache holds steps x 32
        lines = (tmp_path / "runs-offpolicy" / arm / "seed-0" / "episodes.jsonl").read_text().splitlines()
        assert len(lines) == 2 * bl.EPISODES_PER_STEP
    teacher_eps = (tmp_path / "runs-offpolicy" / "sft-teacher" / "seed-0" / "episodes.jsonl").read_text()
    assert json.loads(teacher_eps.splitlines()[0])["invocations"]  # sampled by the teacher, one call per chunk
    assert (tmp_path / "student-mid" / "config.json").is_file()
    for arm in ("ppo", "ppo+memopd", "opd-only"):
        cfg = (tmp_path / "runs-signal" / "fkl" / arm / "seed-0" / "config.toml").read_text()
        assert "student-mid" in cfg and "group_size = 2" in cfg  # smoke: 2 samples (8 in the study)
    var = json.loads((tmp_path / "variance.json").read_text())
    assert set(var["cells"]) == {"t0-s0", "t0-s1", "t1-s0", "t1-s1"}
    assert var["cells"]["t0-s0"]["source"] == "results-fair120-fkl.json"  # the control's runs, read at step 2
    assert var["cells"]["t1-s1"]["teacher"] == "teacher-both-s2000" and var["cells"]["t1-s1"]["student"] == "student-s8"
    assert (tmp_path / "runs-var-t1-s1" / "fkl" / "ppo+memopd" / "seed-0" / "summary.json").is_file()
    assert "| t1-s1 |" in (tmp_path / "variance.md").read_text()
    # a rerun reuses every finished arm
    before = (tmp_path / "runs-offpolicy" / "sft-oracle" / "seed-0" / "curve.json").stat().st_mtime
    assert bl.main(["--smoke", "--exp", str(tmp_path), "--seeds", "0", "--study", "offpolicy", "--no-progress"]) == 0
    assert (tmp_path / "runs-offpolicy" / "sft-oracle" / "seed-0" / "curve.json").stat().st_mtime == before


def test_baselines_arms_are_checked(capsys):
    bl = load("reproduce_baselines")
    with pytest.raises(SystemExit):
        bl.parse_args(["--study", "offpolicy", "--arms", "sft-nope"])
    assert "unknown off-policy arm" in capsys.readouterr().err


def test_rl_plateau_keeps_its_metrics_compactly():
    """The plateau study's results JSON: floats to 6 significant digits, by hand; the committed data
    keeps the script's metrics for five seeds."""
    plateau = load("rl_plateau")
    assert plateau.rounded({"a": [0.9765625, 1234.56789], "b": 3, "c": "x"}) == {"a": [0.976562, 1234.57], "b": 3,
                                                                                  "c": "x"}
    data = json.loads((Path(__file__).resolve().parents[1] / "docs/data/rl_plateau/dapo.json").read_text())
    rows = [row for run in data["runs"].values() for row in run["rows"]]
    assert {k for row in rows for k in row} <= set(plateau.KEPT) and len(data["runs"]) == 5
    assert sum("eval/f1" in row for row in rows) == 5 * 11  # step 0 and every 40th of 400
