"""A teacher behind a stock OpenAI-compatible server (``vllm serve``), scored token in, token out.

    python -m vllm.entrypoints.openai.api_server --model TEACHER --max-logprobs 64   # any machine the trainer reaches
    python -m memopd.train --teacher http://HOST:8000/v1 --opd-estimator topk --opd-topk 20

Each packed invocation becomes one ``/completions`` request whose prompt is the call's restored
tokens, sent as token ids: its recorded prompt, then the action it sampled. vLLM's
``prompt_logprobs`` extension returns, for every prompt position, the log-probs of the ``k`` most
likely tokens and of the actual one; at the action positions they are exactly what the top-k and
sampled estimators need (:mod:`memopd.estimators`), in the state the student sampled each action
in (every call alone: the aligned context). Nothing is decoded or re-encoded.

- Requests of a step run concurrently (``--teacher-concurrency``); a connection error or timeout
  is retried with exponential backoff (``--teacher-retries``, ``--teacher-timeout``); scoring is
  idempotent, so a retried request changes nothing. When the retries are spent the step fails
  with one clear error before any update: nothing is lost or counted twice, and ``--resume``
  continues from the last checkpoint.
- At start a probe checks the server: the model is listed, it tokenizes a probe text as the
  student's tokenizer does, and its log-probs of a probe prompt are finite; with a local copy of
  the served model (``--teacher-audit-model``) the probe's log-probs (the actual tokens' and the
  top 5 of each position) must also equal the copy's. A mismatch is one ``error:`` line: a model of
  the same tokenizer but other weights (the student served by mistake) passes the tokens and fails
  the log-probs.
- With that copy, at the first step and every ``--audit-every`` steps, the served log-probs of the
  step's first calls (the sampled tokens' and the top-k's) are checked against the copy's forward
  of each call alone, with no packing (``audit/teacher_max_abs_diff``): the RCE audit's question
  asked of the server. Past ``--teacher-audit-tolerance`` the step fails before its update (one
  error; ``--teacher-audit-warn-only`` warns and trains on).
- The server's log-probs are at temperature 1: the calls must have been sampled at temperature 1
  (or greedily), which the default ``--temperature 1.0`` does; and ``k`` may not exceed the
  server's ``--max-logprobs`` (vLLM's default is 20).
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

from agents.records import Episode, Invocation
from memopd.config import ConfigError
from memopd.estimators import TeacherScores, TopK
from memopd.learn.plugin import TrainingError
from memopd.packing import PackedBatch

PROBE_TEXT = "The capital of France is Paris."
PROBE_TOPK = 5
"""How many of each probe position's most likely tokens the start-up probe compares with the copy."""


class RemoteTeacherError(TrainingError):
    """The teacher's server cannot score a step (unreachable after the retries, or it answered
    something the estimators cannot use); the run ends with its last checkpoint intact, and the
    message says what to do."""


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


