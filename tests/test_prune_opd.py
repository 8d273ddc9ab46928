"""Prune-OPD (``--prune-opd``, :mod:`memopd.plugins.prune_opd`): the window's expansion and shrinking,
the hits and reliable calls, the student's top-k recorded at sampling equal to the model's own
forward, and the trainer's weights and window against hand computations from independent
forwards of the student and the teacher on each call alone."""

from __future__ import annotations

import json

import pytest
import torch

from agents import HFBackend, SamplingParams
from agents.backends.base import GenerationRequest
from memopd import train
from memopd.plugins.prune_opd import Window, is_hit, reliable_calls

FAST = ["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=3", "--questions-per-step", "2", "--group-size",
        "2", "--max-new-tokens", "6", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--teacher", "tiny-teacher", "--no-progress", "--pack-tokens", "1024", "--threads", "1", "--ppo-epochs", "1",
        "--prune-opd"]


def _trainer(run_dir, *extra):
    cfg = train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(run_dir), *extra], "t", "")
    return train.Trainer(train.prepare(cfg), log=lambda m: None)


def test_the_window_grows_on_enough_hits_and_shrinks_after_patience_misses():
    w = Window(start=3, least=1, most=6, step=1, margin=1, hit_ratio=0.25, patience=2)
    assert w.bound() == 2 and w.limit() == 3
    w.update(hits=1, episodes=4)  # 0.25 >= 0.25: grow
    assert w.size == 4 and w.misses == 0
    w.update(hits=0, episodes=4)  # a miss
    assert w.size == 4 and w.misses == 1
    w.update(hits=3, episodes=4)  # a hit ratio resets the misses
    assert w.size == 5 and w.misses == 0
    w.update(hits=0, episodes=4)
    w.update(hits=0, episodes=4)  # the second miss in a row: shrink
    assert w.size == 4 and w.misses == 0
    for _ in range(5):
        w.update(hits=4, episodes=4)
    assert w.size == 6  # never above the most
    for _ in range(20):
        w.update(hits=0, episodes=4)
    assert w.size == 1 and w.bound() == 1  # never below the least
    # no --prune-window-max: up to the longest episode seen, where the rollouts are no longer cut
    open_top = Window(start=2, least=1, most=0, step=1, margin=1, hit_ratio=0.1, patience=3)
    open_top.update(hits=4, episodes=4, longest=0)  # every episode cut: no top known yet, it grows
    assert open_top.size == 3 and open_top.limit() == 3
    open_top.update(hits=4, episodes=4, longest=4)
    assert open_top.size == 4 and open_top.limit() is None
    open_top.update(hits=4, episodes=4, longest=4)
    assert open_top.size == 4
    again = Window(start=2, least=1, most=0, step=1, margin=1, hit_ratio=0.1, patience=3)
    again.load_state_dict(open_top.state_dict())
    assert again.size == 4 and again.limit() is None


def test_reliable_calls_end_at_the_first_call_with_a_zero_reliability_and_hits_need_the_bound():
    # episode 0: calls of 2, 2 and 1 tokens, reliability 0 from call 1's second token; episode 1: never 0
    tm = torch.tensor([[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1], [0, 2, 0], [1, 0, 0], [1, 1, 0]])
    w = torch.tensor([1.0, 0.5, 0.5, 0.0, 0.0, 0.9, 0.8])
    assert reliable_calls(w, tm, 2, [3, 2]) == [1, 2]
    assert is_hit(reliable=3, calls=3, answered=False, bound=3)  # cut at the window, reliable to its bound
    assert not is_hit(reliable=1, calls=3, answered=False, bound=2)
    assert not is_hit(reliable=2, calls=2, answered=True, bound=3)  # answered before the bound: no hit
    assert is_hit(reliable=4, calls=4, answered=True, bound=3)


def test_the_recorded_top_k_is_the_sampling_distributions_own(tiny):
    model, tok = tiny
    backend = HFBackend(model, tok, seed=0)
    backend.record_topk = 5
    prompts = [tok("alice works at acme . where does alice work ?")["input_ids"], tok("bob")["input_ids"]]
    reqs = [GenerationRequest(prompt_ids=list(p), prefix_len=0) for p in prompts]
    for sp in (SamplingParams(temperature=0.7, max_new_tokens=4), SamplingParams(greedy=True, max_new_tokens=4)):
        for inv in backend.generate(reqs, sp):
            with torch.no_grad():  # the model's own forward of prompt + response, alone
                logits = model(input_ids=torch.tensor([inv.input_ids])).logits[0].float()
            n = len(inv.prompt_ids)
            for t in range(len(inv.response_ids)):
                lp = torch.log_softmax(logits[n + t - 1] / (1.0 if sp.greedy else sp.temperature), -1)
                vals, idx = lp.topk(5)
                assert inv.topk_ids[t] == idx.tolist()
                assert inv.topk_logprobs[t] == pytest.approx(vals.tolist(), abs=1e-4)
                assert inv.response_ids[t] in inv.topk_ids[t] or not sp.greedy
    backend.record_topk = 0
    assert all(inv.topk_ids is None for inv in backend.generate(reqs, SamplingParams(max_new_tokens=2)))


