"""LongQA and NeedleQA generators: determinism, exact chunk plans, answers, knobs, laziness."""

import re
import tracemalloc

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from memgym.chunking import TokenCounter, iter_chunks
from memgym.generators import longqa, needle
from memgym.generators.longqa import make_source, tokenizer_corpus

NATURAL_RE = re.compile(r"(\w+) (?:works at|is located in|is in) (\w+)\.")


def stream_text(sample):
    return " ".join(d.text for d in sample.documents)


def follow_chain(sample, style):
    """Answer the question independently: follow the facts from its subject through the text."""
    text = stream_text(sample)
    if style == "compact":
        pairs = re.findall(r"(?:^|(?<=\. ))(\w+) (\w+) \.", text)
        person = sample.question.split(" does ")[1].split()[0] if " does " in sample.question else \
            sample.question.split(" that ")[1].split()[0]
    else:
        pairs = NATURAL_RE.findall(text)
        person = re.search(r"(?:does|that) (\w+) work", sample.question).group(1)
    entity = person
    for _ in range(sample.metadata["hops"]):
        objects = [o for s, o in pairs if s == entity]
        assert len(objects) == 1, (entity, objects)  # the chain subject has exactly one fact
        entity = objects[0]
    return entity


SETTINGS = [
    {},
    {"hops": 2},
    {"hops": 3, "fact_order": "random", "distractor_similarity": 1.0},
    {"hops": 2, "fact_style": "natural", "chunk_size": 96, "num_chunks": 7},
    {"hops": 1, "distractor_similarity": 0.0, "context_length": 1000, "chunk_size": 100},
]


@pytest.mark.parametrize("kwargs", SETTINGS)
def test_plans_fill_exact_chunks_and_facts_sit_where_stated(kwargs):
    source = make_source("train", 3, **kwargs)
    cfg = source.config
    for i in range(60):
        sample = source[i]
        chunks = list(iter_chunks(sample.documents, cfg.chunk_size))
        assert len(chunks) == cfg.num_chunks == sample.documents.num_chunks_for(cfg.chunk_size, cfg.counter)
        assert all(c.size <= cfg.chunk_size for c in chunks)
        for fact in sample.supporting_facts:
            assert fact["text"] in chunks[fact["chunk"]].text
        assert [f["hop"] for f in sample.supporting_facts] == list(range(cfg.hops))
        assert follow_chain(sample, cfg.fact_style) == sample.answers[0]


def test_context_length_sets_the_number_of_chunks():
    assert make_source("train", 0, context_length=1000, chunk_size=100).config.num_chunks == 10
    assert make_source("train", 0, context_length=1001, chunk_size=100).config.num_chunks == 11


def test_samples_are_deterministic_and_documents_reiterable():
    a, b = make_source("train", 0, hops=2), make_source("train", 0, hops=2)
    for i in (0, 7, 999_999):
        sa, sb = a[i], b[i]
        assert (sa.id, sa.question, sa.answers) == (sb.id, sb.question, sb.answers)
        assert list(sa.documents) == list(sb.documents) == list(sa.documents)
    assert a.index_of(a[42].id) == 42
    with pytest.raises(KeyError):
        a.index_of("longqa-test-0-1")
    with pytest.raises(IndexError):
        a[len(a)]


def test_splits_and_seeds_give_different_streams():
    first = [make_source(split, seed)[0] for split, seed in (("train", 0), ("test", 0), ("train", 1))]
    assert len({stream_text(s) for s in first}) == 3
    assert len(make_source("test", 0)) == 1000 and len(make_source("train", 0)) == 1_000_000


def test_causal_order_reads_each_hop_before_the_next_and_random_order_does_not():
    def inverted(order):
        source = make_source("train", 0, hops=2, fact_order=order, num_chunks=6)
        count = 0
        for i in range(80):
            s = source[i]
            text = stream_text(s)
            pos = [text.index(f["text"]) for f in s.supporting_facts]
            count += pos[0] > pos[1]
        return count

    assert inverted("causal") == 0
    assert inverted("random") > 10


def test_distractor_similarity_controls_fact_like_distractors():
    def sentences(sim):
        s = make_source("train", 0, distractor_similarity=sim)[5]
        return [x.strip() for x in stream_text(s).split(" .") if x.strip()], s

    filler_only, s0 = sentences(0.0)
    facts = {f["text"].rstrip(" .") for f in s0.supporting_facts}
    assert all(x.startswith("the ") for x in filler_only if x not in facts)
    facts_only, _ = sentences(1.0)
    assert not any(x.startswith("the ") for x in facts_only)


@pytest.mark.parametrize("kwargs", [{"num_chunks": 6}, {"hops": 2, "num_chunks": 6}, {"hops": 2, "num_chunks": 2},
                                    {"hops": 3, "fact_order": "random", "distractor_similarity": 1.0}])
