"""The memgym environment: stream a long input in chunks to a compact-memory agent.

Each step delivers one chunk; the agent's action for it becomes its new memory (cut to the
memory budget). After the last chunk the agent answers; the episode terminates with the
answer's score as reward. See the README quickstart and docs/gym.md for the info keys.

One unit everywhere: ``memory_budget`` and ``chunk_size`` are counted in **tokens** of the env's
``tokenizer`` (the agent's: ``memopd.eval`` and ``memopd.train`` pass the model's), or, made
without one, of memgym's default tokenizer (the tiny presets'; :func:`memgym.chunking.default_tokenizer`).
``info["budget_unit"]`` is ``"tokens"`` and ``info["budget_tokenizer"]`` names the tokenizer
(:func:`memgym.chunking.tokenizer_fingerprint`), so an agent counting with another one is told.
"""

from __future__ import annotations

from typing import Any, Iterator

import gymnasium as gym

from memgym.chunking import NUMBERINGS, Chunk, TokenCounter, count_chunks, first_label, iter_chunks, make_counter
from memgym.data import Sample
from memgym.errors import EpisodeEndedError, ResetNeededError
from memgym.registry import ENV_SETTINGS, TaskSpec, get_task, load_task
from memgym.spaces import UnicodeText

SCORERS = ("f1", "em", "sub_em")
# Environment settings and their defaults (the one list is registry.ENV_SETTINGS); a task's
# [env] table overrides them, make kwargs override both. Every other make kwarg goes to the
# task's make_source.
ENV_DEFAULTS: dict[str, Any] = {key: default for key, (default, _) in ENV_SETTINGS.items()}
# Fewest characters one unit takes in a chunk: a word and the space after it; a token may be one
# character. A chunk_size above max_text_length // this can never be shown in an observation.
MIN_CHARS_PER_UNIT = {"words": 2, "tokens": 1}
RESET_OPTIONS = ("sample_id", "index")
EMPTY_MEMORY = "(empty)"
CUT_MARK = " [...]"
NO_METRICS = {"f1": 0.0, "em": 0.0, "sub_em": 0.0}


