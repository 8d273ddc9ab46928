"""Several envs in one run: the mix of ``--env`` (repeated, each with a weight and options of its own).

    python -m memopd.train --env memgym/LongQA-v0:2 --env memgym/KnowledgeUpdate-v0:1,num_chunks=6

A spec is ``NAME[:WEIGHT][,KEY=VALUE...]`` (weight 1 by default; VALUE as ``--env-kwarg`` reads it);
in a TOML config, ``env_mix`` is a list of such strings or of tables (``{ name = "...", weight = 2,
num_chunks = 6 }``). The run's ``--env-kwarg`` options go to every env, a spec's own override them.
A run of one ``--env`` has no mix: its behaviour, metric names and cache keys are those of before.

Each step draws the env of each of its ``--questions-per-step`` questions by weight from a random
stream seeded by the run's seed and the step alone (:func:`question_envs`), so a resumed run draws
the same mix; the questions are grouped by env, and an env's questions keep the step's consecutive
env seeds. An env is named in metrics and routes by its tag (the id after ``memgym/``:
``LongQA-v0``); an episode is matched to its env by ``Episode.task_id`` (a memgym env's id).
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

from memgym.cli import CLIError, parse_kwargs
from memopd.config import ConfigError

# CoreConfig (memopd.learn.options) names the run's core options in the annotations; it is not imported,
# even for type checkers, because options imports this module (an import cycle otherwise).


@dataclass(frozen=True)
class EnvSpec:
    """One env of the mix: its id, weight, and its own env options."""

    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def tag(self) -> str:
        """Its name in metrics and routes: the id after its namespace (``LongQA-v0``)."""
        return env_tag(self.name)

    def text(self) -> str:
        """The spec as ``--env`` takes it (what ``config.toml`` keeps)."""
        opts = "".join(f",{k}={v}" if isinstance(v, str) else f",{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}:{self.weight:g}{opts}"


def env_tag(env_id: str) -> str:
    """``memgym/LongQA-v0`` -> ``LongQA-v0``."""
    return env_id.rsplit("/", 1)[-1]


def parse_env_spec(item: Any) -> EnvSpec:
    """An ``env_mix`` item: ``NAME[:WEIGHT][,KEY=VALUE...]`` or a TOML table (name, weight, options)."""
    if isinstance(item, dict):
        rest = {k: v for k, v in item.items() if k not in ("name", "weight")}
        if not isinstance(item.get("name"), str):
            raise ConfigError(f"--env {item!r}: a table of env_mix needs name = \"ENV_ID\"")
        return _checked(EnvSpec(item["name"], item.get("weight", 1.0), dict(rest.pop("env_kwargs", {}), **rest)))
    if not isinstance(item, str):
        raise ConfigError(f"--env {item!r}: expected NAME[:WEIGHT][,KEY=VALUE...] or a table")
    head, *opts = item.split(",")
    name, weight = split_weight(head)
    try:
        kwargs = parse_kwargs(opts, flag=f"--env {name}")
    except CLIError as exc:
        raise ConfigError(f"{exc} (a spec is NAME[:WEIGHT][,KEY=VALUE...])") from None
    return _checked(EnvSpec(name.strip(), weight, kwargs))


def split_weight(head: str) -> tuple[str, float]:
    """``NAME:2`` -> ``(NAME, 2.0)``; a name without a numeric suffix keeps weight 1
    (``memgym:LongQA-v0`` is an env id with its namespace)."""
    name, sep, weight = head.rpartition(":")
    try:
        return (name, float(weight)) if sep else (head, 1.0)
    except ValueError:
        return head, 1.0


def _checked(spec: EnvSpec) -> EnvSpec:
    """The spec with its canonical env id (``LongQA`` -> ``memgym/LongQA-v0``: an episode's
    ``task_id``) and a float weight."""
    import memgym

    if not spec.name:
        raise ConfigError("--env: an empty env id in the mix (NAME[:WEIGHT][,KEY=VALUE...])")
    if isinstance(spec.weight, bool) or not isinstance(spec.weight, (int, float)) or not 0 < spec.weight < math.inf:
        raise ConfigError(f"--env {spec.name}: weight {spec.weight!r} must be a finite number above 0")
    try:
        name = memgym.resolve_id(spec.name)
    except memgym.UnknownEnvError as exc:
        raise ConfigError(str(exc)) from None
    return dataclasses.replace(spec, name=name, weight=float(spec.weight))


def parse_mix(items: Sequence[Any]) -> list[EnvSpec]:
    """Every spec of ``env_mix``, each env once."""
    specs = [parse_env_spec(i) for i in items]
    tags = [s.tag for s in specs]
    twice = sorted({t for t in tags if tags.count(t) > 1})
    if twice:
        raise ConfigError(f"--env {twice[0]} is given twice in the mix; give each env once (its weight says how "
                          "often it is drawn)")
    return specs


def env_mix(cfg: CoreConfig) -> list[EnvSpec]:
    """The run's envs: the mix, or the one ``--env`` (weight 1, the run's options)."""
    return parse_mix(cfg.env_mix) if cfg.env_mix else [EnvSpec(cfg.env)]


def is_mix(cfg: CoreConfig) -> bool:
    return bool(cfg.env_mix)


def env_config(cfg: Any, spec: EnvSpec) -> Any:
    """``cfg`` as a run of this env alone (its id, the run's options with its own over them, no
    mix, no routing table): what the env checks, the auto teacher and the warm start read."""
    alone = {"teacher_routes": []} if hasattr(cfg, "teacher_routes") else {}  # routes name the mix's envs
    return dataclasses.replace(cfg, env=spec.name, env_kwargs={**cfg.env_kwargs, **spec.kwargs}, env_mix=[], **alone)


def env_configs(cfg: Any) -> list[Any]:
    """``cfg`` as a run of each env alone (``[cfg]`` itself without a mix)."""
    return [env_config(cfg, s) for s in env_mix(cfg)] if cfg.env_mix else [cfg]


def shares(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split by weight (largest remainders; the parts sum to ``total``)."""
    exact = [total * w / sum(weights) for w in weights]
    parts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: parts[i] - exact[i])[: total - sum(parts)]:
        parts[i] += 1
    return parts


def question_envs(seed: int, step: int, questions: int, weights: Sequence[float]) -> list[int]:
    """The env index of each of a step's questions, drawn by weight and grouped by env
    (deterministic in ``seed`` and ``step``: a resume draws the same)."""
    if len(weights) == 1:
        return [0] * questions
    rng = random.Random(f"memopd-mix:{seed}:{step}")
    return sorted(rng.choices(range(len(weights)), weights=weights, k=questions))


def episode_tags(cfg: CoreConfig) -> dict[str, str]:
    """Env id -> tag for the run's envs (an episode's ``task_id`` is its env's id)."""
    return {s.name: s.tag for s in env_mix(cfg)}


__all__ = ["EnvSpec", "split_weight", "env_config", "env_configs", "env_mix", "shares", "env_tag", "episode_tags", "is_mix", "parse_env_spec", "parse_mix",
           "question_envs"]
