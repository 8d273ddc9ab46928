"""Model backends: batched token-in/token-out generation with exact invocation records."""

from agents.backends.base import (
    FINISH_REASONS,
    Backend,
    GenerationRequest,
    SamplingParams,
    default_stop_ids,
)

__all__ = ["Backend", "GenerationRequest", "SamplingParams", "FINISH_REASONS", "default_stop_ids", "HFBackend"]


def __getattr__(name: str):
    # HFBackend imports torch; load it lazily so the interface stays importable on its own.
    if name == "HFBackend":
        from agents.backends.hf import HFBackend

        return HFBackend
    raise AttributeError(f"module 'agents.backends' has no attribute {name!r}")