class RemoteTeacher:
    """Scores a step's invocations on a served model; see the module doc."""

    model = None  # no weights in this process: no held-out evaluation, no Prune-OPD monitor
    context = "aligned"

    def __init__(self, base_url: str, tokenizer: Any, *, k: int, served_model: str | None = None,
                 concurrency: int = 8, retries: int = 4, timeout_s: float = 120.0,
                 audit_model: torch.nn.Module | None = None, audit_every: int = 0, audit_tolerance: float = 1e-4,
                 audit_warn_only: bool = False) -> None:
        from agents.backends.openai import OpenAIBackend, OpenAIBackendError

        self.tokenizer, self.k, self.concurrency = tokenizer, k, max(1, concurrency)
        self.audit_model = audit_model
        self.audit_every, self.audit_tolerance, self.audit_warn_only = audit_every, audit_tolerance, audit_warn_only
        self.steps = 0  # steps scored by this process: the audit runs at the first and every audit_every
        try:
            self.server = OpenAIBackend(base_url, tokenizer, model=served_model, retries=retries, timeout_s=timeout_s,
                                        flag="--teacher")
        except OpenAIBackendError as exc:
            raise ConfigError(f"--teacher {base_url}: {exc}") from None
        self.url = base_url
        self.probe()

    # -- the start-up probe -----------------------------------------------------------------------
    def probe(self) -> None:
        """The served model tokenizes a probe text as the student's tokenizer does (the server sends
        back the actual token of every prompt position with its log-prob) and scores it finitely."""
        from agents.backends.openai import OpenAIBackendError

        mine = list(self.tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
        try:
            rows = self._score_call(PROBE_TEXT, 0)
        except (OpenAIBackendError, RemoteTeacherError) as exc:
            raise ConfigError(f"--teacher {self.url}: the probe failed: {exc}") from None
        # the actual token of positions 1..; the server may put special tokens (BOS) before the text's
        theirs = [next(iter(r)) if len(r) == 1 else None for r in rows[1:]]
        if len(theirs) < len(mine) - 1 or theirs[len(theirs) - len(mine) + 1:] != mine[1:]:
            raise ConfigError(f"--teacher {self.url}: the served model {self.server.model!r} tokenizes a probe text "
                              f"as [..., {theirs[-len(mine) + 1:][:8]}...], the student's tokenizer as {mine[1:9]}...; the "
                              "teacher must "
                              "share the student's tokenizer (serve a model of the same family)")
        if not all(v == v and v <= 0 for r in rows[1:] for v in r.values()):
            raise ConfigError(f"--teacher {self.url}: the server returned log-probs that are not finite and <= 0 "
                              f"for a probe prompt: {rows[1:4]}")
        if self.audit_model is not None:
            self._probe_logprobs(mine)

    @torch.no_grad()
    def _probe_logprobs(self, ids: list[int]) -> None:
        """The served log-probs of the probe's tokens (each actual token's and the top
        :data:`PROBE_TOPK` of each position) against the local copy's forward."""
        from agents.backends.openai import OpenAIBackendError

        try:
            rows = self._score_call(ids, PROBE_TOPK)
        except (OpenAIBackendError, RemoteTeacherError) as exc:
            raise ConfigError(f"--teacher {self.url}: the probe failed: {exc}") from None
        device = next(self.audit_model.parameters()).device
        logits = self.audit_model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0]
        logp = torch.log_softmax(logits.float(), -1).cpu()
        worst = max(abs(float(logp[j - 1, tok]) - v) for j in range(1, len(ids)) for tok, v in rows[j].items())
        if worst > self.audit_tolerance:
            message = (f"--teacher {self.url}: the served model {self.server.model!r} gives the probe's tokens "
                       f"log-probs {worst:.3g} away from --teacher-audit-model's (tolerance "
                       f"{self.audit_tolerance:g}, --teacher-audit-tolerance): the server serves other weights or "
                       "another dtype than the local copy; serve the teacher in float32, or pass "
                       "--teacher-audit-warn-only to train on")
            if not self.audit_warn_only:
                raise ConfigError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    # -- scoring --------------------------------------------------------------------------------
    def score(self, episodes: Sequence[Episode], batch: PackedBatch) -> TeacherScores:
        """The teacher's top-k and its log-probs of the sampled tokens at every action of ``batch``
        (the packed ``episodes``), in the batch's action order."""
        from agents.backends.openai import OpenAIBackendError

        if bool((batch.temperatures != 1.0).any()):
            raise RemoteTeacherError(f"--teacher {self.url}: the server's log-probs are at temperature 1, and this "
                                     "step's calls were sampled at another; train with --temperature 1.0")
        calls = list(dict.fromkeys((e, i) for e, i, _ in batch.token_map.tolist()))
        invs = [episodes[e].invocations[i] for e, i in calls]
        t0, sent0, received0 = time.perf_counter(), self.server.bytes_sent, self.server.bytes_received
        try:
            with ThreadPoolExecutor(self.concurrency) as pool:
                answers = list(pool.map(self._score_invocation, invs))
        except OpenAIBackendError as exc:
            raise RemoteTeacherError(f"the teacher at {self.url} could not score this step ({exc}); no update was "
                                     "made, and the last checkpoint is intact: restart the server, then --resume")
        per_call = dict(zip(calls, answers))
        ids, logp, sampled = [], [], []
        for e, i, t in batch.token_map.tolist():
            entry = per_call[(e, i)][len(episodes[e].invocations[i].prompt_ids) + t]
            action = episodes[e].invocations[i].response_ids[t]
            top = sorted(entry.items(), key=lambda kv: -kv[1])[: self.k]
            if len(top) < self.k or action not in entry:
                raise RemoteTeacherError(f"the teacher at {self.url} returned {len(entry)} log-probs at an action "
                                         f"position, not the top {self.k} and the sampled token; serve it with "
                                         f"--max-logprobs {self.k} or more")
            ids.append([tok for tok, _ in top])
            logp.append([v for _, v in top])
            sampled.append(entry[action])
        n = len(ids)
        top = TopK(torch.tensor(ids, dtype=torch.long).reshape(n, self.k),
                   torch.tensor(logp, dtype=torch.float32).reshape(n, self.k))
        scores = TeacherScores(top=top, sampled=torch.tensor(sampled, dtype=torch.float32),
                               metrics={"teacher/remote_s": time.perf_counter() - t0,
                                      "teacher/requests": float(len(invs)),
                                      # what the estimators read: k ids and log-probs, and the sampled token's
                                      "teacher/bytes_per_token": 8.0 * self.k + 4.0,
                                      # what crossed the wire: the JSON bodies of the step's requests and answers
                                      # (vLLM returns every prompt position's log-probs, not the actions' alone)
                                      "teacher/sent_bytes": float(self.server.bytes_sent - sent0),
                                      "teacher/received_bytes": float(self.server.bytes_received - received0),
                                      "teacher/received_bytes_per_action": (self.server.bytes_received - received0)
                                      / max(1, n)})
        self.steps += 1
        if self.audit_model is not None and (self.steps == 1 or (self.audit_every
                                                                 and self.steps % self.audit_every == 0)):
            self._check_audit(self.audit(episodes, batch, scores), scores.metrics)
        return scores

    # -- the audit against a local copy ---------------------------------------------------------
    def _check_audit(self, res: dict[str, Any], metrics: dict[str, float]) -> None:
        """Log the audit; past the tolerance, fail the step before its update (or warn)."""
        metrics["audit/teacher_max_abs_diff"] = res["max_abs_diff"]
        metrics["audit/teacher_passed"] = bool(res["passed"])
        if res["passed"]:
            return
        message = (f"the teacher at {self.url} failed its audit at its step {self.steps}: the served log-probs differ "
                   f"from --teacher-audit-model's forward by {res['max_abs_diff']:.3g} (tolerance "
                   f"{self.audit_tolerance:g}); is the copy the served model, in float32?")
        if not self.audit_warn_only:
            raise RemoteTeacherError(message + " No update was made, and the last checkpoint is intact; fix the "
                                     "server, then --resume (or pass --teacher-audit-warn-only to train on)")
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    @torch.no_grad()
    def audit(self, episodes: Sequence[Episode], batch: PackedBatch, scores: TeacherScores,
              max_calls: int = 8) -> dict[str, Any]:
        """The served log-probs of a step's first ``max_calls`` calls (the sampled tokens', and the
        top-k's) against the local copy's own forward of each call alone, no packing:
        ``{"max_abs_diff", "passed", "tokens"}``."""
        where: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for n, (e, i, t) in enumerate(batch.token_map.tolist()):
            if (e, i) in where or len(where) < max_calls:
                where.setdefault((e, i), []).append((n, t))
        worst, count = 0.0, 0
        device = next(self.audit_model.parameters()).device
        for (e, i), actions in where.items():
            inv = episodes[e].invocations[i]
            ids = torch.tensor([list(inv.prompt_ids) + list(inv.response_ids)], device=device)
            logp = torch.log_softmax(self.audit_model(input_ids=ids, use_cache=False).logits[0].float(), -1).cpu()
            for n, t in actions:
                row = logp[len(inv.prompt_ids) + t - 1]
                worst = max(worst, abs(float(row[inv.response_ids[t]]) - float(scores.sampled[n])))
                if scores.top is not None and scores.top.ids.shape[-1]:
                    worst = max(worst, float((row[scores.top.ids[n]] - scores.top.logp[n]).abs().max()))
                count += 1
        return {"max_abs_diff": worst, "passed": worst <= self.audit_tolerance, "tokens": count}

    def _score_invocation(self, inv: Invocation) -> list[dict[int, float]]:
        tokens = list(inv.prompt_ids) + list(inv.response_ids)
        if list(inv.position_ids) != list(range(len(tokens))):
            raise RemoteTeacherError(f"--teacher {self.url}: a call's recorded positions do not start at 0 and run "
                                     "on; a server scores positions 0.. only: use a local teacher for such records")
        return self._score_call(tokens, self.k)

    def _score_call(self, tokens: list[int] | str, k: int) -> list[dict[int, float]]:
        """Per prompt position, {token id: log-prob} of the k most likely tokens and the actual one
        (position 0: empty); ``tokens`` as ids (or a text, tokenized by the server: the probe)."""
        body = {"model": self.server.model, "prompt": tokens, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": k}
        answer = self.server.request("/completions", body)
        rows = (answer.get("choices") or [{}])[0].get("prompt_logprobs")
        if rows is None or (not isinstance(tokens, str) and len(rows) != len(tokens)):
            raise RemoteTeacherError(f"the teacher at {self.url} returned no prompt_logprobs for a {len(tokens)}-token "
                                     "prompt; serve it with vLLM (its completions API returns them)")
        return [{} if row is None else {int(tok): float(v["logprob"] if isinstance(v, dict) else v)
                                        for tok, v in row.items()} for row in rows]


__all__ = ["PROBE_TEXT", "RemoteTeacher", "RemoteTeacherError", "is_url"]
