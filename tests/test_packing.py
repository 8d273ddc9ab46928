"""Packing: rows, segments, restored positions, action gather index, masks, splitting."""

import random

import pytest
import torch

from agents.records import Episode, Invocation
from memopd.contexts import Block, PackingError, Unit, persistent_units
from memopd.packing import pack_episodes, place_units


def make_episode(eid: int, n_calls: int, *, prefix: int = 6, pos0: int = 0, rng: random.Random,
                 prompt_equals_prefix: bool = False) -> Episode:
    """Records with random tokens (no model needed for layout tests)."""
    q = [rng.randrange(10, 200) for _ in range(prefix)]
    invs = []
    memory: list[int] = []
    for t in range(n_calls):
        answer = t == n_calls - 1
        private = [] if prompt_equals_prefix else [1] + memory + [2] + [rng.randrange(10, 200) for _ in range(rng.randint(2, 9))]
        prompt = q + private
        resp = [rng.randrange(10, 200) for _ in range(rng.randint(1, 5))]
        n = len(prompt) + len(resp)
        invs.append(Invocation(prompt_ids=prompt, response_ids=resp, logprobs=[-0.1 * (k + 1) for k in range(len(resp))],
                               position_ids=list(range(pos0, pos0 + n)), prefix_len=len(q),
                               role="answer" if answer else "memory", turn=t,
                               spans={"memory": [len(q) + 1, len(q) + 1 + len(memory)]} if private else {}))
        memory = resp
    return Episode(episode_id=f"e{eid}", task_id="t", sample_id=str(eid), invocations=invs)


@pytest.fixture
def episodes():
    rng = random.Random(0)
    return [make_episode(i, rng.randint(2, 6), prefix=rng.randint(3, 9), pos0=5 * (i % 2), rng=rng) for i in range(7)]


def unit(name: str, prefix: int, blocks: list[int]) -> Unit:
    return Unit(0, [0] * prefix, list(range(prefix)), [Block([0] * n, list(range(n)), invocation=k)
                                                       for k, n in enumerate(blocks)], key=(name,))


def test_best_fit_decreasing_with_splitting():
    a, b, c, d = unit("a", 2, [4, 3]), unit("b", 1, [5]), unit("c", 0, [3]), unit("d", 0, [1])
    rows = place_units([d, c, b, a], 10)  # taken largest first: a (9), b (6), c (3), d (1)
    # a -> row 0 (room 1); b fits nowhere, row 0 cannot take prefix + a block -> row 1 (room 4);
    # c -> the tightest row that holds it, row 1 (room 1); d -> tightest tie, first row
    assert [[u.key[0] for u in r] for r in rows] == [["a", "d"], ["b", "c"]]
    # a unit larger than the budget is split at block boundaries, its prefix in every piece
    rows = place_units([unit("e", 2, [4, 4, 4, 4])], 10)
    assert [[len(bl) for bl in r[0].blocks] for r in rows] == [[4, 4], [4, 4]]
    assert all(r[0].size <= 10 and len(r[0].prefix_ids) == 2 for r in rows)
    # a unit that fits no row whole fills the roomiest row first when it can take prefix + a block
    rows = place_units([unit("f", 0, [7]), unit("g", 1, [2, 2, 2])], 10)
    assert [[(u.key[0], [len(bl) for bl in u.blocks]) for u in r] for r in rows] == [
        [("f", [7]), ("g", [2])], [("g", [2, 2])]]
    with pytest.raises(PackingError, match="raise max_tokens"):
        place_units([unit("h", 5, [6])], 10)


def invocation_view(batch, e, j):
    """Reassemble invocation j of episode e from the batch's explicit segments."""
    for r, segs in enumerate(batch.segments):
        for s in segs:
            if s.episode == e and s.invocation == j and not s.is_prefix:
                cols = list(range(s.start, s.end))
                if s.prefix >= 0:
                    p = segs[s.prefix]
                    assert p.is_prefix and p.end <= s.start
                    cols = list(range(p.start, p.end)) + cols
                return r, cols
    raise AssertionError(f"invocation {e}/{j} not in batch")


@pytest.mark.parametrize("budget", [4096, 40])
def test_every_invocation_restored_exactly(episodes, budget):
    batch = pack_episodes(episodes, budget)
    assert batch.row_len <= budget
    for e, ep in enumerate(episodes):
        for j, inv in enumerate(ep.invocations):
            r, cols = invocation_view(batch, e, j)
            assert batch.input_ids[r, cols].tolist() == inv.input_ids
            assert batch.position_ids[r, cols].tolist() == inv.position_ids


