"""Packed scoring is exact on every architecture it accepts, and refuses the rest up front.

Each family is built tiny from its transformers config (random weights, fp32, eager attention)
with the features that make packed scoring hard: logit scaling (Granite, Cohere), final and
attention soft-capping (Gemma 2), qk-norm (Qwen3, OLMo2, Cohere), partial rotary (Phi3,
StableLM), sliding windows on every layer (Mistral, Phi3) or on some (Qwen2, Gemma 2), a model
that does not pass kwargs to its attention (StableLM) and a hybrid state-space model (Falcon-H1).
Episodes are sampled token by token from the model's own forward. The reference is that forward
again: ``model(prompt + response, position_ids).logits`` of each call alone — never the packer's
own head or masks. For every lowering, scoring is either within 1e-4 of it (full-vocabulary
log-probs) or refused with a message that says why. Never silent.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from memopd.attention import UnsupportedLoweringError, layer_windows, resolve_lowering
from memopd.audit import alone_logprobs, rce_audit
from memopd.heads import UnsupportedModelError
from memopd.packing import pack_episodes
from memopd.scoring import score
from packing_fixtures import one_thread, sample_episode  # noqa: F401

TOL = 1e-4
WINDOW = 8  # shorter than most calls of the sampled episodes (10-token prefix + chunk + memory)
LOWERINGS = ("blocks", "sdpa", "eager")
COMMON = dict(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False)

# family -> (config class, model class, extra config, lowerings expected to be refused)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, ()),
    "qwen2-sliding-layers": ("Qwen2Config", "Qwen2ForCausalLM",
                             dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), ()),
    "qwen3-qk-norm": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8), ()),
    "granite-logits-scaling": ("GraniteConfig", "GraniteForCausalLM",
                               dict(logits_scaling=8.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                                    attention_multiplier=0.3), ()),
    "cohere-logit-scale": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.25, use_qk_norm=True), ()),
    "gemma2-softcap-sliding": ("Gemma2Config", "Gemma2ForCausalLM",
                               dict(head_dim=8, final_logit_softcapping=5.0, attn_logit_softcapping=3.0,
                                    sliding_window=WINDOW, query_pre_attn_scalar=8), ("blocks", "sdpa")),
    "mistral-sliding": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW), ()),
    "mistral-default-window": ("MistralConfig", "MistralForCausalLM", {}, ()),
    "phi3-partial-rotary-sliding": ("Phi3Config", "Phi3ForCausalLM",
                                    dict(sliding_window=WINDOW, partial_rotary_factor=0.5, pad_token_id=0), ()),
    "olmo2-qk-norm": ("Olmo2Config", "Olmo2ForCausalLM", dict(pad_token_id=0), ()),
    "stablelm-partial-rotary": ("StableLmConfig", "StableLmForCausalLM", dict(partial_rotary_factor=0.25),
                                ("blocks",)),
}


def build(family: str) -> torch.nn.Module:
    cfg_name, model_name, extra, _ = FAMILIES[family]
    torch.manual_seed(0)
    cfg = getattr(tf, cfg_name)(**{**COMMON, **extra})
    cfg._attn_implementation = "eager"
    return getattr(tf, model_name)(cfg).eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    model = build(request.param)
    episodes = [sample_episode(model, turns=2, seed=s, pos0=3 * s) for s in range(3)]
    batch = pack_episodes(episodes, 96)  # several episodes per row, and an episode split across rows
    ref = torch.cat([alone_logprobs(model, ep.invocations[j])[k][None] for e, j, k in batch.token_map.tolist()
                     for ep in [episodes[e]]])
    return request.param, model, episodes, batch, ref


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_exact_or_refused_up_front(family, lowering):
    name, model, _, batch, ref = family
    refused = FAMILIES[name][3]
    if lowering in refused:
        with pytest.raises(UnsupportedLoweringError) as exc:
            score(model, batch, lowering=lowering)
        assert type(model).__name__ in str(exc.value) and "use" in str(exc.value), str(exc.value)
        return
    scores = score(model, batch, lowering=lowering, apply_temperature=False, full_logdist=True)
    diff = (scores.logdist - ref).abs().max().item()
    assert diff <= TOL, f"{name} / {lowering}: max |log p_packed - log p_own_forward| = {diff:.3g}"
    # the recorded sampling log-probs (from the same forward, one token at a time) agree too
    assert (scores.logprobs.double() - batch.old_logprobs.double()).abs().max().item() <= TOL


def test_automatic_lowering_is_exact(family):
    name, model, episodes, batch, _ = family
    lowering = resolve_lowering(model, "cpu", None, batch)
    assert lowering not in FAMILIES[name][3]
    audit = rce_audit(model, episodes, max_tokens=96)["aligned"]
    assert audit.passed and audit.lowering == lowering, audit


def test_windows_are_read_from_the_config():
    assert layer_windows(build("mistral-sliding")) == [WINDOW, WINDOW]
    assert layer_windows(build("qwen2-sliding-layers")) == [None, WINDOW]
    assert layer_windows(build("gemma2-softcap-sliding")) == [WINDOW, None]
    assert layer_windows(build("llama")) == [None, None]
    assert layer_windows(build("mistral-default-window")) == [4096, 4096]


def test_a_window_longer_than_every_call_is_not_refused():
    model = build("mistral-default-window")
    eps = [sample_episode(model, turns=1, seed=0)]
    for lowering in LOWERINGS:
        assert resolve_lowering(model, "cpu", lowering, pack_episodes(eps, 512)) == lowering


def test_a_hybrid_state_space_model_is_refused_with_the_reason():
    torch.manual_seed(0)
    cfg = tf.FalconH1Config(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8,
                            mamba_chunk_size=8, initializer_range=0.1)
    cfg._attn_implementation = "eager"
    model = tf.FalconH1ForCausalLM(cfg).eval()
    eps = [sample_episode(model, turns=1, seed=0)]
    with pytest.raises((UnsupportedLoweringError, UnsupportedModelError)) as exc:
        score(model, pack_episodes(eps, 512))
    assert "FalconH1" in str(exc.value)


def test_the_audit_catches_a_wrong_output_head(monkeypatch):
    """The audit's reference is the model's own forward, so a head that forgets Granite's logit
    scaling fails it (the old audit pushed both sides through the packer's head and passed)."""
    import memopd.scoring as scoring
    from memopd.heads import OutputHead

    model = build("granite-logits-scaling")
    eps = [sample_episode(model, turns=2, seed=0)]
    assert rce_audit(model, eps)["aligned"].passed
    monkeypatch.setattr(scoring, "output_head", lambda m: OutputHead(m.get_output_embeddings()))
    res = rce_audit(model, eps)["aligned"]
    assert not res.passed and res.max_abs_diff > 0.1


def test_an_unknown_post_head_step_is_refused():
    """A model whose forward does something after the decoder that its config does not declare."""

    class Shifted(tf.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 3.0
            return out

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(**COMMON)
    model = Shifted(cfg).eval()
    eps = [sample_episode(tf.LlamaForCausalLM(cfg).eval(), turns=1, seed=0)]
    with pytest.raises(UnsupportedModelError, match="does not reproduce"):
        score(model, pack_episodes(eps, 512))
