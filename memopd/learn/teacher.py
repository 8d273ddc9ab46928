"""The teacher as the update sees it: a scorer of packed invocations.

What the update asks of a teacher is its states at the action tokens of a packed batch
(:class:`memopd.scoring.ActionStates`: hidden states and the output head that turns them into the
full next-token distribution, the full-vocabulary estimator's input), each action scored in the
context the run distils in:

- ``aligned`` (MemOPD): the batch the student is trained on, so every action is scored in the
  exact state the student sampled it in (prompt tokens, positions and visibility restored);
- ``persistent`` (the control): the episode flattened into one growing transcript, packed anew.

Four teachers live behind :meth:`Teacher.score` today: :class:`LocalTeacher` (whole weights in
this process), :class:`CrossTokenizerTeacher` (the same with another tokenizer: each call scored
in the teacher's own tokens, the log-probs shared back over text spans, :mod:`memopd.retokenize`),
:class:`ShardedTeacher` (FSDP2 under torchrun, ``--teacher-parallel fsdp``: each rank holds 1/N
of the decoder and a whole copy of the output head) and
:class:`memopd.learn.remote_teacher.RemoteTeacher` (a model behind a stock ``vllm serve``: the
top-k and the sampled token's log-prob at every action, for the estimators that need no more).
What a score holds is :class:`TeacherScores`: whichever of these the teacher has.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from agents.records import ROLES, Episode
from memopd import distributed
from memopd.config import ConfigError
from memopd.estimators import TeacherScores, TopK, teacher_targets
from memopd.learn.models import default_teacher_dir, ensure_teacher, pad_id
from memopd.packing import PackedBatch, fitting_budget, pack_episodes
from memopd.retokenize import chunk_starts, first_pieces, same_tokenizer, spread, view_episodes
from memopd.scoring import ActionStates, action_states, row_grouped_states


class Teacher(ABC):
    """Scores a step's packed invocations. ``model`` and ``tokenizer`` are the teacher's whole
    weights and tokenizer where it has them in this process (its held-out evaluation and
    Prune-OPD's rollout monitor use them)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, context: str = "aligned",
                 lowering: str | None = None, pack_tokens: int = 4096, roles: Sequence[str] = ROLES,
                 rows_per_forward: int = 0):
        self.model, self.tokenizer = model, tokenizer
        self.rows_per_forward = rows_per_forward  # packed rows per forward (0: every row at once)
        self.context, self.lowering, self.pack_tokens, self.roles = context, lowering, pack_tokens, tuple(roles)

    @abstractmethod
    def action_states(self, batch: PackedBatch) -> ActionStates:
        """The teacher's states at ``batch``'s action tokens, detached (no grad)."""

    @torch.no_grad()
    def score(self, episodes: Sequence[Episode], batch: PackedBatch) -> TeacherScores:
        """The teacher's states at the action tokens of ``batch`` (the packed ``episodes``), in the
        run's context; the action order is ``batch``'s in either context."""
        if self.context == "aligned":
            return TeacherScores(states=self.action_states(batch))
        # a flattened transcript cannot be split across rows: widen rows to fit it
        flat = pack_episodes(list(episodes), fitting_budget(list(episodes), "persistent", self.pack_tokens),
                             mode="persistent", teacher_roles=self.roles, pad_token_id=pad_id(self.tokenizer))
        return TeacherScores(states=self.action_states(flat))


class LocalTeacher(Teacher):
    """Whole weights in this process (one process, or a replica on every rank)."""

    def action_states(self, batch: PackedBatch) -> ActionStates:
        return row_grouped_states(lambda part: action_states(self.model, part, lowering=self.lowering).detach(),
                                  batch, self.rows_per_forward)


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


