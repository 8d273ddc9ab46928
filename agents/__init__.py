"""The agent side of memopd: the MemoryPolicy API, model backends, agents and rollouts.

``import agents`` is light (no torch); names are imported on first use::

    from agents import MemAgent, OracleAgent, load_episodes
    from agents.rollout import rollout
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    # records
    "Invocation": "agents.records", "Episode": "agents.records", "RecordError": "agents.records",
    "save_episodes": "agents.records", "load_episodes": "agents.records",
    # policy API
    "MemoryPolicy": "agents.policy", "EpisodeState": "agents.policy", "AgentError": "agents.policy",
    "make_agent": "agents.registry", "BUILTIN_AGENTS": "agents.registry",
    # prompts
    "PromptBuilder": "agents.prompts", "PromptTemplate": "agents.prompts", "template_corpus": "agents.prompts",
    # agents
    "MemAgent": "agents.memagent", "FullContextAgent": "agents.baselines", "RAGAgent": "agents.baselines",
    "OracleAgent": "agents.oracle",
    # rollouts (the function `rollout` lives in `agents.rollout`, a submodule of the same name)
    "run_episode": "agents.rollout",
    # backends and models (these import torch)
    "Backend": "agents.backends.base", "SamplingParams": "agents.backends.base",
    "GenerationRequest": "agents.backends.base", "HFBackend": "agents.backends.hf",
    "load_model": "agents.models",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agents' has no attribute {name!r}")
    attr = "load" if name == "load_model" else name
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
