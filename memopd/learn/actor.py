"""The rollout worker: runs episodes of the ``--agent`` policy with the current student on a pool of
envs, through a backend made by :func:`agents.backends.factory.make_backend`, and checks that its
records carry what the learner needs.

Every training step has its own seeds (``seed * 1_000_003 + step * B + question``), so a
resumed run replays exactly what it would have done; held-out episode g has seed 10_000 + g. With
several envs (:mod:`memopd.learn.mix`) each question's env is drawn by weight from the seed and the
step, the questions are grouped by env, and each env has its own pool of envs and its own held-out
episodes (``--eval-episodes`` of each).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from agents.records import Episode
from memopd import distributed
from memopd.config import ConfigError
from memopd.learn.mix import EnvSpec, env_mix, question_envs

# CoreConfig (memopd.learn.options) names the run's core options in the annotations; it is not imported,
# even for type checkers, because options imports this module (an import cycle otherwise).

SEED_STRIDE = 1_000_003
"""Env seed of a step's first question: ``seed * SEED_STRIDE + step * questions_per_step``."""
EVAL_SEED = 10_000
"""Seed of held-out episode 0 (episode g: ``EVAL_SEED + g``)."""
PRE_TRAINING_STEPS = 1_000_000
"""A rollout of step -k (made before training) is seeded as step ``PRE_TRAINING_STEPS - k``."""
EXTRA_DRAW_STEPS = 2_000_000
MAX_DRAWS = 100
"""Extra draw k (1..MAX_DRAWS - 1) of step s (more questions for the same step, e.g. dynamic sampling's) is
seeded as step ``EXTRA_DRAW_STEPS + s * MAX_DRAWS + k``: questions no step and no other draw has."""


@dataclass(frozen=True)
class RolloutLimits:
    """What a plugin may limit or ask of a rollout: the most model calls per episode (a depth
    budget; an episode is cut there), the top-k of each sampling distribution to record with
    every token (``Backend.record_topk``), and which draw of the step's questions it is."""

    max_calls: int | None = None
    record_topk: int = 0
    draw: int = 0  # 0: the step's own questions; k > 0: its k-th extra draw, questions of seeds of their own


@dataclass
class Rollout:
    """A step's episodes (every rank's, in rank order), the actor's sampling seconds, and the
    metrics of whatever produced them."""

    episodes: list[Episode]
    seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


def engine_options(cfg: CoreConfig) -> Any:
    """The backend factory's engine options from the trainer's ``--vllm-*`` flags."""
    from agents.backends.factory import EngineOptions

    return EngineOptions(dtype=cfg.vllm_dtype, max_model_len=cfg.max_model_len,
                         gpu_memory_utilization=cfg.gpu_memory_utilization,
                         tensor_parallel_size=cfg.tensor_parallel_size, kv_cache_gib=cfg.kv_cache_gib,
                         sleep_mode=cfg.vllm_sleep)