def _top(model, inv, k):
    """The model's own top-k at each of a call's response tokens (its plain forward, the call alone)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([inv.input_ids])).logits[0].float()
    n = len(inv.prompt_ids)
    return [logits[n + t - 1].topk(k).indices.tolist() for t in range(len(inv.response_ids))]


def test_the_trainers_weights_lower_the_drifted_tokens_loss_as_computed_by_hand(tmp_path):
    """Untrained student and teacher: their top-16 sets barely meet, so most tokens are drift
    events at threshold 0.7. The distillation loss is checked against the per-token divergences
    the run wrote, weighted by hand from overlaps of independent forwards of each call alone, and
    divided by the supervised tokens' count (not by the weights' sum)."""
    trainer = _trainer(tmp_path / "run", "--prune-drop", "0.25", "--prune-floor", "0.5", "--prune-format-prob", "0",
                       "--prune-window", "0", "--sample-episodes", "4", "--reward", "none")
    episodes = trainer.rollout()
    student, teacher = trainer.student, trainer.teacher.model
    weights, drifted = [], 0
    for e in episodes:
        events, low_any = 0, False
        for inv in e.invocations:
            for s, t in zip(_top(student, inv, 16), _top(teacher, inv, 16)):
                low = len(set(s) & set(t)) / 16 < 0.7
                events += low
                low_any |= low
                w = max(0.0, min(1.0, 1 - 0.25 * events))
                weights.append((w + 0.5) / 1.5)
        drifted += low_any
    metrics = trainer.learn(episodes)
    lines = (tmp_path / "run" / "episodes" / "step-000001.jsonl").read_text().splitlines()
    kls = [v for line in lines for inv in json.loads(line)["invocations"] for v in inv["meta"]["teacher_kl"]]
    assert len(kls) == len(weights) and all(v is not None for v in kls)
    assert metrics["prune/recorded_topk"] == 0.0  # trainer.rollout() records none: the forward fallback ran
    assert metrics["prune/drift_episodes"] == drifted / len(episodes) and drifted > 0
    assert min(weights) < 0.5  # the weights reached their floor's range
    want = sum(w * v for w, v in zip(weights, kls)) / len(kls)
    assert metrics["opd_loss"] == pytest.approx(want, rel=1e-5)
    self_normalised = sum(w * v for w, v in zip(weights, kls)) / sum(weights)
    assert abs(want - self_normalised) > 1e-3 * want  # what the loss was before: the weights divided out


def test_the_window_cuts_rollouts_records_top_k_and_grows_while_compatibility_holds(tmp_path):
    # threshold 0: no overlap is below it, so every episode is reliable throughout: each step a hit
    trainer = _trainer(tmp_path / "run", "--prune-threshold", "0", "--prune-window", "1")
    plugin = trainer.plugin("prune_opd")
    sizes, calls = [], []
    for step in range(4):
        trainer.step = step
        m = trainer.train_step()
        sizes.append(m["prune/window"])
        calls.append(m["calls_per_episode"])
        assert m["prune/recorded_topk"] == 1.0 and m["prune/hit_ratio"] == 1.0  # the rollout's own top-k
        assert all(i.topk_ids is not None and len(i.topk_ids[0]) == 16
                   for e in trainer.last_episodes for i in e.invocations)
    # cut at 1, 2, 3 calls, then the window covers the 4 turns (3 chunks and the answer): no cut
    assert sizes == [1.0, 2.0, 3.0, 4.0] and calls == [1.0, 2.0, 3.0, 4.0]
    assert plugin.window.size == 4 and plugin.window.limit() is None and m["prune/cut_episodes"] == 0.0
    assert m["f1"] == m["f1"]  # episodes reached their answer again
    trainer.save()
    resumed = _trainer(tmp_path / "other", "--prune-threshold", "0", "--prune-window", "1")
    resumed.run_dir = trainer.run_dir
    resumed.restore()
    assert resumed.plugin("prune_opd").window.state_dict() == plugin.window.state_dict()


def test_the_window_shrinks_when_every_episode_loses_its_reliability(tmp_path):
    # threshold 1 and drop 1: the first drift event zeroes an episode's reliability; patience 1
    trainer = _trainer(tmp_path / "run", "--prune-threshold", "1.0", "--prune-drop", "1.0", "--prune-window", "3",
                       "--prune-shrink-patience", "1", "--prune-format-prob", "0")
    m = trainer.train_step()
    assert m["calls_per_episode"] == 3.0 and m["prune/hit_ratio"] == 0.0 and trainer.plugin("prune_opd").window.size == 2


def test_bad_window_options_are_refused(tmp_path):
    with pytest.raises(train.ConfigError, match="prune-window-min"):
        train.cfgmod.parse_args(train.TrainConfig, FAST + ["--run-dir", str(tmp_path / "r"), "--prune-window", "1",
                                                           "--prune-window-min", "2"], "t", "")
