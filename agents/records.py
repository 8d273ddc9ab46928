"""Exact records of model invocations and episodes (token in, token out).

An :class:`Invocation` is everything the learner needs to restore the exact state a model call
saw: the prompt token ids, the position ids used at sampling time, the sampled token ids and
their sampling log-probs, and which prompt span is the episode's shared prefix. An
:class:`Episode` is an episode's invocations plus its reward and metrics. Both round-trip
losslessly through JSON (Python floats are written with ``repr`` precision).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

if TYPE_CHECKING:
    from memgym.perturb import Perturbation

ROLES = ("memory", "answer")


class RecordError(ValueError):
    """A record is malformed (wrong lengths, missing fields, bad JSON)."""


_ATOMS = (int, float, str, bool, type(None))


def plain(value: Any) -> Any:
    """``dataclasses.asdict``'s conversion, without its deep copy of every number: a record's id
    and log-prob lists are copied as lists (writing episodes through ``asdict`` took as long as
    sampling them in a 192-chunk evaluation). Lists, tuples and dicts are new containers, as with
    ``asdict``; other objects are deep-copied, as ``asdict`` does."""
    kind = type(value)
    if kind in _ATOMS:
        return value
    if kind is list or kind is tuple:
        out = [x if type(x) in _ATOMS else plain(x) for x in value]
        return out if kind is list else tuple(out)
    if kind is dict:
        return {plain(k): plain(v) for k, v in value.items()}
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in fields(value)}
    return copy.deepcopy(value)


def _set_meta(meta: dict[str, Any], key: str, value: Any) -> None:
    """A typed field kept in ``meta`` (the file format): None removes it."""
    if value is None:
        meta.pop(key, None)
    else:
        meta[key] = value


@dataclass
class Invocation:
    """One model call, exactly as it was sampled.

    Lengths: ``len(position_ids) == len(prompt_ids) + len(response_ids)`` (positions of the
    prompt tokens, then of the sampled tokens) and ``len(logprobs) == len(response_ids)``.
    ``prompt_ids[:prefix_len]`` is the episode's shared prefix (instructions + question); it is
    identical in every invocation of the episode.
    ``logprobs[k]`` is log p(response_ids[k]) under softmax(logits / temperature) over the full
    vocabulary, the distribution sampled from (``sampling`` records temperature and top-p; a
    greedy call records them at temperature 1).
    ``spans`` names the segments the agent built the prompt from: slot -> ``[start, end)`` in
    ``prompt_ids`` (e.g. ``"memory"``, ``"chunk"``). ``spans["memory"]`` is the memory this call
    received, which the persistent-history control removes; a recorded ``spans`` without
    ``"memory"`` says the call received none; ``None`` says nothing is known (the learner then
    refuses the persistent control for it). Older records' ``meta["spans"]`` and
    ``meta["memory_span"]`` are read into it.
    ``topk_ids[k]`` / ``topk_logprobs[k]``: the likeliest tokens of the distribution
    ``response_ids[k]`` was sampled from and their log-probs, most likely first, where the backend
    was asked to record them (``Backend.record_topk``); None otherwise.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    position_ids: list[int]
    prefix_len: int
    role: str = "memory"
    turn: int = 0
    policy_version: int = 0
    finish_reason: str = "eos"
    sampling: dict[str, Any] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)
    response_text: str = ""
    spans: dict[str, list[int]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None

    def __post_init__(self) -> None:
        self._adopt_legacy_spans()
        self.validate()

    @property
    def teacher_kl(self) -> list[float | None] | None:
        """The trainer's per-token divergence to the teacher (one value per response token, None
        where the teacher does not supervise), as a run's ``episodes/step-N.jsonl`` records it for
        the viewer; None when not scored. Kept in ``meta["teacher_kl"]``, the file format, with the
        context it was scored in as ``meta["teacher_mode"]`` (:attr:`teacher_mode`)."""
        return self.meta.get("teacher_kl")

    @teacher_kl.setter
    def teacher_kl(self, values: list[float | None] | None) -> None:
        _set_meta(self.meta, "teacher_kl", values)

    @property
    def teacher_mode(self) -> str | None:
        """The context :attr:`teacher_kl` was scored in (aligned or persistent)."""
        return self.meta.get("teacher_mode")

    @teacher_mode.setter
    def teacher_mode(self, mode: str | None) -> None:
        _set_meta(self.meta, "teacher_mode", mode)


    def _adopt_legacy_spans(self) -> None:
        """Records written before ``spans`` was a field kept it in ``meta``."""
        if self.spans is None and isinstance(self.meta, dict):
            if isinstance(self.meta.get("spans"), dict):
                self.meta = dict(self.meta)
                self.spans = self.meta.pop("spans")
            elif self.meta.get("memory_span") is not None:
                self.meta = dict(self.meta)
                self.spans = {"memory": self.meta.pop("memory_span")}
        if self.spans is not None:
            self.spans = {str(k): list(v) if isinstance(v, (list, tuple)) else v for k, v in self.spans.items()}

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def input_ids(self) -> list[int]:
        """Prompt followed by the sampled response: the sequence a re-scorer runs."""
        return list(self.prompt_ids) + list(self.response_ids)

    def validate(self) -> None:
        n_p, n_r = len(self.prompt_ids), len(self.response_ids)
        if n_p == 0:
            raise RecordError("invocation has an empty prompt")
        if len(self.position_ids) != n_p + n_r:
            raise RecordError(
                f"position_ids has {len(self.position_ids)} entries, expected prompt+response = {n_p + n_r}")
        if len(self.logprobs) != n_r:
            raise RecordError(f"logprobs has {len(self.logprobs)} entries, expected one per response token ({n_r})")
        if not 0 <= self.prefix_len <= n_p:
            raise RecordError(f"prefix_len={self.prefix_len} outside the prompt (length {n_p})")
        if self.role not in ROLES:
            raise RecordError(f"role {self.role!r} is not one of {ROLES}")
        for name in ("prompt_ids", "response_ids", "position_ids"):
            if not all(type(t) is int for t in getattr(self, name)):
                raise RecordError(f"{name} must be a list of integers")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in self.logprobs):
            raise RecordError("logprobs must be a list of numbers")
        if any(not math.isfinite(x) or x > 1e-6 for x in self.logprobs):
            raise RecordError("logprobs must be finite and <= 0")
        if (self.topk_ids is None) != (self.topk_logprobs is None):
            raise RecordError("topk_ids and topk_logprobs come together (both or neither)")
        if self.topk_ids is not None and not (len(self.topk_ids) == len(self.topk_logprobs) == n_r and all(
                len(i) == len(v) for i, v in zip(self.topk_ids, self.topk_logprobs))):
            raise RecordError(f"topk_ids and topk_logprobs must have one equal-length list per response token ({n_r})")
        if self.spans is not None:
            for slot, se in self.spans.items():
                if not (isinstance(se, list) and len(se) == 2 and all(type(x) is int for x in se)
                        and 0 <= se[0] <= se[1] <= n_p):
                    raise RecordError(f"spans[{slot!r}] = {se!r} is not [start, end) within the prompt (length {n_p})")

    def to_dict(self) -> dict[str, Any]:
        return plain(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Invocation":
        if not isinstance(d, dict):
            raise RecordError(f"an invocation must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        missing = {"prompt_ids", "response_ids", "logprobs", "position_ids", "prefix_len"} - d.keys()
        if missing:
            raise RecordError(f"invocation is missing fields {sorted(missing)}")
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class Episode:
    """One episode: its invocations in call order, the final reward and metrics.

    What the learner reads (see docs/extend.md, "Bring your own agent"): ``invocations`` (each call's
    exact record, ``role`` for the teacher mask, ``spans`` for the persistent-history control),
    ``reward`` and ``metrics`` (the trainer's ``--reward`` names a metric), ``group_id`` (episodes
    of one question, for group-relative advantages) and ``agent`` (named in its error messages).
    """

    episode_id: str
    task_id: str
    sample_id: str
    invocations: list[Invocation]
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    prediction: str = ""
    answers: list[str] = field(default_factory=list)
    question: str = ""
    seed: int | None = None
    group_id: str | None = None
    agent: str = ""
    """The name of the agent that played the episode (``MemoryPolicy.name``); the learner names
    it when the records lack what a mode needs. Older records' ``meta["agent"]`` is read into it."""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.agent and isinstance(self.meta, dict) and self.meta.get("agent") is not None:
            self.meta = dict(self.meta)  # records written before ``agent`` was a field kept it in meta
            self.agent = self.meta.pop("agent")
        if not isinstance(self.agent, str):
            raise RecordError(f"episode {self.episode_id!r}: agent must be the agent's name (a string), "
                              f"got {type(self.agent).__name__}")

    @property
    def cut(self) -> int | None:
        """The number of calls an episode was cut at before its answer (a rollout-depth budget, a
        drift stop; :meth:`agents.policy.MemoryPolicy.cut_episode`), None for an episode that ran
        to its answer. A learner gives a cut episode no reward. Kept in ``meta["cut"]``."""
        return self.meta.get("cut")

    @cut.setter
    def cut(self, calls: int | None) -> None:
        _set_meta(self.meta, "cut", calls)

    @property
    def turns(self) -> int | None:
        """The turns the whole episode has (a memory call per chunk and the answer), recorded for a
        cut episode; None when not known. Kept in ``meta["turns"]``."""
        return self.meta.get("turns")

    @turns.setter
    def turns(self, turns: int | None) -> None:
        _set_meta(self.meta, "turns", turns)

    @property
    def dropped_facts(self) -> list[str] | None:
        """What a scripted oracle's final memory lacked for the right answer (the memory budget
        could not hold it, or it was never read whole); None when it held everything, or for an
        agent that is not scripted. Kept in ``meta["dropped_facts"]``."""
        return self.meta.get("dropped_facts")

    @dropped_facts.setter
    def dropped_facts(self, facts: list[str] | None) -> None:
        _set_meta(self.meta, "dropped_facts", facts)

    @property
    def perturbations(self) -> list["Perturbation"] | None:
        """The memories the perturbed-memory control replaced in this episode
        (:class:`memgym.perturb.Perturbation`: kind, after which chunk, what was there, what replaced
        it, whether a supporting fact was read again); None for an unperturbed episode. Kept in
        ``meta["perturbations"]``."""
        from memgym.perturb import Perturbation

        raw = self.meta.get("perturbations")
        return [Perturbation.from_dict(d) for d in raw] if raw else None

    @perturbations.setter
    def perturbations(self, records: list["Perturbation"] | None) -> None:
        _set_meta(self.meta, "perturbations", [r.to_dict() for r in records] if records else None)


    def to_dict(self) -> dict[str, Any]:
        return plain(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Episode":
        if not isinstance(d, dict):
            raise RecordError(f"an episode must be a JSON object, got {type(d).__name__}")
        missing = {"episode_id", "task_id", "sample_id", "invocations"} - d.keys()
        if missing:
            raise RecordError(f"episode is missing fields {sorted(missing)}")
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if not isinstance(d["invocations"], list):
            raise RecordError(f"'invocations' must be a list, got {type(d['invocations']).__name__}")
        invs = []
        for i, inv in enumerate(d["invocations"]):
            try:
                invs.append(Invocation.from_dict(inv))
            except (RecordError, TypeError) as exc:
                raise RecordError(f"invocation {i}: {exc}") from None
        kw["invocations"] = invs
        return cls(**kw)

    @classmethod
    def from_json(cls, line: str) -> "Episode":
        try:
            d = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecordError(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
        return cls.from_dict(d)


def save_episodes(path: str | Path, episodes: Iterable[Episode], append: bool = False) -> int:
    """Write episodes as JSONL (one per line); returns how many were written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("a" if append else "w", encoding="utf-8") as fh:
        for ep in episodes:
            fh.write(ep.to_json() + "\n")
            n += 1
    return n


@dataclass
class LoadReport:
    """What :func:`load_episodes` read: the good episodes and ``(line, message)`` for bad lines."""

    episodes: list[Episode]
    errors: list[tuple[int, str]]


def iter_episode_lines(path: str | Path) -> Iterator[tuple[int, Episode | RecordError]]:
    """``(line number, Episode or the RecordError saying why that line is not one)``; lines are
    decoded one by one, so a binary or mis-encoded line is reported, not fatal."""
    with Path(path).open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield lineno, RecordError("not UTF-8 text (is this a binary file?)")
                continue
            if not line.strip():
                continue
            try:
                yield lineno, Episode.from_json(line)
            except (RecordError, TypeError, ValueError) as exc:
                yield lineno, RecordError(str(exc))


def load_episodes(path: str | Path, strict: bool = False) -> LoadReport:
    """Read episodes JSONL. A corrupt or truncated line is reported with its line number and
    skipped; the other lines are still read. ``strict=True`` raises on the first bad line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"episodes file not found: {path}")
    episodes, errors = [], []
    for lineno, item in iter_episode_lines(path):
        if isinstance(item, RecordError):
            if strict:
                raise RecordError(f"{path}:{lineno}: {item}")
            errors.append((lineno, str(item)))
        else:
            episodes.append(item)
    return LoadReport(episodes, errors)
