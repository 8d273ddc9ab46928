"""A teacher with another tokenizer than the student's (:class:`CrossTokenizerTeacher`): each call
scored in the teacher's own tokens (:mod:`memopd.retokenize`), the log-probs shared back on the
student's tokens over text spans, and its top-k by first pieces."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Sequence

import torch

from agents.records import Episode
from memopd.learn.estimators.base import TeacherScores, TopK, teacher_targets
from memopd.learn.models import pad_id
from memopd.learn.teachers.local import LocalTeacher
from memopd.packing import PackedBatch, fitting_budget, pack_episodes
from memopd.retokenize import chunk_starts, first_pieces, same_tokenizer, spread, view_episodes


class CrossTokenizerTeacher(LocalTeacher):
    """Whole weights in this process, with a tokenizer other than the student's: each call is
    scored in the teacher's own tokens (:mod:`memopd.retokenize`: the record's text re-encoded,
    cut at the same prefix; the response's chunks, the spans both tokenizations end on), and
    the teacher's log-prob of each chunk is shared among the student tokens of the chunk. What it
    returns, in the student batch's action order, is the sampled estimator's input
    (``TeacherScores.sampled``) and, with ``k`` > 0, the top-k estimator's: the teacher's ``k``
    most likely tokens in its own ids at the first student token of each chunk
    (``TeacherScores.supervised``), with the map that sums the student's distribution onto them
    (``TopK.project``; retokenize's rule 4)."""

    provides = frozenset({"topk", "sampled"})
    lacks = {"distribution": "a teacher with another tokenizer gives the log-prob of the student's text and its "
                             "top-k over its own tokens (the student's summed onto them), not a distribution over "
                             "the student's whole vocabulary",
             "persistent": "a teacher with another tokenizer scores in the aligned context only: the persistent "
                           "control flattens each episode by the record's spans, which name student tokens",
             "sharded": "a teacher with another tokenizer is replicated on each rank in this version"}
    instead = "a teacher with the student's tokenizer"

    def __init__(self, model: torch.nn.Module, tokenizer: Any, student_tokenizer: Any, k: int = 0, **kwargs: Any):
        super().__init__(model, tokenizer, **kwargs)
        self.student_tokenizer = student_tokenizer
        self.k = k
        # the student-to-teacher map of the top-k; none with identical tokenizers (the ids are the student's)
        self.project = torch.tensor(first_pieces(student_tokenizer, tokenizer), dtype=torch.long) \
            if k > 0 and not same_tokenizer(student_tokenizer, tokenizer) else None

    @torch.no_grad()
    def score(self, episodes: Sequence[Episode], batch: PackedBatch) -> TeacherScores:
        t0 = time.perf_counter()
        views = view_episodes(episodes, self.student_tokenizer, self.tokenizer)
        t_eps = [replace(ep, invocations=[v.invocation for v in vs]) for ep, vs in zip(episodes, views)]
        t_batch = pack_episodes(t_eps, fitting_budget(t_eps, self.context, self.pack_tokens), mode=self.context,
                                teacher_roles=self.roles, pad_token_id=pad_id(self.tokenizer))
        states = self.action_states(t_batch)
        t_lp = teacher_targets(states, t_batch.action_ids, "sampled", 0)
        per_call: dict[tuple[int, int], list[float]] = {}
        row: dict[tuple[int, int, int], int] = {}  # (episode, call, teacher token) -> its action in t_batch
        for n, ((e, i, j), lp) in enumerate(zip(t_batch.token_map.tolist(), t_lp.tolist())):
            per_call.setdefault((e, i), [0.0] * len(t_eps[e].invocations[i].response_ids))[j] = lp
            row[(e, i, j)] = n
        shares = {key: spread(lps, views[key[0]][key[1]].alignment) for key, lps in per_call.items()}
        sampled = torch.tensor([shares[(e, i)][j] for e, i, j in batch.token_map.tolist()], dtype=torch.float32)
        aligned = [v.alignment for vs in views for v in vs]
        metrics = {"teacher/tokens_per_action": t_batch.num_actions / max(1, batch.num_actions),
                   "teacher/chunks_per_action": sum(a.num_chunks for a in aligned) / max(
                       1, sum(len(a.student_chunk) for a in aligned)),
                   "teacher/text_mismatch_calls": float(sum(not a.text_match for a in aligned))}
        scores = TeacherScores(sampled=sampled, metrics=metrics)
        if self.k > 0:
            top = teacher_targets(states, t_batch.action_ids, "topk", self.k)
            src = torch.full((batch.num_actions,), -1, dtype=torch.long)  # the teacher action whose state each reads
            starts: dict[tuple[int, int], list[int | None]] = {}
            for n, (e, i, j) in enumerate(batch.token_map.tolist()):
                first = starts.setdefault((e, i), chunk_starts(views[e][i].alignment))[j]
                if first is not None:
                    src[n] = row[(e, i, first)]
            scores.supervised = src >= 0
            at = src.clamp_min(0)  # unsupervised actions: any row, weight 0
            scores.top = TopK(top.ids[at], top.logp[at], self.project)
            metrics["teacher/supervised_share"] = float(scores.supervised.float().mean()) if batch.num_actions else 0.0
        metrics["teacher/score_s"] = time.perf_counter() - t0
        return scores


__all__ = ["CrossTokenizerTeacher"]
