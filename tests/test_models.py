"""agents.models.load: presets, local directories, gguf files, the cache, and clear errors."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from agents import models, presets
from agents.backends import GenerationRequest, HFBackend, SamplingParams
from agents.models import ModelLoadError, check_same_vocab


def state_equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tiny_preset_is_deterministic_across_builds(tmp_path, tiny):
    model_a, tok_a = tiny
    model_b, tok_b = models.load("tiny", cache_dir=tmp_path / "other")  # a fresh build
    assert state_equal(model_a, model_b)
    assert tok_a.get_vocab() == tok_b.get_vocab()
    assert isinstance(model_a, torch.nn.Module) and not model_a.training
    assert next(model_a.parameters()).dtype == torch.float32


def test_second_load_comes_from_the_cache(cache, tiny, monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("the preset was rebuilt instead of read from the cache")

    monkeypatch.setattr(presets, "build_model", no_build)
    monkeypatch.setattr(presets, "build_tokenizer", no_build)
    model, tok = models.load("tiny", cache_dir=cache)
    assert state_equal(model, tiny[0]) and tok.get_vocab() == tiny[1].get_vocab()
    names = {p.name.rsplit("-", 1)[0] for p in (cache / "presets").iterdir()}
    assert {"tiny", "tokenizer"} <= names  # the presets' shared tokenizer is cached beside them


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMOPD_CACHE", str(tmp_path / "c"))
    assert models.cache_dir() == tmp_path / "c"
    assert models.cache_dir(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("MEMOPD_CACHE")
    assert models.cache_dir().parts[-2:] == (".cache", "memopd")


def test_tokenizer_chatml_and_one_token_per_task_word(tiny):
    _, tok = tiny
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    # words at a line start get the leading space of a mid-line word (see presets.build_tokenizer)
    assert tok.decode(ids) == "<|im_start|> user\n hi<|im_end|> \n<|im_start|> assistant\n"
    from memgym.generators import longqa

    # one token per task word, and the SAME token mid-line, at a line start and at the start of a
    # text (a memory's first word, an answer): copying a word is one rule for a tiny model
    for word in longqa.PERSONS + longqa.COMPANIES + longqa.CITIES + longqa.COUNTRIES + longqa.TITLES:
        mid = tok(" " + word, add_special_tokens=False)["input_ids"]
        assert len(mid) == 1, word
        assert tok(word, add_special_tokens=False)["input_ids"] == mid, word
        assert tok("x .\n" + word, add_special_tokens=False)["input_ids"][-1:] == mid, word
    # byte-level: any text encodes and decodes losslessly up to those inserted spaces
    text = "héllo 世界 ∑ <not special>\nnext line"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == " héllo 世界 ∑ <not special>\n next line"


def test_teacher_and_student_presets_share_the_vocabulary(cache, tiny):
    teacher, tok_t = models.load("tiny-teacher", cache_dir=cache)
    student, tok_s = tiny
    check_same_vocab(tok_t, tok_s)
    assert teacher.config.vocab_size == student.config.vocab_size == len(tok_s)
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(teacher) > 1.5 * n(student)  # the teacher is the larger model
    assert student.config.num_key_value_heads < student.config.num_attention_heads  # GQA
    llama, tok_l = models.load("tiny-llama", cache_dir=cache)
    assert llama.config.model_type == "llama"
    check_same_vocab(tok_l, tok_s)


def test_check_same_vocab_reports_the_difference(tiny):
    _, tok = tiny
    other = presets.build_tokenizer(["alice bob carol works at acme"] * 10, vocab_size=300)
    pattern = r"teacher/student tokenizers differ: sizes \d+ vs \d+; first differing id \d+"
    with pytest.raises(ValueError, match=pattern):
        check_same_vocab(tok, other)
    with pytest.raises(ValueError, match="reward/policy"):
        check_same_vocab(other, tok, what="reward/policy")


def test_local_directory_roundtrip_and_dtype(tmp_path, tiny):
    model, tok = tiny
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    loaded, tok2 = models.load(str(tmp_path / "m"))
    assert state_equal(loaded, model) and tok2.get_vocab() == tok.get_vocab()
    half, _ = models.load(tmp_path / "m", dtype=torch.bfloat16)
    assert next(half.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("spec", ["runs/does-not-exist", "runs/quickstar", "my model/x"])
def test_a_local_looking_path_is_never_sent_to_the_hub(tmp_path, monkeypatch, spec):
    """``runs/does-not-exist`` has the shape of a hub id ``org/name``, but ``runs/`` is a local
    directory: a typo there is a missing path (with the closest names), never a hub lookup; so is a
    name a hub id cannot have."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "quickstart").mkdir(parents=True)

    def hub(repo_id):
        raise AssertionError(f"{repo_id} was sent to the hub")

    monkeypatch.setattr(models, "_load_hub", hub)
    with pytest.raises(FileNotFoundError, match="model path not found") as err:
        models.load(spec)
    if spec.startswith("runs/"):
        assert "runs/ is a local directory" in str(err.value)
    if spec == "runs/quickstar":
        assert "did you mean runs/quickstart?" in str(err.value)


