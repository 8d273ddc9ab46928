"""Length-robust inputs: the digit presets, the document numbering option, and what a longer input
shows a model that training did not (the positive control's premise, at a small size)."""

from __future__ import annotations

import hashlib
import re

import gymnasium as gym
import pytest

import memgym  # noqa: F401
from memgym.chunking import RANDOM_LABELS, first_label

NUMBER = re.compile(r"\d+")


@pytest.fixture(scope="module")
def digits():
    from agents.models import load_tokenizer

    return load_tokenizer("tiny-digits")


@pytest.fixture(scope="module")
def tiny():
    from agents.models import load_tokenizer

    return load_tokenizer("tiny")


def texts_with_numbers() -> list[str]:
    """Chunks with labels from 1 to 5 digits, needles' 7-digit values, numbers beside punctuation."""
    out = ["x = 4821 .", "12,5 a1b2 (307) 0.25", "Document 153: notes\nalice acme .", "9\n10 99999"]
    for kw in ({"num_chunks": 24}, {"num_chunks": 6, "numbering": "random"}):
        env = gym.make("memgym/LongQA-v0", **kw)
        _, info = env.reset(seed=0)
        while info["phase"] == "memory":
            out.append(info["chunk"])
            _, _, _, _, info = env.step("")
    env = gym.make("memgym/NeedleQA-v0", num_chunks=2)
    _, info = env.reset(seed=0)
    out.append(info["chunk"] + " " + info["question"])
    return out


def numbers_split_into_digits(tokenizer, text: str) -> bool:
    """Every number of ``text`` is one token per digit, by the tokenizer's own encode and offsets."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    for m in NUMBER.finditer(text):
        inside = [(s, e, i) for (s, e), i in zip(enc["offset_mapping"], enc["input_ids"])
                  if s < m.end() and e > m.start() and not tokenizer.decode([i]).isspace()]  # not a prefix space
        spans = [(s, e) for s, e, _ in inside]
        if spans != [(k, k + 1) for k in range(m.start(), m.end())]:
            return False
        if [tokenizer.decode([i]) for _, _, i in inside] != list(m.group()):
            return False
    return True


def test_the_digit_presets_tokenize_every_number_digit_by_digit(digits, tiny):
    texts = texts_with_numbers()
    assert sum(len(NUMBER.findall(t)) for t in texts) > 60
    assert all(numbers_split_into_digits(digits, t) for t in texts)
    # The first presets' tokenizer does not (the check can fail): "153" is not 1, 5, 3 there.
    assert not numbers_split_into_digits(tiny, "Document 153: notes")
    # Teacher and student share the digit tokenizer (full-vocabulary distillation needs it).
    from agents.models import load_tokenizer

    assert load_tokenizer("tiny-teacher-digits").get_vocab() == digits.get_vocab()


def test_the_first_presets_keep_their_cache_keys():
    from agents import presets

    fp = presets.corpus_fingerprint()
    keys = {name: presets.preset_key(p, fp) for name, p in presets.TINY_PRESETS.items()}
    assert {k: keys[k] for k in ("tiny", "tiny-teacher", "tiny-llama", "tiny-teacher-bpe1k")} == {
        "tiny": "bdfd5f546f20", "tiny-teacher": "cb48c0a8b26a", "tiny-llama": "6ea8f21f6e6d",
        "tiny-teacher-bpe1k": "169474af950c"}
    assert presets.tokenizer_key(fp) == "3482bcae1c62"
    assert presets.TEACHER_OF["tiny-digits"] == "tiny-teacher-digits"


def test_sequential_numbering_is_the_chunking_of_before(tiny):
    """The hash of these episodes' chunks, as the code before the numbering option gave them."""
    h = hashlib.sha256()
    for env_id, kw in [("memgym/LongQA-v0", {"num_chunks": 6}), ("memgym/LongQA-v0", {"num_chunks": 24, "hops": 2}),
                       ("memgym/NeedleQA-v0", {})]:
        env = gym.make(env_id, tokenizer=tiny, numbering="sequential", **kw)
        for seed in range(3):
            _, info = env.reset(seed=seed)
            while info["phase"] == "memory":
                h.update(info["chunk"].encode())
                h.update(b"\0")
                _, _, _, _, info = env.step("")
    assert h.hexdigest()[:16] == "d92140a04bf366fa"


