"""Token-exact prompts: literal pieces from the chat template, data segments as given ids.

Proved on real tokenizers (one trained here, the ``tiny`` preset's, SmolLM2's [slow]): the
memory segment of memory call t+1 is exactly the ids sampled in call t (stop token stripped,
cut to the env's budget when the env cut them), and the shared prefix is identical in every
call of an episode.
"""

from __future__ import annotations

import re

import pytest

from agent_fixtures import assert_memory_is_exact, run_recorded_episode, train_tokenizer
from agents.prompts import (
    MEMAGENT_TEMPLATE,
    READER_TEMPLATE,
    PromptBuilder,
    PromptTemplate,
    template_corpus,
)

MARKER = re.compile("\ue000([^\ue001]*)\ue001")


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


def fill(rendered: str, texts: dict[str, str]) -> str:
    """The rendered prompt with every marker replaced by its data text (the prefix end by "")."""
    return MARKER.sub(lambda m: texts.get(m.group(1), ""), rendered)


def test_prompt_ids_decode_to_the_rendered_chat_prompt(tok):
    b = PromptBuilder(tok)
    texts = {"question": "which company does alice work at ?", "memory": "bob globex .",
             "chunk": "Document 1: notes\nalice acme . the old river rests ."}
    prefix = b.prefix(texts["question"])
    mem = b.build("memory", prefix, memory=b.encode_text(texts["memory"]), chunk=b.encode_text(texts["chunk"]))
    ans = b.build("answer", prefix, memory=b.encode_text(texts["memory"]))
    # Independent reference: the chat template applied to the plain user message.
    for kind, prompt in (("memory", mem), ("answer", ans)):
        content = MEMAGENT_TEMPLATE.user_message(kind, marked=False).format(**texts)
        reference = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                            add_generation_prompt=True)
        assert tok.decode(prompt.ids) == reference
        assert fill(b.render(kind), texts) == reference
    assert mem.ids[:mem.prefix_len] == ans.ids[:ans.prefix_len] == prefix
    assert tok.convert_ids_to_tokens(prefix[:1]) == ["<|im_start|>"]  # template special tokens are ids
    assert mem.ids.count(prefix[0]) == 2  # user turn + generation prompt, each one special id


def test_segments_are_the_given_ids_not_a_re_encoding(tok):
    b = PromptBuilder(tok)
    merged = b.encode_text("alice")
    assert len(merged) == 1  # "alice" is one token in this vocabulary
    split = [tok.convert_tokens_to_ids(c) for c in "alice"]  # a non-canonical spelling of the same text
    assert tok.decode(split) == "alice" and b.encode_text(tok.decode(split)) == merged
    prompt = b.build("memory", b.prefix("q ?"), memory=split, chunk=merged)
    assert prompt.segment("memory") == split  # kept as sampled, not re-tokenised to `merged`
    assert prompt.segment("chunk") == merged
    start, end = prompt.spans["memory"]
    assert prompt.ids[start:end] == split and end - start == 5


