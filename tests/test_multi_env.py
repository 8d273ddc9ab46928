"""Several envs in one run (memopd.learn.mix): the spec grammar, the draw of each step's envs,
per-env metrics and held-out figures, and a killed-and-resumed mixed run equal to the uninterrupted one."""

from __future__ import annotations

import math
import random

import pytest

from memopd import config as cfgmod
from memopd import train
from memopd.config import ConfigError
from memopd.learn.teachers.routing import teacher_flags
from memopd.learn.mix import EnvSpec, env_mix, parse_env_spec, question_envs, shares
from memopd.runlog import read_metrics

LQ, KU = "memgym/LongQA-v0", "memgym/KnowledgeUpdate-v0"
MIX = ["--env", f"{LQ}:2,num_chunks=2", "--env", f"{KU}:1,num_chunks=2"]
FAST = ["--questions-per-step", "4", "--group-size", "2", "--max-new-tokens", "12", "--eval-episodes", "2",
        "--eval-every", "0", "--student-warmup-steps", "0", "--no-progress",
        "--pack-tokens", "1024", "--threads", "1", "--audit-every", "0", "--sample-episodes", "2"]
TIMING = {"tokens_per_s", "rollout_s", "step_s", "train_clock_s"}


def _cfg(run, *extra, mix=MIX):  # (the auto teacher where no --teacher is given)
    argv = teacher_flags(train.env_flags([*mix, *FAST, "--run-dir", str(run), *extra]))
    return train.prepare(cfgmod.parse_args(train.TrainConfig, argv, "t", ""))


def test_spec_grammar_against_hand_parsed_values():
    assert parse_env_spec(f"{LQ}:2,num_chunks=6,fact_order=random") == EnvSpec(
        LQ, 2.0, {"num_chunks": 6, "fact_order": "random"})
    assert parse_env_spec("LongQA") == EnvSpec(LQ, 1.0, {})  # a task folder's name: its env id
    assert parse_env_spec({"name": KU, "weight": 3, "num_chunks": 4}) == EnvSpec(KU, 3.0, {"num_chunks": 4})
    spec = EnvSpec(LQ, 0.5, {"num_chunks": 6, "fact_order": "random"})
    assert parse_env_spec(spec.text()) == spec  # what config.toml keeps reads back
    assert parse_env_spec("memgym:LongQA-v0:3") == EnvSpec(LQ, 3.0, {})  # an id with its namespace
    for bad, says in [(f"{LQ}:x", "unknown memgym env"), (f"{LQ}:0", "above 0"), (f"{LQ},num_chunks", "KEY=VALUE"),
                      ("memgym/Nope-v0:1", "unknown memgym env")]:
        with pytest.raises(ConfigError, match=says):
            parse_env_spec(bad)


def test_env_flags_make_a_mix_only_when_repeated_or_weighted():
    assert train.env_flags(["--env", LQ, "--steps", "2"]) == ["--env", LQ, "--steps", "2"]
    assert train.env_flags(["--env", "memgym:LongQA-v0"]) == ["--env", "memgym:LongQA-v0"]
    assert train.env_flags(["--env", f"{LQ}:2"]) == ["--env-mix", f"{LQ}:2"]
    assert train.env_flags(["--env", LQ, f"--env={KU}"]) == ["--env-mix", LQ, f"--env-mix={KU}"]


