"""One place that builds a backend by kind (``hf``, ``vllm``, ``openai``) from the options the
command lines share, so ``memopd.eval`` and ``memopd.train`` offer the same engine flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agents.backends.base import Backend

BACKENDS = ("hf", "vllm", "openai")
"""hf: transformers in this process (reference, any device, shares the trainer's model);
vllm: a vLLM engine in this process (fast sampling on GPU, in-place weight sync);
openai: a model already served by an OpenAI-compatible server (eval only)."""


class BackendOptionError(ValueError):
    """Backend options that do not fit together; the message says which flag to change."""


@dataclass
class EngineOptions:
    """Flags of the vllm / openai backends (the hf backend ignores them)."""

    dtype: str = "auto"
    """vLLM dtype: auto (the checkpoint's), float32, bfloat16, float16."""
    max_model_len: int | None = None
    """Most positions per sequence (prompt + response); None = the model's limit."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory vLLM may take (lower it when a trainer shares the GPU)."""
    tensor_parallel_size: int = 1
    """GPUs one vLLM engine shards over."""
    kv_cache_gib: float | None = None
    """KV cache size in GiB (default: 1 on CPU, vLLM's own sizing on GPU)."""
    sleep_mode: bool = False
    """GPU: the engine frees its memory while a colocated trainer updates."""
    base_url: str | None = None
    """openai: the server's base URL, e.g. http://127.0.0.1:8000/v1."""
    served_model: str | None = None
    """openai: the served model's name (default: the server's first model)."""
    server_logprobs_mode: str = "raw_logprobs"
    """openai: the server's --logprobs-mode (processed_logprobs allows any temperature)."""


def make_backend(kind: str, *, model: Any, tokenizer: Any, options: EngineOptions, device: str = "cpu",
                 seed: int = 0, max_batch_size: int = 32, name: str | None = None) -> Backend:
    """A backend of ``kind`` sampling ``model`` (a loaded transformers model; unused by openai)."""
    if kind == "hf":
        from agents.backends.hf import HFBackend

        return HFBackend(model, tokenizer, device=device, max_batch_size=max_batch_size, seed=seed, name=name)
    if kind == "vllm":
        from agents.backends.vllm import VLLMBackend

        return VLLMBackend.from_model(
            model, tokenizer, dtype=options.dtype, max_model_len=options.max_model_len,
            gpu_memory_utilization=options.gpu_memory_utilization,
            tensor_parallel_size=options.tensor_parallel_size, enable_sleep_mode=options.sleep_mode,
            kv_cache_gib=options.kv_cache_gib, seed=seed, name=name and f"vllm:{name.partition(':')[2]}")
    if kind == "openai":
        if not options.base_url:
            raise BackendOptionError("--backend openai needs --base-url, e.g. http://127.0.0.1:8000/v1")
        from agents.backends.openai import OpenAIBackend

        return OpenAIBackend(options.base_url, tokenizer, model=options.served_model, seed=seed,
                             max_concurrency=max_batch_size, logprobs_mode=options.server_logprobs_mode)
    raise BackendOptionError(f"unknown backend {kind!r}; choose from {', '.join(BACKENDS)}")
