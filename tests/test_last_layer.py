"""The last decoder layer run on the gather positions alone (memopd.last_layer) gives the same
hidden states and gradients as the whole layer, and a model it does not reproduce runs whole.

The reference for values is the model's own forward of each call alone (test_architectures and
test_attention_rce check every lowering that way, with this path on); here each supported family
also compares the two packed paths' hidden states and parameter gradients directly.
"""

from __future__ import annotations

import pytest
import torch

from memopd import attention, last_layer
from memopd.audit import alone_logprobs
from memopd.packing import pack_episodes
from memopd.scoring import score
from packing_fixtures import one_thread, sample_episode  # noqa: F401
from test_architectures import FAMILIES, build

GATHERED = ["llama", "qwen2-sliding-layers", "qwen3-qk-norm", "mistral-sliding"]


def episodes(model, n=3):
    # a question's samples (a shared prefix and first prompt) and another question
    eps = [sample_episode(model, turns=2, seed=0, sample_seed=s) for s in range(n - 1)]
    return eps + [sample_episode(model, turns=2, seed=7, pos0=5)]


@pytest.mark.parametrize("family", GATHERED)
def test_gathered_last_layer_equals_the_whole_layer(family):
    model = build(family)
    eps = episodes(model)
    batch = pack_episodes(eps, 96)
    assert last_layer.supported(attention.base_model(model))
    ref = torch.cat([alone_logprobs(model, eps[e].invocations[j])[k][None] for e, j, k in batch.token_map.tolist()])
    got = score(model, batch, lowering="blocks", apply_temperature=False, full_logdist=True).logdist
    assert attention._GATHERED[model] is True, "the probe found the gathered layer exact and switched it on"
    assert (got - ref).abs().max().item() <= 1e-4

    windows = attention.effective_windows(model, batch)
    model.train()
    grads = []
    for gathered in (False, True):
        model.zero_grad()
        h = attention._packed_hidden(model, batch, "blocks", windows, gathered=gathered)
        (h.double().pow(2).sum() + h[::3].sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        grads[-1]["h"] = h.detach()
    model.eval()
    whole, part = grads
    assert whole.keys() == part.keys()
    for name in whole:
        scale = 1.0 + whole[name].abs().max().item()
        assert (whole[name] - part[name]).abs().max().item() <= 1e-5 * scale, name


@pytest.mark.parametrize("family", ["phi3-partial-rotary-sliding", "olmo2-qk-norm", "gemma2-softcap-sliding"])
def test_other_layers_run_whole(family):
    model = build(family)
    assert not last_layer.supported(attention.base_model(model))


def test_a_layer_that_does_not_match_is_switched_off(monkeypatch):
    """A model whose last layer the hand-written path gets wrong (here: a constant added after
    everything the path knows) is found by the probe and scored with the whole layer."""
    model = build("llama")
    layer = model.model.layers[-1]
    forward = type(layer).forward

    def different(self, *args, **kwargs):  # the whole layer, then a step the gathered path does not take
        return forward(self, *args, **kwargs) + 0.5

    monkeypatch.setattr(type(layer), "forward", different)
    eps = episodes(model)
    batch = pack_episodes(eps, 96)
    ref = torch.cat([alone_logprobs(model, eps[e].invocations[j])[k][None] for e, j, k in batch.token_map.tolist()])
    got = score(model, batch, lowering="blocks", apply_temperature=False, full_logdist=True).logdist
    assert attention._GATHERED[model] is False
    assert (got - ref).abs().max().item() <= 1e-4

