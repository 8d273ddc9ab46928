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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from agents.records import ROLES, Episode, Invocation

MODES = ("aligned", "persistent")


class PackingError(ValueError):
    """Records cannot be packed as asked (an invocation larger than the budget, bad settings)."""


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

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class Unit:
    """A packing unit: an optional shared prefix and the private blocks that attend to it.

    ``key`` identifies the prefix: pieces of one split unit that land in the same row share one
    stored copy of it.
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


def aligned_units(episodes: Sequence[Episode | Sequence[Invocation]], *, share_prefix: bool = True,
                  teacher_roles: Iterable[str] = ROLES) -> list[Unit]:
    """Each invocation restored exactly; invocations of an episode with the same prefix (ids and
    positions) share it. ``share_prefix=False`` gives every invocation its own prefix copy."""
    roles = check_teacher_roles(teacher_roles)
    units: list[Unit] = []
    for e, invs in enumerate(episode_invocations(episodes)):
        groups: dict[tuple, Unit] = {}
        for j, inv in enumerate(invs):
            p = inv.prefix_len
            pre_ids, pre_pos = list(inv.prompt_ids[:p]), list(inv.position_ids[:p])
            key = (e, tuple(pre_ids), tuple(pre_pos)) if share_prefix else (e, j)
            block = Block(ids=list(inv.prompt_ids[p:]) + list(inv.response_ids),
                          positions=list(inv.position_ids[p:]), invocation=j,
                          **_action_fields(inv, e, j, inv.prompt_len - p, inv.role in roles))
            if key not in groups:
                groups[key] = Unit(e, pre_ids, pre_pos, [], key)
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
        raise PackingError(f"{where} has no spans, so the persistent-history context cannot find the memory it "
                           "received; the agent must record Invocation.spans (slot -> [start, end) of the prompt, "
                           "with 'memory' for the memory the call received; agents built on MemoryPolicy.request "
                           "do this)")
    span = inv.spans.get("memory")
    if span is not None:
        s, t = int(span[0]), int(span[1])
        if not p <= s <= t <= inv.prompt_len:
            raise PackingError(f"{where}: spans['memory'] {span} must lie in the private prompt "
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
            if list(inv.prompt_ids[:inv.prefix_len]) != list(first.prompt_ids[:first.prefix_len]):
                raise PackingError(f"episode {e} invocation {j}: its shared prefix differs from invocation 0's; "
                                   "a persistent transcript needs one task prefix per episode")
            obs, _ = observation_ids(inv, f"episode {_name(episodes[e], e)} invocation {j}")
            ids += obs
            fields_ = _action_fields(inv, e, j, len(ids), inv.role in roles)
            ids += list(inv.response_ids)
            for name, vals in fields_.items():
                getattr(block, name).extend(vals)
        if block.action_idx and block.action_idx[0] == 0:
            raise PackingError(f"episode {e}: empty transcript before the first action")
        start = first.position_ids[0]
        block.ids = ids
        block.positions = list(range(start, start + len(ids)))
        units.append(Unit(e, [], [], [block], key=(e, "persistent")))
    return units


def _name(episode: Episode | Sequence[Invocation], index: int) -> str:
    if isinstance(episode, Episode):
        agent = (episode.meta or {}).get("agent")
        return f"{index} ({episode.episode_id}{', agent ' + str(agent) if agent else ''})"
    return str(index)


def build_units(episodes: Sequence[Episode | Sequence[Invocation]], mode: str = "aligned", *,
                share_prefix: bool = True, teacher_roles: Iterable[str] = ROLES) -> list[Unit]:
    """Units for a context mode (``aligned`` or ``persistent``)."""
    if mode == "aligned":
        return aligned_units(episodes, share_prefix=share_prefix, teacher_roles=teacher_roles)
    if mode == "persistent":
        return persistent_units(episodes, teacher_roles=teacher_roles)
    raise PackingError(f"unknown context mode {mode!r}; choose from {MODES}")