def test_config_keeps_the_mix_and_names_the_first_env(tmp_path):
    cfg = _cfg(tmp_path / "run")
    assert cfg.env == LQ and [s.tag for s in env_mix(cfg)] == ["LongQA-v0", "KnowledgeUpdate-v0"]
    from memopd.learn.teachers.routing import Route, route_table

    # --teacher auto on a mix: each env's own auto teacher (built for that env alone)
    assert route_table(cfg) == [Route("LongQA-v0", "*", "auto"), Route("KnowledgeUpdate-v0", "*", "auto")]
    with pytest.raises(ConfigError, match="given twice"):
        _cfg(tmp_path / "r2", mix=["--env", LQ, "--env", "LongQA:2"])
    toml = tmp_path / "mix.toml"
    toml.write_text(f'env_mix = ["{LQ}:2", {{ name = "{KU}", weight = 1, num_chunks = 3 }}]\n')
    cfg = cfgmod.parse_args(train.TrainConfig, ["--config", str(toml)], "t", "")
    assert env_mix(cfg) == [EnvSpec(LQ, 2.0, {}), EnvSpec(KU, 1.0, {"num_chunks": 3})]
    toml.write_text(f'[env_mix]\n"{LQ}" = 2\n"{KU}" = {{ weight = 1, num_chunks = 3 }}\n'
                    '[teacher_routes]\nmemory = "tiny-teacher"\n"KnowledgeUpdate-v0:answer" = "tiny-teacher-bpe1k"\n')
    cfg = cfgmod.parse_args(train.TrainConfig, ["--config", str(toml), "--opd-estimator", "sampled"], "t", "")
    assert env_mix(cfg) == [EnvSpec(LQ, 2.0, {}), EnvSpec(KU, 1.0, {"num_chunks": 3})]  # the TOML tables
    assert route_table(cfg) == [Route("*", "memory", "tiny-teacher"),
                                Route("KnowledgeUpdate-v0", "answer", "tiny-teacher-bpe1k")]
    saved = tmp_path / "saved.toml"
    cfgmod.save_toml(cfg, saved)  # config.toml keeps them as lists, read back the same
    again = cfgmod.from_dict(train.TrainConfig, cfgmod.load_toml(saved))
    assert again.env_mix == cfg.env_mix and again.teacher_routes == cfg.teacher_routes
    with pytest.raises(ConfigError, match="^--async-rollouts samples one env"):
        _cfg(tmp_path / "r4", "--async-rollouts")
    one = _cfg(tmp_path / "r3", mix=["--env", LQ])  # one plain --env: no mix, as before
    assert one.env_mix == [] and env_mix(one) == [EnvSpec(LQ)]


def test_question_envs_follow_the_weights_and_the_seed_alone():
    assert question_envs(0, 5, 8, [1.0]) == [0] * 8  # one env: no draw at all
    a = question_envs(3, 7, 16, [2.0, 1.0])
    assert a == question_envs(3, 7, 16, [2.0, 1.0]) and a == sorted(a)  # same seed and step: the same draw
    rng = random.Random("memopd-mix:3:7")  # the draw by hand: weighted choices from the seed and the step
    assert a == sorted(rng.choices([0, 1], weights=[2.0, 1.0], k=16))
    counts = [0, 0]
    for step in range(400):
        for e in question_envs(0, step, 8, [3.0, 1.0]):
            counts[e] += 1
    assert abs(counts[0] / sum(counts) - 0.75) < 0.02  # 3200 draws: sd 0.008
    assert shares(1000, [2.0, 1.0]) == [667, 333] and shares(10, [1, 1, 1]) == [4, 3, 3]


def _rows(run):
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("time/")} for r in read_metrics(run)]


def _same(a, b):
    assert [(r["step"], sorted(r)) for r in a] == [(r["step"], sorted(r)) for r in b]
    for ra, rb in zip(a, b):
        for k, v in ra.items():
            if isinstance(v, float) and math.isnan(v):
                assert math.isnan(rb[k]), (ra["step"], k)
            else:
                assert rb[k] == (pytest.approx(v, rel=1e-5, abs=1e-6) if isinstance(v, float) else v), (ra["step"], k)


class Killed(BaseException):
    """Stands for SIGKILL right after a checkpoint."""


TEACHERS = {"one teacher": ["--teacher", "tiny-teacher"],  # every call
            "routes": ["--teacher", "memory=tiny-teacher", "--teacher", "KnowledgeUpdate-v0:answer=tiny-teacher"]}


@pytest.fixture(scope="module", params=list(TEACHERS))
def mixed(tmp_path_factory, request):
    run = tmp_path_factory.mktemp("mixed") / "run"
    cfg = _cfg(run, "--steps", "3", "--save-every", "1", *TEACHERS[request.param])
    summary = train.Trainer(cfg, log=lambda m: None).fit()
    return run, summary, request.param


