"""memopd.sft --context: the NLL of a persistent-transcript (or both) SFT equals the model's own
forward over each episode's flattened transcript, computed here without the packer; a teacher can
be fine-tuned on both kinds of state (the fair matched control of the reproduction)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agents import models
from memopd import sft
from memopd.contexts import observation_ids


@pytest.fixture(scope="module")
def setup():
    model, tok = models.load("tiny-teacher")
    eps = sft.oracle_episodes("memgym/LongQA-v0", {"num_chunks": 3}, tok, 3, seed=4, progress=False)
    return model.eval(), eps


def own_forward_nll(model, eps, context):
    """Mean NLL of every action token, each episode run alone by the model's own forward: its
    transcript q, o_1, a_1, ... (persistent) or each call's prompt + response (aligned)."""
    total, n = 0.0, 0
    for ep in eps:
        invs = ep.invocations
        if context == "aligned":
            seqs = [(inv.input_ids, inv.position_ids, inv.prompt_len, inv.response_ids) for inv in invs]
        else:
            ids = list(invs[0].prompt_ids[:invs[0].prefix_len])
            targets = []
            for inv in invs:
                ids += observation_ids(inv, "t")[0]
                targets.append((len(ids), list(inv.response_ids)))
                ids += list(inv.response_ids)
            pos = list(range(invs[0].position_ids[0], invs[0].position_ids[0] + len(ids)))
            seqs = [(ids, pos, start, resp) for start, resp in targets]
        for ids, pos, start, resp in seqs:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos])).logits[0]
            logp = F.log_softmax(logits[start - 1: start - 1 + len(resp)].float(), -1)
            total -= float(logp.gather(-1, torch.tensor(resp)[:, None]).sum())
            n += len(resp)
    return total / n


@pytest.mark.parametrize("context", ["aligned", "persistent", "both"])
def test_the_loss_is_the_own_forward_nll(setup, context):
    model, eps = setup
    with torch.no_grad():
        loss, _ = sft.nll_loss(model, eps, 256, context=context)
    if context == "both":
        want = (own_forward_nll(model, eps, "aligned") + own_forward_nll(model, eps, "persistent")) / 2
    else:
        want = own_forward_nll(model, eps, context)
    assert float(loss) == pytest.approx(want, rel=1e-5)
    if context == "persistent":  # other states: the transcript's loss is not the aligned one
        assert abs(want - own_forward_nll(model, eps, "aligned")) > 1e-3


def test_the_cli_takes_the_context(tmp_path):
    out = tmp_path / "m"
    assert sft.main(["--model", "tiny", "--env-kwarg", "num_chunks=2", "--num-episodes", "4", "--steps", "1",
                     "--batch-episodes", "2", "--no-progress", "--threads", "1", "--context", "both",
                     "--out", str(out)]) == 0
    assert '"context": "both"' in (out / "sft_config.json").read_text()
