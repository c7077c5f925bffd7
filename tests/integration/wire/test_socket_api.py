"""The daemon's socket server, event bus and client library, over real sockets.

The server runs in a subprocess (this file, run as a script with --serve) so that the tests
can kill it, read its RSS and connect to it as another uid.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from eyas.daemon.server import DaemonAlreadyRunning, Server
from eyas.state import paths
from eyas.wire import protocol
from eyas.wire.client import AsyncClient, Client, DaemonError, DaemonNotRunning
from eyas.wire.protocol import Event, ProtocolError

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).resolve()


# -- the test daemon (runs in a subprocess) ---------------------------------------------------


class TestHandler:
    """ping -> pid; status sleeps; skip raises ValueError; retry raises not_found;
    submit publishes events; shutdown closes the server."""

    __test__ = False  # not a pytest class

    def __init__(self) -> None:
        self.server: Server | None = None
        self.stopped = asyncio.Event()

    async def handle(self, req, conn):
        if req.op == "ping":
            return {"pid": os.getpid(), "peer_pid": conn.peer_pid, "peer_uid": conn.peer_uid}
        if req.op == "status":
            await asyncio.sleep(req.args.get("delay", 0.2))
            return {"echo": req.args.get("echo")}
        if req.op == "skip":
            raise ValueError(f"boom {req.args.get('n')}")
        if req.op == "retry":
            raise ProtocolError(protocol.NOT_FOUND, "no run 99; list runs with `eyas runs`")
        if req.op == "submit":
            return await self._publish(req.args)
        if req.op == "shutdown":
            asyncio.get_running_loop().call_soon(self.stopped.set)
            return {"ok": True}
        raise ProtocolError(protocol.UNKNOWN_OP, f"the test handler has no {req.op!r}")

    async def _publish(self, args):
        for topic, data in args.get("events", []):
            self.server.publish(topic, data)
        count, batch = args.get("count", 0), args.get("batch", 1000)
        base, pad = args.get("data", {}), "x" * args.get("pad", 0)
        every = args.get("run5_every")  # mark every k-th event run 5, the others run 6
        for i in range(count):
            data = {**base, "seq": i, "text": pad}
            if every:
                data["run_id"] = 5 if i % every == 0 else 6
            self.server.publish(args["topic"], data)
            if i % batch == batch - 1:
                await asyncio.sleep(0)  # let writers and other connections run meanwhile
        return {"published": count + len(args.get("events", []))}


async def _serve(path: Path, max_queue: int) -> int:
    handler = TestHandler()
    server = Server(path, handler, log=logging.getLogger("eyas.test"), max_queue_bytes=max_queue)
    handler.server = server
    try:
        await server.start()
    except DaemonAlreadyRunning as exc:
        print(f"ALREADY {exc.pid} {exc}", flush=True)
        return 3
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, handler.stopped.set)
    print(f"READY {os.getpid()}", flush=True)
    await handler.stopped.wait()
    await server.close()
    return 0


def serve_main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", required=True)
    ap.add_argument("--max-queue", type=int, default=64 << 20)
    a = ap.parse_args()
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(levelname)s %(message)s")
    return asyncio.run(_serve(Path(a.serve), a.max_queue))


# -- fixtures and helpers ---------------------------------------------------------------------


class Daemon:
    def __init__(self, path: Path, max_queue: int | None = None):
        self.path = path
        self.log = path.parent / f"server-{time.monotonic_ns()}.log"
        argv = [sys.executable, str(HERE), "--serve", str(path)]
        if max_queue:
            argv += ["--max-queue", str(max_queue)]
        self._logf = open(self.log, "wb")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._logf, text=True)
        line = self.proc.stdout.readline()  # blocks until READY/ALREADY or exit
        self.first_line = line.strip()
        self.pid = self.proc.pid
        self.killed = False

    @property
    def ready(self) -> bool:
        return self.first_line == f"READY {self.pid}"

    def log_text(self) -> str:
        return self.log.read_text()

    def hwm_kib(self) -> int:
        """Peak resident memory of the server process."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise AssertionError("no VmHWM")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(20)
        finally:
            self._logf.close()
            self.proc.stdout.close()
        return rc

    def kill(self) -> None:
        self.killed = True
        self.proc.kill()
        self.proc.wait(20)
        self._logf.close()
        self.proc.stdout.close()


