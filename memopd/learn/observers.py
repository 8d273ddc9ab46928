"""What watches the run without changing it: the held-out evaluations, the RCE audit, the sample
episodes and the final export, each an :class:`Observer` the fit loop calls at fixed points.

- :meth:`Observer.after_update`: the step's update is done (before the plugins end the step);
- :meth:`Observer.after_step`: the step is counted (``step`` is the number of steps done); its
  metrics go into the step's row;
- :meth:`Observer.at_end`: the run is over (the files of the finished run, written by rank 0).

An observer reads the step (:class:`~memopd.learn.plugin.StepResult`) and the models; none of
them changes a weight, a loss weight or the RNG the training draws from.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable

from agents.records import save_episodes
from memopd import distributed
from memopd.audit import RCEAuditHook
from memopd.learn.actor import Actor
from memopd.learn.plugin import StepResult
from memopd.learn.state import TrainState

if TYPE_CHECKING:  # the run's options, for the annotations
    from memopd.learn.options import CoreConfig


class Observer:
    """Base of the observers; each hook's default does nothing."""

    def after_update(self, result: StepResult) -> dict[str, Any]:
        return {}

    def after_step(self, step: int, result: StepResult) -> dict[str, Any]:
        return {}

    def at_end(self) -> None:
        pass


class Evaluation(Observer):
    """The held-out evaluations (test split, greedy; :meth:`memopd.learn.actor.Actor.evaluate`):
    the teacher's and the student's before training, every ``--eval-every`` steps, and after
    training; kept in the train state (so a resume neither repeats nor loses one)."""

    def __init__(self, cfg: CoreConfig, actor: Actor, state: Callable[[], TrainState], log: Callable[[str], None]):
        self.cfg, self.actor, self.state, self.log = cfg, actor, state, log

    def before(self, teacher: Any, world: distributed.World) -> dict[str, float]:
        """The teacher's figures (as the run's agent) and the student's, before training."""
        cfg, state = self.cfg, self.state()
        # on hf: a second in-process vLLM engine would tear down the student engine's state when freed
        judge = lambda model, tokenizer: Actor(dataclasses.replace(cfg, backend="hf"), model, tokenizer,  # noqa: E731
                                               world)
        state.eval_teacher = teacher.evaluate(judge, self.log) if teacher is not None else None
        if state.eval_teacher is not None:
            self._say("teacher held-out", state.eval_teacher)
        state.eval_before = self.actor.evaluate()
        self._say("held-out before training", state.eval_before)
        return state.eval_before

    def after_step(self, step: int, result: StepResult) -> dict[str, Any]:
        if not (self.cfg.eval_every and step % self.cfg.eval_every == 0 and step < self.cfg.steps):
            return {}
        return {f"eval/{k}": v for k, v in self.actor.evaluate().items()}

    def after(self, step: int) -> dict[str, float] | None:
        """The evaluation after training (None: the last step had it)."""
        state = self.state()
        if state.eval_after is not None and state.eval_after_step == step:
            return None
        state.eval_after, state.eval_after_step = self.actor.evaluate(), step
        return state.eval_after

    def summary(self) -> dict[str, Any]:
        """The figures of ``summary.json``, and the before -> after line of the log."""
        state = self.state()
        before, after = state.eval_before or {}, state.eval_after
        self.log(f"held-out F1: before {before.get('f1', float('nan')):.3f} -> after {after['f1']:.3f}  "
                 f"(EM {before.get('em', float('nan')):.3f} -> {after['em']:.3f})")
        return {"eval_before": before, "eval_after": after, "eval_teacher": state.eval_teacher}

    def _say(self, what: str, figures: dict[str, float]) -> None:
        self.log(f"{what}: F1 {figures['f1']:.3f}  EM {figures['em']:.3f}  ({self.cfg.eval_episodes} test episodes)")