def test_fact_repeats_states_each_fact_again_in_another_chunk_and_keeps_the_first_statements(kwargs):
    once, twice = make_source("train", 3, **kwargs), make_source("train", 3, fact_repeats=2, **kwargs)
    cfg = twice.config
    for i in range(40):
        a, b = once[i], twice[i]
        assert (a.question, a.answers) == (b.question, b.answers)
        assert b.supporting_facts[:cfg.hops] == a.supporting_facts  # the first statements: the default sample's
        chunks = [c.text for c in iter_chunks(b.documents, cfg.chunk_size)]
        assert len(chunks) == cfg.num_chunks
        text = " ".join(chunks)
        for hop in range(cfg.hops):
            stated = [f for f in b.supporting_facts if f["hop"] == hop]
            assert len(stated) == 2 and stated[0]["text"] == stated[1]["text"]
            sentence = re.compile(r"(?<!\w)" + re.escape(stated[0]["text"]))
            assert len(sentence.findall(text)) == 2  # stated twice in the whole input
            assert all(sentence.search(chunks[f["chunk"]]) for f in stated)
            if cfg.fact_order == "causal" and hop > 0:  # no statement of a hop before the previous hop's first
                first_prev = text.index(next(f["text"] for f in b.supporting_facts if f["hop"] == hop - 1))
                assert all(m.start() > first_prev for m in sentence.finditer(text))
        assert all(len({f["chunk"] for f in b.supporting_facts if f["hop"] == h}) == 2
                   for h in range(cfg.hops) if cfg.fact_order == "random" or h == 0)
    with pytest.raises(ValueError, match="fact_repeats"):
        make_source("train", 0, fact_repeats=0)


def test_the_oracle_keeps_a_fact_stated_twice_once():
    from agents.oracle import supporting_texts

    sample = make_source("train", 0, fact_repeats=3, num_chunks=4)[0]
    assert len(sample.supporting_facts) == 3
    assert supporting_texts(sample) == [sample.supporting_facts[0]["text"]]


def test_natural_style_writes_english():
    s = make_source("train", 0, hops=2, fact_style="natural")[0]
    assert s.question.startswith("In which city") and s.question.endswith("?")
    assert re.fullmatch(r"\w+ works at \w+\.", s.supporting_facts[0]["text"])
    assert s.answers[0][0].isupper()


def test_bad_knobs_are_rejected_clearly():
    with pytest.raises(ValueError, match="hops"):
        make_source("train", 0, hops=0)
    with pytest.raises(ValueError, match="fact_order"):
        make_source("train", 0, fact_order="backwards")
    with pytest.raises(TypeError, match="unknown option"):
        make_source("train", 0, hopz=2)
    with pytest.raises(ValueError, match=r"chunk_size=16 words is too small .* pass chunk_size=36 or more"):
        list(make_source("train", 0, hops=3, chunk_size=16)[0].documents)


def test_tokenizer_corpus_gives_one_token_per_word():
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    # Split punctuation and digits so that document numbers never fall outside the vocabulary.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(True)])
    tok.train_from_iterator(tokenizer_corpus(60), trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    vocab = hf.get_vocab()
    for word in longqa.PERSONS + longqa.COMPANIES + longqa.CITIES + longqa.COUNTRIES:
        assert word in vocab and word.capitalize() in vocab
    # A fresh sample is covered without unknown tokens, so chunks in tokens plan exactly too.
    counter = TokenCounter(hf)
    source = make_source("test", 9, hops=2, counter=counter, chunk_size=80)
    s = source[3]
    chunks = list(iter_chunks(s.documents, 80, counter))
    assert len(chunks) == source.config.num_chunks
    assert hf.unk_token_id not in hf(" ".join(c.text for c in chunks))["input_ids"]


def _peak_bytes(context_length):
    sample = make_source("train", 0, context_length=context_length, chunk_size=512)[0]
    tracemalloc.start()
    for _ in iter_chunks(sample.documents, 512):
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def test_long_inputs_stream_in_flat_memory():
    small, large = _peak_bytes(4_000), _peak_bytes(80_000)
    assert large < 1.5 * small + 64_000, (small, large)


# ----------------------------------------------------------------------------- NeedleQA
def test_needle_sits_in_the_stated_chunk_and_answers_the_question():
    source = needle.make_source("train", 0, num_chunks=6, num_distractor_needles=2)
    for i in range(30):
        s = source[i]
        chunks = list(iter_chunks(s.documents, source.config.chunk_size))
        assert len(chunks) == 6
        fact = s.supporting_facts[0]
        assert fact["text"] in chunks[fact["chunk"]].text
        key = re.search(r"for (\S+) mentioned", s.question).group(1)
        found = re.findall(r"magic numbers for (\S+) is: (\d+)\.", stream_text(s))
        assert len(found) == 3 and dict(found)[key] == s.answers[0]


@pytest.mark.parametrize("depth,chunk", [(0.0, 0), (0.5, 2), (1.0, 3)])
def test_needle_depth(depth, chunk):
    s = needle.make_source("test", 1, num_chunks=4, needle_depth=depth)[0]
    assert s.supporting_facts[0]["chunk"] == chunk


def test_needle_haystacks():
    noise = stream_text(needle.make_source("train", 0, haystack="noise")[0])
    assert "The grass is green. The sky is blue." in noise
    varied = stream_text(needle.make_source("train", 0, haystack="sentences")[0])
    assert "The grass is green" not in varied
    with pytest.raises(ValueError, match="haystack"):
        needle.make_source("train", 0, haystack="essays")


def test_vocabulary_words_are_distinct_single_words():
    pools = [longqa.PERSONS, longqa.COMPANIES, longqa.CITIES, longqa.COUNTRIES, longqa.TITLES,
             longqa.FILLER_ADJ, longqa.FILLER_NOUN, longqa.FILLER_VERB, longqa.FILLER_ADV]
    words = [w for pool in pools for w in pool]
    assert len(words) == len(set(words)) <= 400  # a closed vocabulary: no word has two roles
    assert all(re.fullmatch(r"[a-z]+", w) for w in words)