@pytest.fixture
def sockdir():
    d = Path(tempfile.mkdtemp(dir="/tmp", prefix="eyas-t"))  # AF_UNIX paths are short
    os.chmod(d, 0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def start_daemon(sockdir):
    started: list[Daemon] = []

    def start(max_queue: int | None = None, path: Path | None = None) -> Daemon:
        d = Daemon(path or sockdir / "d.sock", max_queue)
        started.append(d)
        assert d.ready, f"daemon did not start: {d.first_line!r}\n{d.log_text()}"
        return d

    yield start
    for d in started:
        if not d.killed and d.proc.poll() is None:
            assert d.stop() == 0
        # A handler bug is logged with a traceback on purpose in one test; nothing else may.
        text = d.log_text()
        assert text.count("Traceback") == text.count("ValueError: boom"), text


@pytest.fixture
def daemon(start_daemon) -> Daemon:
    return start_daemon()


def connect(path: Path, timeout: float = 20.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(str(path))
    return s


class Lines:
    """Read JSON lines from a raw socket."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = b""

    def next(self) -> dict | None:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                assert self.buf == b"", self.buf[:200]
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def until_reply(self, id_) -> tuple[dict, list[dict]]:
        """The reply with this id and the events seen before it."""
        events = []
        while True:
            msg = self.next()
            assert msg is not None, f"connection closed before reply {id_}"
            if "event" in msg:
                events.append(msg)
            elif msg["id"] == id_:
                return msg, events
            else:
                raise AssertionError(f"unexpected reply {msg}")


def req(id_, op, **args) -> bytes:
    return protocol.encode({"v": 1, "id": id_, "op": op, "args": args})


def ping_ok(path: Path) -> int:
    """A ping on a new connection; returns the daemon's pid."""
    with Client(path, timeout=20) as c:
        return c.request("ping")["pid"]


# -- the socket file --------------------------------------------------------------------------


def test_socket_is_0600_in_a_0700_dir_and_removed_on_close(daemon):
    st = os.lstat(daemon.path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(daemon.path.parent).st_mode) == 0o700
    assert ping_ok(daemon.path) == daemon.pid
    assert daemon.stop() == 0
    assert not daemon.path.exists()


def test_socket_mode_ignores_a_loose_umask(sockdir):
    async def main():
        old = os.umask(0)
        try:
            server = Server(sockdir / "u.sock", TestHandler())
            await server.start()
            mode = stat.S_IMODE(os.lstat(sockdir / "u.sock").st_mode)
            await server.close()
            return mode, os.umask(0)
        finally:
            os.umask(old)

    assert asyncio.run(main()) == (0o600, 0)  # and the process umask is restored


def test_second_server_on_a_live_socket_raises(daemon):
    async def second():
        await Server(daemon.path, TestHandler()).start()

    with pytest.raises(DaemonAlreadyRunning) as info:
        asyncio.run(second())
    assert info.value.pid == daemon.pid
    assert str(info.value) == (
        f"an eyas daemon is already running (pid {daemon.pid}) on {daemon.path}; stop it with `eyas daemon stop`"
    )
    assert ping_ok(daemon.path) == daemon.pid  # the live socket was left alone
    # The same through a second daemon process.
    second_proc = Daemon(daemon.path)
    assert second_proc.first_line.startswith(f"ALREADY {daemon.pid} ")
    assert second_proc.proc.wait(20) == 3
    second_proc._logf.close()
    assert ping_ok(daemon.path) == daemon.pid


def test_stale_socket_is_replaced(start_daemon, sockdir):
    first = start_daemon()
    first.kill()  # SIGKILL: the socket file stays behind
    assert stat.S_ISSOCK(os.lstat(first.path).st_mode)
    with pytest.raises(DaemonNotRunning):
        Client(first.path).request("ping")
    second = start_daemon()
    assert ping_ok(second.path) == second.pid != first.pid
    assert "removing stale socket" in second.log_text()


def test_a_regular_file_at_the_socket_path_is_not_removed(sockdir):
    path = sockdir / "f.sock"
    path.write_text("keep me")

    async def main():
        await Server(path, TestHandler()).start()

    with pytest.raises(FileExistsError, match="exists and is not a socket; remove it"):
        asyncio.run(main())
    assert path.read_text() == "keep me"


# -- another uid ------------------------------------------------------------------------------

OTHER_UID_SCRIPT = r"""
import json, os, socket, sys
os.setgroups([]); os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(20)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print(json.dumps({"connect": type(exc).__name__})); sys.exit(0)
try:
    s.sendall(b'{"v":1,"id":1,"op":"ping"}\n')
except BrokenPipeError:
    pass  # the daemon may have answered and closed already; its reply is still readable
data = b""
while True:
    chunk = s.recv(65536)
    if not chunk:
        break
    data += chunk
print(json.dumps({"connect": "ok", "lines": [json.loads(l) for l in data.splitlines()]}))
"""


def run_as_nobody(path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-I", "-c", OTHER_UID_SCRIPT, str(path)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to become uid 65534")
def test_another_uid_is_refused(daemon):
    # (a) the 0700 directory keeps it out
    assert run_as_nobody(daemon.path) == {"connect": "PermissionError"}
    # (b) with the permissions opened, SO_PEERCRED still refuses it
    os.chmod(daemon.path.parent, 0o755)
    os.chmod(daemon.path, 0o666)
    got = run_as_nobody(daemon.path)
    assert got == {
        "connect": "ok",
        "lines": [
            {
                "v": 1,
                "id": None,
                "ok": False,
                "error": {
                    "code": "forbidden",
                    "message": f"eyas daemon: uid 65534 may not use this daemon; it belongs to uid {os.getuid()}",
                },
            }
        ],
    }
    assert "WARNING refused a connection from pid" in daemon.log_text()
    assert " uid 65534" in daemon.log_text()
    assert ping_ok(daemon.path) == daemon.pid


# -- bad input --------------------------------------------------------------------------------

BAD = [
    ("garbage", b"\x00\x01garbage\x7f\n", protocol.BAD_REQUEST, None),
    ("invalid-json", b'{"v": 1, "id": 3, "op": \n', protocol.BAD_REQUEST, None),
    ("json-list", b'[{"v": 1, "id": 3, "op": "ping"}]\n', protocol.BAD_REQUEST, None),
    ("json-string", b'"ping"\n', protocol.BAD_REQUEST, None),
    ("wrong-version", b'{"v": 2, "id": 4, "op": "ping"}\n', protocol.VERSION_MISMATCH, 4),
    ("no-version", b'{"id": "a", "op": "ping"}\n', protocol.VERSION_MISMATCH, "a"),
    ("unknown-op", b'{"v": 1, "id": 5, "op": "fly"}\n', protocol.UNKNOWN_OP, 5),
    ("args-not-object", b'{"v": 1, "id": 6, "op": "ping", "args": [1]}\n', protocol.BAD_REQUEST, 6),
    ("bool-id", b'{"v": 1, "id": true, "op": "ping"}\n', protocol.BAD_REQUEST, None),
    ("no-id", b'{"v": 1, "op": "ping"}\n', protocol.BAD_REQUEST, None),
    ("non-utf8", b'{"v": 1, "id": 7, "op": "\xff\xfe"}\n', protocol.BAD_REQUEST, None),
    ("deep-nesting", b"[" * 200_000 + b"\n", protocol.BAD_REQUEST, None),
    ("subscribe-no-topics", b'{"v": 1, "id": 8, "op": "subscribe", "args": {}}\n', protocol.BAD_REQUEST, 8),
    (
        "subscribe-bad-topic",
        b'{"v": 1, "id": 9, "op": "subscribe", "args": {"topics": ["gpu"]}}\n',
        protocol.BAD_REQUEST,
        9,
    ),
    (
        "subscribe-bad-filter",
        b'{"v": 1, "id": 10, "op": "subscribe", "args": {"topics": ["log"], "run": "3"}}\n',
        protocol.BAD_REQUEST,
        10,
    ),
    (
        "subscribe-unknown-arg",
        b'{"v": 1, "id": 11, "op": "subscribe", "args": {"topics": ["log"], "runs": 3}}\n',
        protocol.BAD_REQUEST,
        11,
    ),
    ("unsubscribe-unknown", b'{"v": 1, "id": 12, "op": "unsubscribe", "args": {"sub": 99}}\n', protocol.NOT_FOUND, 12),
]


@pytest.mark.parametrize("payload,code,id_", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request_gets_the_right_error_and_the_connection_keeps_serving(daemon, payload, code, id_):
    with connect(daemon.path) as s:
        lines = Lines(s)
        s.sendall(payload)
        reply = lines.next()
        assert (reply["v"], reply["id"], reply["ok"], reply["error"]["code"]) == (1, id_, False, code)
        assert reply["error"]["message"]  # never empty
        s.sendall(req("after", "ping"))
        assert lines.next() == {
            "v": 1,
            "id": "after",
            "ok": True,
            "result": {"pid": daemon.pid, "peer_pid": os.getpid(), "peer_uid": os.getuid()},
        }
    assert ping_ok(daemon.path) == daemon.pid


def test_error_messages_name_the_problem(daemon):
    with connect(daemon.path) as s:
        lines = Lines(s)
        s.sendall(b'{"v": 2, "id": 1, "op": "ping"}\n{"v": 1, "id": 2, "op": "fly"}\n[1]\n')
        assert lines.next()["error"]["message"] == "protocol version 2 is not supported (this daemon speaks 1)"
        assert lines.next()["error"]["message"].startswith("unknown op 'fly'; known: ping, resume, retry, ")
        assert lines.next()["error"]["message"] == "a request must be a JSON object"


def test_blank_lines_are_ignored(daemon):
    with connect(daemon.path) as s:
        s.sendall(b"\n\r\n   \n" + req(1, "ping"))
        assert Lines(s).next()["id"] == 1


def test_two_mib_line_is_refused_and_skipped(daemon):
    with connect(daemon.path) as s:
        lines = Lines(s)
        s.sendall(b'{"v": 1, "id": 1, "op": "ping", "args": {"x": "' + b"a" * (2 << 20) + b'"}}\n' + req(2, "ping"))
        reply = lines.next()
        assert (reply["id"], reply["error"]["code"]) == (None, protocol.TOO_LARGE)
        assert reply["error"]["message"] == (
            f"a message longer than the {protocol.MAX_LINE}-byte limit was discarded; send smaller requests"
        )
        assert lines.next()["id"] == 2  # the rest of the big line was discarded, the next one served
    # A line exactly at the limit is still accepted.
    with connect(daemon.path) as s:
        line = b'{"v": 1, "id": 3, "op": "ping", "args": {"x": "'
        line += b"a" * (protocol.MAX_LINE - len(line) - 3) + b'"}}'
        assert len(line) == protocol.MAX_LINE
        s.sendall(line + b"\n")
        assert Lines(s).next() == {
            "v": 1,
            "id": 3,
            "ok": True,
            "result": {"pid": daemon.pid, "peer_pid": os.getpid(), "peer_uid": 0},
        }
    assert ping_ok(daemon.path) == daemon.pid


def test_a_huge_line_does_not_grow_the_daemon(daemon):
    before = daemon.hwm_kib()
    block = b"b" * (1 << 20)
    with connect(daemon.path) as s:
        lines = Lines(s)
        for _ in range(256):  # 256 MiB with no newline
            s.sendall(block)
        s.sendall(b"\n" + req(2, "ping"))
        assert lines.next()["error"]["code"] == protocol.TOO_LARGE
        assert lines.next()["id"] == 2
    grown = daemon.hwm_kib() - before
    assert grown < 32 * 1024, f"daemon peak RSS grew by {grown} KiB while reading a 256 MiB line"


def test_half_written_message_then_eof_closes_quietly(daemon):
    with connect(daemon.path) as s:
        s.sendall(b'{"v": 1, "id": 1, "op": "pi')
        s.shutdown(socket.SHUT_WR)
        assert s.recv(100) == b""  # no reply: nothing complete was asked
    assert ping_ok(daemon.path) == daemon.pid


def test_requests_sent_before_a_half_close_are_still_answered(daemon):
    # `printf '...' | socat - UNIX-CONNECT:sock` sends, half-closes, then reads.
    with connect(daemon.path) as s:
        s.sendall(req(1, "status", delay=0.3, echo="late") + req(2, "ping"))
        s.shutdown(socket.SHUT_WR)
        lines = Lines(s)
        got = {m["id"]: m["result"] for m in (lines.next(), lines.next())}
        assert got == {1: {"echo": "late"}, 2: {"pid": daemon.pid, "peer_pid": os.getpid(), "peer_uid": 0}}
        assert lines.next() is None


def test_ten_thousand_garbage_lines(daemon):
    with connect(daemon.path) as s:
        lines = Lines(s)
        s.sendall(b"x\n" * 10_000 + req("last", "ping"))
        codes = [lines.next()["error"]["code"] for _ in range(10_000)]
        assert codes == [protocol.BAD_REQUEST] * 10_000
        assert lines.next()["id"] == "last"
    assert ping_ok(daemon.path) == daemon.pid


def test_a_client_that_vanishes_with_requests_in_flight(daemon):
    s = connect(daemon.path)
    s.sendall(req(1, "status", delay=0.3) + b"x\n" * 1000)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()
    time.sleep(0.5)  # let the slow request finish into a closed connection
    assert ping_ok(daemon.path) == daemon.pid


# -- handlers ---------------------------------------------------------------------------------


def test_handler_exception_is_an_internal_error_and_the_next_request_works(daemon):
    with connect(daemon.path) as s:
        lines = Lines(s)
        s.sendall(req(1, "skip", n=1))
        assert lines.next() == {
            "v": 1,
            "id": 1,
            "ok": False,
            "error": {"code": "internal", "message": "ValueError: boom 1"},
        }
        s.sendall(req(2, "retry"))
        assert lines.next() == {
            "v": 1,
            "id": 2,
            "ok": False,
            "error": {"code": "not_found", "message": "no run 99; list runs with `eyas runs`"},
        }
        s.sendall(req(3, "ping"))
        assert lines.next()["result"]["pid"] == daemon.pid
    log = daemon.log_text()
    assert "ERROR op 'skip' from pid" in log and "Traceback" in log and "ValueError: boom 1" in log


def test_a_slow_request_does_not_block_a_ping(daemon):
    with connect(daemon.path) as s:
        lines = Lines(s)
        t0 = time.monotonic()
        s.sendall(req("slow", "status", delay=2.0, echo="slow") + req("fast", "ping"))
        first = lines.next()
        assert first["id"] == "fast"
        assert time.monotonic() - t0 < 1.5
        assert lines.next() == {"v": 1, "id": "slow", "ok": True, "result": {"echo": "slow"}}


# -- subscriptions ----------------------------------------------------------------------------

EVENTS = [
    ("log", {"run_id": 1, "stage": "train", "rank": 0, "line": "a"}),
    ("log", {"run_id": 1, "stage": "train", "rank": 1, "line": "b"}),
    ("log", {"run_id": 2, "stage": "train", "rank": 0, "line": "c"}),
    ("log", {"run_id": 1, "stage": "extract", "rank": 0, "line": "d"}),
    ("state", {"run_id": 1, "stage": "train", "state": "running"}),
    ("state", {"run_id": 1, "state": "running"}),
    ("state", {"run_id": 2, "state": "failed"}),
    ("metric", {"run_id": 1, "stage": "train", "rank": 0, "loss": 1.5}),
    ("state", {"daemon": "up"}),
    ("log", {"run_id": 1, "stage": "train", "rank": None, "line": "group"}),
    # sentinels: no run/stage/rank keys, so they match every filter
    ("log", {"end": True}),
    ("state", {"end": True}),
    ("metric", {"end": True}),
]


def _read_until_sentinels(sub, topics: set[str]) -> list[tuple[str, dict]]:
    got, ends = [], set()
    for ev in sub:
        if ev.data.get("end"):
            ends.add(ev.event)
            if ends == topics:
                return got
        else:
            got.append((ev.event, ev.data))
    raise AssertionError("subscription ended early")


def test_subscription_filters(daemon):
    c = Client(daemon.path)
    subs = {
        "run1-train-rank0-logs": (c.subscribe(["log"], run=1, stage="train", rank=0), {"log"}),
        "run1-state": (c.subscribe("state", run=1), {"state"}),
        "everything": (c.subscribe(["state", "log", "metric"]), {"state", "log", "metric"}),
        "train-metrics": (c.subscribe(["metric", "log"], stage="train", rank=None), {"metric", "log"}),
    }
    assert c.request("submit", events=EVENTS) == {"published": len(EVENTS)}
    got = {name: _read_until_sentinels(sub, topics) for name, (sub, topics) in subs.items()}
    e = [(t, d) for t, d in EVENTS]
    assert got == {
        "run1-train-rank0-logs": [e[0], e[9]],
        "run1-state": [e[4], e[5], e[8]],
        "everything": e[:10],
        "train-metrics": [e[0], e[1], e[2], e[7], e[9]],
    }
    for sub, _ in subs.values():
        sub.close()
    c.close()


def test_events_carry_the_subscribe_request_id(daemon):
    with connect(daemon.path) as s:
        lines = Lines(s)
        s.sendall(req("my-sub", "subscribe", topics=["metric"], run=7))
        assert lines.next() == {"v": 1, "id": "my-sub", "ok": True, "result": {"sub": "my-sub"}}
        s.sendall(req("my-sub", "subscribe", topics=["log"]))
        assert lines.next()["error"]["code"] == protocol.BAD_REQUEST  # the id is taken
        Client(daemon.path).request("submit", events=[["metric", {"run_id": 7, "loss": 0.5}]])
        assert lines.next() == {"v": 1, "sub": "my-sub", "event": "metric", "data": {"run_id": 7, "loss": 0.5}}


def test_unsubscribe_stops_events(daemon):
    pub = Client(daemon.path)
    with connect(daemon.path) as s:
        lines = Lines(s)
        s.sendall(req(10, "subscribe", topics=["log"]))
        assert lines.next()["result"] == {"sub": 10}
        pub.request("submit", topic="log", count=5)
        assert [lines.next()["data"]["seq"] for _ in range(5)] == [0, 1, 2, 3, 4]
        s.sendall(req(11, "unsubscribe", sub=10))
        reply, before = lines.until_reply(11)
        assert (reply["result"], before) == ({"ok": True}, [])
        pub.request("submit", topic="log", count=5)
        # Anything published for us would have been queued before this reply.
        s.sendall(req(12, "ping"))
        reply, events = lines.until_reply(12)
        assert events == [] and reply["ok"]
        s.sendall(req(13, "unsubscribe", sub=10))
        assert lines.until_reply(13)[0]["error"]["code"] == protocol.NOT_FOUND
    pub.close()


def test_a_vanishing_subscriber_does_not_disturb_others(daemon):
    n = 100_000
    keeper = Client(daemon.path).subscribe(["log"], run=5)
    received: list[int] = []
    errors: list[BaseException] = []

    def keep_reading():
        try:
            for ev in keeper:
                if ev.event != "log":
                    errors.append(AssertionError(f"unexpected {ev}"))
                    return
                received.append(ev.data["seq"])
                if len(received) == n:
                    return
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    reader = threading.Thread(target=keep_reading, daemon=True)
    reader.start()
    leaver = connect(daemon.path)
    leaver_lines = Lines(leaver)
    leaver.sendall(req(1, "subscribe", topics=["log"]))
    assert leaver_lines.next()["ok"]
    with connect(daemon.path, timeout=60) as pub:
        pub.sendall(
            req("pub", "submit", topic="log", count=n, data={"run_id": 5, "stage": "train", "rank": 0}, batch=500)
        )
        seen = [leaver_lines.next()["data"]["seq"] for _ in range(1000)]
        assert seen == list(range(1000))
        leaver.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        leaver.close()  # mid-stream, with events still queued for it
        assert Lines(pub).next() == {"v": 1, "id": "pub", "ok": True, "result": {"published": n}}
    reader.join(60)
    keeper.close()
    assert not errors, errors
    assert received == list(range(n))
    assert ping_ok(daemon.path) == daemon.pid


def test_a_stuck_subscriber_overflows_with_bounded_memory(start_daemon):
    max_queue = 256 * 1024
    daemon = start_daemon(max_queue=max_queue)
    n, pad, every = 50_000, 2000, 100  # ~100 MiB of events
    # The healthy subscriber takes 1 event in 100 (run 5), so it keeps up on a loaded machine
    # and must get every one of them, while the stuck one (all events) overflows.
    healthy = Client(daemon.path).subscribe(["log"], run=5)
    healthy_seqs: list[int] = []
    healthy_other: list[Event] = []

    def read_healthy():
        for ev in healthy:
            if ev.event == "log":
                healthy_seqs.append(ev.data["seq"])
                if len(healthy_seqs) == n // every:
                    return
            else:
                healthy_other.append(ev)
                return

    reader = threading.Thread(target=read_healthy, daemon=True)
    reader.start()
    stuck = connect(daemon.path, timeout=60)
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    lines = Lines(stuck)
    stuck.sendall(req("s", "subscribe", topics=["log"]))
    assert lines.next()["result"] == {"sub": "s"}
    before = daemon.hwm_kib()
    with Client(daemon.path, timeout=60) as pub:
        assert pub.request("submit", topic="log", count=n, pad=pad, batch=50, run5_every=every) == {"published": n}
    grown = daemon.hwm_kib() - before
    assert grown < 24 * 1024, f"daemon peak RSS grew by {grown} KiB for a stuck subscriber"
    assert "is not reading; dropping its events until it catches up" in daemon.log_text()
    reader.join(120)
    healthy.close()
    assert (healthy_seqs, healthy_other) == (list(range(0, n, every)), [])  # the healthy one lost nothing
    # Now the stuck one reads: what was already on its way, then one overflow event.
    stuck.sendall(req("after", "ping"))
    seqs, dropped, got_reply = [], None, False
    while dropped is None or not got_reply:
        msg = lines.next()
        if msg.get("event") == "log":
            assert dropped is None, "events after the overflow marker, yet nothing more was published"
            seqs.append(msg["data"]["seq"])
        elif msg.get("event") == "overflow":
            assert msg["sub"] == "s"
            dropped = msg["data"]["dropped"]
        else:
            assert msg["id"] == "after" and msg["ok"]
            got_reply = True
    assert seqs == list(range(len(seqs)))  # a prefix, in order
    assert len(seqs) + dropped == n
    assert 0 < len(seqs) * (pad + 60) < 2 << 20  # what was in kernel and transport buffers
    # Delivery resumes normally after the overflow.
    Client(daemon.path).request("submit", topic="log", count=3)
    assert [lines.next()["data"]["seq"] for _ in range(3)] == [0, 1, 2]
    stuck.close()


# -- clients ----------------------------------------------------------------------------------


def test_client_request_and_errors(daemon):
    with Client(daemon.path) as c:
        assert c.request("ping") == {"pid": daemon.pid, "peer_pid": os.getpid(), "peer_uid": os.getuid()}
        with pytest.raises(DaemonError) as info:
            c.request("skip", n=2)
        assert (info.value.code, info.value.message) == ("internal", "ValueError: boom 2")
        with pytest.raises(DaemonError) as info:
            c.request("fly")
        assert info.value.code == protocol.UNKNOWN_OP
        with pytest.raises(DaemonError) as info:
            c.request("ping", blob="x" * protocol.MAX_LINE)  # refused before sending
        assert info.value.code == protocol.TOO_LARGE
        assert c.request("status", delay=0, echo=[1, "two"]) == {"echo": [1, "two"]}
        assert c.request("ping")["peer_pid"] == os.getpid()


def test_client_timeout(daemon):
    with Client(daemon.path, timeout=0.3) as c:
        with pytest.raises(TimeoutError, match=r"did not answer within 0.3 s"):
            c.request("status", delay=3)
        assert c.request("ping")["pid"] == daemon.pid  # a fresh connection afterwards


def test_daemon_not_running(sockdir):
    path = sockdir / "none.sock"
    expected = f"eyas daemon is not running (no socket at {path}); start it with `eyas daemon start`"
    with pytest.raises(DaemonNotRunning) as info:
        Client(path).request("ping")
    assert str(info.value) == expected
    with pytest.raises(DaemonNotRunning):
        Client(path).subscribe(["log"])

    async def main():
        with pytest.raises(DaemonNotRunning) as ainfo:
            await AsyncClient(path).connect()
        assert str(ainfo.value) == expected

    asyncio.run(main())


def test_client_default_path_is_the_state_socket(monkeypatch, sockdir):
    monkeypatch.setenv("EYAS_HOME", str(sockdir / "home"))
    (sockdir / "rt").mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(sockdir / "rt"))
    assert not (sockdir / "rt" / "eyas").exists()  # a client computes the path, it makes nothing
    assert Client().path == AsyncClient().path == paths.socket_path()
    assert str(paths.socket_path()).startswith(str(sockdir / "rt" / "eyas"))
    assert paths.lock_path() == sockdir / "home" / "daemon.lock"  # with the state it guards
    # A set but missing XDG_RUNTIME_DIR (removed at logout) is neither used nor made again.
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(sockdir / "gone"))
    assert Client().path.parent.parent == Path("/tmp") / f"eyas-{os.getuid()}"
    assert not (sockdir / "gone").exists()


def test_clients_follow_the_record_while_its_daemon_lives(monkeypatch, sockdir, start_daemon):
    home = sockdir / "home"
    home.mkdir()
    (sockdir / "rt").mkdir()
    monkeypatch.setenv("EYAS_HOME", str(home))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(sockdir / "rt"))
    computed = paths.socket_path(home, create=False)
    elsewhere = start_daemon(path=sockdir / "elsewhere.sock")
    assert Client().path == computed  # no record
    created = psutil.Process(elsewhere.pid).create_time()
    paths.write_record(home, pid=elsewhere.pid, create_time=created, socket=str(elsewhere.path), started=0)
    assert stat.S_IMODE(paths.record_path(home).stat().st_mode) == 0o600
    assert Client().path == AsyncClient().path == elsewhere.path
    assert Client().request("ping")["pid"] == elsewhere.pid
    # Another process with the recorded pid (a recycled one) is not the daemon.
    paths.write_record(home, pid=elsewhere.pid, create_time=created - 100, socket=str(elsewhere.path), started=0)
    assert Client().path == computed
    # A daemon answering at the computed path comes first.
    paths.write_record(home, pid=elsewhere.pid, create_time=created, socket=str(elsewhere.path), started=0)
    here = start_daemon(path=paths.socket_path(home))
    assert Client().path == computed and Client().request("ping")["pid"] == here.pid
    assert [p.name for p in home.iterdir()] == ["daemon.json"]  # no temp file left behind


