"""Talk to the eyas daemon: a blocking Client for the CLI, an AsyncClient for the TUI.

Stdlib only (the CLI imports this on every control command). Lines are framed by hand over
fixed-size reads rather than asyncio's readline, whose 64 KiB default limit is smaller than
the log-chunk events the daemon sends (up to protocol.MAX_LINE).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import socket
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

from eyas.wire import protocol
from eyas.wire.protocol import Event, Reply, Request

CHUNK = 65536
# A line from the daemon longer than this means a broken stream, not a big event.
MAX_INCOMING = 4 * protocol.MAX_LINE


class DaemonNotRunning(ConnectionError):
    def __init__(self, path: Path | str, message: str | None = None):
        super().__init__(
            message or f"eyas daemon is not running (no socket at {path}); start it with `eyas daemon start`"
        )
        self.path = Path(path)


class DaemonError(RuntimeError):
    """An error reply from the daemon: `code` is one of the protocol's error codes."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _default_path() -> Path:
    from eyas.state import paths  # imported here so that a given path needs no state dir

    return paths.find_socket()


def _lost(path: Path) -> DaemonNotRunning:
    return DaemonNotRunning(
        path, f"eyas daemon closed the connection on {path} (did it stop?); check with `eyas daemon status`"
    )


def _subscribe_args(topics: str | Iterable[str], filters: dict[str, Any]) -> dict[str, Any]:
    args = {k: v for k, v in filters.items() if v is not None}
    args["topics"] = [topics] if isinstance(topics, str) else list(topics)
    return args


def _encode(req: Request) -> bytes:
    line = req.encode()
    if len(line) > protocol.MAX_LINE:
        raise DaemonError(
            protocol.TOO_LARGE, f"request {req.op!r} is {len(line)} bytes; the daemon takes at most {protocol.MAX_LINE}"
        )
    return line


