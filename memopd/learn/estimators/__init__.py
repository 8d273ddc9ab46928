"""The distillation estimators, one module each, by name (``--opd-estimator NAME``).

    full      the whole vocabulary, exact (MemOPD's)                           full.py
    topk      the teacher's k most likely tokens plus a tail bucket            topk.py
    sampled   k1 / k3 of the log-ratio at the sampled token (or the fkl's)      sampled.py

An estimator is an :class:`~memopd.learn.estimators.base.Estimator` that declares what it needs of
the teacher; ``--opd-estimator`` also takes ``module:Class`` (e.g. ``examples.gkd:GeneralizedJSD``,
imported from the current directory) or a name an installed package registers under the
``memopd.estimators`` entry points. Its options: a built-in's are flags of ``memopd.train``, any
other's ``--opd-estimator-kwarg KEY=VALUE`` (the fields of its ``Options``); docs/extend.md.
"""

from __future__ import annotations

from typing import Any

from memopd.learn.estimators.base import (Estimator, NoDistillation, TeacherScores, TopK, teacher_targets,
                                          teacher_token_logprobs, teacher_topk)
from memopd.learn.estimators.full import FullEstimator
from memopd.learn.estimators.sampled import (SAMPLED_KINDS, SampledEstimator, SampledOptions, sampled_advantage,
                                             sampled_estimate, sampled_loss)
from memopd.learn.estimators.topk import (PROJECT_FLOOR, TAIL_FLOOR, TopKEstimator, TopKOptions, bucket_divergence,
                                          project_student, student_terms_topk, topk_buckets, topk_divergence)
from memopd.learn.needs import Need
from memopd.learn.registry import Registry, options_of

# CoreConfig (memopd.learn.options) names the run's core options in the annotations; it is not imported,
# even for type checkers, because options imports this module (an import cycle otherwise).

BUILTIN = {"full": "memopd.learn.estimators.full:FullEstimator",
           "topk": "memopd.learn.estimators.topk:TopKEstimator",
           "sampled": "memopd.learn.estimators.sampled:SampledEstimator"}
ENTRY_POINT_GROUP = "memopd.estimators"
REGISTRY = Registry("--opd-estimator", "estimator", ENTRY_POINT_GROUP, Estimator, BUILTIN)
OPTION_SLICES = (TopKOptions, SampledOptions)
"""The built-in estimators' options, flags of ``memopd.train``."""


def resolve_estimator(spec: str) -> type[Estimator]:
    return REGISTRY.resolve(spec)


def estimator_options(cls: type[Estimator], cfg: CoreConfig) -> Any:
    """An estimator's Options: a built-in's from the run's flags, any other's from
    ``--opd-estimator-kwarg``."""
    import dataclasses

    from memopd.config import from_dict

    if cls.Options is None:
        return None
    if cls.Options in OPTION_SLICES:
        return from_dict(cls.Options, {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls.Options)})
    return options_of(cls, cfg.opd_estimator_kwargs, f"--opd-estimator {cfg.opd_estimator}", "--opd-estimator-kwarg")


def make_estimator(cfg: CoreConfig) -> Estimator:
    """The run's estimator (:class:`NoDistillation` without a teacher, ``--opd-coef 0``)."""
    if cfg.opd_coef <= 0:
        return NoDistillation(cfg)
    cls = resolve_estimator(cfg.opd_estimator)
    return cls(cfg, estimator_options(cls, cfg))


def estimator_needs(cfg: CoreConfig) -> list[Need]:
    """What the run's estimator needs of the teacher, each with the estimators that would do."""
    if cfg.opd_coef <= 0:
        return []
    cls = resolve_estimator(cfg.opd_estimator)
    return [Need(c, f"--opd-estimator {cfg.opd_estimator} needs {_WHAT[c]} at each action",
                 lambda teacher, name=cls.name: feeding(teacher, name)) for c in sorted(cls.needs)]


_WHAT = {"distribution": "the teacher's whole distribution", "topk": "the teacher's top-k",
         "sampled": "the teacher's log-prob of the sampled token"}


def feeding(teacher: Any, but: str = "") -> str:
    """What would work with ``teacher`` (a Teacher class): the built-in estimators it can feed."""
    names = [n for n in BUILTIN if n != but and resolve_estimator(n).needs <= teacher.provides]
    return f"pass --opd-estimator {' or '.join(names)}" if names else "use another teacher"


__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "OPTION_SLICES", "PROJECT_FLOOR", "REGISTRY", "SAMPLED_KINDS", "TAIL_FLOOR",
           "Estimator", "FullEstimator", "estimator_needs", "NoDistillation", "SampledEstimator", "SampledOptions",
           "TeacherScores", "TopK", "TopKEstimator", "TopKOptions", "bucket_divergence", "estimator_options", "feeding",
           "make_estimator", "project_student", "resolve_estimator", "sampled_advantage", "sampled_estimate",
           "sampled_loss", "student_terms_topk", "teacher_targets", "teacher_token_logprobs", "teacher_topk",
           "topk_buckets", "topk_divergence"]
