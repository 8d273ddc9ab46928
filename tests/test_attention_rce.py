"""Rollout Context Equivalence: packed execution == each invocation run alone (fp32 CPU).

Models are real tiny transformers (Qwen2 and Llama, grouped-query attention); episodes are
sampled from them token by token. The reference ("alone") logits come from plain full forwards
of each invocation, independent of the packing code.
"""

import json

import pytest
import torch
from transformers.masking_utils import find_packed_sequence_indices

from agents.records import save_episodes
from memopd.attention import (additive_mask, allowed_mask, base_model, choose_lowering, flash_layout,
                              packed_hidden_states)
from memopd.audit import RCEAuditHook, audit_episodes, rce_audit
from memopd.packing import pack_episodes
from packing_fixtures import (HARD_CASE_BUDGET, alone_logits, hard_case_episodes, one_thread, save_model_dir,  # noqa: F401
                              tiny_model)

TOL = 1e-4


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def setup(request):
    model = tiny_model(request.param)
    eps = hard_case_episodes(model)
    batch = pack_episodes(eps, HARD_CASE_BUDGET)
    ref = torch.stack([alone_logits(model, eps[e].invocations[j])[k] for e, j, k in batch.token_map.tolist()])
    return model, eps, batch, ref


def packed_logits(model, batch, lowering):
    with torch.no_grad():
        return model.get_output_embeddings()(packed_hidden_states(model, batch, lowering))


def test_batch_covers_the_hard_cases(setup):
    _, eps, batch, _ = setup
    rows_per_episode = {}
    for r, segs in enumerate(batch.segments):
        for s in segs:
            rows_per_episode.setdefault(s.episode, set()).add(r)
    assert any(len(rows) >= 2 for rows in rows_per_episode.values()), "an episode split across rows"
    assert any(len({s.episode for s in segs}) >= 2 for segs in batch.segments), "several episodes in a row"
    pos = batch.position_ids
    continuing = [
        (r, a, b) for r, segs in enumerate(batch.segments) for a, b in zip(segs, segs[1:])
        if b.prefix == -1 and not b.is_prefix and b.start == a.end and pos[r, b.start] == pos[r, a.end - 1] + 1]
    assert continuing, "a standalone block whose positions continue the previous block's"
    assert all(pos[r, b.start] > 0 for r, _, b in continuing), "...and so start above 0"
    assert any(s.is_prefix and pos[r, s.start] > 0 for r, segs in enumerate(batch.segments) for s in segs)


@pytest.mark.parametrize("lowering", ["sdpa", "eager", "blocks"])
def test_packed_logits_equal_alone(setup, lowering):
    model, eps, batch, ref = setup
    diff = (packed_logits(model, batch, lowering) - ref).abs().max().item()
    assert diff <= TOL, f"{lowering}: max |logit diff| {diff}"
    audit = rce_audit(model, eps, lowering=lowering, max_tokens=HARD_CASE_BUDGET)["aligned"]
    assert audit.passed and audit.max_abs_diff <= TOL and audit.num_actions == batch.num_actions


@pytest.mark.parametrize("lowering", ["sdpa", "eager", "blocks"])
def test_a_questions_samples_share_one_prefix_copy_and_stay_exact(lowering):
    """Four samples of one question (same question and chunks, own responses) and one other
    question: the four store their question once per row, and their identical first prompt
    once (each response attends to it), and every call's logits still equal its own forward
    alone."""
    from packing_fixtures import sample_episode

    model = tiny_model("qwen2")
    eps = [sample_episode(model, turns=3, seed=0, sample_seed=s) for s in range(4)]
    eps.append(sample_episode(model, turns=3, seed=5))
    batch = pack_episodes(eps, 160)
    apart = pack_episodes(eps, 160, across_episodes=False)
    prefixes = lambda b: sum(s.is_prefix for segs in b.segments for s in segs)  # noqa: E731
    assert prefixes(batch) < prefixes(apart) and batch.num_real_tokens < apart.num_real_tokens
    shared = [(p, {s.episode for s in segs if not s.is_prefix and s.prefix == p.block})
              for segs in batch.segments for p in segs if p.is_prefix]
    first = eps[0].invocations[0]
    lead = first.spans["memory"][0]  # the question and the template before the memory: 11 tokens
    assert any(len(eps_) >= 2 and p.end - p.start == lead for p, eps_ in shared), "the question, stored once"
    assert all(inv.prompt_ids == first.prompt_ids for e in eps[:4] for inv in e.invocations[:1])
    assert any(len(eps_) >= 2 and p.end - p.start == first.prompt_len for p, eps_ in shared), \
        "the first call's whole prompt, stored once for the samples"
    ref = torch.stack([alone_logits(model, eps[e].invocations[j])[k] for e, j, k in batch.token_map.tolist()])
    diff = (packed_logits(model, batch, lowering) - ref).abs().max().item()
    assert diff <= TOL, f"{lowering}: max |logit diff| {diff}"
    audit = rce_audit(model, eps, lowering=lowering, max_tokens=160)["aligned"]
    assert audit.passed and audit.num_actions == batch.num_actions


