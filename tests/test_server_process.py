"""The server helper (agents.backends.vllm_serve.ServerProcess, what VLLMServer runs vLLM's API
server with) ends the server's whole process group: a real HTTP server process that starts an
"engine" child, as vLLM's API server starts its EngineCore. After a ``kill -9`` of the server, its
engine lives on in the group; ``stop()`` must end it too."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

SERVER = '''
import http.server, json, subprocess, sys
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[2], "w").write(f"{engine.pid}")

class Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": "fake"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Models).serve_forever()
'''


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of a process group, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


@pytest.fixture
def server(tmp_path):
    from agents.backends.vllm_serve import ServerProcess, free_port

    script = tmp_path / "server.py"
    script.write_text(SERVER)
    port = free_port()
    proc = ServerProcess([sys.executable, str(script), str(port), str(tmp_path / "engine.pid")],
                         f"http://127.0.0.1:{port}/v1", startup_s=60, lifetime_s=120, name="test server")
    proc.start()
    engine = int((tmp_path / "engine.pid").read_text())
    yield proc, engine
    proc.stop(grace_s=2)
    if alive(engine):
        os.kill(engine, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
def test_stop_ends_the_server_and_its_engine(server):
    proc, engine = server
    assert alive(engine) and proc.alive()
    proc.stop(grace_s=5)
    assert not alive(engine) and not proc.alive() and group_members(proc.group) == []


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
def test_stop_after_a_kill_9_of_the_server_still_ends_its_engine(server):
    proc, engine = server
    members = group_members(proc.group)
    (http_server,) = [p for p in members if p not in (proc.group, engine)]
    os.kill(http_server, signal.SIGKILL)  # what a user's kill -9 of the API server does
    deadline = time.monotonic() + 10
    while proc.proc.poll() is None and time.monotonic() < deadline:  # `timeout` exits with its command
        time.sleep(0.1)
    assert proc.proc.poll() is not None and alive(engine)  # the engine outlives its server
    proc.stop(grace_s=5)
    assert not alive(engine) and group_members(proc.group) == []
