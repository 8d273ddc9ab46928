"""State-aligned packing: recorded invocations of many episodes -> packed rows under a token budget.

Rows are filled by best-fit decreasing over packing units (the invocations that share a prefix:
an episode's, and those of every episode with the same prefix, e.g. a question's G samples; see
:mod:`memopd.contexts`). A unit's shared prefix is stored once per row it lands
in; a unit that fits no row whole (larger than the budget, or larger than any row's room) is
split across rows at invocation boundaries, with its prefix repeated in each piece.
Every token keeps its recorded position id. The segment structure (which block each token
belongs to and which prefix each block attends to) is explicit in the batch: boundaries are
never inferred from position ids, which may legitimately start above 0 or continue across
blocks. :mod:`memopd.attention` lowers that structure to a mask for the attention backend.

Action tokens (sampled response tokens) are listed once each, in canonical order (episode,
invocation, token): ``action_rows/action_cols`` is the gather index of the position *before*
each sampled token (the hidden state whose logits predict it).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, fields, replace
from typing import Iterable, Sequence

import torch

from agents.records import ROLES, Episode, Invocation
from memopd.contexts import Block, PackingError, Unit, build_units


@dataclass(frozen=True)
class Segment:
    """A contiguous run of a row: a shared prefix or one private block."""

    start: int  # first column in the row
    end: int  # one past the last column
    block: int  # block id within the row (index into PackedBatch.block_prefix[row])
    prefix: int  # block id of the prefix this block attends to; -1: none (or this is a prefix)
    is_prefix: bool
    episode: int  # index of the episode in the packed input
    invocation: int  # invocation index; -1 for a shared prefix or a persistent transcript


PER_ACTION_FIELDS = ("action_rows", "action_cols", "action_ids", "action_blocks", "old_logprobs", "temperatures",
                     "teacher", "advantages", "token_map", "action_uid")


@dataclass
class PackedBatch:
    """Packed rows and their action tokens. R rows of L columns, B = max blocks in a row,
    N action tokens. Row tensors are padded: ``block_ids == -1`` marks padding."""

    input_ids: torch.Tensor  # [R, L] long; pad_token_id in padding
    position_ids: torch.Tensor  # [R, L] long; the recorded position ids (0 in padding)
    block_ids: torch.Tensor  # [R, L] long; block id within the row, -1 = padding
    block_prefix: torch.Tensor  # [R, B] long; block b also sees block block_prefix[r, b] (its prefix); -1 = none
    action_mask: torch.Tensor  # [R, L] bool; column holds a sampled token
    teacher_mask: torch.Tensor  # [R, L] bool; sampled token the teacher supervises (<= action_mask)
    action_rows: torch.Tensor  # [N] long; row of the position before each sampled token
    action_cols: torch.Tensor  # [N] long; column of the position before each sampled token
    action_ids: torch.Tensor  # [N] long; the sampled token ids (targets)
    action_blocks: torch.Tensor  # [N] long; block id (in its row) of the block holding the sampled token
    old_logprobs: torch.Tensor  # [N] float32; sampling log-probs recorded at rollout
    temperatures: torch.Tensor  # [N] float32; sampling temperature of each token's call
    teacher: torch.Tensor  # [N] bool; teacher mask over action tokens
    advantages: torch.Tensor  # [N] float32; zeros, filled in by the trainer
    token_map: torch.Tensor  # [N, 3] long; (episode, invocation, response token index)
    action_uid: torch.Tensor  # [N] long; index in the canonical order of the full batch
    segments: list[list[Segment]]  # per row, in column order
    mode: str = "aligned"

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def row_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_actions(self) -> int:
        return self.action_ids.shape[0]

    @property
    def gather_index(self) -> torch.Tensor:
        """[N] flat index into ``[R * L]`` of the position before each sampled token."""
        return self.action_rows * self.row_len + self.action_cols

    @property
    def num_real_tokens(self) -> int:
        return int((self.block_ids >= 0).sum())

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.num_real_tokens / max(1, self.block_ids.numel())

    def to(self, device: torch.device | str) -> "PackedBatch":
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)

    def select_rows(self, rows: Sequence[int]) -> "PackedBatch":
        """A batch of a subset of rows (micro-batching); action uids are kept."""
        rows_t = torch.as_tensor(list(rows), dtype=torch.long)
        remap = torch.full((self.num_rows,), -1, dtype=torch.long)
        remap[rows_t] = torch.arange(len(rows_t))
        keep = remap[self.action_rows] >= 0
        per_action = {n: getattr(self, n)[keep] for n in PER_ACTION_FIELDS}
        per_action["action_rows"] = remap[self.action_rows[keep]]
        per_row = {n: getattr(self, n)[rows_t] for n in ("input_ids", "position_ids", "block_ids", "block_prefix",
                                                          "action_mask", "teacher_mask")}
        return replace(self, **per_action, **per_row, segments=[self.segments[r] for r in rows_t.tolist()])

    def micro_batches(self, rows_per_batch: int) -> list["PackedBatch"]:
        return [self.select_rows(range(i, min(i + rows_per_batch, self.num_rows)))
                for i in range(0, self.num_rows, rows_per_batch)]

    def per_invocation(self, values: torch.Tensor) -> dict[tuple[int, int], torch.Tensor]:
        """Split a per-action tensor ``[N, ...]`` into ``{(episode, invocation): [n_tokens, ...]}``
        ordered by response token."""
        out: dict[tuple[int, int], list[int]] = {}
        for i, (e, j, _) in enumerate(self.token_map.tolist()):
            out.setdefault((e, j), []).append(i)
        # canonical order makes each list already sorted by token index
        return {k: values[torch.as_tensor(v, device=values.device)] for k, v in out.items()}


def _check_fits(units: Sequence[Unit], max_tokens: int) -> None:
    for u in units:
        p = len(u.prefix_ids)
        for blk in u.blocks:
            if p + len(blk) > max_tokens:
                what = (f"episode {u.episode} invocation {blk.invocation}: prefix {p} + block {len(blk)} tokens"
                        if blk.invocation >= 0 else f"episode {u.episode}: the persistent transcript has")
                raise PackingError(f"{what} {p + len(blk)} tokens, more than max_tokens={max_tokens}; "
                                   f"raise max_tokens to at least {p + len(blk)}")


def min_budget(units: Sequence[Unit]) -> int:
    """The smallest ``max_tokens`` that can hold every unit (split as needed)."""
    return max((len(u.prefix_ids) + len(b) for u in units for b in u.blocks), default=1)


def fitting_budget(episodes: Sequence[Episode | Sequence[Invocation]], mode: str, max_tokens: int) -> int:
    """``max_tokens``, raised if needed so the longest invocation (or persistent transcript, which
    cannot be split) fits one row."""
    return max(max_tokens, min_budget(build_units(episodes, mode)))


def place_units(units: Sequence[Unit], capacity: int) -> list[list[Unit]]:
    """Rows of unit pieces: best-fit decreasing, splitting a unit that fits no row whole.

    Units are taken largest first. One that fits an open row whole goes to the row with the
    least room that still holds it (best fit). One that fits none is split: as many of its
    blocks as fit go (with a copy of its prefix) to the roomiest open row — or to a new row if
    that one cannot take the prefix and a block — and the rest is queued again by size. Rows thus
    fill up to the last block that fits, at the price of one prefix copy per extra row.
    """
    _check_fits(units, capacity)
    pending = sorted(enumerate(units), key=lambda iu: (-iu[1].size, iu[0]))  # stable, largest first
    rows: list[list[Unit]] = []
    free: list[int] = []
    while pending:
        i, u = pending.pop(0)
        fits = [r for r in range(len(rows)) if free[r] >= u.size]
        if fits:
            r = min(fits, key=lambda r: (free[r], r))
            rows[r].append(u)
            free[r] -= u.size
            continue
        p = len(u.prefix_ids)
        r = max(range(len(rows)), key=lambda r: (free[r], -r), default=None)
        if r is None or free[r] < p + min(len(b) for b in u.blocks):
            rows.append([])
            free.append(capacity)
            r = len(rows) - 1
        room, take, rest = free[r] - p, [], []
        for blk in u.blocks:
            if len(blk) <= room:
                take.append(blk)
                room -= len(blk)
            else:
                rest.append(blk)
        piece = replace(u, blocks=take)
        rows[r].append(piece)
        free[r] -= piece.size
        if rest:
            left = replace(u, blocks=rest)
            bisect.insort(pending, (i, left), key=lambda iu: (-iu[1].size, iu[0]))
    return rows


def place_balanced(units: Sequence[Unit], max_tokens: int) -> list[list[Unit]]:
    """:func:`place_units` at the row capacity that pads least.

    Rows are padded to the longest one, so a nearly empty last row, or rows that each hold one
    long unit with room to spare, are mostly padding. Candidates: ``max_tokens``, the smallest
    capacity that holds every unit, and ``total / R`` plus a few percent (R = rows needed at
    ``max_tokens``); the placement with the fewest padded tokens ``rows x longest row`` wins
    (split prefixes count), ties going to fewer rows.
    """
    total, floor = sum(u.size for u in units), min_budget(units)
    plain = place_units(units, max_tokens)
    caps = {min(max_tokens, max(floor, int(-(-total // max(len(plain), 1)) * slack)))
            for slack in (1.0, 1.01, 1.02, 1.04, 1.06, 1.08, 1.12, 1.16, 1.24)} | {floor}
    cost = lambda rows: (len(rows) * max((sum(u.size for u in r) for r in rows), default=0), len(rows))  # noqa: E731
    return min([plain] + [place_units(units, cap) for cap in sorted(caps) if cap < max_tokens], key=cost)


@dataclass
class _RowBuilder:
    ids: list[int]
    pos: list[int]
    blk: list[int]
    segments: list[Segment]

    def add(self, ids: list[int], pos: list[int], prefix: int, is_prefix: bool, episode: int, inv: int) -> tuple[int, int]:
        b, start = len(self.segments), len(self.ids)
        self.ids += ids
        self.pos += pos
        self.blk += [b] * len(ids)
        self.segments.append(Segment(start, len(self.ids), b, prefix, is_prefix, episode, inv))
        return b, start


def pack_units(units: Sequence[Unit], max_tokens: int = 4096, *, pad_token_id: int = 0,
               pad_to_multiple_of: int = 1, mode: str = "aligned", balance: bool = True) -> PackedBatch:
    """Pack units into rows of at most ``max_tokens`` tokens (see :func:`place_units`;
    ``balance``: :func:`place_balanced`)."""
    if max_tokens < 1 or pad_to_multiple_of < 1:
        raise PackingError(f"max_tokens ({max_tokens}) and pad_to_multiple_of ({pad_to_multiple_of}) must be >= 1")
    rows: list[_RowBuilder] = []
    actions: list[tuple] = []  # (src, row, pred col, token col, block, id, logprob, temp, teacher)
    placed = place_balanced(units, max_tokens) if balance else place_units(units, max_tokens)
    for r, members in enumerate(placed):
        row = _RowBuilder([], [], [], [])
        by_key: dict[tuple, list[Unit]] = {}
        for piece in members:  # pieces of one unit in the same row share one prefix copy
            by_key.setdefault(piece.key, []).append(piece)
        for group in by_key.values():
            u = group[0]
            pb, ps = (row.add(u.prefix_ids, u.prefix_positions, -1, True, u.episode, -1)
                      if u.prefix_ids else (-1, -1))
            for blk in (b for piece in group for b in piece.blocks):
                ep = blk.episode if blk.episode >= 0 else u.episode
                b, bs = row.add(blk.ids, blk.positions, pb, False, ep, blk.invocation)
                for k, idx in enumerate(blk.action_idx):
                    pred = bs + idx - 1 if idx > 0 else ps + len(u.prefix_ids) - 1
                    if idx == 0 and pb < 0:
                        raise PackingError(f"episode {ep}: an action token has no preceding context")
                    actions.append((blk.action_src[k], r, pred, bs + idx, b, blk.ids[idx],
                                    blk.action_logprobs[k], blk.action_temperature[k], blk.action_teacher[k]))
        rows.append(row)
    return _to_tensors(rows, actions, pad_token_id, pad_to_multiple_of, mode)


def _to_tensors(rows: list[_RowBuilder], actions: list[tuple], pad_token_id: int, multiple: int,
                mode: str) -> PackedBatch:
    R = len(rows)
    L = max((len(r.ids) for r in rows), default=0)
    L = -(-L // multiple) * multiple
    B = max((len(r.segments) for r in rows), default=0)
    input_ids = torch.full((R, L), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((R, L), dtype=torch.long)
    block_ids = torch.full((R, L), -1, dtype=torch.long)
    block_prefix = torch.full((R, B), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        n = len(row.ids)
        input_ids[r, :n] = torch.tensor(row.ids, dtype=torch.long)
        position_ids[r, :n] = torch.tensor(row.pos, dtype=torch.long)
        block_ids[r, :n] = torch.tensor(row.blk, dtype=torch.long)
        for s in row.segments:
            block_prefix[r, s.block] = s.prefix

    actions.sort(key=lambda a: a[0])  # canonical (episode, invocation, token) order
    src, a_row, a_pred, a_col, a_blk, a_id, a_lp, a_t, a_teach = zip(*actions) if actions else ([],) * 9
    lt = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    ft = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    N = len(actions)
    action_mask = torch.zeros((R, L), dtype=torch.bool)
    teacher_mask = torch.zeros((R, L), dtype=torch.bool)
    teacher = torch.tensor(a_teach, dtype=torch.bool)
    if N:
        action_mask[lt(a_row), lt(a_col)] = True
        teacher_mask[lt(a_row)[teacher], lt(a_col)[teacher]] = True
    return PackedBatch(
        input_ids=input_ids, position_ids=position_ids, block_ids=block_ids, block_prefix=block_prefix,
        action_mask=action_mask, teacher_mask=teacher_mask,
        action_rows=lt(a_row), action_cols=lt(a_pred), action_ids=lt(a_id), action_blocks=lt(a_blk),
        old_logprobs=ft(a_lp), temperatures=ft(a_t), teacher=teacher, advantages=torch.zeros(N),
        token_map=lt(src).reshape(N, 3), action_uid=torch.arange(N), segments=[r.segments for r in rows],
        mode=mode)


def pack_episodes(episodes: Sequence[Episode | Sequence[Invocation]], max_tokens: int = 4096, *,
                  mode: str = "aligned", share_prefix: bool = True, teacher_roles: Iterable[str] = ROLES,
                  pad_token_id: int = 0, pad_to_multiple_of: int = 1, balance: bool = True,
                  across_episodes: bool = True) -> PackedBatch:
    """Pack recorded episodes for scoring.

    Args:
        episodes: Episode records (or lists of Invocation records), in any number.
        max_tokens: token budget of one row; an episode larger than it is split across rows.
        mode: ``aligned`` (each invocation's own state, MemOPD) or ``persistent`` (flattened
            history, the paper's control; see :mod:`memopd.contexts`).
        share_prefix: store a shared prefix once per row (``False``: one copy per invocation,
            the "packed without prefix sharing" layout).
        across_episodes: with ``share_prefix``, episodes with the same prefix (a question's
            samples) share its copy too (``False``: one copy per episode and row).
        teacher_roles: roles whose sampled tokens the teacher supervises: ``("memory",)``,
            ``("answer",)`` or both.
        pad_token_id: token id written in padding columns (never attended to by real tokens).
        pad_to_multiple_of: round the row length up to a multiple of this.
        balance: lower the row capacity when the same number of rows then pads less (matters
            when rows are few, see :func:`place_balanced`); ``False``: plain placement.
    """
    units = build_units(episodes, mode, share_prefix=share_prefix, teacher_roles=teacher_roles,
                        across_episodes=across_episodes)
    return pack_units(units, max_tokens, pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of,
                      mode=mode, balance=balance)


__all__ = ["Block", "PackedBatch", "PackingError", "Segment", "Unit", "fitting_budget", "min_budget", "pack_episodes",
           "pack_units", "place_balanced", "place_units"]
