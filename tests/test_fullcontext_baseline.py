"""The full-context baseline of the length axis: the ``tiny-long`` preset (16,384 positions), the
gold records that fine-tune it (FullContextOracle), and the recipe end to end at a small size."""

from __future__ import annotations

import json

import pytest

import memgym
from agents import models, presets
from agents.backends import HFBackend, SamplingParams
from agents.baselines import FullContextAgent, FullContextOracle
from agents.records import load_episodes
from agents.rollout import rollout
from memopd import sft
from memopd.eval import evaluate

KW = {"chunk_size": 48, "memory_budget": 16}


def test_tiny_long_is_tiny_teacher_with_more_positions(cache):
    long_model, long_tok = models.load("tiny-long", cache_dir=cache)
    teacher, teacher_tok = models.load("tiny-teacher", cache_dir=cache)
    assert long_model.config.max_position_embeddings == 16_384 == 4 * teacher.config.max_position_embeddings
    shape = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    assert [getattr(long_model.config, k) for k in shape] == [getattr(teacher.config, k) for k in shape]
    assert long_tok.get_vocab() == teacher_tok.get_vocab()  # the shared preset tokenizer
    fingerprint = presets.corpus_fingerprint()
    keys = {name: presets.preset_key(p, fingerprint) for name, p in presets.TINY_PRESETS.items()}
    assert len(set(keys.values())) == len(keys)  # a cache directory of its own


def test_the_whole_input_fits_where_tiny_cuts_it(cache):
    """An input of ~5,000 tokens: tiny-long's full-context agent reads all of it (its limit is the
    model's 16,384 positions, not the shared tokenizer's 4,096); tiny's keeps the last 4,096."""
    cuts, lengths = {}, {}
    for preset in ("tiny-long", "tiny"):
        model, tok = models.load(preset, cache_dir=cache)
        env = memgym.make("memgym/LongQA-v0", num_chunks=2, chunk_size=2500, tokenizer=tok)
        agent = FullContextAgent(HFBackend(model, tok), SamplingParams(greedy=True), answer_max_new_tokens=2)
        assert agent.context_length == model.config.max_position_embeddings
        inv = rollout([env], agent, 1, seed=0, progress=False)[0].invocations[0]
        cuts[preset], lengths[preset] = inv.meta["context_cut"], len(inv.prompt_ids)
    assert cuts["tiny-long"] == 0 and lengths["tiny-long"] > 4_500
    assert cuts["tiny"] > 0 and lengths["tiny"] + 2 == 4_096


def test_fullcontext_oracle_records_the_agents_prompt_with_the_gold_answer(cache):
    model, tok = models.load("tiny-long", cache_dir=cache)

    def env():
        return memgym.make("memgym/LongQA-v0", num_chunks=3, tokenizer=tok, **KW)

    gold = rollout([env()], FullContextOracle(env().unwrapped.source, tokenizer=tok), 3, seed=1, progress=False)
    agent = rollout([env()], FullContextAgent(HFBackend(model, tok), SamplingParams(greedy=True)), 3, seed=1,
                    progress=False)
    for g, a in zip(gold, agent):
        assert g.metrics["f1"] == 1.0 and g.agent == "fullcontext-oracle" and len(g.invocations) == 1
        inv = g.invocations[0]
        assert inv.prompt_ids == a.invocations[0].prompt_ids and inv.spans == a.invocations[0].spans
        assert inv.response_ids == tok(g.answers[0], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert inv.logprobs == [0.0] * len(inv.response_ids) and inv.meta["oracle"]


def test_the_recipe_at_a_small_size(tmp_path, cache, monkeypatch):
    """docs/agents.md's commands at a small size: gold records at the short length, fine-tuning,
    then a length sweep compared with a memory agent's; the pipeline, not the result."""
    monkeypatch.setenv("MEMOPD_CACHE", str(cache))
    env_flags = [f for k, v in KW.items() for f in ("--env-kwarg", f"{k}={v}")]
    evaluate(["--agent", "agents.baselines:FullContextOracle", "--model", "tiny-long", "--split", "train",
              "--episodes", "16", "--env-kwarg", "num_chunks=3", *env_flags, "--out", str(tmp_path / "gold"),
              "--no-progress"])
    assert len(load_episodes(tmp_path / "gold" / "episodes.jsonl").episodes) == 16
    assert sft.main(["--model", "tiny-long", "--episodes", str(tmp_path / "gold" / "episodes.jsonl"), "--steps", "3",
                     "--batch-episodes", "8", "--threads", "1", "--out", str(tmp_path / "reader"),
                     "--no-progress"]) == 0
    memory = evaluate(["--agent", "memagent", "--model", "tiny", "--episodes", "4", "--lengths", "3,12",
                       "--max-new-tokens", "4", *env_flags, "--out", str(tmp_path / "memagent"), "--no-progress"])
    full = evaluate(["--agent", "fullcontext", "--model", str(tmp_path / "reader"), "--episodes", "4", "--lengths",
                     "3,12", *env_flags, "--compare", str(tmp_path / "memagent"), "--out", str(tmp_path / "full"),
                     "--no-progress"])
    saved = json.loads((tmp_path / "full" / "sweep.json").read_text())
    assert [r["value"] for r in saved["rows"]] == [3, 12] == [r["value"] for r in memory["rows"]]
    assert saved["compared"][0]["policy"] == "memagent (tiny)" and full["policy"].startswith("fullcontext (")
    runs = [load_episodes(tmp_path / "full" / f"num_chunks-{n}" / "episodes.jsonl").episodes for n in (3, 12)]
    assert all(e.invocations[0].meta["context_cut"] == 0 for run in runs for e in run)  # all of it read
    assert max(len(e.invocations[0].prompt_ids) for e in runs[1]) > 2 * min(len(e.invocations[0].prompt_ids)
                                                                            for e in runs[0])
