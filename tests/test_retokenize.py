"""A teacher with another tokenizer (memopd.retokenize, CrossTokenizerTeacher): the chunk rule
against hand computations on the two preset tokenizers, the shares' sum against an independent
plain forward of the teacher, and, with identical tokenizers, equality with the same-tokenizer
sampled path."""

from __future__ import annotations

import math
import random

import pytest
import torch

from agents import models
from agents.records import Invocation
from memopd.retokenize import (Alignment, align, chunk_of, decode, encode, same_tokenizer, spread, token_ends,
                               view_call, view_episodes)


@pytest.fixture(scope="module")
def toks(cache):
    _, student = models.load("tiny", cache_dir=cache)
    _, teacher = models.load("tiny-teacher-bpe1k", cache_dir=cache)
    return student, teacher


def ids(tok, pieces):
    out = [tok.convert_tokens_to_ids(p) for p in pieces]
    assert tok.unk_token_id not in out and None not in out
    return out


def test_the_preset_tokenizers_differ_where_the_study_needs_it(toks):
    s, t = toks
    assert not same_tokenizer(s, t) and same_tokenizer(s, s)
    assert [s.convert_ids_to_tokens(i) for i in encode(s, " Zane works")] == ["ĠZane", "Ġworks"]
    assert [t.convert_ids_to_tokens(i) for i in encode(t, " Zane works")] == ["ĠZ", "ane", "Ġworks"]


def test_chunks_by_hand_teacher_splits_a_student_token(toks):
    """' Zane works': student ends {5, 11}, teacher ends {2, 5, 11}; chunks [0, 5) and [5, 11):
    the student's ' Zane' gets the sum of the teacher's ' Z' and 'ane'."""
    s, t = toks
    a = align(ids(s, ["ĠZane", "Ġworks"]), ids(t, ["ĠZ", "ane", "Ġworks"]), s, t)
    assert a == Alignment((0, 1), (0, 0, 1), 2)
    assert spread([-1.0, -0.5, -2.0], a) == [-1.5, -2.0]


def test_chunks_by_hand_student_splits_a_teacher_token(toks):
    """The roles swapped: two student tokens share one teacher token's log-prob equally."""
    s, t = toks
    a = align(ids(t, ["ĠZ", "ane", "Ġworks"]), ids(s, ["ĠZane", "Ġworks"]), t, s)
    assert a == Alignment((0, 0, 1), (0, 1), 2)
    assert spread([-3.0, -0.25], a) == [-1.5, -1.5, -0.25]


def test_crossing_boundaries_merge_into_one_chunk(toks):
    """Student ' ind|ust' ends at {4, 7}, teacher ' in|dust' at {3, 7}: the only shared end is 7."""
    s, _ = toks
    a = Alignment(tuple(chunk_of([4, 7], [7])), tuple(chunk_of([3, 7], [7])), 1)
    assert a == Alignment((0, 0), (0, 0), 1)
    assert spread([-1.0, -3.0], a) == [-2.0, -2.0]


def test_a_token_inside_a_character_has_no_end(toks):
    """Byte-level tokens of one character: the prefix ends inside it (decodes to U+FFFD), so the
    token has no end and joins the chunk of the character's last byte."""
    s, t = toks
    text = " caf\u00e9 \u2603 at"
    s_ids, t_ids = encode(s, text), encode(t, text)
    _, ends = token_ends(s, s_ids)
    assert None in ends and ends[-1] == len(text)
    a = align(s_ids, t_ids, s, t)
    assert a.text_match
    lps = [-0.1 * (i + 1) for i in range(len(t_ids))]
    assert sum(spread(lps, a)) == pytest.approx(sum(lps), abs=1e-12)


