"""The viewer's report in a real browser: headless Chromium driven over the DevTools protocol.

Chromium is driven through ``--remote-debugging-pipe`` (JSON messages on file descriptors 3/4),
so no websocket package and no port are needed. Needs Debian's ``chromium`` package (CI
installs it); set MEMOPD_CHROMIUM to use another binary. Screenshots land in pytest's tmp dir.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from agents.records import save_episodes
from memopd import view
from view_fixtures import SCRIPT_MEMORY, make_run_dir, sample_episodes, tiny_tokenizer


def find_chromium() -> str | None:
    override = os.environ.get("MEMOPD_CHROMIUM")
    if override:
        return override
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed "
                                "(apt-get install -y chromium, or set MEMOPD_CHROMIUM)")
TIMEOUT_S = 30.0  # per protocol wait; a hang fails the test instead of blocking CI


class Chromium:
    """A headless Chromium process and its DevTools protocol pipe."""

    def __init__(self, exe: str, user_data_dir: Path):
        cmd_r, self._cmd_w = os.pipe()  # we write commands, Chromium reads them on fd 3
        self._out_r, out_w = os.pipe()  # Chromium writes replies and events on fd 4

        def wire_fds() -> None:  # in the child: move the pipe ends to fds 3 and 4
            a, b = os.dup(cmd_r), os.dup(out_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-extensions", "--disable-quic", "--mute-audio", "--hide-scrollbars",
                 "--remote-debugging-pipe", f"--user-data-dir={user_data_dir}", "about:blank"]
        self._log = (user_data_dir / "chromium.log").open("wb")
        self.proc = subprocess.Popen([exe, *flags], preexec_fn=wire_fds, close_fds=False,
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log)
        os.close(cmd_r)
        os.close(out_w)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        reply = self._read_until(lambda m: m.get("id") == msg["id"])
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    def wait_event(self, method: str, session: str) -> dict:
        for k, ev in enumerate(self.events):
            if ev.get("method") == method and ev.get("sessionId") == session:
                return self.events.pop(k)
        ev = self._read_until(lambda m: m.get("method") == method and m.get("sessionId") == session)
        self.events.remove(ev)
        return ev

    def _read_until(self, match) -> dict:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" not in msg:
                    self.events.append(msg)
                if match(msg):
                    return msg
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out_r], [], [], left)[0]:
                raise TimeoutError(f"Chromium did not answer within {TIMEOUT_S} s")
            chunk = os.read(self._out_r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium exited (code {self.proc.poll()})")
            self._buf += chunk

    def close(self) -> None:
        try:
            self.send("Browser.close")
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)
        os.close(self._out_r)
        self._log.close()


class Page:
    """One tab: navigation, JS evaluation, collected errors, screenshots."""

    def __init__(self, browser: Chromium):
        self.b = browser
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")

    def send(self, method: str, params: dict | None = None) -> dict:
        return self.b.send(method, params, self.session)

    def goto(self, path: Path, hash: str = "") -> None:
        self.b.events.clear()
        self.send("Page.navigate", {"url": path.resolve().as_uri() + hash})
        self.b.wait_event("Page.loadEventFired", self.session)

    def eval(self, expression: str):
        res = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in res:
            raise AssertionError(f"JS error in {expression!r}: {res['exceptionDetails']}")
        return res["result"].get("value")

    def errors(self) -> list[str]:
        """Uncaught exceptions, console.error/assert calls and browser log errors (CSP, network)."""
        out = []
        for ev in self.b.events:
            if ev.get("sessionId") != self.session:
                continue
            p = ev.get("params", {})
            if ev["method"] == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                out.append(d.get("exception", {}).get("description") or d.get("text", "exception"))
            elif ev["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
            elif ev["method"] == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(f"log: {p['entry']['text']}")
        return out

    def screenshot(self, path: Path, width: int = 1280, height: int = 900, full: bool = False) -> Path:
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        params: dict = {"format": "png"}
        if full:
            size = self.send("Page.getLayoutMetrics")["cssContentSize"]
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": width, "height": min(size["height"], 4000), "scale": 1})
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", params)["data"]))
        return path


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    b = Chromium(CHROMIUM, tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    d = tmp_path_factory.mktemp("reports")
    tok = tiny_tokenizer()
    save_episodes(d / "episodes.jsonl", sample_episodes(tok, 7))
    src = view.load_source(d / "episodes.jsonl")
    return {
        "tok": view.write_report(src, d / "tok.html", tokenizer=tok),
        "plain": view.write_report(view.load_source(_plain_episodes(d)), d / "plain.html"),
        "run": view.write_report(view.load_source(make_run_dir(d / "run", tok)), d / "run.html", tokenizer=tok),
        "n": len(src.episodes),
        "calls": [len(ep.invocations) for ep in src.episodes],
        "failures": sum(view.is_failure(ep) for ep in src.episodes),
    }


def _plain_episodes(d: Path) -> Path:
    """Episodes without recorded texts; the report is made without a tokenizer."""
    save_episodes(d / "plain.jsonl", sample_episodes(tiny_tokenizer(), 4, record_texts=False))
    return d / "plain.jsonl"


def test_report_renders_expands_and_escapes(browser, reports, tmp_path):
    page = Page(browser)
    page.goto(reports["tok"])
    assert page.eval("document.querySelectorAll('#episodes tbody tr.row').length") == reports["n"]
    assert page.eval("document.getElementById('count').dataset.total") == str(reports["n"])
    assert page.eval("document.querySelectorAll('.card').length") == 0  # details are built lazily

    # expand episode 1: one card per call, its <script> memory shown as text and never run
    page.eval("document.querySelector('#episodes tr.row[data-i=\"1\"]').click()")
    assert page.eval("document.querySelectorAll('tr.detail .card').length") == reports["calls"][1]
    memories = page.eval("[...document.querySelectorAll('tr.detail pre.segment.memory')].map(e => e.textContent)")
    assert SCRIPT_MEMORY in memories
    assert page.eval("window.__pwned === undefined")
    assert page.eval("document.querySelectorAll('tr.detail script, tr.detail img').length") == 0
    # the action tokens carry their KL on hover and join up to the action text
    titles = page.eval("[...document.querySelectorAll('tr.detail .action.kl .tok')].map(e => e.title)")
    assert titles and all(t.startswith("token ") and " KL " in t for t in titles)
    shot = page.screenshot(tmp_path / "viewer-episode.png", full=True)
    print(f"\nscreenshot: {shot}")

    # collapse, filter failures, sort by F1
    page.eval("document.querySelector('#episodes tr.row[data-i=\"1\"]').click()")
    assert page.eval("document.querySelectorAll('.card').length") == 0
    page.eval("const f = document.getElementById('failures'); f.click();")
    assert page.eval("document.querySelectorAll('#episodes tbody tr.row').length") == reports["failures"]
    page.eval("document.getElementById('failures').click(); document.querySelector('th[data-key=f1]').click()")
    f1s = page.eval("[...document.querySelectorAll('#episodes tbody tr.row td.f1-ok, "
                    "#episodes tbody tr.row td.f1-bad, #episodes tbody tr.row td.f1-mid')].map(e => +e.textContent)")
    assert f1s == sorted(f1s, reverse=True) and len(f1s) == reports["n"]
    page.eval("const s = document.getElementById('search'); s.value = 'Chloé'; "
              "s.dispatchEvent(new Event('input'))")
    assert page.eval("document.getElementById('count').dataset.shown") == "1"
    assert page.errors() == []


def test_report_without_tokenizer_opens_episode_from_hash(browser, reports):
    page = Page(browser)
    page.goto(reports["plain"], "#ep=2")
    assert page.eval("document.querySelectorAll('tr.detail .card').length") == 4
    # no tokenizer: KL as one cell per response token, state shown as counts
    cells = page.eval("document.querySelectorAll('tr.detail .klstrip')[1].children.length")
    assert cells > 0
    assert page.eval("document.querySelector('tr.detail .card').textContent").count("pass --tokenizer") >= 1
    assert page.errors() == []


def test_run_report_curves_and_steps(browser, reports, tmp_path):
    page = Page(browser)
    page.goto(reports["run"])
    titles = page.eval("[...document.querySelectorAll('#curves svg')].map(s => s.dataset.title)")
    assert titles == ["reward / F1", "KL to teacher", "entropy", "tokens/s"]
    series = page.eval("[...document.querySelectorAll('#curves svg')[1].querySelectorAll('polyline')]"
                       ".map(p => p.dataset.series)")
    assert series == ["kl/all", "kl/memory", "kl/answer"]
    page.eval("location.hash = '#step=10'")
    page.eval("window.dispatchEvent(new HashChangeEvent('hashchange'))")
    shown = page.eval("[...document.querySelectorAll('#episodes tbody tr.row td:nth-child(4)')].map(e => e.textContent)")
    assert shown and set(shown) == {"10"}
    assert page.eval("[...document.getElementById('step').options].map(o => o.value)") == ["", "2", "4", "10"]
    assert page.eval("document.getElementById('step').value") == "10"
    print(f"\nscreenshot: {page.screenshot(tmp_path / 'viewer-run.png')}")
    assert page.errors() == []


def test_ten_thousand_episodes_page_and_lazy(browser, tmp_path):
    from view_fixtures import make_episode  # small episodes, many of them
    tok = tiny_tokenizer()
    base = make_episode(tok, 0, question="Where does Ada work?", answers=["Acme"], chunks=["Ada works at Acme."],
                        memories=["Ada works at Acme."], prediction="Acme")
    src = view.Source(tmp_path, "episodes")
    src.episodes = [dataclasses.replace(base, episode_id=f"ep-{i}", sample_id=f"s{i}") for i in range(10_000)]
    src.steps = [None] * len(src.episodes)
    out = view.write_report(src, tmp_path / "big.html")
    page = Page(browser)
    page.goto(out)
    assert page.eval("document.getElementById('count').dataset.total") == "10000"
    assert page.eval("document.querySelectorAll('#episodes tbody tr').length") == 100
    assert page.eval("document.querySelectorAll('.card').length") == 0
    page.eval("document.getElementById('next').click()")
    assert page.eval("document.querySelector('#episodes tbody tr.row').dataset.i") == "100"
    load_ms = page.eval("performance.getEntriesByType('navigation')[0].loadEventEnd")
    print(f"\n10k episodes: {out.stat().st_size / 1e6:.1f} MB, load event after {load_ms:.0f} ms")
    assert page.errors() == []


def test_whole_numbers_dates_and_a_training_runs_heatmap(browser, tmp_path):
    """Counts print as integers and timestamps as dates; a run directory's sample episodes are
    decoded with the run's tokenizer, so their teacher-KL heatmap colours real tokens."""
    tok = tiny_tokenizer()
    run = tmp_path / "run"
    (run / "episodes").mkdir(parents=True)
    tok.save_pretrained(run / "model")
    (run / "config.toml").write_text('model = "tiny"\n')
    eps = sample_episodes(tok, 3)
    for ep in eps:
        for inv in ep.invocations:
            inv.timing = {"start": 1796062579.06812, "latency_s": 0.25}
    save_episodes(run / "episodes" / "step-000003.jsonl", eps)
    (run / "summary.json").write_text(json.dumps({"episodes": 20, "calls": 4.0, "wall_s": 2.5}))
    assert view.main([str(run), "-o", str(tmp_path / "run.html")]) == 0
    page = Page(browser)
    page.goto(tmp_path / "run.html", "#ep=1")
    f1 = page.eval("[...document.querySelectorAll('#episodes tbody tr.row td.f1-ok')].map(e => e.textContent)")
    assert f1 and set(f1) == {"1"}  # not 1.00
    timing = page.eval("document.querySelector('tr.detail .card').textContent")
    assert "start 2026-11-30 18:16:19 UTC" in timing and "e+9" not in timing and "latency_s 0.250" in timing
    tokens = page.eval("[...document.querySelectorAll('tr.detail .action.kl .tok')].map(e => e.textContent)")
    assert "".join(tokens).startswith(eps[1].invocations[0].response_text)  # coloured tokens, not a strip
    assert page.errors() == []


def test_summary_counts_print_as_integers(browser, tmp_path):
    tok = tiny_tokenizer()
    d = tmp_path / "eval"
    d.mkdir()
    save_episodes(d / "episodes.jsonl", sample_episodes(tok, 2))
    (d / "summary.json").write_text(json.dumps({"episodes": 20, "calls": 4.0, "wall_s": 2.5, "f1": 1.0}))
    out = view.write_report(view.load_source(d), d / "report.html")
    page = Page(browser)
    page.goto(out)
    cells = page.eval("Object.fromEntries([...document.querySelectorAll('table.kv tr')]"
                      ".map(r => [r.querySelector('th').textContent, r.querySelector('td').textContent]))")
    assert cells == {"episodes": "20", "calls": "4", "wall_s": "2.5000", "f1": "1"}
    assert page.errors() == []