def test_prefix_stored_once_per_row_and_split_repeats_it(episodes):
    whole = pack_episodes(episodes, 4096)
    assert whole.num_rows == 1
    lead = lambda ep: ep.invocations[0].spans["memory"][0]  # noqa: E731  shared: the prefix and the template up to the memory
    for e, ep in enumerate(episodes):
        prefixes = [s for s in whole.segments[0] if s.episode == e and s.is_prefix]
        assert len(prefixes) == 1 and prefixes[0].end - prefixes[0].start == lead(ep)
    real = sum(lead(ep) + sum(i.total_len - lead(ep) for i in ep.invocations) for ep in episodes)
    assert whole.num_real_tokens == real and whole.padding_fraction == 0.0

    big = max(range(len(episodes)), key=lambda e: sum(i.total_len for i in episodes[e].invocations))
    budget = 40
    split = pack_episodes(episodes, budget)
    rows_of = {r for r, segs in enumerate(split.segments) for s in segs if s.episode == big}
    assert len(rows_of) >= 2, "the largest episode should be split across rows"
    for r in rows_of:
        assert sum(s.is_prefix for s in split.segments[r] if s.episode == big) == 1
    for segs in split.segments:  # blocks see only their own episode's prefix
        for s in segs:
            if s.prefix >= 0:
                assert segs[s.prefix].episode == s.episode and segs[s.prefix].is_prefix


def test_several_episodes_share_a_row(episodes):
    batch = pack_episodes(episodes, 120)
    assert any(len({s.episode for s in segs}) >= 2 for segs in batch.segments)


def test_action_gather_index_is_the_position_before_each_token(episodes):
    batch = pack_episodes(episodes, 50)
    n = sum(len(i.response_ids) for ep in episodes for i in ep.invocations)
    assert batch.num_actions == n == int(batch.action_mask.sum())
    for a, (e, j, k) in enumerate(batch.token_map.tolist()):
        inv = episodes[e].invocations[j]
        r, c = int(batch.action_rows[a]), int(batch.action_cols[a])
        assert int(batch.input_ids[r, c]) == inv.input_ids[inv.prompt_len + k - 1]
        assert int(batch.position_ids[r, c]) == inv.position_ids[inv.prompt_len + k - 1]
        assert int(batch.action_ids[a]) == inv.response_ids[k]
        assert float(batch.old_logprobs[a]) == pytest.approx(inv.logprobs[k])
    # canonical order: (episode, invocation, token) sorted, uid = index
    assert batch.token_map.tolist() == sorted(batch.token_map.tolist())
    assert torch.equal(batch.action_uid, torch.arange(n))


def test_first_token_conditioned_on_prefix_when_private_prompt_is_empty():
    rng = random.Random(3)
    eps = [make_episode(0, 3, prefix=5, rng=rng, prompt_equals_prefix=True)]
    batch = pack_episodes(eps, 4096)
    firsts = [a for a, (e, j, k) in enumerate(batch.token_map.tolist()) if k == 0]
    prefix_seg = batch.segments[0][0]
    assert prefix_seg.is_prefix
    for a in firsts:
        assert int(batch.action_cols[a]) == prefix_seg.end - 1


def test_teacher_mask_selects_roles(episodes):
    both = pack_episodes(episodes, 4096)
    answers = pack_episodes(episodes, 4096, teacher_roles=("answer",))
    memory = pack_episodes(episodes, 4096, teacher_roles=("memory",))
    roles = [episodes[e].invocations[j].role for e, j, _ in both.token_map.tolist()]
    assert both.teacher.all()
    assert answers.teacher.tolist() == [r == "answer" for r in roles]
    assert memory.teacher.tolist() == [r == "memory" for r in roles]
    for b in (both, answers, memory):
        assert not (b.teacher_mask & ~b.action_mask).any()
        assert int(b.teacher_mask.sum()) == int(b.teacher.sum())
    with pytest.raises(PackingError, match="teacher_roles"):
        pack_episodes(episodes, 4096, teacher_roles=("critic",))


def test_without_prefix_sharing_each_call_has_its_own_prefix(episodes):
    shared = pack_episodes(episodes, 4096)
    private = pack_episodes(episodes, 4096, share_prefix=False)
    n_calls = sum(len(ep.invocations) for ep in episodes)
    assert sum(s.is_prefix for segs in private.segments for s in segs) == n_calls
    # shared, an episode's calls store once its prefix and the template up to the memory
    extra = sum((len(ep.invocations) - 1) * ep.invocations[0].spans["memory"][0] for ep in episodes)
    assert private.num_real_tokens == shared.num_real_tokens + extra