def test_a_text_the_teachers_normaliser_changed_is_aligned_by_characters(toks):
    """A sampled '\\nworks' (no space after the line break) reads '\\n works' to a tokenizer
    that inserts one: by hand, student ' at|\\n|w|o|r|k|s' ends {3, 4, 5, 6, 7, 8, 9}; the
    teacher's ' at|\\n| works' ends {3, 4, 10}, carried onto the student's text {3, 4, 9}:
    chunks [0, 3), [3, 4), [4, 9), the last one of five student tokens."""
    s, t = toks
    s_ids = ids(s, ["Ġat", "Ċ", "w", "o", "r", "k", "s"])
    assert decode(s, s_ids) == " at\nworks"
    t_ids = encode(t, " at\nworks")
    assert decode(t, t_ids) == " at\n works"  # the normaliser's space
    a = align(s_ids, t_ids, s, t)
    assert not a.text_match and a.num_chunks == 3
    assert a.student_chunk == (0, 1, 2, 2, 2, 2, 2) and a.teacher_chunk == (0, 1, 2)
    assert sum(spread([-0.5] * len(t_ids), a)) == pytest.approx(-0.5 * len(t_ids))
    # a token after the changed text: only the carried ends keep ' at' its own chunk ({1, 6, 9},
    # not {1, 9}, which the teacher's own offsets {1, 7, 10} would give)
    s_ids = ids(s, ["Ċ", "w", "o", "r", "k", "s", "Ġat"])
    b = align(s_ids, encode(t, "\nworks at"), s, t)
    assert b.num_chunks == 3 and b.student_chunk == (0, 1, 1, 1, 1, 1, 2)
    from memopd.retokenize import map_offsets

    assert map_offsets([3, 4, 5, 10], " at\n works", " at\nworks") == [3, 4, 4, 9]


def test_shares_sum_to_the_teachers_log_prob_of_the_text(toks):
    """Over random LongQA-like responses, the students' shares sum to the sum of the teacher's
    token log-probs (the response text's), chunk by chunk and in all."""
    s, t = toks
    rng = random.Random(0)
    words = "kevin works at globex wayne industries memory : zane planetex who does the".split()
    for _ in range(50):
        text = " " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        s_ids, t_ids = encode(s, text), encode(t, text)
        a = align(s_ids, t_ids, s, t)
        lps = [rng.uniform(-5, 0) for _ in t_ids]
        shares = spread(lps, a)
        assert len(shares) == len(s_ids) and a.text_match
        assert math.isclose(sum(shares), sum(lps), abs_tol=1e-9)
        for c in range(a.num_chunks):
            assert math.isclose(sum(x for x, k in zip(shares, a.student_chunk) if k == c),
                                sum(x for x, k in zip(lps, a.teacher_chunk) if k == c), abs_tol=1e-9)


def test_the_view_reencodes_prefix_rest_and_response_apart(toks):
    s, t = toks
    prefix = encode(s, "<|im_start|>user\n question: who does kevin work for?")
    rest = encode(s, " memory: kevin works at<|im_end|>\n<|im_start|>assistant\n")
    resp = encode(s, " kevin works at globex<|im_end|>")
    inv = Invocation(prompt_ids=prefix + rest, response_ids=resp, logprobs=[-1.0] * len(resp),
                     position_ids=list(range(len(prefix) + len(rest) + len(resp))), prefix_len=len(prefix),
                     role="answer", sampling={"temperature": 0.7})
    v = view_call(inv, s, t)
    ti = v.invocation
    assert ti.prompt_ids[:ti.prefix_len] == encode(t, decode(s, prefix))
    assert decode(t, ti.prompt_ids) == decode(s, inv.prompt_ids)
    assert decode(t, ti.response_ids) == decode(s, resp)
    assert ti.response_ids[-1] == t.convert_tokens_to_ids("<|im_end|>")  # special tokens by their text
    assert ti.position_ids == list(range(ti.total_len)) and ti.sampling == inv.sampling and ti.role == "answer"


@pytest.fixture(scope="module")
def step(cache):
    """A step's episodes sampled by the tiny student, packed as the trainer packs them."""
    import gymnasium as gym

    import memgym  # noqa: F401
    from agents.backends.base import SamplingParams
    from agents.backends.hf import HFBackend
    from agents.memagent import MemAgent
    from agents.rollout import rollout
    from memopd.learn.models import pad_id
    from memopd.packing import pack_episodes

    model, tok = models.load("tiny", cache_dir=cache)
    envs = [gym.make("memgym/LongQA-v0", tokenizer=tok, num_chunks=2) for _ in range(4)]
    agent = MemAgent(HFBackend(model, tok, seed=0), SamplingParams(temperature=1.0, max_new_tokens=10))
    eps = rollout(envs, agent, 4, group_size=2, seed=7, progress=False, run_id="t")
    return eps, pack_episodes(eps, 1024, mode="aligned", pad_token_id=pad_id(tok)), tok


