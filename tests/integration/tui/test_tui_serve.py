"""`eyas tui --serve` (tui/serve.py): the bind address rule, the token every request needs, and
the served TUI in a real headless Chromium against a real daemon."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tui_world as world
from daemon_harness import Daemon, short_tmp, wait_for

from eyas.state import paths, queries
from eyas.tui.serve import NOT_LOOPBACK_FLAG

EYAS = str(Path(sys.executable).with_name("eyas"))
# The escape sequences of Textual's output, stripped to read what the terminal shows.
_ESCAPES = re.compile(r"\x1b(\[[0-9;?<>=$]*[ -/]*[@-~]|\][^\x07]*\x07|[()][0-9A-Za-z])")


def _env(home: Path) -> dict:
    return {**os.environ, "EYAS_HOME": str(home), "XDG_RUNTIME_DIR": str(home / "rt"), "TZ": "UTC"}


def _world(home: Path) -> dict:
    ids = world.build(home)
    (home / "rt").mkdir(mode=0o700, exist_ok=True)
    return ids


def _run_names(home: Path) -> dict[int, str]:
    db = queries.connect(paths.db_path(home))
    try:
        return {r["id"]: r["name"] for r in queries.list_runs(db)}
    finally:
        db.close()


def _served_apps(home: Path) -> list[int]:
    """The TUI processes textual-serve started for `home` that are still alive."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "eyas.cli.main" in cmd and str(home) in cmd and p.status() != psutil.STATUS_ZOMBIE:
            found.append(p.pid)
    return found


