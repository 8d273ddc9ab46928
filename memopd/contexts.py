"""Context modes: which tokens a scorer sees for each recorded action (pure Python, no torch).

Both modes turn recorded :class:`~agents.records.Episode` objects into :class:`Unit` s, the input
of :func:`memopd.packing.pack_units`. A unit is an optional shared prefix plus private blocks;
each private block sees the prefix and itself (causally), never another block.

- ``aligned`` (MemOPD): every invocation is restored exactly as it was sampled — its own prompt
  ids, its recorded position ids, causal visibility of nothing but its own prompt. The episode's
  shared prefix (``prompt_ids[:prefix_len]``) is one prefix; each invocation's
  ``prompt_ids[prefix_len:] + response_ids`` is one private block.
- ``persistent`` (the paper's control): the episode flattened into one growing transcript,
  ``q, o_1, a_1, o_2, a_2, ..., o_n, a_n``, with continuous positions. ``q`` is the shared
  prefix; ``o_t`` is call t's private prompt with the memory it received removed
  (``Invocation.spans["memory"]``, prompt-relative ``[start, end)``; the memory is the earlier
  action, already in the transcript); ``a_t`` is the sampled response. A record without
  ``spans`` cannot say where its memory is and is refused. Every ``a_t`` is scored in place, so it is
  conditioned on all earlier chunks and actions — the state the student never saw.

Actions are enumerated canonically (episode, invocation, response token), so the same episodes
give the same action order in every mode, and results of two modes line up index by index.

:func:`check_contract` checks, before any work, that episodes carry what a mode (and the
trainer's reward and teacher mask) needs; a record that lacks it is refused with a
:class:`ContractError` naming the episode, its agent (``Episode.agent``) and the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from agents.records import ROLES, Episode, Invocation, RecordError

MODES = ("aligned", "persistent")


class PackingError(ValueError):
    """Records cannot be packed as asked (an invocation larger than the budget, bad settings)."""


class ContractError(PackingError):
    """Episodes lack what the learner needs (see :func:`check_contract`); the message names the
    episode, its agent and the record field."""


@dataclass
class Block:
    """A run of tokens stored contiguously in a row, with its recorded positions and actions.

    ``action_idx[k]`` is the index (in this block) of the k-th sampled token scored in it; its
    logits come from the token before it in the block's context ``prefix + block`` (for the first
    response token of a call whose private prompt is empty, that is the last prefix token).
    """

    ids: list[int]
    positions: list[int]
    action_idx: list[int] = field(default_factory=list)
    action_logprobs: list[float] = field(default_factory=list)
    action_temperature: list[float] = field(default_factory=list)
    action_teacher: list[bool] = field(default_factory=list)
    action_src: list[tuple[int, int, int]] = field(default_factory=list)  # (episode, invocation, token)
    invocation: int = -1  # the invocation this block restores (-1: several, persistent mode)
    episode: int = -1  # the episode it belongs to (-1: its unit's)

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class Unit:
    """A packing unit: an optional shared prefix and the private blocks that attend to it (of one
    episode, or of every episode with that prefix: a question's group of samples).

    ``key`` identifies the prefix: pieces of one split unit that land in the same row share one
    stored copy of it. ``episode`` is the first episode whose blocks it holds.
    """

    episode: int
    prefix_ids: list[int]
    prefix_positions: list[int]
    blocks: list[Block]
    key: tuple[Any, ...]

    @property
    def size(self) -> int:
        return len(self.prefix_ids) + sum(len(b) for b in self.blocks)


def temperature_of(inv: Invocation) -> float:
    """The temperature the record's log-probs refer to: 1.0 for a greedy call (arg-max sampling
    records log-probs at temperature 1, whatever temperature its settings carry) or a missing /
    non-positive one, else the sampling temperature."""
    sampling = inv.sampling or {}
    if sampling.get("greedy"):
        return 1.0
    t = sampling.get("temperature", 1.0)
    try:
        t = float(t)
    except (TypeError, ValueError):
        raise PackingError(f"sampling temperature {t!r} is not a number") from None
    return t if t > 0 else 1.0


def check_teacher_roles(teacher_roles: Iterable[str]) -> frozenset[str]:
    roles = frozenset(teacher_roles)
    bad = roles - set(ROLES)
    if bad:
        raise PackingError(f"teacher_roles {sorted(bad)} unknown; choose from {ROLES} (memory writes, answers or both)")
    return roles


def episode_invocations(episodes: Sequence[Episode | Sequence[Invocation]]) -> list[list[Invocation]]:
    """Accept Episode objects or plain lists of invocations."""
    out = []
    for i, ep in enumerate(episodes):
        invs = ep.invocations if hasattr(ep, "invocations") else ep
        invs = list(invs)
        if not all(isinstance(x, Invocation) for x in invs):
            raise PackingError(f"episode {i}: expected Invocation records, got {[type(x).__name__ for x in invs][:3]}")
        out.append(invs)
    return out


def _action_fields(inv: Invocation, ep: int, j: int, start: int, teacher: bool) -> dict[str, list]:
    n = len(inv.response_ids)
    t = temperature_of(inv)
    return dict(
        action_idx=[start + k for k in range(n)],
        action_logprobs=[float(x) for x in inv.logprobs],
        action_temperature=[t] * n,
        action_teacher=[teacher] * n,
        action_src=[(ep, j, k) for k in range(n)],
    )


def _lead(inv: Invocation) -> int:
    """Where a call's prompt stops being the same for the samples of a question at this turn: at
    the memory it received (``spans["memory"]``: every token before it is instructions, question
    and, in a chunk-first prompt order, the turn's chunk), else where the shared prefix ends."""
    mem = (inv.spans or {}).get("memory")
    return int(mem[0]) if mem and int(mem[0]) > inv.prefix_len else inv.prefix_len


def aligned_units(episodes: Sequence[Episode | Sequence[Invocation]], *, share_prefix: bool = True,
                  teacher_roles: Iterable[str] = ROLES, across_episodes: bool = True) -> list[Unit]:
    """Each invocation restored exactly, each unit's prefix stored once per row and its blocks
    attending to it (a two-level tree that every attention lowering expresses).

    Invocations with the same prefix (ids and positions) share it: within an episode, and with
    ``across_episodes`` across episodes too (the G samples of a question: same instructions and
    question at the same positions). With ``across_episodes`` a call's shared part also grows to
    the longest leading run it has in common with another call: its whole prompt when that is
    the same (a question's samples all start with one first call), else the prompt up to the
    memory it received when that is the same (with the chunk before the memory, a turn's chunk
    is then stored once for all the samples). ``share_prefix=False`` gives every invocation its
    own prefix copy."""
    roles = check_teacher_roles(teacher_roles)
    invocations = episode_invocations(episodes)
    key_at = lambda inv, cut: (cut, tuple(inv.prompt_ids[:cut]), tuple(inv.position_ids[:cut]))  # noqa: E731
    count: dict[tuple, int] = {}
    if share_prefix and across_episodes:
        for inv in (inv for invs in invocations for inv in invs if inv.response_ids):
            for cut in {inv.prompt_len, _lead(inv)}:
                count[key_at(inv, cut)] = count.get(key_at(inv, cut), 0) + 1
    units: list[Unit] = []
    groups: dict[tuple, Unit] = {}
    for e, invs in enumerate(invocations):
        for j, inv in enumerate(invs):
            p = inv.prefix_len
            cut = next((c for c in (inv.prompt_len, _lead(inv)) if c > p and count.get(key_at(inv, c), 0) > 1), p)
            if not share_prefix:
                key: tuple = (e, j)
            elif across_episodes and cut:
                key = key_at(inv, cut)
            else:
                key = (e, *key_at(inv, cut))
            block = Block(ids=list(inv.prompt_ids[cut:]) + list(inv.response_ids),
                          positions=list(inv.position_ids[cut:]), invocation=j, episode=e,
                          **_action_fields(inv, e, j, inv.prompt_len - cut, inv.role in roles))
            if key not in groups:
                groups[key] = Unit(e, list(inv.prompt_ids[:cut]), list(inv.position_ids[:cut]), [], key)
                units.append(groups[key])
            groups[key].blocks.append(block)
    return units


def observation_ids(inv: Invocation, where: str = "the invocation") -> tuple[list[int], list[int]]:
    """The private prompt of a call minus the memory it received (``inv.spans["memory"]``,
    prompt-relative ``[start, end)``), as (ids, original prompt indices). A record without
    ``spans`` is refused: keeping its memory would silently put a second copy of it in the
    transcript."""
    p = inv.prefix_len
    keep = list(range(p, inv.prompt_len))
    if inv.spans is None:
        raise ContractError(f"{where} has no spans, so the persistent-history context cannot find the memory it "
                           "received; the agent must record Invocation.spans (slot -> [start, end) of the prompt, "
                           "with 'memory' for the memory the call received; agents built on MemoryPolicy.request "
                           "do this)")
    span = inv.spans.get("memory")
    if span is not None:
        s, t = int(span[0]), int(span[1])
        if not p <= s <= t <= inv.prompt_len:
            raise ContractError(f"{where}: spans['memory'] {span} must lie in the private prompt "
                               f"[{p}, {inv.prompt_len})")
        keep = [i for i in keep if not s <= i < t]
    return [inv.prompt_ids[i] for i in keep], keep


def persistent_units(episodes: Sequence[Episode | Sequence[Invocation]], *,
                     teacher_roles: Iterable[str] = ROLES) -> list[Unit]:
    """One unit per episode: the flattened transcript ``q, o_1, a_1, ..., o_n, a_n`` as a single
    block with continuous positions (starting at the first recorded position of the episode)."""
    roles = check_teacher_roles(teacher_roles)
    units: list[Unit] = []
    for e, invs in enumerate(episode_invocations(episodes)):
        if not invs:
            continue
        first = invs[0]
        ids = list(first.prompt_ids[:first.prefix_len])
        block = Block(ids=[], positions=[])
        for j, inv in enumerate(invs):
            _check_same_prefix(first, inv, _where(episodes, e, j))
            obs, _ = observation_ids(inv, _where(episodes, e, j))
            ids += obs
            fields_ = _action_fields(inv, e, j, len(ids), inv.role in roles)
            ids += list(inv.response_ids)
            for name, vals in fields_.items():
                getattr(block, name).extend(vals)
        if block.action_idx and block.action_idx[0] == 0:
            raise ContractError(f"{_where(episodes, e)}: empty transcript before the first action (invocation 0 "
                                "has neither a shared prefix nor a private prompt)")
        start = first.position_ids[0]
        block.ids = ids
        block.positions = list(range(start, start + len(ids)))
        units.append(Unit(e, [], [], [block], key=(e, "persistent")))
    return units


def _check_same_prefix(first: Invocation, inv: Invocation, where: str) -> None:
    if list(inv.prompt_ids[:inv.prefix_len]) != list(first.prompt_ids[:first.prefix_len]):
        raise ContractError(f"{where}: its shared prefix (prompt_ids[:prefix_len]) differs from invocation 0's; a "
                            "persistent transcript needs one task prefix per episode (Invocation.prefix_len must "
                            "cover the same instructions + question in every call)")


def _name(episode: Episode | Sequence[Invocation], index: int) -> str:
    if isinstance(episode, Episode):
        return f"{index} ({episode.episode_id}{', agent ' + episode.agent if episode.agent else ''})"
    return str(index)


def _where(episodes: Sequence[Episode | Sequence[Invocation]], e: int, j: int | None = None) -> str:
    """How every message names a record: ``episode 3 (id, agent NAME) invocation 2``."""
    where = f"episode {_name(episodes[e], e)}"
    return where if j is None else f"{where} invocation {j}"


def check_contract(episodes: Sequence[Episode], mode: str = "aligned", *, teacher_roles: Iterable[str] | None = None,
                   reward: str | None = None) -> None:
    """Refuse episodes that lack what the learner needs, before any work.

    Every mode (state-aligned packing, PPO): ``Episode.invocations`` are valid
    :class:`~agents.records.Invocation` records (prompt, positions, sampled ids and their
    log-probs, ``prefix_len``, ``role``) and at least one episode sampled a token; ``reward`` is a
    finite number and ``metrics`` finite numbers. ``mode="persistent"`` also needs
    ``Invocation.spans`` (with ``"memory"`` for the memory a call received) and one shared prefix
    per episode. ``reward`` (a metric name, e.g. the trainer's ``--reward f1``) must be in every
    ``Episode.metrics``. ``teacher_roles`` (the teacher mask) must select some sampled token of
    the batch by ``Invocation.role``.

    Raises :class:`ContractError` naming the episode, its agent and the field."""
    if mode not in MODES:
        raise PackingError(f"unknown context mode {mode!r}; choose from {MODES}")
    roles = check_teacher_roles(teacher_roles) if teacher_roles is not None else None
    sampled: dict[str, int] = {r: 0 for r in ROLES}
    for e, ep in enumerate(episodes):
        if not isinstance(ep, Episode):
            raise ContractError(f"episode {e}: expected an agents.records.Episode (MemoryPolicy.end_episode returns "
                                f"one), got {type(ep).__name__}")
        _check_outcome(episodes, e, reward)
        for j, inv in enumerate(ep.invocations):
            _check_invocation(episodes, e, j, inv, mode)
            sampled[inv.role] += len(inv.response_ids)
    agents = sorted({ep.agent or "unnamed" for ep in episodes})
    if episodes and not any(sampled.values()):
        raise ContractError(f"agent {', '.join(agents)}: {len(episodes)} episodes hold no sampled token "
                            "(Episode.invocations is empty or every response_ids is); the learner trains on the "
                            "tokens an agent samples through its backend (MemoryPolicy.step yields requests)")
    if roles is not None and episodes and not any(sampled[r] for r in roles):
        held = sorted(r for r, n in sampled.items() if n)
        raise ContractError(f"agent {', '.join(agents)}: the teacher mask selects role(s) {sorted(roles)} but every "
                            f"sampled token is in a call of role {held} (Invocation.role); choose a teacher mask "
                            f"that includes {held[0]!r} (e.g. --teacher-mask both)")


def _check_outcome(episodes: Sequence[Episode], e: int, reward: str | None) -> None:
    ep = episodes[e]
    if ep.meta.get("cut"):  # cut by a rollout-depth budget: no outcome (distillation terms only)
        return
    if not _finite(ep.reward):
        raise ContractError(f"{_where(episodes, e)}: Episode.reward is {ep.reward!r}, not a finite number")
    if not isinstance(ep.metrics, dict) or not all(_finite(v) for v in ep.metrics.values()):
        raise ContractError(f"{_where(episodes, e)}: Episode.metrics must map names to finite numbers, got "
                            f"{ep.metrics!r}")
    if reward is not None and reward not in ep.metrics:
        raise ContractError(f"{_where(episodes, e)}: Episode.metrics has no {reward!r} (it has "
                            f"{sorted(ep.metrics)}), the reward the trainer reads; keep the env's final "
                            "info['metrics'] (MemoryPolicy.end_episode does)")


def _check_invocation(episodes: Sequence[Episode], e: int, j: int, inv: Any, mode: str) -> None:
    where = _where(episodes, e, j)
    if not isinstance(inv, Invocation):
        raise ContractError(f"{where}: expected an agents.records.Invocation (the backend writes one per model "
                            f"call), got {type(inv).__name__}")
    try:
        inv.validate()  # the record may have been edited after the backend wrote it
    except RecordError as exc:
        raise ContractError(f"{where}: {exc}") from None
    if mode == "persistent":
        observation_ids(inv, where)
        _check_same_prefix(episodes[e].invocations[0], inv, where)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def build_units(episodes: Sequence[Episode | Sequence[Invocation]], mode: str = "aligned", *,
                share_prefix: bool = True, teacher_roles: Iterable[str] = ROLES,
                across_episodes: bool = True) -> list[Unit]:
    """Units for a context mode (``aligned`` or ``persistent``)."""
    if mode == "aligned":
        return aligned_units(episodes, share_prefix=share_prefix, teacher_roles=teacher_roles,
                             across_episodes=across_episodes)
    if mode == "persistent":
        return persistent_units(episodes, teacher_roles=teacher_roles)
    raise PackingError(f"unknown context mode {mode!r}; choose from {MODES}")
