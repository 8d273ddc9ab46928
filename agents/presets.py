"""Built-in tiny models: small Qwen2/Llama configs and a BPE tokenizer trained in process.

The presets exist so that everything (tests, examples, CI) runs offline on a CPU in seconds. The
first tiny presets share one byte-level BPE tokenizer trained on LongQA text
(:func:`memgym.generators.longqa.tokenizer_corpus`) plus the agents' prompt template text
(:func:`agents.prompts.template_corpus`), so every task word is a single token and teacher and
student have the same vocabulary (on-policy distillation over the vocabulary needs that);
``tiny-teacher-bpe1k`` has a BPE of its own on the same corpus, to test and study a teacher with
another tokenizer.

The digit presets (``tiny-digits``, ``tiny-teacher-digits``) share a tokenizer that splits every
number into one token per digit, as Llama's and Qwen's do, so that a number never seen in training
(``Document 153:``) is made of the ten digit tokens every number is made of. It is trained on the
same text plus every built-in generated task's (:func:`digit_corpus`). They are new names: the
first presets, their tokenizer and cache keys are as they were.

Weights are a seeded random initialisation: building a preset twice gives identical weights.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Iterator

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Special tokens of the preset tokenizer: padding / document end, then the ChatML markers."""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML, without a default system message."""

TOKENIZER_VOCAB_SIZE = 2048
"""Target vocabulary size of the preset tokenizer (bytes + merges + special tokens)."""

PRESET_FORMAT = 4
"""Bump when the way presets are built changes, so stale caches are rebuilt."""


@dataclass(frozen=True)
class Preset:
    """A tiny model: architecture and sizes; the tokenizer is the shared preset tokenizer."""

    name: str
    description: str
    model_type: str
    """``"qwen2"`` or ``"llama"``."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    """Fewer KV heads than attention heads = grouped-query attention (as in Qwen2.5)."""
    max_position_embeddings: int = 4096
    seed: int = 0
    """Seed of the weight initialisation."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Other config fields."""
    tokenizer_vocab: int = TOKENIZER_VOCAB_SIZE
    """Vocabulary size of the preset's tokenizer: the shared one at the default; another size is
    another BPE on the same corpus (other merges, other ids: a teacher with another tokenizer)."""
    digits: bool = False
    """Split numbers into one token per digit (the digit presets' tokenizer, on :func:`digit_corpus`)."""

    def config_dict(self, vocab_size: int, special_ids: dict[str, int]) -> dict[str, Any]:
        return dict(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            # ~1/sqrt(hidden): the usual 0.02 (tuned for hidden >= 768) leaves a hidden-128 model on a
            # long plateau where it cannot learn to copy a token from its prompt (measured: at chance
            # after 25k answer-call examples with 0.02; learnt in ~150 steps at this scale)
            initializer_range=round(self.hidden_size ** -0.5, 4),
            bos_token_id=None,
            eos_token_id=special_ids["<|im_end|>"],
            pad_token_id=special_ids["<|endoftext|>"],
            **self.extra,
        )


TINY_PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("tiny", "student: Qwen2-style, hidden 128, 2 layers, 4 heads / 2 KV heads (0.62M params)",
               "qwen2", hidden_size=128, intermediate_size=384, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, seed=0),
        Preset("tiny-teacher", "teacher: Qwen2-style, hidden 192, 2 layers, 4 heads / 2 KV heads (1.2M params)",
               "qwen2", hidden_size=192, intermediate_size=576, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, seed=1),
        Preset("tiny-llama", "Llama-style variant of tiny (tests other architectures)",
               "llama", hidden_size=128, intermediate_size=384, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, seed=2),
        Preset("tiny-teacher-bpe1k", "teacher with another tokenizer: tiny-teacher's shape, its own 1024-token "
               "BPE on the same corpus (many task words split in two or three, other ids)",
               "qwen2", hidden_size=192, intermediate_size=576, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, seed=1, tokenizer_vocab=1024),
        Preset("tiny-digits", "student: tiny's shape, a tokenizer that splits numbers into digits (length-robust "
               "inputs: an unseen document number is made of seen tokens)",
               "qwen2", hidden_size=128, intermediate_size=384, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, seed=0, digits=True),
        Preset("tiny-teacher-digits", "teacher: tiny-teacher's shape, the digit presets' tokenizer",
               "qwen2", hidden_size=192, intermediate_size=576, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, seed=1, digits=True),
        Preset("tiny-long", "full-context baseline: tiny-teacher's shape with 16,384 positions, so that a whole "
               "long input fits one prompt (the length axis: trained short, evaluated long)",
               "qwen2", hidden_size=192, intermediate_size=576, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16_384, seed=1),
    )
}
TEACHER_OF = {"tiny-digits": "tiny-teacher-digits"}
"""The teacher preset sharing a student preset's tokenizer, where it is not ``tiny-teacher``."""


