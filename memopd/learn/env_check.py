"""Checks of ``--env`` and its settings before any model work: the env exists, every chunk of a
few episodes of each split is generated under the student's tokenizer, and oracle trajectories
(the auto teacher's and the warm start's data) fit the memory budget."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memopd.config import ConfigError

if TYPE_CHECKING:  # the run's options, for the annotations
    from memopd.learn.options import CoreConfig

def check_env(env_id: str) -> None:
    """``--env`` must name a registered env or a task folder."""
    import memgym

    try:
        memgym.resolve_id(env_id)
    except memgym.UnknownEnvError as exc:
        raise ConfigError(str(exc)) from None


def needs_oracle(cfg: CoreConfig) -> bool:
    """Whether the run learns from oracle trajectories: the auto teacher, or the warm start of a
    from-scratch tiny student."""
    from agents.presets import TINY_PRESETS

    warm = cfg.student_warmup_steps > 0 and cfg.model in TINY_PRESETS and not cfg.resume
    auto = cfg.teacher == "auto" or any(str(r).endswith("=auto") for r in getattr(cfg, "teacher_routes", ()))
    return warm or (auto and cfg.opd_coef > 0)


class OracleDataError(ValueError):
    """The oracle trajectories of the env cannot teach what the run needs (the message says why)."""


def check_env_settings(cfg: CoreConfig, tokenizer: Any, episodes: int = 4) -> None:
    """Play a few episodes of each split of ``--env`` as the run will, before any model work.

    The run counts ``chunk_size`` and ``memory_budget`` in the student's tokens, where a task's
    defaults may be written for another tokenizer; and the auto teacher and the warm
    start learn from oracle trajectories, whose memory keeps whole supporting facts. A setting that
    cannot work here is a :class:`ConfigError` naming the ``--env-kwarg`` value to pass."""
    import gymnasium as gym

    import memgym  # noqa: F401  (registers the envs)
    from agents.oracle import OracleAgent
    from agents.rollout import run_episode
    from memgym.errors import MemgymError
    from memgym.generators.hotpot import DatasetUnavailableError

    oracle = needs_oracle(cfg)
    for split in ("train", "test"):
        try:
            env = gym.make(cfg.env, split=split, **{**cfg.env_kwargs, "tokenizer": tokenizer})
            agent = OracleAgent.for_env(env, tokenizer=tokenizer) if oracle else None
            for seed in range(episodes):
                if agent is not None:
                    _check_facts_fit(env.unwrapped, run_episode(env, agent, seed=seed), cfg)
                else:
                    _play_empty(env, seed)
            env.close()
        except DatasetUnavailableError as exc:
            raise ConfigError(f"--env {cfg.env}: {' '.join(str(exc).split())} With memopd.train, pass the files "
                              "as --env-kwarg path=FILE_OR_DIR.") from None
        except OracleDataError as exc:
            raise ConfigError(str(exc)) from None
        except (ValueError, TypeError, KeyError, MemgymError) as exc:
            message = str(exc).split(" was raised from the environment creator")[0]  # not gymnasium's kwargs dump
            if oracle and "supporting_facts" in message:
                message += ("; the auto teacher and the student warm start learn from oracle trajectories: give "
                            "the samples supporting facts as sentences, or pass --teacher SPEC and "
                            "--student-warmup-steps 0")
            raise ConfigError(f"--env {cfg.env} (split {split!r}, env options {cfg.env_kwargs or 'the task defaults'}, "
                              f"sizes in the student's tokens): {message}") from None


def _play_empty(env: Any, seed: int) -> None:
    """Step one episode through with empty actions: every chunk of it is generated."""
    _, info = env.reset(seed=seed)
    while info["phase"] != "done":
        _, _, _, _, info = env.step("")


def _check_facts_fit(env: Any, episode: Any, cfg: CoreConfig) -> None:
    """The oracle keeps whole supporting facts: one longer than the memory budget leaves it nothing.
    A task with its own oracle script (memgym.oracle) keeps other items: refused only when the
    oracle's memory stayed empty and it could not answer."""
    from agents.oracle import supporting_texts

    sample = env.source[env.source.index_of(episode.sample_id)]
    if getattr(sample, "oracle", None) is not None:
        if episode.dropped_facts and not any(i.response_text for i in episode.invocations if i.role == "memory"):
            raise OracleDataError(
                f"--env {cfg.env}: memory_budget={env.memory_budget} {env.counter.unit} holds nothing the oracle keeps "
                f"(it needs {episode.dropped_facts[0]!r}, in the student's tokenizer), so the oracle trajectories that "
                "build the auto teacher and warm up the student keep no memory; pass a larger --env-kwarg memory_budget")
        return
    sizes = [env.counter.count(fact) for fact in supporting_texts(sample)]
    if max(sizes) > env.memory_budget:
        unit = env.counter.unit
        raise OracleDataError(
            f"--env {cfg.env}: memory_budget={env.memory_budget} {unit} cannot hold a supporting fact of "
            f"{max(sizes)} {unit} (in the student's tokenizer), so the oracle trajectories that build the auto teacher "
            f"and warm up the student keep no memory; pass --env-kwarg memory_budget={max(sizes)} or more")


__all__ = ["OracleDataError", "check_env", "check_env_settings", "needs_oracle"]