def test_mixed_run_has_each_envs_metrics_and_heldout_figures(mixed):
    run, summary, teachers = mixed
    steps = [r for r in read_metrics(run) if "loss" in r]
    for r in steps:
        n = {t: r[f"env/{t}/episodes"] for t in ("LongQA-v0", "KnowledgeUpdate-v0")}
        assert sum(n.values()) == 4 * 2  # B x G episodes, split by the step's draw
        draw = question_envs(0, r["step"] - 1, 4, [2.0, 1.0])
        assert n == {"LongQA-v0": 2 * draw.count(0), "KnowledgeUpdate-v0": 2 * draw.count(1)}
        assert all(f"env/{t}/{k}" in r for t in n for k in ("reward", "f1", "kl"))
        if teachers == "routes":  # LongQA's answers have no route
            assert r["teacher/unrouted_share"] > 0 and math.isfinite(r["kl/all"])
            assert r["teacher/memory/supervised_share"] + r["teacher/KnowledgeUpdate-v0:answer/supervised_share"] \
                + r["teacher/unrouted_share"] == pytest.approx(1.0)
    for key in ("eval_before", "eval_after"):
        fig = summary[key]
        assert {"LongQA-v0/f1", "KnowledgeUpdate-v0/f1", "f1"} <= set(fig)
        # the pooled figure is the mean over both envs' episodes (the same count each)
        assert fig["f1"] == pytest.approx((fig["LongQA-v0/f1"] + fig["KnowledgeUpdate-v0/f1"]) / 2)
    from agents.records import load_episodes

    tasks = {e.task_id for f in sorted((run / "episodes").glob("*.jsonl")) for e in load_episodes(f).episodes}
    assert tasks <= {LQ, KU}


def test_killed_and_resumed_mixed_run_equals_the_uninterrupted_one(mixed, tmp_path, monkeypatch):
    full, _, teachers = mixed
    run = tmp_path / "run"
    real_save = train.Trainer.save

    def save_then_die(self):
        out = real_save(self)
        if self.step == 2:
            raise Killed  # checkpoint 2 is on disk; the process dies before step 3
        return out

    monkeypatch.setattr(train.Trainer, "save", save_then_die)
    with pytest.raises(Killed):
        train.Trainer(_cfg(run, "--steps", "3", "--save-every", "1", *TEACHERS[teachers]), log=lambda m: None).fit()
    monkeypatch.undo()
    train.Trainer(train.prepare(train.TrainConfig(resume=str(run))), log=lambda m: None).fit()
    _same(_rows(full), _rows(run))


def test_run_report_and_viewer_split_by_env(mixed):
    from memopd import view
    from memopd.runlog import run_panels

    run, summary, _ = mixed
    src = view.load_source(run)
    line = view.heldout_line(src)
    a, b = summary["eval_after"], summary["eval_before"]
    assert line.endswith(f"(2 test episodes of each env); by env: LongQA-v0 {b['LongQA-v0/f1']:.3f} -> "
                         f"{a['LongQA-v0/f1']:.3f}, KnowledgeUpdate-v0 {b['KnowledgeUpdate-v0/f1']:.3f} -> "
                         f"{a['KnowledgeUpdate-v0/f1']:.3f}")
    panels = dict(run_panels(src.metrics))
    assert panels["F1 by env"] == ("env/KnowledgeUpdate-v0/f1", "eval/KnowledgeUpdate-v0/f1", "env/LongQA-v0/f1",
                                   "eval/LongQA-v0/f1")
    assert panels["KL by env"] == ("env/KnowledgeUpdate-v0/kl", "env/LongQA-v0/kl")
    index, _ = view.report_data(src)
    assert {"F1 by env", "KL by env"} <= {p["title"] for p in index["panels"]}
    if any("teacher/unrouted_share" in r for r in src.metrics):
        assert panels["supervised share by route"] == ("teacher/KnowledgeUpdate-v0:answer/supervised_share",
                                                       "teacher/memory/supervised_share", "teacher/unrouted_share")
    assert {r["task"] for r in index["rows"]} <= {LQ, KU}