def test_unknown_preset_lists_presets():
    with pytest.raises(ModelLoadError, match=r"unknown model spec 'tinny'.*tiny, tiny-teacher, tiny-llama, tiny-teacher-bpe1k, tiny-digits, tiny-teacher-digits, tiny-long, smollm2"):
        models.load("tinny")


def test_missing_paths_raise_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="model path not found"):
        models.load(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="gguf file not found"):
        models.load(str(tmp_path / "model.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        models.load(str(tmp_path / "empty"))


def test_corrupt_safetensors_is_a_clear_error(tmp_path, cache, tiny):
    src = next(p for p in (cache / "presets").iterdir() if p.name.startswith("tiny-") and "teacher" not in p.name
               and "llama" not in p.name)
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated download
    with pytest.raises(ModelLoadError, match=re.escape(str(dst)) + ".*corrupt or truncated"):
        models.load(str(dst))


def test_tokenizer_larger_than_model_vocab_is_refused(tmp_path, tiny):
    model, tok = tiny
    config = model.config.to_dict()
    config["vocab_size"] = 100
    small = type(model)(type(model.config).from_dict(config))
    small.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    with pytest.raises(ModelLoadError, match=r"100 embedding rows but its tokenizer has \d+ tokens"):
        models.load(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="100 embedding rows"):
        HFBackend(small, tok)


def test_hub_id_without_network_says_what_to_do(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no waiting on retries
    with pytest.raises(ModelLoadError, match=r"(?s)from the Hugging Face hub.*local model directory, a .gguf file"):
        models.load("some-org/some-model")


@pytest.mark.slow
def test_smollm2_from_gguf_is_cached_and_answers(tmp_path, monkeypatch):
    gguf = models.smollm2_gguf()  # from the user cache (downloaded there once per machine)
    assert gguf.suffix == ".gguf" and gguf.stat().st_size > 50e6
    cache = tmp_path / "fresh"
    model, tok = models.load(str(gguf), cache_dir=cache)  # dequantised and converted here
    converted = list((cache / "gguf").iterdir())
    assert len(converted) == 1 and (converted[0] / "model.safetensors").is_file()
    assert model.config.model_type == "llama" and len(tok) == 49152
    assert not hasattr(model, "hf_quantizer") or model.hf_quantizer is None

    # the second load reads the safetensors cache, not the gguf
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    def no_gguf(*args, **kwargs):
        raise AssertionError("the gguf was read again instead of the cache")

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", no_gguf)
    again, _ = models.load(str(gguf), cache_dir=cache)
    assert state_equal(again, model)

    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_dict=False)
    inv = HFBackend(model, tok).generate([GenerationRequest(prompt, prefix_len=0, role="answer")],
                                         SamplingParams(greedy=True, max_new_tokens=20))[0]
    assert "Paris" in inv.response_text and inv.finish_reason == "eos"


def test_save_pretrained_is_atomic_with_normal_permissions(tmp_path, tiny):
    model, tok = tiny
    out = models.save_pretrained(tmp_path / "m", model, tok, files={"note.txt": "hi"})
    assert oct(out.stat().st_mode & 0o777) == "0o755" and (out / "note.txt").read_text() == "hi"
    again = models.save_pretrained(out, model, tok)  # replaces the previous one
    assert not (again / "note.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert state_equal(models.load(out)[0], model)


def test_directories_that_hold_no_model_say_what_is_expected(tmp_path):
    with pytest.raises(ModelLoadError, match="a training run directory"):
        models.load(tmp_path)
    (tmp_path / "config.toml").write_text('model = "tiny"\n')
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(ModelLoadError, match="no final model .* and no checkpoint yet"):
        models.load(tmp_path)
