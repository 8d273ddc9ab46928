"""memopd.train --agent: the policy rolled out and trained is the one named, with its
--agent-kwarg options; the oracle is refused; an agent whose records lack what the run needs
fails before any update, naming the agent and the field."""

from __future__ import annotations

import uuid

import pytest

from agents.records import load_episodes
from memopd import checkpoint, train
from memopd.runlog import read_metrics

FAST = ["--env-kwarg", "num_chunks=2", "--questions-per-step", "2", "--group-size", "2", "--max-new-tokens", "8",
        "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0", "--teacher", "tiny-teacher",
        "--no-progress", "--pack-tokens", "1024", "--ppo-epochs", "1", "--audit-every", "0", "--threads", "1"]

AGENTS = '''
from agents.baselines import FullContextAgent
from agents.memagent import MemAgent


class BriefReader(FullContextAgent):
    """The full-context baseline with a word limit on its answers (an option the trainer passes on)."""

    name = "brief"

    def __init__(self, backend=None, sampling=None, answer_words=1, **kwargs):
        super().__init__(backend=backend, sampling=sampling, **kwargs)
        self.answer_words = answer_words


class NoSpans(MemAgent):
    """A MemAgent whose records do not say where the memory is (Invocation.spans is None)."""

    name = "nospans"

    def request(self, state, prompt, role, **meta):
        req = super().request(state, prompt, role, **meta)
        req.spans = None
        return req
'''


@pytest.fixture
def agents_module(tmp_path, monkeypatch):
    name = f"train_agents_{uuid.uuid4().hex[:8]}"
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / f"{name}.py").write_text(AGENTS)
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    return name


def _cfg(run_dir, *extra):
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(run_dir)] + list(extra), "t", "")
    return train.prepare(cfg)


def test_one_step_trains_the_named_agent_with_its_options(tmp_path, agents_module):
    run = tmp_path / "run"
    cfg = _cfg(run, "--steps", "1", "--agent", f"{agents_module}:BriefReader", "--agent-kwarg", "answer_words=2",
               "--agent-kwarg", "answer_max_new_tokens=3", "--teacher-mask", "answer")
    trainer = train.Trainer(cfg, log=lambda m: None)
    agent = trainer.actor.agent(False, None)
    assert type(agent).__name__ == "BriefReader" and agent.answer_words == 2
    assert agent.backend is trainer.actor.backend and agent.answer_sampling.max_new_tokens == 3
    trainer.fit()
    episodes = load_episodes(run / "episodes" / "step-000001.jsonl").episodes
    assert episodes and {e.agent for e in episodes} == {"brief"}
    assert all([i.role for i in e.invocations] == ["answer"] for e in episodes)  # one answer call: the reader
    assert all(len(i.response_ids) <= 3 for e in episodes for i in e.invocations)
    (row,) = [r for r in read_metrics(run) if "loss" in r]
    assert row["calls_per_episode"] == 1.0 and row["kl/answer"] >= 0
    assert 'agent = "' in (run / "config.toml").read_text() and "answer_words = 2" in (run / "config.toml").read_text()


def test_fullcontext_by_name(tmp_path):
    cfg = _cfg(tmp_path / "run", "--steps", "1", "--agent", "fullcontext")
    trainer = train.Trainer(cfg, log=lambda m: None)
    episodes = trainer.actor.rollout(0).episodes
    assert {e.agent for e in episodes} == {"fullcontext"} and len(episodes) == 4


def test_the_oracle_is_refused_for_training(tmp_path, capsys):
    assert train.main(FAST + ["--run-dir", str(tmp_path / "run"), "--agent", "oracle"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --agent oracle: OracleAgent makes no model calls") and "nothing to train" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra, says", [
    (["--agent", "nope"], "--agent nope: unknown agent 'nope'; available agents: "),
    (["--agent", "agents.records:Episode"], "is not derived from agents.MemoryPolicy"),
    (["--agent-kwarg", "colour=blue"], "--agent memagent: MemAgent takes no option 'colour' (--agent-kwarg)"),
    (["--agent-kwarg", "backend=x"], "--agent-kwarg backend: set by the command line itself"),
])
def test_bad_agent_flags_fail_before_anything_loads(tmp_path, capsys, extra, says):
    assert train.main(FAST + ["--run-dir", str(tmp_path / "run"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_records_without_spans_fail_the_persistent_control_before_any_update(tmp_path, agents_module, capsys):
    run = tmp_path / "run"
    args = FAST + ["--run-dir", str(run), "--steps", "1", "--agent", f"{agents_module}:NoSpans",
                   "--teacher-context", "persistent"]
    assert train.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the config the CLI prints
    assert err.startswith(f"error: --agent {agents_module}:NoSpans: episode 0 (") and ", agent nospans)" in err
    assert "invocation 0 has no spans" in err and "Invocation.spans" in err
    assert not run.exists() and not checkpoint.list_checkpoints(run)  # failed at the held-out rollout: no update
    # the aligned context needs no spans: the same agent trains
    cfg = _cfg(tmp_path / "aligned", "--steps", "1", "--agent", f"{agents_module}:NoSpans")
    train.Trainer(cfg, log=lambda m: None).fit()
    assert [r["step"] for r in read_metrics(tmp_path / "aligned") if "loss" in r] == [1]