class MemoryQAEnv(gym.Env[str, str]):
    """A long-horizon QA episode over one sample of a memgym task.

    Args:
        task_dir: the task folder (what registration passes); or give ``task``.
        task: a registered id or name (``"LongQA"``, ``"memgym/LongQA-v0"``).
        render_mode: ``None`` or ``"ansi"`` (``render()`` returns the observation text).
        **kwargs: the settings of :data:`ENV_DEFAULTS` (see the kwargs table in docs/gym.md);
            any other kwarg goes to the task's ``make_source`` (e.g. ``hops=2``). ``memory_budget``
            and ``chunk_size`` are in tokens of ``tokenizer`` (default: memgym's default tokenizer).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, task_dir: str | None = None, *, task: str | None = None, render_mode: str | None = None,
                 **kwargs: Any):
        if (task_dir is None) == (task is None):
            raise TypeError("MemoryQAEnv needs exactly one of task_dir (a task folder) or task (an env id)")
        self.task: TaskSpec = load_task(task_dir) if task_dir is not None else get_task(task)
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.render_mode = render_mode
        settings, source_kwargs = self._resolve(kwargs)
        self.settings = settings
        self.split: str = settings["split"]
        self.chunk_size: int = settings["chunk_size"]
        self.memory_budget: int = settings["memory_budget"]
        self.scorer: str = settings["scorer"]
        self.hotpot_rules: bool = settings["hotpot_rules"]
        self.numbering: str = settings["numbering"]
        self.counter: TokenCounter = make_counter(settings["tokenizer"])
        max_len = settings["max_text_length"]
        _check_chunk_fits(self.chunk_size, max_len, self.counter.unit)
        self.source = self._make_source(settings, source_kwargs)
        if len(self.source) == 0:
            raise ValueError(f"task {self.task.name} split {self.split!r} has no samples")
        self.observation_space = UnicodeText(max_len)
        self.action_space = UnicodeText(max_len)
        self._sample: Sample | None = None
        self._chunks: Iterator[Chunk] | None = None

    # ----------------------------------------------------------------- construction
    def _resolve(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        given = {k: v for k, v in kwargs.items() if k in ENV_DEFAULTS}
        settings = {**ENV_DEFAULTS, **self.task.env, **given}
        # An explicit num_chunks or context_length replaces the task's default for the other.
        if given.get("context_length") is not None and given.get("num_chunks") is not None:
            raise ValueError("give num_chunks or context_length, not both (context_length sets the number "
                             "of chunks as ceil(context_length / chunk_size))")
        if given.get("context_length") is not None:
            settings["num_chunks"] = None
        elif given.get("num_chunks") is not None:
            settings["context_length"] = None
        _check_int(settings, "chunk_size", 1)
        _check_int(settings, "memory_budget", 1)
        _check_int(settings, "data_seed", 0)
        _check_int(settings, "max_text_length", 1)
        for key in ("num_chunks", "context_length"):
            if settings[key] is not None:
                _check_int(settings, key, 1)
        if settings["numbering"] not in NUMBERINGS:
            raise ValueError(f"numbering must be one of {NUMBERINGS}, got {settings['numbering']!r}")
        if settings["scorer"] not in SCORERS:
            raise ValueError(f"scorer must be one of {SCORERS}, got {settings['scorer']!r}")
        self.task.check_split(settings["split"])
        source_kwargs = {**self.task.source_kwargs, **{k: v for k, v in kwargs.items() if k not in ENV_DEFAULTS}}
        return settings, source_kwargs

    def _make_source(self, settings: dict[str, Any], source_kwargs: dict[str, Any]):
        sizing = {"chunk_size": settings["chunk_size"], "num_chunks": settings["num_chunks"],
                  "context_length": settings["context_length"], "counter": self.counter,
                  "numbering": settings["numbering"], "memory_budget": settings["memory_budget"]}
        for key in ("num_chunks", "context_length"):
            if sizing[key] is not None and not self.task.accepts(key):
                raise ValueError(f"task {self.task.name} does not take {key}: its input length comes from its data; "
                                 f"change chunk_size to change the number of chunks")
        sizing = {k: v for k, v in sizing.items() if v is not None and self.task.accepts(k)}
        if self.task.source is None:
            return self.task.make_source(self.split, settings["data_seed"], **source_kwargs)
        return self.task.make_source(self.split, settings["data_seed"], **sizing, **source_kwargs)

    # ----------------------------------------------------------------- gymnasium API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        index = self._select(options)
        sample = self.source[index]
        self._sample = sample
        first = first_label(self.numbering, sample.id)
        planned = getattr(sample.documents, "num_chunks_for", None)
        n = planned(self.chunk_size, self.counter, first) if planned else None
        self._num_chunks = n if n is not None else count_chunks(sample.documents, self.chunk_size, self.counter, first)
        self._chunks = iter_chunks(sample.documents, self.chunk_size, self.counter, first)
        self._memory, self._memory_size = "", 0
        self._cut = 0
        self._chunk_index = 0
        self._chunk = self._next_chunk() if self._num_chunks else ""
        self._phase = "memory" if self._num_chunks else "answer"  # an empty input goes straight to the answer
        self._final: dict[str, Any] = {}
        self._obs = self._observation()
        return self._obs, self._info()

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._check_action(action)  # before anything changes: a refused action leaves the episode as it was
        reward = 0.0
        if self._phase == "memory":
            memory, size, cut = self.counter.cut(action, self.memory_budget)
            self._chunk_index += 1
            if self._chunk_index < self._num_chunks:
                self._chunk = self._next_chunk()
            else:
                self._end_of_input()
                self._phase, self._chunk = "answer", ""
            self._memory, self._memory_size, self._cut = self._fit_memory(memory, size, cut)
        else:
            from memgym.scoring import score_answer  # lazy: the scorer is only needed at the end

            metrics = score_answer(action, list(self._sample.answers), hotpot_rules=self.hotpot_rules)
            metrics = {k: float(metrics[k]) for k in ("em", "f1", "sub_em")}
            reward = metrics[self.scorer]
            self._final = {"answers": list(self._sample.answers), "prediction": action, "metrics": metrics}
            self._phase, self._cut = "done", 0
        self._obs = self._observation()
        return self._obs, reward, self._phase == "done", False, self._info()

    @property
    def sample(self) -> Sample | None:
        """The sample of the running episode (None before the first reset)."""
        return self._sample

    def replace_memory(self, text: str) -> tuple[str, dict[str, Any]]:
        """Replace the memory the next step reads (the perturbed-memory control,
        :class:`memgym.perturb.MemoryPerturbation`): cut to the budget as an action is; returns the
        new observation and info."""
        if self._sample is None or self._phase == "done":
            raise ResetNeededError("replace_memory needs a running episode (reset first; not after the answer)")
        memory, size, cut = self.counter.cut(text, self.memory_budget)
        self._memory, self._memory_size, self._cut = self._fit_memory(memory, size, cut)
        self._obs = self._observation()
        return self._obs, self._info()

    def render(self) -> str | None:
        if self.render_mode == "ansi":
            return self._obs + "\n" if self._sample is not None else "(call reset() first)\n"
        return None

    # ----------------------------------------------------------------- internals
    def _check_action(self, action: Any) -> None:
        if self._sample is None:
            raise ResetNeededError("call env.reset() before env.step()")
        if self._phase == "done":
            raise EpisodeEndedError("the episode has ended (the answer was given); call env.reset() to start a new one")
        if not isinstance(action, str):
            raise TypeError(f"action must be a str (the new memory, or the final answer), got "
                            f"{type(action).__name__}: {action!r:.80}")
        if not self.action_space.contains(action):
            raise ValueError(f"the action has {len(action)} characters, more than the action space's "
                             f"max_text_length={self.action_space.max_length}; send a shorter action, or make "
                             f"the env with a larger max_text_length")

    def _select(self, options: dict[str, Any] | None) -> int:
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"reset options must be a dict such as {{'sample_id': 'q1'}} or {{'index': 0}}, got "
                            f"{type(options).__name__} {options!r:.80}")
        options = options or {}
        unknown = set(options) - set(RESET_OPTIONS)
        if unknown:
            raise ValueError(f"unknown reset option(s) {sorted(unknown)}; use 'sample_id' or 'index'")
        if "sample_id" in options and "index" in options:
            raise ValueError("give reset option 'sample_id' or 'index', not both")
        if "sample_id" in options:
            try:
                return self.source.index_of(options["sample_id"])
            except KeyError as exc:
                raise ValueError(f"reset option sample_id: {exc.args[0]}") from None
        if "index" in options:
            index = options["index"]
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(self.source):
                raise ValueError(f"reset option index must be an int in [0, {len(self.source)}), got {index!r}")
            return index
        return int(self.np_random.integers(len(self.source)))

    def _next_chunk(self) -> str:
        try:
            chunk = next(self._chunks, None)
        except ValueError as exc:  # a plan that cannot be packed: name the sample, so it can be replayed
            raise ValueError(f"sample {self._sample.id} of split {self.split!r} (reset option "
                             f"{{'sample_id': {self._sample.id!r}}}), chunk {self._chunk_index + 1}: {exc}") from exc
        if chunk is None:
            raise RuntimeError(f"sample {self._sample.id}: the input ended after {self._chunk_index} chunks, "
                               f"{self._num_chunks} were expected (the source's chunk plan is wrong)")
        return chunk.text

    def _end_of_input(self) -> None:
        if next(self._chunks, None) is not None:
            raise RuntimeError(f"sample {self._sample.id}: the input has more than the {self._num_chunks} chunks "
                               f"expected (the source's chunk plan is wrong)")
        self._chunks = None

    def _render(self, phase: str, memory: str, memory_size: int, answer: str = "") -> str:
        unit = self.counter.unit
        head = (f"[{self.task.id} | sample {self._sample.id} | chunk {min(self._chunk_index + 1, self._num_chunks)}"
                f"/{self._num_chunks} | memory {memory_size}/{self.memory_budget} {unit}]")
        lines = [head, f"Question: {self._sample.question}", "", "Memory:", memory or EMPTY_MEMORY, ""]
        if phase == "memory":
            lines += [f"Chunk {self._chunk_index + 1} of {self._num_chunks}:", self._chunk, "",
                      f"Write your new memory (at most {self.memory_budget} {unit}): keep what you need "
                      f"to answer the question."]
        elif phase == "answer":
            lines += [f"All {self._num_chunks} chunks have been read. Answer the question in a few words."]
        else:
            m = self._final.get("metrics", NO_METRICS)  # NO_METRICS: same width, to measure before the answer
            lines += [f"Your answer: {answer}", f"Gold answer(s): {' | '.join(self._sample.answers)}",
                      f"Score: f1={m['f1']:.2f} em={m['em']:.2f} sub_em={m['sub_em']:.2f}"]
        return "\n".join(lines)

    def _observation(self) -> str:
        max_len = self.observation_space.max_length
        answer = ""
        if self._phase == "done":  # an answer too long to show in full is shown cut; info keeps it whole
            room = max_len - len(self._render("done", self._memory, self._memory_size))
            answer = _shorten(self._final["prediction"], room)
        obs = self._render(self._phase, self._memory, self._memory_size, answer)
        if len(obs) > max_len:
            raise ValueError(f"the observation has {len(obs)} characters, more than max_text_length={max_len}; "
                             f"pass a larger max_text_length or a smaller chunk_size")
        return obs

    def _fit_memory(self, memory: str, size: int, cut: int) -> tuple[str, int, int]:
        """Shorten ``memory`` (already cut to the budget) so that every observation still to come
        fits max_text_length characters: at the last whitespace that fits, else mid-word."""
        phases = [self._phase] + (["done"] if self._phase == "answer" else [])
        # Measured with an empty memory and the widest header (the size never exceeds the budget).
        room = min(self.observation_space.max_length - len(self._render(p, "", self.memory_budget)) for p in phases)
        room = max(room + len(EMPTY_MEMORY), 0)
        if len(memory) <= room:
            return memory, size, cut
        end = max(memory.rfind(" ", 0, room + 1), memory.rfind("\n", 0, room + 1))
        kept = (memory[:end] if end > 0 else memory[:room]).rstrip()
        kept_size = self.counter.count(kept)
        return kept, kept_size, max(cut + size - kept_size, 1)  # a word cut part-way counts as cut

    def _info(self) -> dict[str, Any]:
        info = {
            "task_id": self.task.id,
            "sample_id": self._sample.id,
            "question": self._sample.question,
            "phase": self._phase,
            "chunk": self._chunk if self._phase == "memory" else "",
            "chunk_index": self._chunk_index,
            "num_chunks": self._num_chunks,
            "memory": self._memory,
            "memory_size": self._memory_size,
            "memory_budget": self.memory_budget,
            "budget_unit": self.counter.unit,
            "budget_tokenizer": self.counter.fingerprint,
            "memory_truncated": self._cut > 0,
            "memory_cut": self._cut,
        }
        info.update(self._final)
        return info


def _shorten(text: str, room: int) -> str:
    """``text`` in at most ``room`` characters, marked with CUT_MARK when cut."""
    if len(text) <= room:
        return text
    if room <= len(CUT_MARK):
        return text[:max(room, 0)]
    return text[:room - len(CUT_MARK)] + CUT_MARK


def _check_chunk_fits(chunk_size: int, max_text_length: int, unit: str) -> None:
    """Refuse a chunk_size no observation can hold (a generated task would fill it, for ever)."""
    per_unit = MIN_CHARS_PER_UNIT.get(unit, 1)
    bound = max_text_length // per_unit
    if chunk_size > bound:
        raise ValueError(f"chunk_size={chunk_size} {unit} cannot fit an observation of max_text_length="
                         f"{max_text_length} characters (a chunk of n {unit} takes at least {per_unit}n-"
                         f"{per_unit - 1} characters); use chunk_size <= {bound}, or raise max_text_length")


def _check_int(settings: dict[str, Any], key: str, minimum: int) -> None:
    value = settings[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{key} must be an int >= {minimum}, got {value!r}")


__all__ = ["MemoryQAEnv", "ENV_DEFAULTS", "SCORERS"]
