"""The teachers, one module per kind, each a :class:`~memopd.learn.teachers.base.Teacher` that
declares what it provides:

    local.py            whole weights in this process; FSDP2-sharded under torchrun
    other_tokenizer.py  whole weights, another tokenizer (scored in its own tokens)
    served.py           a stock vllm serve behind a URL (top-k and sampled-token log-probs)
    routing.py          a teacher per env and per call role (--teacher KEY=SPEC), any kind in any slot

:func:`load_teacher` picks the kind from ``--teacher`` (a URL, or a model whose tokenizer differs
from the student's) and ``--teacher-parallel``, checks the run's needs against what that kind
provides (:func:`memopd.learn.needs.check_needs`, before anything is built or contacted), then
builds it.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from memopd import distributed
from memopd.learn.estimators import estimator_needs
from memopd.learn.models import default_teacher_dir, ensure_teacher, pad_id
from memopd.learn.needs import Need, check_needs
from memopd.learn.teachers.base import Teacher
from memopd.learn.teachers.local import LocalTeacher, ShardedTeacher
from memopd.learn.teachers.other_tokenizer import CrossTokenizerTeacher
from memopd.learn.teachers.routing import Route, RoutedTeacher, load_routed, route_table
from memopd.learn.teachers.served import RemoteTeacher, RemoteTeacherError, ServedTeacherOptions, is_url
from memopd.retokenize import same_tokenizer

# CoreConfig (memopd.learn.options) names the run's core options in the annotations; it is not imported,
# even for type checkers, because options imports this module (an import cycle otherwise).


def context_needs(cfg: CoreConfig) -> list[Need]:
    """What the run's teacher context needs of the teacher."""
    if cfg.teacher_context != "persistent":
        return []
    return [Need("persistent", "the persistent control needs a local teacher with the student's tokenizer, to "
                 "score each episode flattened into one transcript of student tokens",
                 "pass --teacher-context aligned")]


def parallel_needs(cfg: CoreConfig, ranks: int) -> list[Need]:
    """What ``--teacher-parallel`` needs of the teacher under torchrun (``ranks`` > 1)."""
    if not (ranks > 1 and cfg.teacher_parallel == "fsdp"):
        return []
    return [Need("sharded", "--teacher-parallel fsdp shards the teacher's forward over the ranks",
                 "drop --teacher-parallel fsdp")]


def run_needs(cfg: CoreConfig, plugins: Sequence[Any], ranks: int) -> list[Need]:
    """Everything the run needs of its teacher: the estimator's, the context's, the plugins' (their
    ``teacher_needs``) and the parallel options', in that order."""
    if cfg.opd_coef <= 0:
        return []
    return [*estimator_needs(cfg), *context_needs(cfg), *(n for p in plugins for n in p.teacher_needs),
            *parallel_needs(cfg, ranks)]


def check_served(cfg: CoreConfig, needs: Sequence[Need]) -> None:
    """A served teacher's kind is known from ``--teacher`` alone: its check runs when the config is
    made, before any model loads or the server is contacted; so do a routing table's checks of its
    own (:func:`check_routes`) and of each served route."""
    if cfg.opd_coef <= 0:
        return
    routes = route_table(cfg)
    if routes:
        check_routes(cfg, routes, needs)
        for r in routes:
            if is_url(r.spec):
                check_needs(RemoteTeacher, r.text(), needs)
    elif is_url(cfg.teacher):
        check_needs(RemoteTeacher, cfg.teacher, needs)


def check_routes(cfg: CoreConfig, routes: Sequence[Route], needs: Sequence[Need]) -> None:
    """What a routing table cannot do, whatever its teachers: the persistent control (a call's
    route is its own state) and the sharded teacher; each route's teacher is checked as it loads."""
    own = [n for n in needs if n.capability in ("persistent", "sharded")]
    check_needs(RoutedTeacher, " ".join(f"--teacher {r.text()}" for r in routes)[len("--teacher "):], own)