class ShardedTeacher(Teacher):
    """FSDP2-sharded under torchrun: every rank runs its packed forward at once (one call a step
    each: FSDP2 gathers layer by layer). Sharded at its first use, so that the whole-weight uses
    before training (the held-out evaluation of a fresh run) are over by then."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, world: distributed.World, device: str,
                 **kwargs: Any):
        super().__init__(model, tokenizer, **kwargs)
        self.world, self.device = world, device
        self._fwd: Any = None
        self._head: Any = None

    def action_states(self, batch: PackedBatch) -> ActionStates:
        if self._fwd is None:
            self._shard()
        hidden = self._fwd(batch, self.lowering)
        self._fwd.reshard()  # FSDP2 keeps a root's weights gathered after its forward, for a backward
        return ActionStates(hidden.detach(), self._head, batch.temperatures.to(hidden.device))

    def _shard(self) -> None:
        from memopd.heads import output_head

        self._head = distributed.whole_head(output_head(self.model))  # applied after the forward
        self._fwd = distributed.wrap(distributed.PackedStates(self.model), distributed.decoder_layers(self.model),
                                     "fsdp", self.device, self.world)


def load_teacher(cfg: Any, student_tokenizer: Any, world: distributed.World,
                 log: Callable[[str], None] = print) -> Any:
    """The run's teacher (None without distillation, ``--opd-coef 0``). ``--teacher URL`` is a
    served one. ``--teacher auto`` is built once per machine, by its local rank 0, while the
    machine's other ranks wait for the cache (on the filesystem: a build outlasts any collective
    timeout)."""
    from agents.models import load

    if cfg.opd_coef <= 0:
        return None
    from memopd.learn.remote_teacher import RemoteTeacher, is_url

    if is_url(cfg.teacher):
        k = cfg.opd_topk if cfg.opd_estimator == "topk" else 0  # the sampled estimator needs the action's only
        audit = load(cfg.teacher_audit_model, device=cfg.device)[0].eval().requires_grad_(False) \
            if cfg.teacher_audit_model else None
        return RemoteTeacher(cfg.teacher, student_tokenizer, k=k, served_model=cfg.teacher_model, audit_model=audit,
                             concurrency=cfg.teacher_concurrency, retries=cfg.teacher_retries,
                             timeout_s=cfg.teacher_timeout, audit_every=cfg.audit_every,
                             audit_tolerance=cfg.teacher_audit_tolerance, audit_warn_only=cfg.teacher_audit_warn_only)
    if cfg.teacher == "auto" and world.local_rank != 0:
        while not (default_teacher_dir(cfg) / "config.json").is_file():
            time.sleep(2.0)
    model, tokenizer = load(ensure_teacher(cfg, log), device=cfg.device)
    model.eval().requires_grad_(False)
    kw = dict(context=cfg.teacher_context, lowering=cfg.attn, pack_tokens=cfg.pack_tokens,
              rows_per_forward=cfg.micro_batch_rows or 0,
              roles=ROLES if cfg.teacher_mask == "both" else (cfg.teacher_mask,))
    if not same_tokenizer(tokenizer, student_tokenizer):
        check_other_tokenizer(cfg, tokenizer, student_tokenizer, world)
        log(f"teacher: another tokenizer ({len(tokenizer)} tokens, the student's {len(student_tokenizer)}): each call "
            "is re-encoded in the teacher's tokens and its log-probs shared back over text spans")
        k = cfg.opd_topk if cfg.opd_estimator == "topk" else 0
        return CrossTokenizerTeacher(model, tokenizer, student_tokenizer, k=k, **kw)
    if world.enabled and cfg.teacher_parallel == "fsdp":
        return ShardedTeacher(model, tokenizer, world=world, device=cfg.device, **kw)
    return LocalTeacher(model, tokenizer, **kw)


def check_other_tokenizer(cfg: Any, tokenizer: Any, student_tokenizer: Any, world: distributed.World) -> None:
    """What a teacher with another tokenizer can do: the sampled and the top-k estimators (two
    vocabularies have no token-for-token map for a whole distribution; the top-k sums the
    student's tokens onto the teacher's by first pieces), in one process or replicated, without
    Prune-OPD (which compares the two distributions at every token)."""
    from agents.models import check_same_vocab

    try:
        check_same_vocab(tokenizer, student_tokenizer)
    except ValueError as exc:
        what = str(exc).split(". They must")[0]
    if cfg.opd_estimator == "full":
        raise ConfigError(f"--teacher {cfg.teacher}: {what}. A teacher with another tokenizer gives the log-prob "
                          "of the student's text and its top-k over its own tokens (the student's summed onto them), "
                          "not a distribution over the student's whole vocabulary: pass --opd-estimator topk or "
                          "sampled, or use a teacher with the student's tokenizer")
    if cfg.teacher_context != "aligned":
        raise ConfigError(f"--teacher {cfg.teacher}: {what}. The persistent control flattens each episode by the "
                          "record's spans, which name student tokens; a teacher with another tokenizer scores in "
                          "the aligned context (--teacher-context aligned)")
    if cfg.prune_opd:
        raise ConfigError(f"--teacher {cfg.teacher}: {what}. --prune-opd compares the teacher's and the "
                          "student's distributions token by token; it needs a teacher with the student's tokenizer")
    if world.enabled and cfg.teacher_parallel == "fsdp":
        raise ConfigError(f"--teacher {cfg.teacher}: {what}. A teacher with another tokenizer is replicated on "
                          "each rank in this version; drop --teacher-parallel fsdp")


__all__ = ["CrossTokenizerTeacher", "LocalTeacher", "ShardedTeacher", "Teacher", "TeacherScores", "load_teacher"]