class _Lines:
    """Split a byte stream into lines; bounded so a broken peer cannot exhaust memory."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buf += chunk
        if b"\n" not in chunk:
            if len(self._buf) > MAX_INCOMING:
                raise ConnectionError(f"the daemon sent a line longer than {MAX_INCOMING} bytes")
            return []
        *lines, rest = self._buf.split(b"\n")
        self._buf = bytearray(rest)
        return [bytes(line) for line in lines if line.strip()]


def _raise_for(reply: Reply) -> Any:
    if reply.ok:
        return reply.result
    err = reply.error or {}
    raise DaemonError(err.get("code", protocol.INTERNAL), err.get("message", "error reply without a message"))


# -- blocking ---------------------------------------------------------------------------------


class _SyncConn:
    def __init__(self, path: Path, timeout: float | None):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            self.sock.close()
            raise DaemonNotRunning(path) from None
        except PermissionError:
            self.sock.close()
            raise PermissionError(
                f"eyas daemon socket {path}: permission denied (it belongs to another user)"
            ) from None
        except BaseException:
            self.sock.close()
            raise
        self._lines = _Lines()
        self._ready: collections.deque[bytes] = collections.deque()

    def send(self, line: bytes) -> None:
        try:
            self.sock.sendall(line)
        except (BrokenPipeError, ConnectionResetError):
            raise _lost(self.path) from None

    def next_message(self) -> Reply | Event | None:
        """The next message, or None at EOF."""
        while not self._ready:
            try:
                chunk = self.sock.recv(CHUNK)
            except TimeoutError:
                raise TimeoutError(f"eyas daemon did not answer within {self.sock.gettimeout()} s") from None
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            self._ready.extend(self._lines.feed(chunk))
        return protocol.parse_message(self._ready.popleft())

    def close(self) -> None:
        self.sock.close()


class Client:
    """A blocking client; connects on first use. One request at a time."""

    def __init__(self, path: Path | None = None, timeout: float = 30.0):
        self.path = Path(path) if path is not None else _default_path()
        self.timeout = timeout
        self._conn: _SyncConn | None = None
        self._ids = itertools.count(1)

    def connect(self) -> Client:
        if self._conn is None:
            self._conn = _SyncConn(self.path, self.timeout)
        return self

    def request(self, op: str, **args: Any) -> Any:
        """Send one request and return its result; an error reply raises DaemonError."""
        req = Request(id=next(self._ids), op=op, args=args)
        line = _encode(req)
        conn = self.connect()._conn
        try:
            conn.send(line)
            while True:
                msg = conn.next_message()
                if msg is None:
                    raise _lost(self.path)
                if isinstance(msg, Reply) and (msg.id == req.id or (msg.id is None and not msg.ok)):
                    break  # an id-less error (e.g. "forbidden") is about us too
        except BaseException:
            # After a timeout or a lost daemon the stream position is unknown: start afresh.
            self.close()
            raise
        return _raise_for(msg)

    def subscribe(self, topics: str | Iterable[str], **filters: Any) -> SyncSubscription:
        """Stream events on a connection of its own. The subscription is live on return;
        iterating ends when the daemon closes the connection."""
        conn = _SyncConn(self.path, self.timeout)
        try:
            req = Request(id=1, op="subscribe", args=_subscribe_args(topics, filters))
            conn.send(_encode(req))
            while True:
                msg = conn.next_message()
                if msg is None:
                    raise _lost(self.path)
                if isinstance(msg, Reply):
                    _raise_for(msg)
                    break
        except BaseException:
            conn.close()
            raise
        conn.sock.settimeout(None)  # events may be minutes apart
        return SyncSubscription(conn, req.id)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Client:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncSubscription(Iterator[Event]):
    def __init__(self, conn: _SyncConn, sub: int | str):
        self._conn = conn
        self.sub = sub

    def __next__(self) -> Event:
        while True:
            msg = self._conn.next_message()
            if msg is None:
                self.close()
                raise StopIteration
            if isinstance(msg, Event):
                return msg

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> SyncSubscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- asyncio ----------------------------------------------------------------------------------


class Subscription(AsyncIterator[Event]):
    """Events of one subscription of an AsyncClient, in order.

    If the consumer falls more than `maxsize` events behind, newer events are dropped and an
    Event(event="overflow", data={"dropped": n}) takes their place (the daemon does the same
    for a client that stops reading). When the connection is lost, iteration raises
    DaemonNotRunning after the events already received; after close() it just ends.
    """

    def __init__(self, client: AsyncClient, sub: int | str, maxsize: int):
        self._client = client
        self.sub = sub
        self._maxsize = maxsize
        self._items: collections.deque[Event] = collections.deque()
        self._dropped = 0
        self._wake = asyncio.Event()
        self._end: BaseException | None = None
        self._closed = False

    def _push(self, ev: Event) -> None:
        if len(self._items) >= self._maxsize:
            self._dropped += 1
            return
        if self._dropped:
            self._items.append(self._overflow())
        self._items.append(ev)
        self._wake.set()

    def _overflow(self) -> Event:
        ev = Event(sub=self.sub, event="overflow", data={"dropped": self._dropped})
        self._dropped = 0
        return ev

    def _finish(self, exc: BaseException | None) -> None:
        if self._end is None:
            self._end = exc or StopAsyncIteration()
        self._wake.set()

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Event:
        while True:
            if self._items:
                return self._items.popleft()
            if self._dropped:
                return self._overflow()
            if self._end is not None:
                if isinstance(self._end, StopAsyncIteration):
                    raise StopAsyncIteration
                raise self._end
            self._wake.clear()
            await self._wake.wait()

    async def close(self) -> None:
        """Unsubscribe; no event of this subscription follows."""
        if self._closed:
            return
        self._closed = True
        self._items.clear()  # a closed subscription yields nothing more, queued or not
        self._dropped = 0
        try:
            if self._end is None:
                await self._client.request("unsubscribe", sub=self.sub)
        except (DaemonNotRunning, DaemonError):
            pass
        finally:
            self._client._subs.pop(self.sub, None)
            self._finish(None)

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncClient:
    """One connection that multiplexes requests and subscriptions.

    A reader task routes replies by id to futures and events by subscription id to
    Subscription queues; when the connection drops, every waiter gets DaemonNotRunning.
    """

    def __init__(self, path: Path | None = None, timeout: float = 30.0, max_pending_events: int = 100_000):
        self.path = Path(path) if path is not None else _default_path()
        self.timeout = timeout
        self.max_pending_events = max_pending_events
        self._ids = itertools.count(1)
        self._pending: dict[int | str, asyncio.Future] = {}
        self._subs: dict[int | str, Subscription] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._lost: BaseException | None = None

    @property
    def connected(self) -> bool:
        return self._writer is not None and self._lost is None

    async def connect(self) -> AsyncClient:
        try:
            reader, self._writer = await asyncio.open_unix_connection(str(self.path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise DaemonNotRunning(self.path) from None
        except PermissionError:
            raise PermissionError(
                f"eyas daemon socket {self.path}: permission denied (it belongs to another user)"
            ) from None
        self._lost = None
        self._reader_task = asyncio.create_task(self._read_loop(reader))
        return self

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            try:
                await self._reader_task
            except asyncio.CancelledError:
                pass
            self._reader_task = None
        self._fail_all(DaemonNotRunning(self.path, f"the connection to the eyas daemon at {self.path} was closed"))

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def request(self, op: str, **args: Any) -> Any:
        """Send a request and await its result; an error reply raises DaemonError."""
        if self._writer is None:
            raise DaemonNotRunning(self.path, "AsyncClient is not connected; call connect() first")
        if self._lost is not None:
            raise self._lost
        req = Request(id=next(self._ids), op=op, args=args)
        line = _encode(req)
        fut = asyncio.get_running_loop().create_future()
        self._pending[req.id] = fut
        try:
            self._writer.write(line)
            await self._writer.drain()
            reply = await asyncio.wait_for(asyncio.shield(fut), self.timeout)
        except (ConnectionError, OSError) as exc:
            if isinstance(exc, DaemonNotRunning):
                raise
            raise _lost(self.path) from None
        except TimeoutError:
            raise TimeoutError(f"eyas daemon did not answer {op!r} within {self.timeout} s") from None
        finally:
            self._pending.pop(req.id, None)
        return _raise_for(reply)

    async def subscribe(self, topics: str | Iterable[str], **filters: Any) -> Subscription:
        """Subscribe and return the (async-iterable) Subscription; events published after this
        returns are delivered. Filters: run, stage, rank."""
        args = _subscribe_args(topics, filters)
        # The request id becomes the subscription id; the queue must exist before the reply
        # arrives, since the first events may follow it in the same read.
        if self._writer is None:
            raise DaemonNotRunning(self.path, "AsyncClient is not connected; call connect() first")
        if self._lost is not None:
            raise self._lost
        req_id = next(self._ids)
        sub = Subscription(self, req_id, self.max_pending_events)
        self._subs[req_id] = sub
        fut = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        try:
            self._writer.write(_encode(Request(id=req_id, op="subscribe", args=args)))
            await self._writer.drain()
            _raise_for(await asyncio.wait_for(asyncio.shield(fut), self.timeout))
        except BaseException as exc:
            self._subs.pop(req_id, None)
            if isinstance(exc, (ConnectionError, OSError)) and not isinstance(exc, DaemonNotRunning):
                raise _lost(self.path) from None
            raise
        finally:
            self._pending.pop(req_id, None)
        return sub

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        lines = _Lines()
        try:
            while True:
                chunk = await reader.read(CHUNK)
                if not chunk:
                    break
                for line in lines.feed(chunk):
                    self._route(protocol.parse_message(line))
        except (ConnectionError, OSError, ValueError):
            pass  # reset, or a garbled stream: either way the connection is gone
        self._fail_all(_lost(self.path))  # (not reached when close() cancels us)

    def _route(self, msg: Reply | Event) -> None:
        if isinstance(msg, Event):
            sub = self._subs.get(msg.sub)
            if sub is not None:
                sub._push(msg)
        elif msg.id is None:
            if not msg.ok:  # a connection-level error ("forbidden"): every waiter shares it
                try:
                    _raise_for(msg)
                except DaemonError as exc:
                    self._fail_all(exc)
        else:
            fut = self._pending.get(msg.id)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _fail_all(self, exc: BaseException) -> None:
        if self._lost is None:
            self._lost = exc
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
        for sub in list(self._subs.values()):
            sub._finish(exc)
        self._subs.clear()