async def test_the_server_rebinds_and_keeps_its_connections(sockdir):
    handler = TestHandler()
    (sockdir / "a").mkdir()
    first = sockdir / "a" / "d.sock"
    server = Server(first, handler, log=logging.getLogger("eyas.test"))
    handler.server = server
    await server.start()
    assert server.lost() is None
    async with AsyncClient(first) as before:
        shutil.rmtree(sockdir / "a")
        assert server.lost() == "is gone"
        second = sockdir / "b.sock"
        await server.rebind(second)
        assert (server.path, server.lost()) == (second, None)
        assert stat.S_IMODE(second.stat().st_mode) == 0o600
        assert (await before.request("ping"))["pid"] == os.getpid()  # kept across the rebind
        async with AsyncClient(second) as after:
            assert (await after.request("ping"))["pid"] == os.getpid()
        second.unlink()
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        other.bind(str(second))
        try:
            assert server.lost() == "was replaced"
            await server.close()
            assert second.exists()  # not ours: close() leaves it
        finally:
            other.close()


def test_client_sees_a_daemon_that_dies_mid_request(daemon):
    c = Client(daemon.path)
    sub = c.subscribe(["log"])
    killer = threading.Timer(0.5, daemon.kill)
    killer.start()
    with pytest.raises(DaemonNotRunning, match="closed the connection"):
        c.request("status", delay=10)
    killer.join()
    assert list(sub) == []  # the event stream just ends