class EnvMetrics(Observer):
    """With several envs (:mod:`memopd.learn.mix`): each env's share of the step, as
    ``env/TAG/reward``, ``env/TAG/f1``, ``env/TAG/episodes`` (the episodes that ran to their answer
    count in the first two, as in ``reward`` and ``f1``) and ``env/TAG/kl`` (the mean divergence
    to the teacher over its supervised action tokens; every rank's)."""

    def __init__(self, cfg: CoreConfig, world: distributed.World):
        from memopd.learn.mix import episode_tags

        self.cfg, self.world, self.tags = cfg, world, episode_tags(cfg)

    def after_update(self, result: StepResult) -> dict[str, Any]:
        from memopd.learn.advantage import episode_rewards

        kind = self.cfg.reward if self.cfg.reward != "none" else "f1"
        out: dict[str, Any] = {}
        kl: dict[str, list[float]] = {t: [0.0, 0.0] for t in self.tags.values()}
        for (e, _, _), v in zip(result.batch.token_map.tolist(), result.token_kl.tolist()):
            tag = self.tags.get(result.episodes[result.own[e]].task_id)
            if tag is not None and math.isfinite(v):
                kl[tag][0] += v
                kl[tag][1] += 1
        for tag in self.tags.values():
            eps = [ep for ep in result.episodes if self.tags.get(ep.task_id) == tag]
            done = [ep for ep in eps if ep.cut is None]
            total, count = distributed.all_sum(kl[tag], self.world)
            out[f"env/{tag}/episodes"] = len(eps)
            out[f"env/{tag}/reward"] = float(episode_rewards(done, kind).mean()) if done else float("nan")
            out[f"env/{tag}/f1"] = sum(ep.metrics.get("f1", 0.0) for ep in done) / len(done) if done else float("nan")
            out[f"env/{tag}/kl"] = total / count if count else float("nan")
        return out


class Audit(Observer):
    """Rollout Context Equivalence (``--audit-every``): the packed log-probs of 4 of the step's
    episodes against each call alone (:class:`memopd.audit.RCEAuditHook`), on rank 0."""

    def __init__(self, cfg: CoreConfig, world: distributed.World, model: Any):
        self.world, self.model = world, model
        self.hook = RCEAuditHook(every=cfg.audit_every, max_episodes=4, lowering=cfg.attn, strict=False,
                                 tolerance=1e-1 if cfg.dtype == "bfloat16" else None)  # autocast: bf16's bound

    def after_step(self, step: int, result: StepResult) -> dict[str, Any]:
        res = self.hook(step, self.model, result.episodes) if self.world.is_main else None
        return {} if res is None else {"audit/max_abs_diff": res.max_abs_diff, "audit/passed": bool(res.passed)}


class SampleDump(Observer):
    """The step's first ``--sample-episodes`` episodes in ``episodes/step-N.jsonl``, each call with
    its ``teacher_kl`` (one value per response token, the first epoch's divergence; None where the
    teacher does not supervise) for the viewer's heatmap. Under torchrun rank 0 collects every
    rank's values and writes the file."""

    def __init__(self, cfg: CoreConfig, world: distributed.World, run: Any, distilled: bool):
        self.n, self.context, self.world, self.run, self.distilled = (cfg.sample_episodes, cfg.teacher_context,
                                                                       world, run, distilled)

    def after_update(self, result: StepResult) -> dict[str, Any]:
        episodes, own, n = result.episodes, result.own, self.n
        kl: dict[tuple[int, int], list[float | None]] = {}
        if self.distilled:
            for (e, i, t), v in zip(result.batch.token_map.tolist(), result.token_kl.tolist()):
                if own[e] < n:
                    kl.setdefault((own[e], i), [None] * len(episodes[own[e]].invocations[i].response_ids))[t] = \
                        v if math.isfinite(v) else None
            if self.world.enabled:
                kl = {k: v for part in distributed.gather_objects(kl, self.world) for k, v in part.items()}
        if not self.world.is_main:
            return {}
        for (e, i), values in kl.items():
            inv = episodes[e].invocations[i]
            inv.teacher_kl, inv.teacher_mode = values, self.context
        save_episodes(self.run.run_dir / "episodes" / f"step-{result.step + 1:06d}.jsonl", episodes[:n])
        return {}


class Export(Observer):
    """The final model (:meth:`memopd.learn.student.Student.export`) at the end of the run, written
    by rank 0."""

    def __init__(self, student: Any, run: Any, tokenizer: Any):
        self.student, self.run, self.tokenizer = student, run, tokenizer

    def at_end(self) -> None:
        if self.student.world.is_main:
            self.student.export(self.run.run_dir, self.tokenizer)


def observers(cfg: CoreConfig, world: distributed.World, evaluation: Evaluation, student: Any, run: Any, tokenizer: Any,
              distilled: bool) -> list[Observer]:
    """The run's observers, in the order they act (the sample episodes, the evaluation, the audit,
    the export); ``run``: what holds the run directory (``run.run_dir``, the checkpointer)."""
    out: list[Observer] = [SampleDump(cfg, world, run, distilled)] if cfg.sample_episodes else []
    if cfg.env_mix:
        out.append(EnvMetrics(cfg, world))
    out.append(evaluation)
    if cfg.audit_every:
        out.append(Audit(cfg, world, student.twin))
    return out + [Export(student, run, tokenizer)]


__all__ = ["Audit", "EnvMetrics", "Evaluation", "Export", "Observer", "SampleDump", "observers"]
