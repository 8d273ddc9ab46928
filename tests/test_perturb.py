"""The perturbed-memory control (memgym.perturb): what the records say was replaced, that the next
call reads it, recovery, and that a run it does not perturb is the run without it."""

from __future__ import annotations

import json

import gymnasium as gym
import pytest

import memgym  # noqa: F401
from agents.oracle import OracleAgent
from agents.records import Episode
from agents.rollout import rollout, run_episode
from memgym.perturb import MemoryPerturbation, PerturbationSpec, parse_spec


@pytest.fixture(scope="module")
def backend(tiny):
    from agents.backends.hf import HFBackend

    return HFBackend(*tiny, seed=0)


def test_spec_strings():
    assert parse_spec("drop") == PerturbationSpec("drop")
    assert parse_spec("stale@3") == PerturbationSpec("stale", after=3)
    assert parse_spec("distractor@p0.25") == PerturbationSpec("distractor", probability=0.25)
    assert str(parse_spec("stale@p0.5")) == "stale@p0.5" and str(parse_spec("drop@2")) == "drop@2"
    for bad in ("swap", "drop@", "drop@p0", "drop@p1.5", "drop@-1", ""):
        with pytest.raises(ValueError, match="KIND@N"):
            parse_spec(bad)


def wrapped(spec, env_id="memgym/LongQA-v0", **kw):
    return MemoryPerturbation(gym.make(env_id, split="test", **kw), spec)


def oracle_episodes(env, n):
    agent = OracleAgent.for_env(env)
    return [run_episode(env, agent, seed=s) for s in range(n)]


def test_drop_records_what_it_replaced_and_the_next_call_reads_it():
    env = wrapped("drop@0", num_chunks=3)
    dropped = 0
    for ep in oracle_episodes(env, 12):
        fact = ep.invocations[0].response_text  # what the oracle wrote after chunk 0
        if not fact:
            assert ep.perturbations is None  # nothing to drop: no perturbation, no record
            continue
        dropped += 1
        (p,) = ep.perturbations
        assert (p.kind, p.after_chunk, p.original, p.replacement, p.reappears) == ("drop", 0, fact, "", False)
        nxt = ep.invocations[1]
        assert nxt.prompt_ids[slice(*nxt.spans["memory"])] == []  # the next call read the empty memory
        assert ep.reward == 0.0 and ep.prediction == ""  # the one fact was lost: the oracle cannot answer
    assert dropped >= 2


def test_distractor_puts_a_wrong_answer_in_the_memory():
    env = wrapped("distractor@2", num_chunks=3)
    for ep in oracle_episodes(env, 8):
        (p,) = ep.perturbations
        gold = ep.answers[0]
        assert p.original.split()[1] == gold and p.replacement.split()[0] == p.original.split()[0]
        wrong = p.replacement.split()[1]
        assert wrong != gold and p.replacement == f"{p.original.split()[0]} {wrong} ."
        answer_call = ep.invocations[-1]
        memory = env.unwrapped.counter.tokenizer.decode(answer_call.prompt_ids[slice(*answer_call.spans["memory"])])
        assert memory.strip() == p.replacement


def test_stale_brings_back_the_overwritten_value():
    """KnowledgeUpdate, one person with 2 updates over 3 chunks (one statement a chunk): made stale
    after the last chunk, the memory holds the value before the last update, and the oracle answers that."""
    env = wrapped("stale@2", "memgym/KnowledgeUpdate-v0", updates=2, num_chunks=3, people=1)
    for ep in oracle_episodes(env, 6):
        (p,) = ep.perturbations
        values = [i.response_text.split()[1] for i in ep.invocations[:-1]]
        assert p.original.split()[1] == values[2] == ep.answers[0] and p.replacement.split()[1] == values[1]
        assert p.reappears is False and ep.prediction == values[1] and ep.reward == 0.0