def labels_and_chunks(env, seed):
    _, info = env.reset(seed=seed)
    sample = env.unwrapped._sample
    chunks = []
    while info["phase"] == "memory":
        chunks.append(info["chunk"])
        _, _, _, _, info = env.step("")
    labels = [int(x) for c in chunks for x in re.findall(r"Document (\d+):", c)]
    return sample, chunks, labels


@pytest.mark.parametrize("env_id", ["memgym/LongQA-v0", "memgym/NeedleQA-v0"])
def test_random_numbering_labels_from_a_per_sample_offset(env_id):
    env = gym.make(env_id, numbering="random", num_chunks=8)
    starts = set()
    for seed in range(6):
        sample, chunks, labels = labels_and_chunks(env, seed)
        first = first_label("random", sample.id)
        assert 1 <= first <= RANDOM_LABELS and labels[0] == first
        assert labels == list(range(first, first + len(labels)))  # consecutive, one per document
        assert len(chunks) == 8  # the plan holds with the longer labels
        for fact in sample.supporting_facts:  # each fact is read in the chunk it was planned for
            assert fact["text"] in chunks[fact["chunk"]]
        again = labels_and_chunks(env, seed)
        assert (again[1], again[2]) == (chunks, labels)
        starts.add(first)
    assert len(starts) == 6


def test_no_numbering_has_no_labels():
    env = gym.make("memgym/LongQA-v0", numbering="none", num_chunks=6)
    sample, chunks, labels = labels_and_chunks(env, 0)
    assert labels == [] and all(re.search(r"Document: \w+", c) for c in chunks)
    assert not any(re.search(r"\d", c) for c in chunks)
    for fact in sample.supporting_facts:
        assert fact["text"] in chunks[fact["chunk"]]
    with pytest.raises(ValueError, match="numbering must be one of"):
        gym.make("memgym/LongQA-v0", numbering="roman")


def prompt_ids(tokenizer, numbering: str, num_chunks: int, episodes: int, split: str) -> set[int]:
    """Every token id of the memory calls MemAgent would build over these episodes' chunks."""
    from agents.prompts import MEMAGENT_TEMPLATE, PromptBuilder

    builder = PromptBuilder(tokenizer, MEMAGENT_TEMPLATE)
    env = gym.make("memgym/LongQA-v0", split=split, tokenizer=tokenizer, numbering=numbering, num_chunks=num_chunks)
    seen: set[int] = set()
    for seed in range(episodes):
        _, info = env.reset(seed=seed)
        prefix = builder.prefix(info["question"])
        while info["phase"] == "memory":
            seen.update(builder.build("memory", prefix, memory=[], chunk=builder.encode_text(info["chunk"])).ids)
            _, _, _, _, info = env.step("")
    return seen


def test_a_long_input_shows_no_token_that_training_did_not(digits, tiny):
    """The positive control's premise: with the digit presets and random numbering, the prompts of
    192-chunk episodes hold only token ids that 6-chunk training episodes hold; with the first
    presets and sequential labels they do not (labels past 14 were never read in training)."""
    trained = prompt_ids(digits, "random", 6, 150, "train")
    long = prompt_ids(digits, "random", 192, 3, "test")
    assert long <= trained
    old_trained, old_long = prompt_ids(tiny, "sequential", 6, 150, "train"), prompt_ids(tiny, "sequential", 192, 3,
                                                                                        "test")
    unseen = old_long - old_trained
    assert unseen and all(re.search(r"\d", tiny.decode([i])) for i in unseen)