def test_sync_subscription_ends_when_the_daemon_stops(daemon):
    sub = Client(daemon.path).subscribe(["state"])
    Client(daemon.path).request("submit", events=[["state", {"run_id": 1, "state": "queued"}]])
    assert next(sub) == Event(sub=1, event="state", data={"run_id": 1, "state": "queued"})
    assert daemon.stop() == 0
    assert list(sub) == []


def test_shutdown_request_is_answered_then_the_daemon_closes(daemon):
    sub = Client(daemon.path).subscribe(["state"])
    with Client(daemon.path) as c:
        assert c.request("shutdown") == {"ok": True}
    assert list(sub) == []
    assert daemon.proc.wait(20) == 0
    assert not daemon.path.exists()


def test_large_events_reach_both_clients(daemon):
    size = protocol.MAX_LINE - 1000  # bigger than asyncio's 64 KiB readline limit
    sub = Client(daemon.path).subscribe(["log"])

    async def main():
        async with AsyncClient(daemon.path) as ac:
            asub = await ac.subscribe(["log"])
            await ac.request("submit", topic="log", count=3, pad=size)
            got = [await asub.__anext__() for _ in range(3)]
            await asub.close()
            return got

    got = asyncio.run(main())
    assert [(e.data["seq"], len(e.data["text"])) for e in got] == [(0, size), (1, size), (2, size)]
    sync_got = [next(sub) for _ in range(3)]
    assert [(e.data["seq"], len(e.data["text"])) for e in sync_got] == [(0, size), (1, size), (2, size)]
    sub.close()