class Actor:
    """Samples the student's episodes for training (this rank's share of the questions) and for the
    held-out evaluation (split over the ranks of ``world``)."""

    def __init__(self, cfg: CoreConfig, model: Any, tokenizer: Any, world: distributed.World = distributed.SINGLE,
                 envs: bool = True):
        from agents.backends.factory import make_backend
        from agents.backends.vllm import VLLMUnsupportedError

        self.cfg, self.model, self.world = cfg, model, world
        self.questions = distributed.question_share(cfg.questions_per_step, world)  # (first, count)
        self.run_tag = f"-r{world.rank}" if world.enabled else ""  # tells the group ids of ranks apart
        try:
            self.backend = make_backend(cfg.backend, model=model, tokenizer=tokenizer, options=engine_options(cfg),
                                        device=cfg.device, seed=cfg.seed)
        except VLLMUnsupportedError as exc:
            raise ConfigError(f"--backend vllm: {exc}") from None
        self.mix = env_mix(cfg)  # one env, or several (--env repeated): a pool of envs each
        self.train_pools = [self._envs(s, "train", cfg.questions_per_step * cfg.group_size, tokenizer) if envs else []
                            for s in self.mix]
        self.test_pools = [self._envs(s, "test", cfg.eval_episodes, tokenizer) if envs else [] for s in self.mix]
        self.train_envs, self.test_envs = self.train_pools[0], self.test_pools[0]

    def _envs(self, spec: EnvSpec, split: str, n: int, tokenizer: Any) -> list[Any]:
        import gymnasium as gym

        import memgym  # noqa: F401  (registers the envs)

        kwargs = {**self.cfg.env_kwargs, **spec.kwargs}
        try:
            envs = [gym.make(spec.name, split=split, **{**kwargs, "tokenizer": tokenizer})
                    for _ in range(min(self.cfg.rollout_envs, n))]
        except (TypeError, ValueError, KeyError) as exc:  # env options are user input
            raise ConfigError(f"--env-kwarg: {spec.name} refused {kwargs}: {exc}") from None
        spec = getattr(self.cfg, "memory_perturbation", None)
        if spec and split == "train":  # the perturbed-memory control: training states imitation never shows
            from memgym.perturb import MemoryPerturbation

            envs = [MemoryPerturbation(env, spec) for env in envs]
        return envs

    def agent(self, greedy: bool = False, seed: int | None = None) -> Any:
        """The ``--agent`` by the constructor convention: this actor's backend, the run's sampling,
        and the ``--agent-kwarg`` options."""
        from agents.backends.base import SamplingParams
        from agents.registry import AgentSpecError, build_agent

        sp = SamplingParams(temperature=self.cfg.temperature, max_new_tokens=self.cfg.max_new_tokens,
                            greedy=greedy, seed=seed)
        try:
            return build_agent(self.cfg.agent, {"backend": self.backend, "sampling": sp}, options=self.cfg.agent_kwargs)
        except AgentSpecError as exc:
            raise ConfigError(f"--agent {exc}") from None

    def check(self, episodes: Sequence[Episode]) -> None:
        """The learner's contract on the agent's records (:func:`memopd.contexts.check_contract`) for
        this run's reward, teacher context and mask: a bad agent fails at its first rollout (the
        held-out evaluation before training), before any update, with its name."""
        from memopd.contexts import ContractError, check_contract

        cfg = self.cfg
        roles = None if cfg.opd_coef == 0 else cfg.teacher_roles()
        try:
            check_contract(episodes, cfg.teacher_context if roles is not None else "aligned", teacher_roles=roles,
                           reward=None if cfg.reward == "none" else cfg.reward)
        except ContractError as exc:
            raise ContractError(f"--agent {cfg.agent}: {exc}") from None

    def load_weights(self, state: dict[str, Any], version: int) -> None:
        """Sample these weights (a state dict of the student) as policy ``version`` from now on."""
        self.model.load_state_dict(state)
        self.backend.policy_version = version

    def sample(self, base_seed: int, count: int, run_id: str, limits: RolloutLimits = RolloutLimits(),
               version: int | None = None, env: int = 0) -> list[Episode]:
        """``count`` questions x G samples of the mix's env ``env`` from env seed ``base_seed`` on,
        checked; an engine gets the student's current weights first and may sleep after."""
        from agents.rollout import rollout

        if version is not None:
            self.backend.policy_version = version
        self.backend.reseed(base_seed)
        self._sync()
        self.backend.record_topk = limits.record_topk
        try:
            episodes = rollout(self.train_pools[env], self.agent(), count * self.cfg.group_size,
                               group_size=self.cfg.group_size, seed=base_seed, progress=False, run_id=run_id,
                               max_calls=limits.max_calls)
        finally:
            self.backend.record_topk = 0
            self.backend.sleep()
        self.check(episodes)
        return episodes

    def rollout(self, step: int, limits: RolloutLimits = RolloutLimits()) -> Rollout:
        """This rank's share of step ``step``'s questions (every rank's, gathered, under torchrun).
        A step below 0 is a batch made before training, by the initial policy: it has seeds of its
        own (those of step ``1_000_000 + step``, which no run reaches)."""
        first, count = self.questions
        seed_step = step if step >= 0 else PRE_TRAINING_STEPS + step
        if limits.draw:
            if not 0 < limits.draw < MAX_DRAWS:
                raise ValueError(f"draw {limits.draw} out of range: 1..{MAX_DRAWS - 1}")
            seed_step = EXTRA_DRAW_STEPS + seed_step * MAX_DRAWS + limits.draw
        base = self.cfg.seed * SEED_STRIDE + seed_step * self.cfg.questions_per_step
        t0 = time.perf_counter()
        step_tag = f"step{step}" + (f"-draw{limits.draw}" if limits.draw else "")
        mine: list[Episode] = []
        for env, (start, n) in self.plan(seed_step, first, count):  # one env: the step's questions whole
            tag = f"-{self.mix[env].tag}" if len(self.mix) > 1 else ""
            mine += self.sample(base + start, n, f"{step_tag}{self.run_tag}{tag}", limits, version=max(step, 0),
                                env=env)
        return Rollout(distributed.gather_episodes(mine, self.world), seconds=time.perf_counter() - t0)

    def plan(self, seed_step: int, first: int, count: int) -> list[tuple[int, tuple[int, int]]]:
        """This rank's questions ``[first, first + count)`` of a step, as runs of one env each:
        ``(env, (first question, count))`` (:func:`memopd.learn.mix.question_envs`)."""
        envs = question_envs(self.cfg.seed, seed_step, self.cfg.questions_per_step, [s.weight for s in self.mix])
        runs: list[tuple[int, tuple[int, int]]] = []
        for q in range(first, first + count):
            if runs and runs[-1][0] == envs[q]:
                runs[-1] = (envs[q], (runs[-1][1][0], runs[-1][1][1] + 1))
            else:
                runs.append((envs[q], (q, 1)))
        return runs

    def heldout_episodes(self, env: int = 0) -> list[Episode]:
        """This rank's share of the held-out evaluation of the mix's env ``env``: greedy episodes on
        its test split (test episode g has seed 10_000 + g), checked against the learner's contract."""
        from agents.rollout import rollout

        first, count = distributed.question_share(self.cfg.eval_episodes, self.world)
        self._sync()
        try:
            eps = rollout(self.test_pools[env], self.agent(True, 0), count, seed=EVAL_SEED + first,
                          progress=self.cfg.progress, run_id="eval" if len(self.mix) == 1 else f"eval-{self.mix[env].tag}")
        finally:
            self.backend.sleep()
        self.check(eps)
        return eps

    def evaluate(self) -> dict[str, float]:
        """Held-out EM, F1, sub-EM and generated tokens per episode, over every rank's share. With a
        mix, ``--eval-episodes`` of each env: the figures over all of them, and each env's as
        ``TAG/f1`` (...)."""
        from memgym.scoring import aggregate

        keys = ("em", "f1", "sub_em", "gen_tokens")
        out: dict[str, float] = {}
        every: list[dict[str, float]] = []
        for env, spec in enumerate(self.mix):
            eps = self.heldout_episodes(env)
            mine = [{**e.metrics, "gen_tokens": sum(len(i.response_ids) for i in e.invocations)} for e in eps]
            figures = [m for part in distributed.gather_objects(mine, self.world) for m in part]
            every += figures
            if len(self.mix) > 1:
                agg = aggregate(figures)
                out.update({f"{spec.tag}/{k}": float(agg.get(k, 0.0)) for k in keys})
        agg = aggregate(every)
        return {**{k: float(agg.get(k, 0.0)) for k in keys}, **out}

    def _sync(self) -> None:
        """An engine samples the student's current weights: woken if asleep, then the weights are
        copied in, in memory. Pushing before every rollout rather than after every optimizer step
        costs one copy per step and leaves no path (resume, evaluation) with stale weights. The hf
        backend shares the student's module: nothing to do."""
        self.backend.wake_up()
        self.backend.load_weights(self.model)


__all__ = ["EVAL_SEED", "EXTRA_DRAW_STEPS", "MAX_DRAWS", "SEED_STRIDE", "Actor", "Rollout", "RolloutLimits", "engine_options"]
