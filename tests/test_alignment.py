"""State-alignment check: with teacher = student, aligned scoring reproduces the recorded
log-probs at every turn (<= 1e-4 fp32); the persistent flattened history does not."""

import json

import pytest

from agents.records import save_episodes
from memopd.alignment import state_alignment
from packing_fixtures import one_thread, sample_episode, save_model_dir, tiny_model  # noqa: F401

TURNS = 8  # memory writes at turns 0..7, the answer at turn 8


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def setup(request):
    model = tiny_model(request.param, seed=3)
    eps = [sample_episode(model, turns=TURNS, seed=s, pos0=3 * s, resp_len=(2, 5)) for s in range(3)]
    return model, eps


def test_aligned_reproduces_recorded_logprobs_and_persistent_does_not(setup):
    model, eps = setup
    rep = state_alignment(model, eps, max_tokens=256)
    aligned = {t.turn: t for t in rep.turns["aligned"]}
    persistent = {t.turn: t for t in rep.turns["persistent"]}
    assert sorted(aligned) == list(range(TURNS + 1)) == sorted(persistent)
    for t in range(TURNS + 1):
        assert aligned[t].max_gap <= 1e-4, f"turn {t}: {aligned[t].max_gap}"
        assert aligned[t].tokens == persistent[t].tokens > 0
    # turn 0 has no history: both modes see the same state
    assert persistent[0].max_gap <= 1e-4
    # every context update after it moves the persistent state away from the sampled one
    for t in range(1, TURNS + 1):
        assert persistent[t].max_gap > 1e-2 and persistent[t].mean_gap > 1e-3, f"turn {t}"
    assert rep.aligned_ok
    table = rep.table().splitlines()
    assert len(table) == TURNS + 2 and "aligned max" in table[0] and "persistent mean" in table[0]


def test_alignment_cli(setup, tmp_path, capsys):
    pytest.importorskip("agents.models")
    from memopd.alignment import main

    model, eps = setup
    save_model_dir(model, tmp_path / "model")
    save_episodes(tmp_path / "eps.jsonl", eps)
    assert main([str(tmp_path / "eps.jsonl"), "--model", str(tmp_path / "model"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["aligned_ok"] and len(out["turns"]["aligned"]) == TURNS + 1
    assert max(t["max_gap"] for t in out["turns"]["persistent"]) > 1e-2


def test_teacher_shift_is_the_full_vocab_kl_between_the_two_contexts(setup):
    """A different model (the teacher) scores the student's episodes: its target distribution is
    the same in both modes at turn 0 and moves at every later turn. Checked against KL computed
    from the full log-distributions of :func:`score` in each mode."""
    import torch

    from memopd.alignment import teacher_shift
    from memopd.packing import pack_episodes
    from memopd.scoring import score

    _, eps = setup
    teacher = tiny_model("llama", seed=11)
    rows = {r.turn: r for r in teacher_shift(teacher, eps, max_tokens=256)}
    assert sorted(rows) == list(range(TURNS + 1))
    assert rows[0].max_gap <= 1e-5
    for t in range(1, TURNS + 1):
        assert rows[t].mean_gap > 1e-4 and rows[t].max_gap >= rows[t].mean_gap, f"turn {t}"

    dists = {}
    for mode in ("aligned", "persistent"):
        batch = pack_episodes(eps, 4096, mode=mode)
        with torch.no_grad():
            dists[mode] = score(teacher, batch, full_logdist=True).logdist.double()
    kl = (dists["aligned"].exp() * (dists["aligned"] - dists["persistent"])).sum(-1)
    turns = torch.tensor([eps[e].invocations[i].turn for e, i, _ in batch.token_map.tolist()])
    for t in range(TURNS + 1):
        assert abs(float(kl[turns == t].mean()) - rows[t].mean_gap) <= 1e-5


def test_greedy_records_are_rescored_at_temperature_one(tiny):
    """A greedy call records log-probs at T = 1 whatever temperature its settings carry; scoring
    must use T = 1 too (it used the settings' temperature: ~1 nat off at T = 0.5)."""
    import gymnasium as gym

    import memgym  # noqa: F401
    from agents import MemAgent
    from agents.backends import HFBackend, SamplingParams
    from agents.rollout import rollout
    from memopd.packing import pack_episodes

    model, tok = tiny
    envs = [gym.make("memgym/LongQA-v0", split="test", tokenizer=tok) for _ in range(2)]
    agent = MemAgent(HFBackend(model, tok), SamplingParams(temperature=0.5, greedy=True, max_new_tokens=8))
    eps = rollout(envs, agent, 2, seed=0, progress=False)
    assert all(inv.sampling["greedy"] and inv.sampling["temperature"] == 0.5 for e in eps for inv in e.invocations)
    assert (pack_episodes(eps).temperatures == 1.0).all()
    rep = state_alignment(model, eps, modes=("aligned",))
    assert rep.aligned_ok, rep.table()