def test_identical_tokenizers_equal_the_same_tokenizer_path_exactly(cache, step):
    from memopd.estimators import teacher_targets
    from memopd.learn.teacher import CrossTokenizerTeacher, LocalTeacher

    eps, batch, tok = step
    teacher, t_tok = models.load("tiny-teacher", cache_dir=cache)
    assert same_tokenizer(tok, t_tok) and tok is not t_tok
    local = LocalTeacher(teacher, t_tok, pack_tokens=1024).score(eps, batch)
    want = teacher_targets(local.states, batch.action_ids, "sampled", 0)
    got = CrossTokenizerTeacher(teacher, t_tok, tok, pack_tokens=1024).score(eps, batch)
    assert torch.equal(got.sampled, want)
    assert got.metrics["teacher/chunks_per_action"] == 1.0


def test_another_tokenizer_against_a_plain_forward_of_each_call(cache, step):
    """Each call's shares sum to the teacher's log-prob of the response, computed here by one
    plain forward of the teacher over the view's tokens (no packing), at the call's temperature."""
    from memopd.learn.teacher import CrossTokenizerTeacher

    eps, batch, tok = step
    teacher, t_tok = models.load("tiny-teacher-bpe1k", cache_dir=cache)
    got = CrossTokenizerTeacher(teacher, t_tok, tok, pack_tokens=1024).score(eps, batch)
    assert got.metrics["teacher/chunks_per_action"] < 1.0 or got.metrics["teacher/tokens_per_action"] != 1.0
    views = view_episodes(eps, tok, t_tok)
    per_call: dict[tuple[int, int], float] = {}
    for (e, i, _), x in zip(batch.token_map.tolist(), got.sampled.tolist()):
        per_call[(e, i)] = per_call.get((e, i), 0.0) + x
    assert len(per_call) == sum(len(e.invocations) for e in eps)
    for (e, i), total in per_call.items():
        inv = views[e][i].invocation
        with torch.no_grad():
            logits = teacher(input_ids=torch.tensor([inv.input_ids]), use_cache=False).logits[0].float()
        logp = torch.log_softmax(logits / inv.sampling.get("temperature", 1.0), -1)
        n = inv.prompt_len
        ref = logp[n - 1:-1].gather(-1, torch.tensor(inv.response_ids)[:, None]).sum().item()
        assert total == pytest.approx(ref, abs=1e-4), (e, i)


CONTEXTS = ("0", "a", "0 a")
"""Texts a student token's text is appended to: a digit before a letter, a letter before a digit or a
mark, so that the pre-tokenizer cuts between the context and the token's text."""


