"""OracleAgent: a scripted agent that knows how each sample is solved (no model).

Memory = what the sample's oracle script (:mod:`memgym.oracle`) keeps, as many whole items as the
memory budget holds (by default the supporting-fact sentences seen so far, verbatim, in reading
order; with ``script="reader"`` the newest sentence of each fact's frame, as a reader of the text
could keep it: :class:`memgym.oracle.ReaderScript`); answer = what the script reads from the memory the env holds, and from nothing else: an
oracle whose budget cannot hold what the answer needs does not answer right, says so once with an
:class:`OracleBudgetWarning`, and its episodes name what the memory lacked
(:attr:`agents.records.Episode.dropped_facts`). It writes the same records as a model agent
(MemAgent prompts, token ids from a tokenizer; response = the oracle text's ids + EOS, log-probs
0.0, ``meta["oracle"] = True``), so its episodes are gold trajectories for SFT and fixtures for
tests. The budget is counted in tokens of the oracle's tokenizer, the env's.

The oracle needs the sample behind each episode: pass the env's sample source (anything with
``index_of(sample_id)`` and ``__getitem__``), a function ``(task_id, sample_id) -> Sample``, or
use :meth:`OracleAgent.for_env`.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable

from agents.memagent import MemAgent
from agents.policy import EpisodeState
from agents.prompts import MEMAGENT_TEMPLATE, PromptTemplate
from agents.records import Episode, Invocation
from memgym.oracle import FactsScript, OracleScript, ReaderScript

SampleLookup = Callable[[str, str], Any]


class OracleBudgetWarning(UserWarning):
    """The memory budget cannot hold what an answer needs: the oracle's episodes score less."""


class OracleDataError(ValueError):
    """A sample the oracle cannot script: it has no supporting-fact sentences. The message names
    the sample and, when known, the file it came from."""


class OracleAgent(MemAgent):
    """Scripted from supporting facts; records in the MemAgent format.

    Args:
        samples: the sample source of the env (``index_of`` + ``__getitem__``), or a function
            ``(task_id, sample_id) -> Sample``.
        tokenizer: tokenizer of the records (default: the ``tiny`` preset's). Make the env with
            the same tokenizer so the memory budget is counted in its tokens.
        template: prompt texts (default: MemAgent's, so the records train a MemAgent).
        script: how a sample without a script of its own is solved (``SCRIPTS``): ``"facts"`` keeps
            the supporting facts only (it knows which sentences are true, so it drops a wrong memory
            it could not tell from a fact); ``"reader"`` keeps the newest sentence of each fact's
            frame, so after a wrong memory its trajectories show a recovery learnable from the text
            (``--agent-kwarg script=reader``).
    """

    name = "oracle"
    calls_model = False  # scripted: nothing sampled, nothing to train (its records are SFT data)

    def __init__(self, samples: Any, tokenizer: Any = None, template: PromptTemplate | str = MEMAGENT_TEMPLATE,
                 backend: Any = None, script: str = "facts") -> None:
        if script not in SCRIPTS:
            raise ValueError(f"OracleAgent: script={script!r} is not one of {sorted(SCRIPTS)} "
                             "(facts: keep the supporting facts; reader: the newest sentence of each fact's frame)")
        self.script = script
        if backend is not None:
            raise ValueError("OracleAgent calls no model; pass tokenizer=..., not a backend")
        if tokenizer is None:
            tokenizer = default_tokenizer()
        super().__init__(backend=None, tokenizer=tokenizer, template=template)
        self.lookup = _as_lookup(samples)
        origin = getattr(samples, "path", None) or getattr(samples, "origin", None)
        self.origin = str(origin) if origin is not None else ""
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
            state.extra["script"] = script_for(sample, self.origin, self.script)
        script: OracleScript = state.extra["script"]
        memory = str(info.get("memory", ""))  # what the env holds: the oracle knows nothing else
        phase = info.get("phase")
        if phase == "memory":
            text = self._fit(script.update(memory, str(info["chunk"])), info)
            ids = self.prompts.encode_text(text)
            prompt = self.prompts.build("memory", state.prefix_ids, memory=state.memory_ids,
                                        chunk=self.prompts.encode_text(info["chunk"]))
            self._record(state, prompt, ids, text, "memory", chunk_index=int(info["chunk_index"]))
            state.pending_memory = ids
            return text
        if phase == "answer":
            text = script.answer(memory)
            state.extra["missing"] = script.missing(memory)
            prompt = self.prompts.build("answer", state.prefix_ids, memory=state.memory_ids)
            self._record(state, prompt, self.prompts.encode_text(text), text, "answer")
            return text
        raise ValueError(f"OracleAgent got phase {phase!r}; expected 'memory' or 'answer'")

    def end_episode(self, info: dict[str, Any], reward: float | None = None, slot: int = 0) -> Episode:
        missing = self.state(slot).extra.get("missing") if slot in self._episodes else None
        episode = super().end_episode(info, reward, slot)
        episode.dropped_facts = list(missing) if missing else None
        return episode

    def _fit(self, items: list[str], info: dict[str, Any]) -> str:
        """The longest run of whole items (from the first) within the memory budget; the first
        item that does not fit is said once (:class:`OracleBudgetWarning`)."""
        budget = info.get("memory_budget")
        text = ""
        for item in items:
            candidate = f"{text} {item}" if text else item
            if budget is not None and self._size(candidate) > int(budget):
                self._warn_short(item, text, int(budget))
                break
            text = candidate
        return text

    def _warn_short(self, item: str, held: str, budget: int) -> None:
        if getattr(self, "_warned", False):
            return
        self._warned = True
        beside = f" beside the {self._size(held)} tokens it already holds" if held else ""
        warnings.warn(f"oracle: the memory budget ({budget} tokens) cannot hold {item!r} ({self._size(item)} "
                      f"tokens){beside}; the oracle answers only from its memory, so episodes that need it score "
                      "less (raise memory_budget to hold it)", OracleBudgetWarning, stacklevel=2)

    def _size(self, text: str) -> int:
        return len(self.prompts.encode_text(text))

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


