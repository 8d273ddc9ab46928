"""Model backends: batched token-in/token-out generation with exact invocation records."""

from agents.backends.base import (
    FINISH_REASONS,
    Backend,
    GenerationRequest,
    SamplingParams,
    default_stop_ids,
)

__all__ = ["Backend", "GenerationRequest", "SamplingParams", "FINISH_REASONS", "default_stop_ids", "HFBackend",
           "VLLMBackend", "OpenAIBackend"]

_LAZY = {"HFBackend": "agents.backends.hf", "VLLMBackend": "agents.backends.vllm",
         "OpenAIBackend": "agents.backends.openai"}


def __getattr__(name: str):
    # backends import torch / vllm; load them lazily so the interface stays importable on its own
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agents.backends' has no attribute {name!r}")