def load_teacher(cfg: CoreConfig, student_tokenizer: Any, world: distributed.World, needs: Sequence[Need], topk: int = 0,
                 log: Callable[[str], None] = print) -> Teacher | None:
    """The run's teacher (None without distillation, ``--opd-coef 0``), after the check of
    ``needs``. ``--teacher URL`` is a served one (asked for its ``topk`` most likely tokens at each
    action). ``--teacher auto`` is built once per machine, by its local rank 0, while the machine's
    other ranks wait for the cache (on the filesystem: a build outlasts any collective timeout)."""
    from agents.models import load

    if cfg.opd_coef <= 0:
        return None
    routes = route_table(cfg)
    if routes:  # a teacher per env and call role, each checked as it loads
        check_routes(cfg, routes, needs)
        reads = frozenset(n.capability for n in needs) & {"distribution", "topk", "sampled"}
        return load_routed(cfg, routes, lambda one, r: load_teacher(one, student_tokenizer, world, needs, topk, log),
                           reads=reads, topk=topk, pad_token_id=pad_id(student_tokenizer))
    if is_url(cfg.teacher):
        check_needs(RemoteTeacher, cfg.teacher, needs)
        audit = load(cfg.teacher_audit_model, device=cfg.device)[0].eval().requires_grad_(False) \
            if cfg.teacher_audit_model else None
        return RemoteTeacher(cfg.teacher, student_tokenizer, k=topk, served_model=cfg.teacher_model,
                             audit_model=audit, concurrency=cfg.teacher_concurrency, retries=cfg.teacher_retries,
                             timeout_s=cfg.teacher_timeout, audit_every=cfg.audit_every,
                             audit_tolerance=cfg.teacher_audit_tolerance, audit_warn_only=cfg.teacher_audit_warn_only)
    if cfg.teacher == "auto" and world.local_rank != 0:
        while not (default_teacher_dir(cfg) / "config.json").is_file():
            time.sleep(2.0)
    model, tokenizer = load(ensure_teacher(cfg, log), device=cfg.device)
    model.eval().requires_grad_(False)
    kw = dict(context=cfg.teacher_context, lowering=cfg.attn, pack_tokens=cfg.pack_tokens,
              rows_per_forward=cfg.micro_batch_rows or 0, roles=cfg.teacher_roles())
    if not same_tokenizer(tokenizer, student_tokenizer):
        check_needs(CrossTokenizerTeacher, cfg.teacher, needs, _vocab_difference(tokenizer, student_tokenizer))
        log(f"teacher: another tokenizer ({len(tokenizer)} tokens, the student's {len(student_tokenizer)}): each call "
            "is re-encoded in the teacher's tokens and its log-probs shared back over text spans")
        return CrossTokenizerTeacher(model, tokenizer, student_tokenizer, k=topk, **kw)
    if world.enabled and cfg.teacher_parallel == "fsdp":
        check_needs(ShardedTeacher, cfg.teacher, needs)
        return ShardedTeacher(model, tokenizer, world=world, device=cfg.device, **kw)
    check_needs(LocalTeacher, cfg.teacher, needs)
    return LocalTeacher(model, tokenizer, **kw)


def _vocab_difference(tokenizer: Any, student_tokenizer: Any) -> str:
    """How the two tokenizers differ, in one clause."""
    from agents.models import check_same_vocab

    try:
        check_same_vocab(tokenizer, student_tokenizer)
    except ValueError as exc:
        return str(exc).split(". They must")[0]
    return "the teacher's tokenizer is not the student's"


__all__ = ["CrossTokenizerTeacher", "LocalTeacher", "RemoteTeacher", "RemoteTeacherError", "RoutedTeacher",
           "ServedTeacherOptions", "ShardedTeacher", "Teacher", "check_routes", "check_served", "context_needs", "load_teacher", "parallel_needs", "run_needs"]
