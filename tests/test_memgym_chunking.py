"""Chunking, units and the memory cut, in words and in tokens of real (in-process) tokenizers."""

import itertools
import re

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from memgym.chunking import (TokenCounter, WordCounter, count_chunks, iter_chunks, make_counter,
                             render_document)
from memgym.data import Document
from memgym.generators.longqa import tokenizer_corpus


@pytest.fixture(scope="module")
def word_level():
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(tokenizer_corpus(60), trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


@pytest.fixture(scope="module")
def byte_bpe():
    # Byte-level BPE with a small vocabulary: many words take several tokens.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(tokenizer_corpus(60), trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def n_tokens(tokenizer, text):
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


DOCS = [
    Document("alpha", "One two three. Four five six seven."),
    Document("beta", "Eight nine."),
    Document("gamma", " ".join(f"w{i}." if i % 7 == 6 else f"w{i}" for i in range(60))),  # long
    Document("delta", "Ünïcödé wörds 世界 stay whole."),
]


def body_words(chunks):
    """Document words in stream order, headers removed."""
    out = []
    for chunk in chunks:
        for piece in chunk.text.split("\n\n"):
            header, _, body = piece.partition("\n")
            assert re.fullmatch(r"Document \d+: \w+( \(continued\))?", header), header
            out += body.split()
    return out


@pytest.mark.parametrize("chunk_size", [12, 16, 25, 40, 200])
def test_word_chunks_keep_every_word_in_order_and_fit(chunk_size):
    chunks = list(iter_chunks(DOCS, chunk_size))
    assert body_words(chunks) == [w for d in DOCS for w in d.text.split()]
    for c in chunks:
        assert c.size == len(c.text.split()) <= chunk_size
    assert count_chunks(DOCS, chunk_size) == len(chunks)


def test_whole_documents_are_packed_greedily_and_long_ones_split_at_sentences():
    chunks = list(iter_chunks(DOCS, 16))
    # alpha (3 + 7 words) fits; beta (3 + 2) fits next to it: 15 <= 16.
    assert chunks[0].text == render_document(1, DOCS[0]) + "\n\n" + render_document(2, DOCS[1])
    gamma = [c for c in chunks if "Document 3" in c.text]
    assert len(gamma) > 1 and "Document 3: gamma (continued)" in gamma[1].text
    for c in gamma[:-1]:  # every split ends at a sentence end when one fits
        assert c.text.endswith(".")


def test_a_word_longer_than_a_chunk_is_never_split():
    doc = Document("t", "short " + "x" * 50 + " end")
    chunks = list(iter_chunks([doc], 4, WordCounter()))
    assert body_words(chunks) == doc.text.split()


def test_chunking_is_lazy_on_an_endless_stream():
    endless = (Document("t", f"word{i} more words here .") for i in itertools.count())
    first = list(itertools.islice(iter_chunks(endless, 30), 3))
    assert len(first) == 3 and "Document 1: t" in first[0].text


def test_word_cut_keeps_text_up_to_the_budget_th_word():
    text = "  alpha beta\n gamma,  delta  "
    counter = WordCounter()
    for budget in range(6):
        kept, size, removed = counter.cut(text, budget)
        words = text.split()
        if budget >= len(words):
            assert (kept, size, removed) == (text, len(words), 0)
        else:  # independent: the end of the budget-th word
            ends = [m.end() for m in re.finditer(r"\S+", text)]
            expected = text[: ends[budget - 1]] if budget else ""
            assert (kept, size, removed) == (expected, budget, len(words) - budget)


@pytest.mark.parametrize("which", ["word_level", "byte_bpe"])
def test_token_cut_follows_the_offsets_rule(which, request):
    tokenizer = request.getfixturevalue(which)
    counter = make_counter(tokenizer)
    assert counter.unit == "tokens"
    text = "alice acme . bob globex . Wörds 世界 carol initech ."
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    total = len(enc["input_ids"])
    for budget in (0, 1, 3, total - 1, total, total + 5):
        kept, size, removed = counter.cut(text, budget)
        if budget >= total:
            assert (kept, size, removed) == (text, total, 0)
        elif budget == 0:
            assert (kept, size, removed) == ("", 0, total)
        else:
            assert kept == text[: enc["offset_mapping"][budget - 1][1]]
            assert (size, removed) == (budget, total - budget)


@pytest.mark.parametrize("which", ["word_level", "byte_bpe"])
@pytest.mark.parametrize("chunk_size", [24, 60])
def test_token_chunks_fit_and_their_size_is_the_real_token_count(which, chunk_size, request):
    tokenizer = request.getfixturevalue(which)
    counter = TokenCounter(tokenizer)
    chunks = list(iter_chunks(DOCS, chunk_size, counter))
    assert body_words(chunks) == [w for d in DOCS for w in d.text.split()]
    for c in chunks:
        assert c.size == n_tokens(tokenizer, c.text)
        # Only a piece holding a single word (never split) may overflow its chunk.
        assert c.size <= chunk_size or len(body_words([c])) == 1
    assert count_chunks(DOCS, chunk_size, counter) == len(chunks)


def test_word_units_sum_to_the_token_count(byte_bpe):
    text = "Document 12: notes\nalice acme . héllo 世界 end"
    units = TokenCounter(byte_bpe).word_units(text)
    assert [text[s:e] for s, e, _ in units] == text.split()
    assert sum(u for _, _, u in units) == n_tokens(byte_bpe, text)


def test_slow_tokenizers_are_rejected_with_a_clear_error():
    class Slow:
        is_fast = False

    with pytest.raises(TypeError, match="fast"):
        make_counter(Slow())