def first_piece_in_text(student, teacher, v: int) -> int:
    """The teacher's token that begins the student token ``v``'s text inside a real text, found
    with the teacher's own calls alone: encode a context, then the context followed by the text;
    the first teacher token after the context's is the first piece (-1: no text, part of a
    character, or a text the teacher's normaliser removes). Independent of :func:`memopd.retokenize.encode`."""
    text = student.decode([v], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if not text or "\ufffd" in text:
        return -1
    for context in CONTEXTS:
        head = teacher(context, add_special_tokens=False)["input_ids"]
        whole = teacher(context + text, add_special_tokens=False)["input_ids"]
        if whole[:len(head)] == head:  # the context kept its tokens; none after it: a text the teacher drops
            return whole[len(head)] if len(whole) > len(head) else -1
    raise AssertionError(f"no context keeps {text!r} apart")


def check_first_pieces(student, teacher) -> None:
    """Every token of ``student``: its first piece is the one found in real text, and that piece's
    text begins the token's text (docs/teacher.md rule 4)."""
    from memopd.retokenize import first_pieces

    fp = first_pieces(student, teacher)
    assert len(fp) == len(student)
    wrong = [v for v in range(len(student)) if fp[v] != first_piece_in_text(student, teacher, v)]
    assert not wrong, [(decode(student, [v]), decode(teacher, [fp[v]])) for v in wrong[:10]]
    for v, u in enumerate(fp):
        if u >= 0:  # in bytes: a piece may hold the first bytes of a character
            piece = token_bytes(teacher, u)
            assert piece and decode(student, [v]).encode().startswith(piece), (v, u)


def token_bytes(tok, u: int) -> bytes:
    """The bytes of token ``u`` of a byte-level BPE (GPT-2's byte-to-character table, inverted);
    an added token's own text."""
    if u in set(tok.all_special_ids) or tok.convert_ids_to_tokens(u) in tok.get_added_vocab():
        return tok.convert_ids_to_tokens(u).encode()
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {chr(b): b for b in printable}
    chars.update({chr(256 + n): b for n, b in enumerate(b for b in range(256) if b not in printable)})
    return bytes(chars[c] for c in tok.convert_ids_to_tokens(u))


def test_first_pieces_of_every_token_of_both_preset_pairs(toks):
    """``pen`` belongs to the teacher's ``pen``, not ``" pen"``; ``!`` to ``!``, not the lone space
    that a text encoded alone begins with under ``add_prefix_space``."""
    s, t = toks
    check_first_pieces(s, t)
    check_first_pieces(t, s)
    from memopd.retokenize import first_pieces

    fp = first_pieces(s, t)
    for student, teacher in [("pen", "pen"), ("!", "!")]:
        if student in s.get_vocab() and teacher in t.get_vocab():
            assert fp[s.convert_tokens_to_ids(student)] == t.convert_tokens_to_ids(teacher)


@pytest.mark.slow
def test_first_pieces_of_every_token_with_smollm2(toks):
    """SmolLM2's tokenizer adds no prefix space: both directions against the tiny student's."""
    s, _ = toks
    _, smol = models.load("smollm2")
    check_first_pieces(s, smol)
    check_first_pieces(smol, s)


def test_a_response_without_a_leading_space_keeps_its_text(toks):
    """A memory that starts without a space (``pen``, ``!``) reads the same text to the teacher:
    no prefix space is inserted into the response or the prompt's parts."""
    s, t = toks
    prefix = encode(s, "<|im_start|>user\n question: who?")
    rest = ids(s, ["pen"]) + encode(s, "<|im_end|>\n<|im_start|>assistant\n")
    resp = ids(s, ["pen"]) + encode(s, " works!<|im_end|>")
    inv = Invocation(prompt_ids=prefix + rest, response_ids=resp, logprobs=[-1.0] * len(resp),
                     position_ids=list(range(len(prefix) + len(rest) + len(resp))), prefix_len=len(prefix),
                     role="memory", sampling={"temperature": 1.0})
    v = view_call(inv, s, t)
    assert decode(t, v.invocation.response_ids) == decode(s, resp) == "pen works!<|im_end|>"
    assert decode(t, v.invocation.prompt_ids) == decode(s, inv.prompt_ids)
    assert v.alignment.text_match


def test_first_pieces_by_hand(toks):
    """Each student token belongs to the teacher's first token of its text: ' Zane' to ' Z',
    ' works' to ' works'; the identity for identical tokenizers."""
    from memopd.retokenize import first_pieces

    s, t = toks
    fp = first_pieces(s, t)
    assert len(fp) == len(s)
    for student, teacher in [("ĠZane", "ĠZ"), ("Ġworks", "Ġworks"), ("<|im_end|>", "<|im_end|>")]:
        assert fp[s.convert_tokens_to_ids(student)] == t.convert_tokens_to_ids(teacher)
    assert first_pieces(s, s) == list(range(len(s)))


def test_chunk_starts_by_hand(toks):
    """' Zane works' (student ' Zane|works', teacher ' Z|ane|works'): both student tokens start a
    chunk, ' Zane' reads the teacher's state before ' Z' (0), ' works' before its ' works' (2);
    the roles swapped, the second piece of ' Z|ane' is inside the teacher's ' Zane'."""
    from memopd.retokenize import chunk_starts

    s, t = toks
    a = align(ids(s, ["ĠZane", "Ġworks"]), ids(t, ["ĠZ", "ane", "Ġworks"]), s, t)
    assert chunk_starts(a) == [0, 2]
    b = align(ids(t, ["ĠZ", "ane", "Ġworks"]), ids(s, ["ĠZane", "Ġworks"]), t, s)
    assert chunk_starts(b) == [0, None, 1]


def test_identical_tokenizers_topk_equals_the_same_tokenizer_path_exactly(cache, step):
    from memopd.estimators import teacher_targets
    from memopd.learn.teacher import CrossTokenizerTeacher, LocalTeacher

    eps, batch, tok = step
    teacher, t_tok = models.load("tiny-teacher", cache_dir=cache)
    local = LocalTeacher(teacher, t_tok, pack_tokens=1024).score(eps, batch)
    want = teacher_targets(local.states, batch.action_ids, "topk", 8)
    got = CrossTokenizerTeacher(teacher, t_tok, tok, k=8, pack_tokens=1024).score(eps, batch)
    assert torch.equal(got.top.ids, want.ids) and torch.equal(got.top.logp, want.logp) and got.top.project is None
    assert bool(got.supervised.all()) and got.metrics["teacher/supervised_share"] == 1.0


def test_another_tokenizer_topk_against_a_plain_forward_of_each_call(cache, step):
    """Every action's top-k, recomputed here from one plain forward of the teacher over the view's
    tokens: at the first student token of a chunk, the teacher's k most likely tokens in the state
    before the chunk's first teacher token; the student-to-teacher map against one built here from
    the two tokenizers' own calls; the supervised actions exactly those that start a chunk."""
    from memopd.learn.teacher import CrossTokenizerTeacher

    eps, batch, tok = step
    teacher, t_tok = models.load("tiny-teacher-bpe1k", cache_dir=cache)
    k = 5
    got = CrossTokenizerTeacher(teacher, t_tok, tok, k=k, pack_tokens=1024).score(eps, batch)
    assert got.top.project.tolist() == [first_piece_in_text(tok, t_tok, v) for v in range(len(tok))]
    views = view_episodes(eps, tok, t_tok)
    inside = 0
    for n, (e, i, j) in enumerate(batch.token_map.tolist()):
        al = views[e][i].alignment
        c = al.student_chunk[j]
        pieces = [u for u, cu in enumerate(al.teacher_chunk) if cu == c]
        starts = (j == 0 or al.student_chunk[j - 1] != c) and bool(pieces)
        assert bool(got.supervised[n]) == starts, (e, i, j)
        if not starts:
            inside += 1
            continue
        inv = views[e][i].invocation
        with torch.no_grad():
            logits = teacher(input_ids=torch.tensor([inv.input_ids]), use_cache=False).logits[0].float()
        logp = torch.log_softmax(logits / inv.sampling.get("temperature", 1.0), -1)[inv.prompt_len - 1 + pieces[0]]
        vals, top = logp.topk(k)
        assert got.top.ids[n].tolist() == top.tolist()
        assert got.top.logp[n].tolist() == pytest.approx(vals.tolist(), abs=1e-4)
    assert got.metrics["teacher/supervised_share"] == pytest.approx(1 - inside / batch.num_actions)


FAST = ["--env", "memgym/LongQA-v0", "--env-kwarg", "num_chunks=2", "--questions-per-step", "2", "--group-size",
        "2", "--max-new-tokens", "8", "--eval-episodes", "2", "--eval-every", "0", "--student-warmup-steps", "0",
        "--no-progress", "--pack-tokens", "1024", "--threads", "1", "--ppo-epochs", "1", "--audit-every", "0",
        "--sample-episodes", "0", "--steps", "1"]


@pytest.mark.parametrize("estimator", [["sampled", "--opd-sampled-as", "loss"],
                                       ["sampled", "--opd-sampled-as", "advantage"], ["topk", "--opd-topk", "8"]])
def test_training_with_a_teacher_of_another_tokenizer(cache, tmp_path, monkeypatch, estimator):
    """memopd.train --teacher tiny-teacher-bpe1k --opd-estimator sampled or topk: a step runs, the
    teacher scored the actions (a non-zero distillation term), its alignment metrics are logged,
    and the teacher's held-out evaluation ran in its own tokens."""
    from memopd import train
    from memopd.runlog import read_metrics

    monkeypatch.setenv("MEMOPD_CACHE", str(cache))
    run = tmp_path / "run"
    assert train.main(FAST + ["--run-dir", str(run), "--teacher", "tiny-teacher-bpe1k", "--opd-estimator",
                              *estimator]) == 0
    (row,) = [r for r in read_metrics(run) if "loss" in r]
    assert row["teacher/tokens_per_action"] > 1.0 and 0 < row["teacher/chunks_per_action"] <= 1.0
    assert row["kl/all"] != 0.0 and math.isfinite(row["kl/all"]) and math.isfinite(row["loss"])
    if estimator[0] == "topk":
        assert 0.5 < row["teacher/supervised_share"] <= 1.0


@pytest.mark.parametrize("extra, says", [
    ([], "pass --opd-estimator topk or sampled"),
    (["--opd-estimator", "sampled", "--prune-opd"], "it needs a teacher with the student's"),
    (["--opd-estimator", "sampled", "--teacher-context", "persistent"], "scores in the aligned context"),
])
def test_what_a_teacher_of_another_tokenizer_cannot_do_is_one_error_line(cache, tmp_path, monkeypatch, capsys,
                                                                         extra, says):
    from memopd import train

    monkeypatch.setenv("MEMOPD_CACHE", str(cache))
    assert train.main(FAST + ["--run-dir", str(tmp_path / "run"), "--teacher", "tiny-teacher-bpe1k"] + extra) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert says in line and line.startswith("error: --teacher tiny-teacher-bpe1k: teacher/student tokenizers differ")
    assert "Traceback" not in err