async def test_async_client_concurrent_requests_match_by_id(daemon):
    async with AsyncClient(daemon.path) as c:
        t0 = time.monotonic()
        results = await asyncio.gather(
            c.request("status", delay=1.0, echo="slow"),
            *(c.request("status", delay=0.05 * i, echo=i) for i in range(10)),
            c.request("ping"),
        )
        elapsed = time.monotonic() - t0
        assert results[0] == {"echo": "slow"}
        assert results[1:11] == [{"echo": i} for i in range(10)]
        assert results[11]["pid"] == daemon.pid
        assert elapsed < 3.0, elapsed  # concurrent, not 3.25 s of sleeps in a row
        with pytest.raises(DaemonError) as info:
            await c.request("retry")
        assert (info.value.code, str(info.value)) == ("not_found", "no run 99; list runs with `eyas runs`")
        assert (await c.request("ping"))["pid"] == daemon.pid


async def test_async_client_subscriptions_multiplexed_with_requests(daemon):
    async with AsyncClient(daemon.path) as c:
        logs = await c.subscribe(["log"], run=1)
        states = await c.subscribe("state")
        assert logs.sub != states.sub
        await c.request("submit", events=EVENTS)
        got_logs = [(await logs.__anext__()).data for _ in range(5)]
        assert [d.get("line") for d in got_logs] == ["a", "b", "d", "group", None]  # None: the sentinel
        got_states = [(await states.__anext__()).data for _ in range(5)]
        assert got_states == [EVENTS[i][1] for i in (4, 5, 6, 8, 11)]
        await c.request("submit", events=[["log", {"run_id": 1, "line": "unread"}]])
        await c.request("ping")  # the event above has arrived, unread, before this reply
        await logs.close()
        await c.request("submit", events=[["log", {"run_id": 1, "line": "late"}], ["state", {"s": 1}]])
        assert (await states.__anext__()).data == {"s": 1}
        with pytest.raises(StopAsyncIteration):
            await logs.__anext__()  # closed: ends, no late events
        with pytest.raises(DaemonError) as info:
            await c.subscribe(["gpu"])
        assert info.value.code == protocol.BAD_REQUEST