def supporting_texts(sample: Any, origin: str = "") -> list[str]:
    """The supporting-fact sentences of a sample (``{"text": ...}`` entries or plain strings), each
    once in first-listed order (a task may list a fact stated twice, e.g. LongQA's ``fact_repeats``).

    Raises :class:`OracleDataError` naming the sample (and ``origin``, its file) when it has none."""
    where = f"sample {sample.id!r}" + (f" of {origin}" if origin else "")
    out = []
    for i, fact in enumerate(getattr(sample, "supporting_facts", None) or ()):
        text = fact.get("text") if isinstance(fact, dict) else fact if isinstance(fact, str) else None
        if not isinstance(text, str) or not text.strip():
            raise OracleDataError(f"{where}: supporting_facts[{i}] = {fact!r:.80} has no sentence text, and the "
                                  "oracle writes its memory from the sentences; give each supporting fact as a "
                                  "string or a {\"text\": ...} object")
        if text.strip() not in out:
            out.append(text.strip())
    if not out:
        raise OracleDataError(f"{where} has no supporting_facts, and the oracle writes its memory from them; add "
                              "\"supporting_facts\": [\"<sentence>\", ...] to the sample")
    return out


SCRIPTS = {"facts": FactsScript, "reader": ReaderScript}
"""The scripts for a sample without its own (``OracleAgent(script=...)``)."""


def script_for(sample: Any, origin: str = "", kind: str = "facts") -> OracleScript:
    """The sample's own oracle script (used as it is, whatever ``kind``), else the supporting-facts
    one of ``kind`` (:data:`SCRIPTS`)."""
    script = getattr(sample, "oracle", None)
    if script is not None:
        return script
    return SCRIPTS[kind](supporting_texts(sample, origin), str(sample.answers[0]))


def _as_lookup(samples: Any) -> SampleLookup:
    if callable(samples) and not hasattr(samples, "index_of"):
        return samples
    if hasattr(samples, "index_of") and hasattr(samples, "__getitem__"):
        return lambda task_id, sample_id: samples[samples.index_of(sample_id)]
    raise TypeError(f"samples must be a sample source (index_of + __getitem__) or a function "
                    f"(task_id, sample_id) -> Sample, got {type(samples).__name__}")


def default_tokenizer() -> Any:
    """The ``tiny`` preset's tokenizer (built once and cached by :mod:`agents.models`)."""
    from agents.models import load_tokenizer

    return load_tokenizer("tiny")