TEMPLATE_WEIGHT = 30
"""Times the prompt template text is repeated in the tokenizer corpus, so that its words, which
every prompt carries, become single tokens against the much larger task text."""
LINE_START_WEIGHT = 120
"""Times a list of every corpus word, one per line, is added: words at a line start (a memory's
first word, an answer) are pre-tokenised without the leading space and need their own tokens."""
FINGERPRINT_TEXTS = 300
"""How many leading LongQA texts the cache key hashes (the whole corpus takes seconds to make)."""
_WORD = re.compile(r"\b[A-Za-z]+\b")
_LOWER_WORD = re.compile(r"\b[a-z]+\b")


def _sources(digits: bool = False) -> tuple[list[str], Iterator[str]]:
    from agents.prompts import template_corpus
    from memgym.generators.longqa import tokenizer_corpus

    return list(template_corpus()), digit_corpus() if digits else tokenizer_corpus()


def digit_corpus() -> Iterator[str]:
    """The digit presets' task text: LongQA's (:func:`memgym.generators.longqa.tokenizer_corpus`),
    then the memory tasks' (:func:`memgym.generators.memory_corpus.tokenizer_corpus`)."""
    from memgym.generators.longqa import tokenizer_corpus
    from memgym.generators.memory_corpus import tokenizer_corpus as memory_corpus

    yield from tokenizer_corpus()
    yield from memory_corpus()


def tokenizer_texts(digits: bool = False) -> Iterator[str]:
    """The text the preset tokenizer is trained on: the prompt templates' text (weighted), LongQA
    text (:func:`memgym.generators.longqa.tokenizer_corpus`; with ``digits``, :func:`digit_corpus`),
    then every word seen, one per line."""
    templates, corpus = _sources(digits)
    words: set[str] = set()
    for text in templates * TEMPLATE_WEIGHT:
        words.update(_WORD.findall(text))
        yield text
    for text in corpus:
        words.update(_LOWER_WORD.findall(text))  # task words; capitals only start sentences
        yield text
    line_start = "\n".join(sorted(words))
    for _ in range(LINE_START_WEIGHT):
        yield line_start


def corpus_fingerprint(digits: bool = False) -> str:
    """Hash of the template text and the first LongQA texts (with ``digits``, of
    :func:`digit_corpus`): when the task generator or the templates change, so does the
    fingerprint (and the cached presets are rebuilt)."""
    templates, corpus = _sources(digits)
    texts = itertools.chain(templates, itertools.islice(corpus, FINGERPRINT_TEXTS))
    if digits:  # the memory tasks' text comes after LongQA's: hash its first texts too
        from memgym.generators.memory_corpus import tokenizer_corpus as memory_corpus

        texts = itertools.chain(texts, itertools.islice(memory_corpus(), FINGERPRINT_TEXTS))
    h = hashlib.sha256()
    for text in texts:
        h.update(text.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


def build_tokenizer(texts: Iterable[str], vocab_size: int = TOKENIZER_VOCAB_SIZE, digits: bool = False) -> Any:
    """Train a byte-level BPE on ``texts`` and wrap it as a transformers tokenizer with ChatML.

    Byte-level: any text (any Unicode) encodes without unknown tokens. EOS is ``<|im_end|>``
    (the end of a chat turn), padding is ``<|endoftext|>``; no BOS is added. ``digits``: every
    digit is a token of its own (split after the byte-level step, so the space before a number is a
    token of its own too, and no merge ever crosses a digit).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # One id per word wherever it stands: a word at a line start (a chunk's first fact, a memory's
    # first word, an answer) is encoded like a word after a space. Without this, "kevin" and
    # " kevin" are different tokens and a tiny model must learn two copies of every copy rule.
    tok.normalizer = normalizers.Replace(Regex(r"\n(?=\S)"), "\n ")
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    if digits:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=True),
                                                     pre_tokenizers.Digits(individual_digits=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def build_model(preset: Preset, tokenizer: Any) -> Any:
    """A randomly initialised model for ``preset``, seeded (same weights every time), fp32."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[preset.model_type]
    special = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = config_cls(**preset.config_dict(len(tokenizer), special))
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state untouched
        torch.manual_seed(preset.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = special["<|endoftext|>"]
    model.generation_config.eos_token_id = special["<|im_end|>"]
    return model


def tokenizer_key(fingerprint: str, vocab_size: int = TOKENIZER_VOCAB_SIZE, digits: bool = False) -> str:
    """Short hash of everything a preset tokenizer depends on (the shared one at the default size)."""
    spec = {"format": PRESET_FORMAT, "vocab": vocab_size, "special": SPECIAL_TOKENS,
            "template": CHATML_TEMPLATE, "weights": [TEMPLATE_WEIGHT, LINE_START_WEIGHT], "corpus": fingerprint}
    if digits:  # only when set: the first presets' keys are as before the field
        spec["digits"] = True
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def preset_key(preset: Preset, fingerprint: str) -> str:
    """Short hash of everything a preset's files depend on (its cache directory name)."""
    fields = asdict(preset)
    if fields["tokenizer_vocab"] == TOKENIZER_VOCAB_SIZE:  # the shared tokenizer: keys as before the field
        del fields["tokenizer_vocab"]
    if not fields["digits"]:
        del fields["digits"]
    spec = {"tokenizer": tokenizer_key(fingerprint, preset.tokenizer_vocab, preset.digits), "preset": fields}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