async def test_async_client_waiters_get_daemon_not_running_on_disconnect(daemon):
    c = AsyncClient(daemon.path)
    await c.connect()
    sub = await c.subscribe(["log"])
    slow = asyncio.create_task(c.request("status", delay=30))
    await asyncio.sleep(0.3)
    daemon.kill()
    with pytest.raises(DaemonNotRunning, match="closed the connection"):
        await slow
    with pytest.raises(DaemonNotRunning):
        await sub.__anext__()
    with pytest.raises(DaemonNotRunning):
        await c.request("ping")
    await c.close()


async def test_async_subscription_overflow_on_a_slow_consumer(daemon):
    async with AsyncClient(daemon.path) as c:
        c.max_pending_events = 10
        sub = await c.subscribe(["metric"])
        await c.request("submit", topic="metric", count=25)
        await c.request("ping")  # all 25 events arrived before this reply
        got = [await sub.__anext__() for _ in range(11)]
        assert [e.data["seq"] for e in got[:10]] == list(range(10))
        assert (got[10].event, got[10].data) == ("overflow", {"dropped": 15})
        await c.request("submit", topic="metric", count=1)
        assert (await sub.__anext__()).data["seq"] == 0


def test_client_module_imports_nothing_heavy():
    code = (
        "import sys, eyas.wire.client; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'textual', 'torch', 'transformers', 'vllm', 'sqlite_utils', 'psutil', 'rich', 'pynvml'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "[]"), out.stderr


if __name__ == "__main__":
    sys.exit(serve_main())
