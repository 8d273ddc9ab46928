"""The MemoryPolicy API: an agent turns environment observations into actions.

An agent reads ``(obs, info)`` from a memgym environment (see the env contract: ``info`` carries
the phase, question, chunk and memory accounting) and returns the action text, making zero or
more model invocations on the way. Every invocation is recorded exactly (the backend fills an
:class:`agents.records.Invocation`), and when the episode ends the agent hands back an
:class:`agents.records.Episode`.

Batching: :meth:`MemoryPolicy.act_batch` takes the observations of many environments (one
*slot* per environment) and sends all their model calls of a round to the backend in one
``generate`` call. Agents write their per-step logic as a generator (:meth:`MemoryPolicy.step`)
that yields ``(GenerationRequest, SamplingParams)`` and receives the resulting ``Invocation``;
the base class drives all slots' generators in lockstep.

Single environment::

    obs, info = env.reset(seed=0)
    done = False
    while not done:
        obs, reward, done, _, info = env.step(agent.act(obs, info))
    episode = agent.end_episode(info, reward)
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generator, Sequence

from agents.records import Episode, Invocation

if TYPE_CHECKING:  # the backend interface is light, but keep `import agents.policy` minimal
    from agents.backends.base import Backend, GenerationRequest, SamplingParams

Call = tuple["GenerationRequest", "SamplingParams"]

class AgentError(RuntimeError):
    """The agent was driven out of protocol (wrong episode in a slot, missing final info, ...)."""


@dataclass
class EpisodeState:
    """What an agent keeps for one running episode (one slot)."""

    episode_id: str
    seed: int | None = None
    group_id: str | None = None
    task_id: str = ""
    sample_id: str = ""
    question: str = ""
    invocations: list[Invocation] = field(default_factory=list)
    prefix_ids: list[int] | None = None
    """The shared prefix ids (instructions + question), built on the first call."""
    memory_ids: list[int] = field(default_factory=list)
    """The memory as the agent's token ids: exactly the ids sampled by the last memory write
    (stop token stripped, cut to the env's budget when the env cut it)."""
    pending_memory: list[int] | None = None
    """Ids of the last memory action, until the env's next info says whether it was cut."""
    steps: int = 0
    """Actions returned so far in this episode."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Agent-specific state (e.g. the chunks a retrieval agent has read)."""


class MemoryPolicy(ABC):
    """Base class of agents. Subclasses implement :meth:`step`.

    Args:
        backend: the model backend (``None`` for agents that call no model, e.g. the oracle).
        tokenizer: the tokenizer prompts are built with; defaults to ``backend.tokenizer``.

    Class attributes: ``name`` is the agent's name in its records (``Episode.agent``; default:
    the class name); ``calls_model`` says whether its actions are sampled through ``backend``
    (a trainer can train only such an agent; a scripted agent sets it to ``False``).

    Constructor convention (what ``memopd.eval`` and ``memopd.train`` pass, see
    :mod:`agents.registry`): a model-backed agent takes ``backend=`` and ``sampling=`` keyword
    arguments; a scripted one takes ``tokenizer=``.
    """

    name: ClassVar[str] = "policy"
    calls_model: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:  # a subclass of MemAgent is not "memagent" in its records
            cls.name = cls.__name__

    def __init__(self, backend: "Backend | None" = None, tokenizer: Any = None) -> None:
        self.backend = backend
        if tokenizer is None and backend is not None:
            tokenizer = backend.tokenizer
        if tokenizer is None:
            raise ValueError(f"{type(self).__name__} needs a backend or a tokenizer")
        self.tokenizer = tokenizer
        self._episodes: dict[int, EpisodeState] = {}

    # ------------------------------------------------------------------ subclass hook
    @abstractmethod
    def step(self, state: EpisodeState, obs: str, info: dict[str, Any]) -> Any:
        """Decide the action for one observation.

        Either return the action ``str`` directly (no model call), or be a generator that yields
        ``(GenerationRequest, SamplingParams)`` pairs, receives each call's ``Invocation`` (already
        appended to ``state.invocations``) and finally returns the action ``str``.
        """

    # ------------------------------------------------------------------ episodes
    def begin_episode(self, slot: int = 0, *, episode_id: str | None = None, seed: int | None = None,
                      group_id: str | None = None) -> EpisodeState:
        """Start a fresh episode in ``slot`` (optional: :meth:`act` starts one when the slot is free)."""
        if slot in self._episodes:
            raise AgentError(f"slot {slot} already has a running episode ({self._episodes[slot].episode_id}); "
                             "call end_episode() or abort_episode() first")
        state = EpisodeState(episode_id=episode_id or uuid.uuid4().hex[:16], seed=seed, group_id=group_id)
        self._episodes[slot] = state
        return state

    def abort_episode(self, slot: int = 0) -> None:
        """Drop the running episode of ``slot`` without producing a record."""
        self._episodes.pop(slot, None)

    def state(self, slot: int = 0) -> EpisodeState:
        """The running episode of ``slot``."""
        if slot not in self._episodes:
            raise AgentError(f"slot {slot} has no running episode")
        return self._episodes[slot]

    def end_episode(self, info: dict[str, Any], reward: float | None = None, slot: int = 0) -> Episode:
        """Close the episode of ``slot`` with the env's final ``info`` and return its record.

        ``info`` must be the info of the terminating step (it holds answers, prediction, metrics).
        ``reward`` defaults to the env's F1.
        """
        missing = [k for k in ("answers", "prediction", "metrics") if k not in info]
        if missing:
            raise AgentError(f"end_episode needs the info of the terminating step; it lacks {missing} "
                             f"(phase is {info.get('phase')!r})")
        state = self._episodes.pop(slot, None)
        if state is None:
            raise AgentError(f"slot {slot} has no running episode to end")
        metrics = {k: float(v) for k, v in info["metrics"].items()}
        episode = Episode(
            episode_id=state.episode_id,
            task_id=str(info.get("task_id", state.task_id)),
            sample_id=str(info.get("sample_id", state.sample_id)),
            invocations=state.invocations,
            reward=float(metrics.get("f1", 0.0) if reward is None else reward),
            metrics=metrics,
            prediction=str(info["prediction"]),
            answers=[str(a) for a in info["answers"]],
            question=state.question or str(info.get("question", "")),
            seed=state.seed,
            group_id=state.group_id,
            agent=self.name,
            meta={"num_chunks": _plain(info.get("num_chunks")),
                  "memory_budget": _plain(info.get("memory_budget")),
                  "budget_unit": _plain(info.get("budget_unit")), "steps": state.steps},
        )
        if info.get("perturbations"):  # the perturbed-memory control (memgym.perturb) replaced a memory
            from memgym.perturb import Perturbation

            episode.perturbations = [Perturbation.from_dict(d) for d in info["perturbations"]]
        return episode

    def cut_episode(self, slot: int = 0) -> Episode:
        """Close the episode of ``slot`` before the env ends it (a rollout-depth budget): the
        record holds the calls made so far, no prediction and no metrics, and ``Episode.cut`` is
        the number of calls. A learner gives it no reward (distillation terms only)."""
        state = self._episodes.pop(slot, None)
        if state is None:
            raise AgentError(f"slot {slot} has no running episode to cut")
        episode = Episode(episode_id=state.episode_id, task_id=state.task_id, sample_id=state.sample_id,
                          invocations=state.invocations, reward=0.0, metrics={}, question=state.question,
                          seed=state.seed, group_id=state.group_id, agent=self.name, meta={"steps": state.steps})
        episode.cut = len(state.invocations)
        return episode

    # ------------------------------------------------------------------ acting
    def act(self, obs: str, info: dict[str, Any], slot: int = 0) -> str:
        """The action for one environment's observation."""
        return self.act_batch([(obs, info)], [slot])[0]

    def act_batch(self, batch: Sequence[tuple[str, dict[str, Any]]], slots: Sequence[int] | None = None) -> list[str]:
        """Actions for several environments at once; their model calls are batched per round.

        ``slots[i]`` names the episode ``batch[i]`` belongs to (default: ``0..len(batch)-1``).
        """
        slots = list(range(len(batch))) if slots is None else list(slots)
        if len(slots) != len(batch):
            raise ValueError(f"got {len(batch)} observations but {len(slots)} slots")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots must be distinct, got {slots}")
        states = [self._state_for(slot, info) for (_, info), slot in zip(batch, slots)]
        actions: list[str | None] = [None] * len(batch)
        running: dict[int, tuple[Generator, Call]] = {}
        for i, ((obs, info), state) in enumerate(zip(batch, states)):
            self._advance(i, self.step(state, obs, info), None, actions, running)
        while running:
            if self.backend is None:
                raise AgentError(f"{type(self).__name__} requested a model call but has no backend")
            groups: dict[str, list[int]] = defaultdict(list)
            for i, (_, (_, sampling)) in running.items():
                groups[json.dumps(sampling.to_dict(), sort_keys=True)].append(i)
            for idx in groups.values():
                sampling = running[idx[0]][1][1]
                invs = self.backend.generate([running[i][1][0] for i in idx], sampling)
                for i, inv in zip(idx, invs):
                    states[i].invocations.append(inv)
                    gen = running.pop(i)[0]
                    self._advance(i, gen, inv, actions, running)
        for state in states:
            state.steps += 1
        return actions  # type: ignore[return-value]

    def _advance(self, i: int, out: Any, value: Invocation | None, actions: list, running: dict) -> None:
        if isinstance(out, str):
            actions[i] = out
            return
        try:
            call = out.send(value)
        except StopIteration as stop:
            if not isinstance(stop.value, str):
                raise AgentError(f"{type(self).__name__}.step must return a str action, got "
                                 f"{type(stop.value).__name__}") from None
            actions[i] = stop.value
            return
        running[i] = (out, call)

    def _state_for(self, slot: int, info: dict[str, Any]) -> EpisodeState:
        state = self._episodes.get(slot) or self.begin_episode(slot)
        sample_id = str(info.get("sample_id", ""))
        if state.steps == 0:
            self._check_unit(info)
            state.task_id = str(info.get("task_id", ""))
            state.sample_id = sample_id
            state.question = str(info.get("question", ""))
        elif sample_id != state.sample_id or (info.get("phase") == "memory" and info.get("chunk_index") == 0):
            raise AgentError(f"slot {slot} is in episode {state.episode_id} (sample {state.sample_id!r}, "
                             f"{state.steps} steps) but got the start of another episode (sample {sample_id!r}); "
                             "call end_episode() after the env terminates, or abort_episode()")
        return state

    def _check_unit(self, info: dict[str, Any]) -> None:
        """The env counts the memory budget in tokens of its tokenizer; an agent with another one
        would cap, cut and record its memory in another unit (its records' memory ids would not be
        what the env kept). Said at the episode's first step, before any model call."""
        expected = info.get("budget_tokenizer")
        if expected is None or self.tokenizer is None:
            return
        from memgym.chunking import tokenizer_fingerprint

        try:
            own = tokenizer_fingerprint(self.tokenizer)
        except (AttributeError, TypeError, ValueError):
            return  # not a Hugging Face fast tokenizer: nothing to compare
        if own != expected:
            raise AgentError(f"{type(self).__name__}'s tokenizer is not the env's (the env counts the memory budget "
                             f"in tokens of its own tokenizer, {expected}; the agent's is {own}); make the env "
                             "with the agent's tokenizer: gym.make(env_id, tokenizer=agent.tokenizer)")

    # ------------------------------------------------------------------ helpers for subclasses
    def request(self, state: EpisodeState, prompt: Any, role: str, **meta: Any) -> "GenerationRequest":
        """A generation request for a prompt built by :class:`agents.prompts.PromptBuilder`."""
        from agents.backends.base import GenerationRequest

        return GenerationRequest(prompt_ids=prompt.ids, prefix_len=prompt.prefix_len, role=role,
                                 turn=len(state.invocations), spans={k: list(v) for k, v in prompt.spans.items()},
                                 meta={"episode_id": state.episode_id, **meta})

    def sync_memory(self, state: EpisodeState, info: dict[str, Any]) -> None:
        """Adopt the last memory write as ``state.memory_ids``, cut the way the env cut it, or the
        memory the env put in its place (``info["memory_replaced"]``, the perturbed-memory control).

        With a token budget the env keeps the first ``memory_size`` tokens, so the agent keeps the
        first ``memory_size`` sampled ids. With a word budget, it keeps the longest prefix of the
        sampled ids whose text the env kept.
        """
        ids, state.pending_memory = state.pending_memory, None
        if info.get("memory_replaced"):  # the env replaced the memory (memgym.perturb): the next call reads it
            state.memory_ids = self.encode_memory(str(info.get("memory", "")))
            return
        if ids is None:
            return
        if info.get("memory_truncated"):
            if info.get("budget_unit") == "tokens":
                ids = ids[: int(info["memory_size"])]
            else:
                ids = self._ids_within_text(ids, str(info.get("memory", "")))
        state.memory_ids = list(ids)

    def encode_memory(self, text: str) -> list[int]:
        """Token ids of a memory the env wrote (not sampled): data text, no special tokens."""
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def _ids_within_text(self, ids: list[int], kept: str) -> list[int]:
        lo, hi = 0, len(ids)  # largest k with decode(ids[:k]) a prefix of the kept text
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if kept.startswith(self.decode(ids[:mid]).strip()):
                lo = mid
            else:
                hi = mid - 1
        return ids[:lo]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def strip_stop(inv: Invocation) -> list[int]:
    """The sampled ids without the final stop token (when the call stopped on one)."""
    ids = list(inv.response_ids)
    if inv.finish_reason in ("eos", "stop") and ids:
        ids = ids[:-1]
    return ids


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value