def test_persistent_context_gives_different_logits(setup):
    model, eps, _, _ = setup
    res = audit_episodes(model, eps, modes=("aligned", "persistent"))
    assert res["aligned"]["max_abs_diff"] <= TOL and res["aligned"]["passed"]
    assert res["persistent"]["max_abs_diff"] > 0.05 and not res["persistent"]["passed"]
    res = rce_audit(model, eps, modes=("aligned", "persistent"), lowering="eager")
    assert res["aligned"].max_abs_diff <= TOL
    assert res["persistent"].max_abs_diff > 0.05, "flattened history must change the logits"
    # a call with no earlier history sees the same state in both modes: its logits agree
    pers = pack_episodes(eps, 4096, mode="persistent")
    first = (pers.token_map[:, 1] == 0)
    ref = torch.stack([alone_logits(model, eps[e].invocations[j])[k] for e, j, k in pers.token_map.tolist()])
    diff = (packed_logits(model, pers, "sdpa") - ref).abs().amax(-1)
    assert diff[first].max() <= TOL and diff[~first].max() > 0.05


def test_boundaries_inferred_from_position_ids_would_fail(setup):
    model, eps, batch, ref = setup
    inferred = find_packed_sequence_indices(batch.position_ids)  # what transformers infers without a mask
    # the inferred segments disagree with the explicit ones: a shared prefix is cut off from all
    # but its first block, and blocks with continuing positions are merged
    for r, segs in enumerate(batch.segments):
        for s in segs:
            if not s.is_prefix and s.prefix >= 0 and s.start != segs[s.prefix].end:
                assert inferred[r, s.start] != inferred[r, segs[s.prefix].start]
            if not s.is_prefix and s.prefix == -1 and s.start > 0:
                prev = max((p for p in segs if p.end == s.start), key=lambda p: p.end)
                if batch.position_ids[r, s.start] == batch.position_ids[r, prev.end - 1] + 1:
                    assert inferred[r, s.start] == inferred[r, prev.end - 1]
    # and the logits are wrong: transformers' own position-id detection (no mask, no cache)
    with torch.no_grad():
        h = base_model(model)(input_ids=batch.input_ids, position_ids=batch.position_ids,
                              use_cache=False).last_hidden_state
        wrong = model.get_output_embeddings()(h[batch.action_rows, batch.action_cols])
    assert (wrong - ref).abs().max() > 0.05
    assert (packed_logits(model, batch, "sdpa") - ref).abs().max() <= TOL


def expected_visibility(batch):
    """The visibility rule written out as loops over the explicit segments."""
    R, L = batch.input_ids.shape
    out = torch.zeros(R, L, L, dtype=torch.bool)
    for r, segs in enumerate(batch.segments):
        used = segs[-1].end if segs else 0
        for s in segs:
            for i in range(s.start, s.end):
                out[r, i, s.start: i + 1] = True
                if s.prefix >= 0:
                    p = segs[s.prefix]
                    out[r, i, p.start: p.end] = True
        for i in range(used, L):
            out[r, i, i] = True
    return out


def test_mask_lowering_matches_the_rule(setup):
    _, _, batch, _ = setup
    assert torch.equal(allowed_mask(batch), expected_visibility(batch))
    m = additive_mask(batch, torch.float32)
    assert m.shape == (batch.num_rows, 1, batch.row_len, batch.row_len)
    assert set(m.unique().tolist()) == {0.0, torch.finfo(torch.float32).min}
    assert (m[:, 0] == 0).sum(-1).min() >= 1, "every row of the mask (padding too) sees something"


