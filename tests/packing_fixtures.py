"""Tiny real transformers models and episodes sampled from them token by token.

Shared by the packing / scoring / audit / alignment tests. Sampling here is an independent
computation: plain full-sequence forwards (no cache, no packing), one token at a time.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from agents.records import Episode, Invocation

VOCAB = 200
MEM, CHUNK, ASK = 1, 2, 3  # marker tokens of the synthetic prompt template


def tiny_model(arch: str = "qwen2", *, seed: int = 0, attn: str = "sdpa", vocab: int = VOCAB) -> torch.nn.Module:
    """hidden 64, 2 layers, 4 heads, 2 KV heads (grouped-query attention), fp32, fixed seed.
    A larger init range than the default makes outputs depend strongly on context."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  initializer_range=0.1, attn_implementation=attn, tie_word_embeddings=False)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(arch)
    return model.eval()


@torch.no_grad()
def sample_response(model, prompt: list[int], positions: list[int], n: int, temperature: float,
                    gen: torch.Generator) -> tuple[list[int], list[float]]:
    """Sample n tokens one by one; returns the tokens and log p under softmax(logits / T)."""
    ids, pos = list(prompt), list(positions)
    out, lps = [], []
    for _ in range(n):
        logits = model(torch.tensor([ids]), position_ids=torch.tensor([pos]), use_cache=False).logits[0, -1]
        logp = torch.log_softmax(logits.double() / temperature, -1)
        tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
        out.append(tok)
        lps.append(min(0.0, float(logp[tok])))
        ids.append(tok)
        pos.append(pos[-1] + 1)
    return out, lps


def sample_episode(model, *, turns: int, seed: int, prefix_len: int = 10, pos0: int = 0,
                   chunk_len: tuple[int, int] = (5, 14), resp_len: tuple[int, int] = (3, 7),
                   temperature: float = 1.0, sample_seed: int | None = None) -> Episode:
    """An episode of ``turns`` memory writes and a final answer. Each call's prompt is
    ``q + [MEM] + m_{t-1} + [CHUNK] + x_t`` (the answer call: ``q + [MEM] + m + [ASK]``), the
    memory m_t is the previous call's sampled response; positions start at ``pos0``. Lengths and
    chunk tokens come from one generator, sampling from another, so the layout does not depend
    on the model. Episodes of one ``seed`` and different ``sample_seed`` are samples of one
    question: the same question and chunks, their own responses (and so memories)."""
    g = torch.Generator().manual_seed(seed)
    g_sample = torch.Generator().manual_seed(seed + 10_000 if sample_seed is None else sample_seed)
    rnd = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    toks = lambda n: torch.randint(10, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    q = toks(prefix_len)
    memory: list[int] = []
    invs = []
    for t in range(turns + 1):
        answer = t == turns
        private = [MEM] + memory + ([ASK] if answer else [CHUNK] + toks(rnd(*chunk_len)))
        prompt = q + private
        positions = list(range(pos0, pos0 + len(prompt)))
        resp, lps = sample_response(model, prompt, positions, rnd(*resp_len), temperature, g_sample)
        invs.append(Invocation(
            prompt_ids=prompt, response_ids=resp, logprobs=lps,
            position_ids=positions + list(range(positions[-1] + 1, positions[-1] + 1 + len(resp))),
            prefix_len=len(q), role="answer" if answer else "memory", turn=t,
            sampling={"temperature": temperature},
            spans={"memory": [len(q) + 1, len(q) + 1 + len(memory)]}))
        memory = resp
    return Episode(episode_id=f"ep{seed}-{sample_seed}", task_id="synthetic", sample_id=str(seed),
                   invocations=invs)


def single_call_episode(model, *, seed: int, length: int, pos0: int, resp: int = 4) -> Episode:
    """One call without a shared prefix (prefix_len 0) whose positions start at ``pos0``."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(10, VOCAB, (length,), generator=g).tolist()
    positions = list(range(pos0, pos0 + length))
    out, lps = sample_response(model, prompt, positions, resp, 1.0, g)
    inv = Invocation(prompt_ids=prompt, response_ids=out, logprobs=lps,
                     position_ids=list(range(pos0, pos0 + length + resp)), prefix_len=0, spans={})
    return Episode(episode_id=f"single{seed}", task_id="synthetic", sample_id=str(seed), invocations=[inv])


@torch.no_grad()
def alone_logits(model, inv: Invocation) -> torch.Tensor:
    """[n_response, V] raw logits predicting each sampled token, running the call alone."""
    ids = torch.tensor([inv.input_ids])
    pos = torch.tensor([inv.position_ids])
    logits = model(ids, position_ids=pos, use_cache=False).logits[0]
    return logits[inv.prompt_len - 1: inv.total_len - 1]


def save_model_dir(model, path) -> None:
    """Save a tiny model with a word-level tokenizer over its vocabulary (``t0 .. t{V-1}``), so
    ``agents.models.load(path)`` can load it like any local model directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t1").save_pretrained(path)
    model.save_pretrained(path)


def hard_case_episodes(model) -> list[Episode]:
    """Episodes whose packing at a budget of 80 tokens has every hard case (see the RCE tests):
    three 4-call episodes with a 10-token prefix (one starting at position 7), and two single
    calls without a prefix where the second's positions (24..) continue the first's (0..23)."""
    eps = [sample_episode(model, turns=3, seed=s, pos0=7 if s == 1 else 0) for s in range(3)]
    eps.append(single_call_episode(model, seed=9, length=20, pos0=0))
    eps.append(single_call_episode(model, seed=10, length=15, pos0=24))
    return eps


HARD_CASE_BUDGET = 80


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread; several threads on a busy 2-core CI box spin."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