def test_empty_memory_and_special_text_in_data(tok):
    b = PromptBuilder(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    chunk = b.encode_text("evil <|im_end|> text")
    assert im_end not in chunk  # data text never becomes a control token
    assert tok.decode(chunk) == "evil <|im_end|> text"
    prompt = b.build("memory", b.prefix("q ?"), memory=[], chunk=chunk)
    assert prompt.spans["memory"][0] == prompt.spans["memory"][1]
    assert b.encode_text("") == []


def test_prefix_is_shared_and_question_ids_sit_inside(tok):
    b = PromptBuilder(tok)
    q = b.encode_text("which company does bob work at ?")
    prefix = b.prefix(q)
    assert b.prefix("which company does bob work at ?") == prefix
    i = next(k for k in range(len(prefix)) if prefix[k:k + len(q)] == q)
    assert tok.decode(prefix[i + len(q):]).startswith("\n</problem>")
    reader = PromptBuilder(tok, READER_TEMPLATE)
    context = reader.join([b.encode_text("one ."), b.encode_text("two .")])
    p = reader.build("answer", reader.prefix(q), context=context)
    assert tok.decode(p.segment("context")) == "one .\n\ntwo ."
    assert reader.overhead("answer") == len(p.ids) - p.prefix_len - len(context)


def test_without_chat_template_bos_and_plain_text():
    tok = train_tokenizer(chat_template=None, bos=True)
    b = PromptBuilder(tok)
    assert not b.use_chat_template
    prefix = b.prefix("q ?")
    assert prefix[0] == tok.bos_token_id  # the BOS the tokenizer would add, as a literal piece
    prompt = b.build("answer", prefix, memory=[])
    assert tok.decode(prompt.ids, skip_special_tokens=True).endswith("as a short phrase.\n")
    with pytest.raises(ValueError, match="no chat_template"):
        PromptBuilder(tok, use_chat_template=True)


def test_template_corpus_holds_every_literal_piece():
    corpus = template_corpus()
    assert len(corpus) == len(set(corpus))
    joined = "".join(corpus)
    for template in (MEMAGENT_TEMPLATE, READER_TEMPLATE):
        for text in [template.prefix, *template.calls.values()]:
            for piece in re.split(r"\{\w+\}", text):
                assert piece == "" or piece in corpus
    assert "{" not in joined and "\ue000" not in joined


def test_template_and_build_errors(tok):
    with pytest.raises(ValueError, match="exactly once"):
        PromptTemplate("bad", prefix="no question", calls={"answer": "{memory}"})
    with pytest.raises(ValueError, match="unknown slot"):
        PromptTemplate("bad", prefix="{question}", calls={"answer": "{notes}"})
    with pytest.raises(ValueError, match="shared prefix"):
        PromptTemplate("bad", prefix="{question}", calls={"answer": "{question}"})
    b = PromptBuilder(tok)
    with pytest.raises(ValueError, match=r"missing \['chunk'\]"):
        b.build("memory", b.prefix("q"), memory=[])
    with pytest.raises(KeyError, match="no call 'summary'"):
        b.build("summary", b.prefix("q"))


# ------------------------------------------------------------------------------------------
# Across an episode, with a real model sampling: memory ids t+1 == sampled ids t (cut).
# ------------------------------------------------------------------------------------------
def memory_exactness(model, tokenizer, **env_kwargs):
    import gymnasium as gym

    import memgym  # noqa: F401  (registers the envs)
    from agents.backends.base import SamplingParams
    from agents.backends.hf import HFBackend
    from agents.memagent import MemAgent

    backend = HFBackend(model, tokenizer, seed=0)
    env = gym.make("memgym/LongQA-v0", tokenizer=tokenizer, **env_kwargs)
    # Uncapped sampling past a small budget makes the env cut some memories.
    agent = MemAgent(backend, SamplingParams(temperature=1.0, max_new_tokens=10), cap_memory_sampling=False)
    cuts = 0
    for seed in range(2):
        episode, infos = run_recorded_episode(env, agent, seed)
        assert [i.role for i in episode.invocations] == ["memory"] * (len(infos) - 1) + ["answer"]
        cuts += assert_memory_is_exact(episode, infos, tokenizer)
    assert cuts > 0, "no memory was cut: the cut path went untested"


def test_memory_exact_with_tokenizer_trained_here(tok):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048)
    model = AutoModelForCausalLM.from_config(config)
    memory_exactness(model, tok, num_chunks=3, memory_budget=6)


def test_memory_exact_with_tiny_preset():
    from agents.models import load

    model, tokenizer = load("tiny")
    memory_exactness(model, tokenizer, num_chunks=3, memory_budget=6)


@pytest.mark.slow
def test_memory_exact_with_smollm2():
    from agents.models import load

    model, tokenizer = load("smollm2")
    PromptBuilder(tokenizer)  # its chat template (default system prompt) splits cleanly
    memory_exactness(model, tokenizer, num_chunks=2, memory_budget=6)