def test_flash_layout_duplicates_prefix_per_block(setup):
    """The flash-attn varlen layout, checked on CPU: every sequence is one invocation's full
    context, and causal attention within each sequence reproduces running it alone."""
    model, eps, batch, ref = setup
    lay = flash_layout(batch)
    seqs = [lay.input_ids[0, a:b].tolist() for a, b in zip(lay.cu_seqlens[:-1], lay.cu_seqlens[1:])]
    calls = [inv.input_ids for ep in eps for inv in ep.invocations]
    assert sorted(seqs) == sorted(calls)
    T = lay.input_ids.shape[1]
    seq_of = torch.repeat_interleave(torch.arange(len(seqs)), (lay.cu_seqlens[1:] - lay.cu_seqlens[:-1]).long())
    visible = (seq_of[:, None] == seq_of[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    mask = torch.zeros(1, 1, T, T).masked_fill(~visible, torch.finfo(torch.float32).min)
    with torch.no_grad():
        h = base_model(model)(input_ids=lay.input_ids, position_ids=lay.position_ids, attention_mask=mask,
                              use_cache=False).last_hidden_state[0, lay.action_index]
        logits = model.get_output_embeddings()(h)
    assert (logits - ref).abs().max() <= TOL


def test_choose_lowering():
    assert choose_lowering("cpu") == "blocks"
    assert choose_lowering("cpu", "eager") == "eager"
    with pytest.raises(ValueError, match="CUDA"):
        choose_lowering("cpu", "flex")
    with pytest.raises(ValueError, match="unknown attention lowering"):
        choose_lowering("cpu", "xformers")


def test_audit_hook_runs_every_n_steps(setup):
    model, eps, _, _ = setup
    hook = RCEAuditHook(every=2, max_episodes=2)
    model.train()
    try:
        assert hook(1, model, eps) is None
        res = hook(2, model, eps)
        assert res is not None and res.passed and res.num_episodes == 2
        assert model.training, "the hook restores the training mode"
        with pytest.warns(UserWarning, match="RCE audit failed"):
            assert not RCEAuditHook(every=1, tolerance=-1.0)(3, model, eps).passed
        with pytest.raises(RuntimeError, match="RCE audit failed"):
            RCEAuditHook(every=1, tolerance=-1.0, strict=True)(3, model, eps)
    finally:
        model.eval()


def test_audit_cli(setup, tmp_path, capsys):
    pytest.importorskip("agents.models")
    from memopd.audit import main

    model, eps, _, _ = setup
    save_model_dir(model, tmp_path / "model")
    save_episodes(tmp_path / "eps.jsonl", eps)
    rc = main([str(tmp_path / "eps.jsonl"), "--model", str(tmp_path / "model"), "--mode", "both", "--json",
               "--max-episodes", "3"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["aligned"]["max_abs_diff"] <= TOL and out["aligned"]["passed"]
    assert out["persistent"]["max_abs_diff"] > 0.05 and out["aligned"]["num_episodes"] == 3
    rc = main([str(tmp_path / "eps.jsonl"), "--model", str(tmp_path / "model"), "--mode", "aligned", "--attn", "eager"])
    text = capsys.readouterr().out
    assert rc == 0 and "aligned" in text and "PASS" in text


@pytest.mark.parametrize("cli", ["audit", "alignment"])
def test_learner_clis_fail_like_tools(setup, tmp_path, capsys, cli):
    """Bad input to the audit / alignment CLIs: ``error: <what, where, how>`` and exit 2, no traceback."""
    import importlib

    main = importlib.import_module(f"memopd.{cli}").main
    model, eps, _, _ = setup
    save_model_dir(model, tmp_path / "model")
    good = tmp_path / "eps.jsonl"
    save_episodes(good, eps)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "binary.jsonl").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "other.jsonl").write_text('{"id": "q1", "prediction": "Paris"}\n')
    small = tmp_path / "small"
    save_model_dir(tiny_model("qwen2", vocab=50), small)
    cases = [
        ([str(tmp_path / "missing.jsonl"), "--model", str(tmp_path / "model")], "missing.jsonl"),
        ([str(tmp_path / "empty.jsonl"), "--model", str(tmp_path / "model")], "no readable episodes"),
        ([str(tmp_path / "binary.jsonl"), "--model", str(tmp_path / "model")], "no readable episodes"),
        ([str(tmp_path / "other.jsonl"), "--model", str(tmp_path / "model")], "no readable episodes"),
        ([str(good), "--model", str(tmp_path / "no-such-model")], "no-such-model"),
        ([str(good), "--model", str(small)], "outside the vocabulary"),
        ([str(good), "--model", str(tmp_path / "model"), "--max-episodes", "0"], "--max-episodes"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "error: " in err and needle in err and "Traceback" not in err, (argv, err)


@pytest.mark.parametrize("lowering", ["blocks", "sdpa"])
def test_activation_checkpointing_gives_the_same_gradients(setup, lowering):
    """Checkpointed layers are recomputed in the backward, after the packed call switched its
    attention lowering off: they must recompute under the lowering of their forward."""
    import copy

    from memopd.attention import enable_activation_checkpointing

    model, _, batch, _ = setup

    def grads(m):
        m.train()
        m.zero_grad(set_to_none=True)
        packed_hidden_states(m, batch, lowering).square().mean().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    plain = copy.deepcopy(model)
    checkpointed = copy.deepcopy(model)
    enable_activation_checkpointing(checkpointed)
    want, got = grads(plain), grads(checkpointed)
    assert want.keys() == got.keys() and len(want) > 0
    assert max((want[n] - got[n]).abs().max().item() for n in want) < 1e-6