class Served:
    """`eyas tui --serve` as the user starts it; `url` is the URL it printed."""

    def __init__(self, home: Path, *args: str):
        self.proc = subprocess.Popen(
            [EYAS, "tui", "--serve", *args],
            env=_env(home),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        line = self.proc.stdout.readline()
        while line:
            self.lines.append(line)
            if "Ctrl-C stops serving" in line:
                break
            line = self.proc.stdout.readline()
        found = re.search(r"on (http://\S+/)$", self.lines[0].strip()) if self.lines else None
        assert found, f"no URL printed: {self.lines!r} {self.proc.stderr.read() if self.proc.poll() else ''}"
        self.url = found.group(1)
        self.base, self.token = self.url.rstrip("/").rsplit("/", 1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


def test_serve_refuses_a_non_loopback_address_without_the_flag(tmp_path):
    out = subprocess.run(
        [EYAS, "tui", "--serve", "--host", "0.0.0.0"], env=_env(tmp_path), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and out.stdout == ""
    assert NOT_LOOPBACK_FLAG in out.stderr and "0.0.0.0 is not a loopback address" in out.stderr
    # --host without --serve is a mistake too, not a silently ignored option.
    alone = subprocess.run(
        [EYAS, "tui", "--host", "127.0.0.1"], env=_env(tmp_path), capture_output=True, text=True, timeout=60
    )
    assert alone.returncode == 2 and "go with --serve" in alone.stderr


def test_serve_with_the_flag_warns_on_stderr(tmp_path):
    """192.0.2.1 (TEST-NET-1) is nobody's address: the command warns, then fails to bind it,
    so the test opens no port that another machine could reach."""
    out = subprocess.run(
        [EYAS, "tui", "--serve", "--host", "192.0.2.1", NOT_LOOPBACK_FLAG],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    warning, _, rest = out.stderr.partition("\n")
    assert warning.startswith("eyas tui: WARNING: serving on 192.0.2.1, which is not loopback")
    assert "cannot listen on 192.0.2.1" in rest and out.returncode == 1


def test_every_request_needs_the_token(tmp_path):
    """Without the token or with a wrong one: 403, for the page, its files and the websocket;
    with it: the page, and a websocket that relays the TUI (a run name of the store on it)."""
    import urllib.error
    import urllib.request

    import aiohttp

    home = short_tmp()
    try:
        _world(home)
        served = Served(home)
        try:
            assert served.url.startswith("http://127.0.0.1:")
            assert re.fullmatch(r"[A-Za-z0-9_-]{32}", served.token)
            assert "ssh -N -L" in served.lines[1] and served.url in served.lines[1]

            def status(url: str) -> int:
                try:
                    with urllib.request.urlopen(url, timeout=10) as r:
                        return r.status
                except urllib.error.HTTPError as exc:
                    return exc.code

            wrong = "x" * len(served.token)
            assert status(served.base + "/") == 403
            assert status(f"{served.base}/{wrong}/") == 403
            assert status(f"{served.base}/{wrong}/static/js/textual.js") == 403
            assert status(f"{served.base}/static/js/textual.js") == 403
            assert status(served.url) == 200
            assert status(served.url + "static/js/textual.js") == 200
            with urllib.request.urlopen(served.url, timeout=10) as r:
                page = r.read().decode()
            ws_url = f"ws://127.0.0.1:{served.base.rsplit(':', 1)[1]}/{served.token}/ws"
            assert f'data-session-websocket-url="{ws_url}"' in page
            # Everything the page loads comes from this server, under the token: textual-serve's
            # Google Fonts link is gone (tui/serve.py says why).
            loads = re.findall(r'\b(?:href|src)="([^"]*)"', page)
            assert loads and all(u.startswith(f"/{served.token}/static/") for u in loads), loads
            assert "googleapis" not in page

            names = _run_names(home)

            async def websocket(url: str) -> str:
                async with aiohttp.ClientSession() as s:
                    async with s.ws_connect(url + "?width=120&height=30", timeout=aiohttp.ClientWSTimeout(10)) as ws:
                        seen = ""
                        deadline = time.monotonic() + 30
                        while not any(n in _ESCAPES.sub("", seen) for n in names.values()):
                            assert time.monotonic() < deadline, seen[-500:]
                            msg = await ws.receive(timeout=30)
                            seen += msg.data.decode() if isinstance(msg.data, bytes) else str(msg.data)
                        return _ESCAPES.sub("", seen)

            for bad in (f"ws://127.0.0.1:{served.base.rsplit(':', 1)[1]}/{wrong}/ws", ws_url.replace(served.token, "")):
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    asyncio.run(websocket(bad))
                assert refused.value.status == 403
            assert "runs" in asyncio.run(websocket(ws_url))

            async def stopped_while_open() -> int:
                """Ctrl-C with a tab open: the tab is told the server went away, at once."""
                async with aiohttp.ClientSession() as s:
                    async with s.ws_connect(ws_url + "?width=80&height=24") as ws:
                        await ws.receive(timeout=30)  # the app is up
                        served.proc.send_signal(signal.SIGINT)
                        while (await ws.receive(timeout=15)).type not in (
                            aiohttp.WSMsgType.CLOSE,
                            aiohttp.WSMsgType.CLOSING,
                            aiohttp.WSMsgType.CLOSED,
                        ):
                            pass
                        return ws.close_code

            t0 = time.monotonic()
            assert asyncio.run(stopped_while_open()) == aiohttp.WSCloseCode.GOING_AWAY
            assert served.proc.wait(15) == 0 and time.monotonic() - t0 < 15
            # Each app was asked to quit (or killed): none outlives the server by more than its exit.
            wait_for(lambda: _served_apps(home) == [], 10, 0.1, "the served apps to end")
        finally:
            assert served.stop() == 0
    finally:
        shutil.rmtree(home, ignore_errors=True)


def chromium() -> tuple[str, str]:
    """Debian's chromium and chromedriver, installed with apt-get when missing and this user may
    (root, or sudo without a password); the caller skips only when that is impossible."""
    found = shutil.which("chromium"), shutil.which("chromedriver")
    if all(found):
        return found
    if os.geteuid() == 0:
        sudo = []
    elif shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
        sudo = ["sudo", "-n"]
    else:
        pytest.skip("chromium and chromium-driver are missing, and installing them needs root or sudo")
    if not shutil.which("apt-get"):
        pytest.skip("chromium and chromium-driver are missing, and there is no apt-get to install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    log = []
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"]):
        done = subprocess.run(sudo + cmd, env=env, capture_output=True, text=True, timeout=900)
        log.append(done.stdout[-1000:] + done.stderr[-1000:])
    found = shutil.which("chromium"), shutil.which("chromedriver")
    if not all(found):
        pytest.skip("could not install chromium and chromium-driver: " + "\n".join(log))
    return found


# Records what the page's websocket receives, so the test can read what xterm.js draws on
# its canvas (WebGL or 2D: no DOM text to query).
_RECORD_WEBSOCKET = """
window.__eyasSeen = [];
const Native = window.WebSocket;
window.WebSocket = function (...args) {
  const ws = new Native(...args);
  ws.addEventListener("message", (e) => {
    window.__eyasSeen.push(typeof e.data === "string" ? e.data : new TextDecoder().decode(e.data));
  });
  return ws;
};
window.WebSocket.prototype = Native.prototype;
"""


@pytest.mark.slow
def test_the_tui_in_headless_chromium_shows_runs_and_opens_one(tmp_path, monkeypatch):
    """A real daemon on the deterministic store, `eyas tui --serve`, and Chromium driven by
    selenium: the Runs screen lists the store's runs with the daemon connected, Enter opens
    the highlighted run, and a screenshot of it is saved under tmp_path."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    browser, driver_path = chromium()
    home = short_tmp()
    daemon = None
    served = None
    driver = None
    try:
        _world(home)
        # The daemon, this test and the served TUI find one socket from these two.
        monkeypatch.setenv("EYAS_HOME", str(home))
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(home / "rt"))
        daemon = Daemon(home).start()
        names = _run_names(home)
        served = Served(home)
        options = webdriver.ChromeOptions()
        options.binary_location = browser
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900"):
            options.add_argument(arg)
        driver = webdriver.Chrome(service=Service(driver_path), options=options)
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": _RECORD_WEBSOCKET})
        driver.get(served.url)

        def screen(since: int = 0) -> str:
            frames = driver.execute_script("return window.__eyasSeen || []")
            return _ESCAPES.sub("", "".join(frames[since:]))

        wait_for(lambda: all(n in screen() for n in names.values()), 60, 0.2, "the run names in the browser")
        wait_for(lambda: "● daemon" in screen(), 30, 0.2, "the TUI to connect to the daemon")
        assert "runs" in screen()
        # What the browser itself fetched: nothing from another host.
        fetched = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert fetched and all(u.startswith(served.base + "/") for u in fetched), fetched
        before = len(driver.execute_script("return window.__eyasSeen"))
        driver.find_element(By.CSS_SELECTOR, "textarea.xterm-helper-textarea").send_keys(Keys.ENTER)
        opened = wait_for(
            lambda: re.search(r"› run (\d+) · (\S+)", screen(before)), 30, 0.2, "the Run screen after Enter"
        )
        run_id, name = int(opened.group(1)), opened.group(2)
        assert names[run_id] == name
        shot = tmp_path / "eyas-tui-serve.png"
        time.sleep(0.5)  # the frame that drew the Run screen reaches the canvas
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        print(f"screenshot: {shot}")
    finally:
        if driver is not None:
            driver.quit()
        if served is not None:
            assert served.stop() == 0
        if daemon is not None:
            daemon.cleanup()
        shutil.rmtree(home, ignore_errors=True)