def test_reappears_says_whether_a_supporting_fact_is_read_after_the_perturbation():
    env = wrapped("drop@0", "memgym/Counting-v0", max_count=3, keys=1)
    source = env.unwrapped.source
    seen = set()
    for ep in oracle_episodes(env, 40):
        chunks = [f["chunk"] for f in source[source.index_of(ep.sample_id)].supporting_facts]
        if chunks[0] != 0:
            assert ep.perturbations is None  # nothing counted yet after chunk 0: nothing to drop
            continue
        (p,) = ep.perturbations
        assert p.reappears == any(c > 0 for c in chunks)
        seen.add(p.reappears)
    assert seen == {True, False}


def test_the_reader_oracle_writes_the_facts_oracle_on_clean_input():
    """On clean LongQA (one and two hops) the reader script (memgym.oracle.ReaderScript) writes what
    the facts script writes, call by call: only the facts fill their frames."""
    for hops in (1, 2):
        env = gym.make("memgym/LongQA-v0", split="test", num_chunks=4, hops=hops)
        facts = oracle_episodes(env, 12)
        reader = [run_episode(env, OracleAgent.for_env(env, script="reader"), seed=s) for s in range(12)]
        for a, b in zip(facts, reader):
            assert [i.response_text for i in a.invocations] == [i.response_text for i in b.invocations]
            assert a.reward == b.reward == 1.0


def test_the_reader_oracle_keeps_a_wrong_memory_until_the_fact_comes_again():
    """After a distractor, the facts script empties the memory (it knows the sentence is wrong: privileged);
    the reader keeps it, answers from it while it is all it has, and takes the fact when read."""
    kw = {"num_chunks": 6, "chunk_size": 48, "memory_budget": 16, "numbering": "random"}
    env = wrapped("distractor@0", **kw)
    source = env.unwrapped.source
    both = zip(oracle_episodes(env, 24), [run_episode(env, OracleAgent.for_env(env, script="reader"), seed=s)
                                          for s in range(24)])
    recovered = 0
    for facts, reader in both:
        (p,) = reader.perturbations
        fact = source[source.index_of(reader.sample_id)].supporting_facts[0]
        wrote = [i.response_text for i in reader.invocations[:-1]]
        if fact["chunk"] == 0:  # the fact was overwritten and never comes again: both answer wrong
            assert wrote[1:] == [p.replacement] * 5 and reader.prediction == p.replacement.split()[1]
            assert facts.prediction == "" and reader.reward == facts.reward == 0.0
            continue
        recovered += 1
        at = fact["chunk"]
        assert wrote[1:at] == [p.replacement] * (at - 1) and wrote[at:] == [fact["text"]] * (6 - at)
        assert [i.response_text for i in facts.invocations[1:at]] == [""] * (at - 1)
        assert reader.reward == facts.reward == 1.0
    assert recovered >= 8


def test_an_unknown_oracle_script_is_refused():
    with pytest.raises(ValueError, match="script='notes' is not one of"):
        OracleAgent.for_env(gym.make("memgym/LongQA-v0"), script="notes")


def test_the_reader_script_reads_its_answer_from_the_frames_fillers():
    from memgym.oracle import ReaderScript

    s = ReaderScript(["karl new york ."], "new york")
    assert s.update("", "karl boston town . karl new york .") == ["karl new york ."]
    assert s.update("karl boston town .", "nothing here .") == ["karl boston town ."]
    assert s.answer("karl boston town .") == "boston town" and s.answer("ann new york .") == ""
    assert s.missing("karl boston town .") == ["karl new york ."] and s.missing("karl new york .") == []
    two = ReaderScript(["ann boss karl .", "karl acme ."], "acme")  # a bridge fact has no blank
    assert two.update("karl initech .", "ann boss karl .") == ["karl initech .", "ann boss karl ."]
    assert two.answer("karl initech . ann boss karl .") == "initech" and two.answer("karl initech .") == ""