def test_persistent_transcript_layout(episodes):
    ep = episodes[0]
    (unit,) = persistent_units([ep])
    (block,) = unit.blocks
    q = ep.invocations[0].prompt_ids[: ep.invocations[0].prefix_len]
    expect = list(q)
    for inv in ep.invocations:
        s, t = inv.spans["memory"]
        expect += [x for i, x in enumerate(inv.prompt_ids) if inv.prefix_len <= i and not s <= i < t]
        expect += inv.response_ids
    assert block.ids == expect
    assert block.positions == list(range(ep.invocations[0].position_ids[0], ep.invocations[0].position_ids[0] + len(expect)))
    batch = pack_episodes([ep], 4096, mode="persistent")
    aligned = pack_episodes([ep], 4096)
    assert torch.equal(batch.token_map, aligned.token_map)  # same canonical action order
    assert torch.equal(batch.action_ids, aligned.action_ids)
    for a in range(batch.num_actions):
        r, c = int(batch.action_rows[a]), int(batch.action_cols[a])
        assert int(batch.input_ids[r, c + 1]) == int(batch.action_ids[a])


def test_oversized_invocation_is_a_clear_error(episodes):
    with pytest.raises(PackingError, match="raise max_tokens to at least"):
        pack_episodes(episodes, 12)
    with pytest.raises(PackingError, match="persistent transcript has .* raise max_tokens"):
        pack_episodes(episodes, 60, mode="persistent")
    with pytest.raises(PackingError, match="unknown context mode"):
        pack_episodes(episodes, 4096, mode="flat")


def test_micro_batches_keep_uids_and_gather(episodes):
    batch = pack_episodes(episodes, 40)
    parts = batch.micro_batches(2)
    assert sum(p.num_rows for p in parts) == batch.num_rows
    uids = torch.cat([p.action_uid for p in parts])
    assert sorted(uids.tolist()) == list(range(batch.num_actions))
    for p in parts:
        assert torch.equal(p.input_ids[p.action_rows, p.action_cols],
                           batch.input_ids[batch.action_rows[p.action_uid], batch.action_cols[p.action_uid]])
        assert torch.equal(p.old_logprobs, batch.old_logprobs[p.action_uid])


def test_per_invocation_maps_back(episodes):
    batch = pack_episodes(episodes, 40)
    out = batch.per_invocation(batch.old_logprobs)
    for e, ep in enumerate(episodes):
        for j, inv in enumerate(ep.invocations):
            assert out[(e, j)].tolist() == pytest.approx(inv.logprobs)


def test_memagent_like_workload_packs_to_95_percent_real_tokens():
    """Varied MemAgent-like sizes (prefix ~150, chunks <= 512, memory <= 128, 9 calls): at least
    95% of the packed row tokens are real, and no row exceeds the budget."""
    rng = random.Random(1)
    eps = []
    for e in range(12):
        q = [5] * rng.randint(130, 170)
        invs, memory = [], []
        for t in range(9):
            prompt = q + [1] + memory + [2] + [7] * (rng.randint(100, 512) if t < 8 else 0)
            resp = [9] * rng.randint(64, 128)
            invs.append(Invocation(prompt_ids=prompt, response_ids=resp, logprobs=[-1.0] * len(resp),
                                   position_ids=list(range(len(prompt) + len(resp))), prefix_len=len(q)))
            memory = resp
        eps.append(Episode(episode_id=str(e), task_id="t", sample_id=str(e), invocations=invs))
    for budget in (4096, 8192, 16384):
        batch = pack_episodes(eps, budget)
        assert batch.row_len <= budget
        assert batch.padding_fraction <= 0.05, (budget, batch.padding_fraction)


def test_persistent_context_refuses_records_without_spans(episodes):
    """Without spans the memory a call received cannot be removed from the transcript: refused,
    naming the episode and the field (it used to keep a second copy silently)."""
    import copy

    eps = copy.deepcopy(episodes[:2])
    eps[1].invocations[2].spans = None
    pack_episodes(eps, 4096, mode="aligned")  # the aligned context needs no spans
    with pytest.raises(PackingError, match=r"episode 1 \(.*\) invocation 2 has no spans.*Invocation.spans"):
        pack_episodes(eps, 4096, mode="persistent")
