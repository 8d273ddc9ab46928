"""OracleAgent: a scripted agent that knows the sample's supporting facts (no model).

Memory = the supporting-fact sentences seen so far, verbatim, in reading order, as many whole
facts as the memory budget holds; answer = the first gold answer. It writes the same records as
a model agent (MemAgent prompts, token ids from a tokenizer; response = the oracle text's ids +
EOS, log-probs 0.0, ``meta["oracle"] = True``), so its episodes are gold trajectories for SFT and
fixtures for tests.

The oracle needs the sample behind each episode: pass the env's sample source (anything with
``index_of(sample_id)`` and ``__getitem__``), a function ``(task_id, sample_id) -> Sample``, or
use :meth:`OracleAgent.for_env`.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

from agents.memagent import MemAgent
from agents.policy import EpisodeState
from agents.prompts import MEMAGENT_TEMPLATE, PromptTemplate
from agents.records import Invocation

SampleLookup = Callable[[str, str], Any]


class OracleAgent(MemAgent):
    """Scripted from supporting facts; records in the MemAgent format.

    Args:
        samples: the sample source of the env (``index_of`` + ``__getitem__``), or a function
            ``(task_id, sample_id) -> Sample``.
        tokenizer: tokenizer of the records (default: the ``tiny`` preset's). Make the env with
            the same tokenizer so the memory budget is counted in its tokens.
        template: prompt texts (default: MemAgent's, so the records train a MemAgent).
    """

    name = "oracle"

    def __init__(self, samples: Any, tokenizer: Any = None, template: PromptTemplate = MEMAGENT_TEMPLATE,
                 backend: Any = None) -> None:
        if backend is not None:
            raise ValueError("OracleAgent calls no model; pass tokenizer=..., not a backend")
        if tokenizer is None:
            tokenizer = default_tokenizer()
        super().__init__(backend=None, tokenizer=tokenizer, template=template)
        self.lookup = _as_lookup(samples)
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("OracleAgent needs a tokenizer with an EOS token (responses end with it)")
        self.eos_id = int(eos)

    @classmethod
    def for_env(cls, env: Any, tokenizer: Any = None, **kwargs: Any) -> "OracleAgent":
        """An oracle reading samples from ``env``'s own sample source (``env.unwrapped.source``)."""
        source = getattr(env.unwrapped, "source", None)
        if source is None:
            raise ValueError(f"{type(env.unwrapped).__name__} exposes no sample source (.source); "
                             "pass OracleAgent(samples=...) instead")
        return cls(source, tokenizer=tokenizer, **kwargs)

    def step(self, state: EpisodeState, obs: str, info: dict[str, Any]) -> str:
        self.sync_memory(state, info)
        if state.prefix_ids is None:
            sample = self.lookup(str(info.get("task_id", "")), str(info["sample_id"]))
            state.prefix_ids = self.prompts.prefix(info["question"])
            state.extra["facts"] = supporting_texts(sample)
            state.extra["answer"] = str(sample.answers[0])
            state.extra["kept"] = []
        phase = info.get("phase")
        if phase == "memory":
            kept: list[str] = state.extra["kept"]
            for fact in state.extra["facts"]:
                if fact not in kept and _contains(info["chunk"], fact):
                    kept.append(fact)
            text = self._fit(kept, info)
            ids = self.prompts.encode_text(text)
            prompt = self.prompts.build("memory", state.prefix_ids, memory=state.memory_ids,
                                        chunk=self.prompts.encode_text(info["chunk"]))
            self._record(state, prompt, ids, text, "memory", chunk_index=int(info["chunk_index"]))
            state.pending_memory = ids
            return text
        if phase == "answer":
            text = state.extra["answer"]
            prompt = self.prompts.build("answer", state.prefix_ids, memory=state.memory_ids)
            self._record(state, prompt, self.prompts.encode_text(text), text, "answer")
            return text
        raise ValueError(f"OracleAgent got phase {phase!r}; expected 'memory' or 'answer'")

    def _fit(self, facts: list[str], info: dict[str, Any]) -> str:
        """The longest run of whole facts (from the first) within the memory budget."""
        budget = info.get("memory_budget")
        text = ""
        for fact in facts:
            candidate = f"{text} {fact}" if text else fact
            if budget is not None and self._size(candidate, info) > int(budget):
                break
            text = candidate
        return text

    def _size(self, text: str, info: dict[str, Any]) -> int:
        if info.get("budget_unit") == "tokens":
            return len(self.prompts.encode_text(text))
        return len(text.split())

    def _record(self, state: EpisodeState, prompt: Any, ids: list[int], text: str, role: str, **meta: Any) -> None:
        response = list(ids) + [self.eos_id]
        state.invocations.append(Invocation(
            prompt_ids=prompt.ids,
            response_ids=response,
            logprobs=[0.0] * len(response),
            position_ids=list(range(len(prompt.ids) + len(response))),
            prefix_len=prompt.prefix_len,
            role=role,
            turn=len(state.invocations),
            policy_version=0,
            finish_reason="eos",
            sampling={},
            timing={"start": time.time(), "latency_s": 0.0},
            response_text=text,
            spans={k: list(v) for k, v in prompt.spans.items()},
            meta={"oracle": True, "episode_id": state.episode_id, **meta},
        ))


def supporting_texts(sample: Any) -> list[str]:
    """The supporting-fact sentences of a sample (``{"text": ...}`` entries or plain strings)."""
    out = []
    for i, fact in enumerate(sample.supporting_facts):
        text = fact.get("text") if isinstance(fact, dict) else fact if isinstance(fact, str) else None
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"sample {sample.id!r}: supporting_facts[{i}] = {fact!r} has no sentence text; "
                             "the oracle needs each supporting fact as a string or a {'text': ...} object")
        out.append(text.strip())
    if not out:
        raise ValueError(f"sample {sample.id!r} has no supporting_facts; the oracle cannot script its memory")
    return out


def _contains(chunk: str, fact: str) -> bool:
    """``fact`` occurs in ``chunk`` as whole words (``"al ice ."`` must not match ``"mal ice ."``)."""
    return re.search(r"(?<!\w)" + re.escape(fact) + r"(?!\w)", chunk) is not None


def _as_lookup(samples: Any) -> SampleLookup:
    if callable(samples) and not hasattr(samples, "index_of"):
        return samples
    if hasattr(samples, "index_of") and hasattr(samples, "__getitem__"):
        return lambda task_id, sample_id: samples[samples.index_of(sample_id)]
    raise TypeError(f"samples must be a sample source (index_of + __getitem__) or a function "
                    f"(task_id, sample_id) -> Sample, got {type(samples).__name__}")


def default_tokenizer() -> Any:
    """The ``tiny`` preset's tokenizer (built once and cached by :mod:`agents.models`)."""
    return load_tokenizer("tiny")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(spec: str | os.PathLike | None = None) -> Any:
    """The tokenizer :func:`agents.models.load` would return for ``spec``, without the model.

    The oracle calls no model, so loading weights only costs time (seconds for a small model,
    minutes for a large one). Presets and ``.gguf`` files read the tokenizer from their cache
    entry (made on first use, as ``load`` makes it); a directory with tokenizer files loads them.
    Anything else (a training run directory, a hub id, a bad spec) goes through ``load``, which
    also raises its errors: :class:`agents.models.ModelLoadError`, ``FileNotFoundError``.
    """
    from agents import models

    s = "tiny" if spec is None else os.fspath(spec)
    path = _tokenizer_dir(s)
    if path is None:
        return models.load(s)[1]
    try:
        return models._load_tokenizer(path)  # the same rules as load(): ids must not change
    except Exception as exc:  # noqa: BLE001 - tokenizer files fail in many ways; re-raised with the path
        raise models.ModelLoadError(f"could not load the tokenizer from {path}: {exc}") from exc


def _tokenizer_dir(spec: str) -> Path | None:
    """The directory holding ``spec``'s tokenizer files, or None when only a full load knows it."""
    from agents import models, presets

    root = models.cache_dir()
    if spec in presets.TINY_PRESETS:
        return models._ensure_tiny_preset(presets.TINY_PRESETS[spec], root)
    if spec == "smollm2":
        return models._ensure_gguf_converted(models.smollm2_gguf(root), root)
    path = Path(spec).expanduser()
    if spec.lower().endswith(".gguf") and path.is_file():
        return models._ensure_gguf_converted(path, root)
    if path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES):
        return path
    if path.is_dir() and models.is_checkpoint_dir(path):  # RUN/checkpoints/step-N: the run's tokenizer
        path = path.parent.parent
    if path.is_dir() and (path / "config.toml").is_file():
        return _run_tokenizer_dir(path)
    return None


def _run_tokenizer_dir(run: Path) -> Path | None:
    """A training run's tokenizer: its final model's, else its base model's (``model = ...`` in
    ``config.toml``; the student keeps its base model's vocabulary)."""
    from agents import models

    final = run / models.RUN_MODEL_DIR
    if any((final / name).is_file() for name in TOKENIZER_FILES):
        return final
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        base = tomllib.loads((run / "config.toml").read_text(encoding="utf-8")).get("model")
    except (OSError, UnicodeDecodeError, ValueError):
        return None  # load() reads the run and says what is wrong with it
    return _tokenizer_dir(base) if isinstance(base, str) and base != str(run) else None