def test_an_unperturbed_run_is_unchanged_by_the_wrapper(tiny, backend):
    from agents.backends.base import SamplingParams
    from agents.memagent import MemAgent

    def run(envs):
        agent = MemAgent(backend, SamplingParams(temperature=1.0, max_new_tokens=8, seed=3))
        return [e.to_dict() for e in rollout(envs, agent, 6, seed=11)]

    _, tokenizer = tiny
    plain = [gym.make("memgym/LongQA-v0", split="test", tokenizer=tokenizer, num_chunks=3) for _ in range(3)]
    never = [MemoryPerturbation(gym.make("memgym/LongQA-v0", split="test", tokenizer=tokenizer, num_chunks=3),
                                "drop@50") for _ in range(3)]  # past the last chunk: it never fires
    a, b = run(plain), run(never)
    for x in a + b:
        x.pop("episode_id")
        for inv in x["invocations"]:
            inv["timing"] = {}
            inv["meta"].pop("episode_id", None)
    assert a == b


def test_a_model_agent_reads_the_replaced_memory(tiny, backend):
    from agents.backends.base import SamplingParams
    from agents.memagent import MemAgent

    _, tokenizer = tiny
    env = MemoryPerturbation(gym.make("memgym/LongQA-v0", split="test", tokenizer=tokenizer, num_chunks=3),
                             "distractor@0")
    ep = run_episode(env, MemAgent(backend, SamplingParams(greedy=True, max_new_tokens=6)), seed=0)
    (p,) = ep.perturbations
    second = ep.invocations[1]
    assert tokenizer.decode(second.prompt_ids[slice(*second.spans["memory"])]).strip() == p.replacement
    assert p.replacement and p.original != p.replacement
    again = Episode.from_json(ep.to_json())  # the typed field survives the file format
    assert again.perturbations == ep.perturbations


def test_eval_reports_recovery_and_the_viewer_shows_it(tmp_path, capsys):
    from memopd.eval import evaluate
    from memopd.view import load_source, render_html

    summary = evaluate(["--env", "memgym/Counting-v0", "--env-kwarg", "keys=1", "--agent", "oracle", "--episodes",
                        "16", "--out", str(tmp_path), "--no-progress", "--memory-perturbation", "drop@0"])
    r = summary["memory_perturbation"]
    assert r["spec"] == "drop@0" and r["perturbed"] + r["unperturbed"] == 16 and r["perturbed"] > 0
    assert r["perturbed"] == r["fact_read_again"] + r["fact_not_read_again"]
    # One count (keys=1): a lost count is not recovered by reading later statements; an untouched
    # episode is solved.
    assert r["f1_perturbed"] == 0.0 and r["f1_unperturbed"] == 1.0
    out = capsys.readouterr().out
    assert "F1 recovery (fact read again)" in out and "F1 unperturbed" in out
    assert json.loads((tmp_path / "summary.json").read_text())["memory_perturbation"] == r
    html = render_html(load_source(tmp_path))
    assert "drop after chunk 0" in html and "memory perturbed" in html


def test_a_bad_spec_is_one_error_line(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "memopd.eval", "--agent", "oracle", "--memory-perturbation",
                          "swap@1", "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("error: --memory-perturbation")
    assert "Traceback" not in out.stderr


def test_train_perturbs_its_rollouts_and_records_it(tmp_path):
    from agents.records import load_episodes
    from memopd import train

    run = tmp_path / "run"
    assert train.main(["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=2", "--questions-per-step", "2",
                       "--group-size", "2", "--max-new-tokens", "6", "--eval-episodes", "2", "--eval-every", "0",
                       "--student-warmup-steps", "0", "--teacher", "tiny-teacher", "--no-progress", "--threads", "1",
                       "--steps", "1", "--sample-episodes", "4", "--audit-every", "0", "--run-dir", str(run),
                       "--memory-perturbation", "distractor@0"]) == 0
    eps = load_episodes(run / "episodes" / "step-000001.jsonl").episodes
    assert len(eps) == 4 and all(e.perturbations and e.perturbations[0].after_chunk == 0 for e in eps)
    assert 'memory_perturbation = "distractor@0"' in (run / "config.toml").read_text()
    assert train.main(["--memory-perturbation", "swap", "--run-dir", str(tmp_path / "bad")]) == 2
