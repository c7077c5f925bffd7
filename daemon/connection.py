"""One client connection of the daemon's socket: its requests run concurrently, its replies and subscribed events go out through one bounded queue.

One asyncio task reads the connection and one writes it. Requests run concurrently, each in
its own task, so a slow request never holds up a ping; replies carry ids and may come out of
order. "subscribe" and "unsubscribe" are handled here; every other op goes to the Handler.

Overflow policy (a subscriber that stops reading): publishing never blocks. When a
connection's queued bytes would pass max_queue_bytes, the queued *events* of that connection
are dropped (replies never are) and later events are dropped too, counted per subscription,
until the client has read everything still queued; then each affected subscription gets one
Event(event="overflow", data={"dropped": n}) and normal delivery resumes. So the client learns
exactly how many events it missed and the daemon's memory stays bounded by max_queue_bytes
per connection. The connection is kept: a TUI that was suspended (^Z) recovers by itself.

asyncio's StreamReader.readline is not used: its limit turns a long line into an error that
loses the stream, while here a too-long line is answered and skipped with bounded memory.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import typing
from typing import Any

from eyas.wire import protocol
from eyas.wire.protocol import Event, ProtocolError, Reply, Request

if typing.TYPE_CHECKING:
    from .server import Server

CHUNK = 65536
# Requests of one connection running at once; beyond it the connection is not read until
# one finishes, so a client flooding requests cannot grow the daemon without bound.
MAX_INFLIGHT = 256
# Bytes handed to the transport per write: large enough to batch small events, small enough
# that a stuck client's kernel buffer plus the transport hold little.
WRITE_BATCH = 256 * 1024
_FILTER_KEYS = {"run": "run_id", "stage": "stage", "rank": "rank"}


class Handler(typing.Protocol):
    async def handle(self, req: Request, conn: Connection) -> Any:
        """Return the reply's result; raise ProtocolError(code, msg) for an error reply."""


class _Sub:
    __slots__ = ("id", "topics", "filters", "dropped")

    def __init__(self, id_: int | str, topics: frozenset[str], filters: dict[str, Any]):
        self.id = id_
        self.topics = topics
        self.filters = filters  # data key -> wanted value
        self.dropped = 0

    def matches(self, topic: str, data: dict) -> bool:
        if topic not in self.topics:
            return False
        # A filter key absent from the data (or None there) matches: a daemon-wide state
        # event reaches a subscriber filtered on one run.
        return all(data.get(k) is None or data[k] == v for k, v in self.filters.items())


class Connection:
    """One client: its peer credentials, its subscriptions and its outgoing queue."""

    _ids = itertools.count(1)

    def __init__(
        self, server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pid: int, uid: int, gid: int
    ):
        self.id = next(self._ids)
        self.peer_pid = pid
        self.peer_uid = uid
        self.peer_gid = gid
        self.subscriptions: dict[int | str, _Sub] = {}
        self._server = server
        self._reader = reader
        self._writer = writer
        # Outgoing lines as (bytes, sub id or None for a reply).
        self._queue: collections.deque[tuple[bytes, int | str | None]] = collections.deque()
        self.queued_bytes = 0
        self._overflowed = False
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._slots = asyncio.Semaphore(MAX_INFLIGHT)
        self._tasks: set[asyncio.Task] = set()
        self._closing = False  # no more output will be queued
        self.closed = False

    def __repr__(self) -> str:
        return f"<Connection {self.id} pid={self.peer_pid} uid={self.peer_uid}>"

    # -- output ---------------------------------------------------------------------------

    def send_reply(self, reply: Reply) -> None:
        try:
            line = reply.encode()
        except (TypeError, ValueError) as exc:  # a result json cannot encode (e.g. a cycle)
            line = protocol.error_reply(reply.id, protocol.INTERNAL, f"{type(exc).__name__}: {exc}").encode()
        self._put(line, None)

    def _put(self, line: bytes, sub: int | str | None) -> None:
        if self._closing:
            return
        self._queue.append((line, sub))
        self.queued_bytes += len(line)
        if self.queued_bytes > self._server.max_queue_bytes:
            self._drained.clear()  # the reader pauses until the writer catches up
        self._wake.set()

    def _publish(self, sub: _Sub, line: bytes) -> None:
        if self._closing:
            return
        if self._overflowed:
            sub.dropped += 1
            return
        if self.queued_bytes + len(line) > self._server.max_queue_bytes:
            self._drop_events()
            sub.dropped += 1
            return
        self._put(line, sub.id)

    def _drop_events(self) -> None:
        kept: collections.deque[tuple[bytes, int | str | None]] = collections.deque()
        for line, sub_id in self._queue:
            if sub_id is None:
                kept.append((line, sub_id))
            else:
                self.queued_bytes -= len(line)
                sub = self.subscriptions.get(sub_id)
                if sub is not None:
                    sub.dropped += 1
        self._queue = kept
        self._overflowed = True
        self._server.log.warning(
            "connection %s (pid %s) is not reading; dropping its events until it catches up", self.id, self.peer_pid
        )

    def _end_overflow(self) -> None:
        self._overflowed = False
        for sub in self.subscriptions.values():
            if sub.dropped:
                self._put(Event(sub=sub.id, event="overflow", data={"dropped": sub.dropped}).encode(), sub.id)
                sub.dropped = 0

    async def _write_loop(self) -> None:
        try:
            while True:
                if not self._queue:
                    if self._overflowed:
                        self._end_overflow()
                        continue
                    if self._closing:
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                batch, size = [], 0
                while self._queue and (size == 0 or size + len(self._queue[0][0]) <= WRITE_BATCH):
                    line, _ = self._queue.popleft()
                    batch.append(line)
                    size += len(line)
                self.queued_bytes -= size
                self._writer.write(b"".join(batch))
                await self._writer.drain()
                if self.queued_bytes <= self._server.max_queue_bytes:
                    self._drained.set()
        except (ConnectionError, OSError):
            pass  # the client went away mid-stream; the read side notices and cleans up
        finally:
            self._closing = True
            self._queue.clear()
            self.queued_bytes = 0
            self._drained.set()
            self._writer.close()

    # -- input ----------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        """Frame JSON lines ourselves so that a line over MAX_LINE is skipped in O(CHUNK) memory."""
        buf = bytearray()
        skipping = False  # inside a too-long line, discarding up to its newline
        while not self._closing:
            await self._drained.wait()
            chunk = await self._reader.read(CHUNK)
            if not chunk:
                return  # EOF; a half-written line is dropped quietly
            start = 0
            while True:
                nl = chunk.find(b"\n", start)
                end = len(chunk) if nl < 0 else nl
                if not skipping:
                    buf += chunk[start:end]
                    if len(buf) > protocol.MAX_LINE:
                        buf.clear()
                        skipping = nl < 0
                        self.send_reply(
                            protocol.error_reply(
                                None,
                                protocol.TOO_LARGE,
                                f"a message longer than the {protocol.MAX_LINE}-byte limit was "
                                "discarded; send smaller requests",
                            )
                        )
                    elif nl >= 0:
                        line = bytes(buf)
                        buf.clear()
                        await self._dispatch(line)
                elif nl >= 0:
                    skipping = False
                if nl < 0:
                    break
                start = nl + 1

    async def _dispatch(self, line: bytes) -> None:
        if not line.strip():
            return  # blank lines (e.g. from a person typing into socat) are not requests
        try:
            req = protocol.parse_request(line)
        except ProtocolError as exc:
            self.send_reply(protocol.error_reply(_salvage_id(line), exc.code, str(exc)))
            return
        except RecursionError:  # "[[[[..." nests deeper than json can parse
            self.send_reply(protocol.error_reply(None, protocol.BAD_REQUEST, "not a JSON object: nested too deeply"))
            return
        if req.op == "subscribe":
            self._subscribe(req)
        elif req.op == "unsubscribe":
            self._unsubscribe(req)
        else:
            await self._slots.acquire()
            task = asyncio.create_task(self._run(req))
            self._tasks.add(task)
            task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._slots.release()

    async def _run(self, req: Request) -> None:
        try:
            result = await self._server.handler.handle(req, self)
        except ProtocolError as exc:
            reply = protocol.error_reply(req.id, exc.code, str(exc))
        except Exception as exc:
            self._server.log.error("op %r from pid %s failed", req.op, self.peer_pid, exc_info=True)
            reply = protocol.error_reply(req.id, protocol.INTERNAL, f"{type(exc).__name__}: {exc}")
        else:
            reply = Reply(id=req.id, ok=True, result=result)
        self.send_reply(reply)

    # -- subscriptions --------------------------------------------------------------------

    def _subscribe(self, req: Request) -> None:
        try:
            sub = _parse_subscribe(req)
            if sub.id in self.subscriptions:
                raise ProtocolError(
                    protocol.BAD_REQUEST,
                    f"subscription {sub.id!r} is already active on this connection; use a new request id",
                )
        except ProtocolError as exc:
            self.send_reply(protocol.error_reply(req.id, exc.code, str(exc)))
            return
        # The reply is queued before the first event can be: the client sees it first.
        self.send_reply(Reply(id=req.id, ok=True, result={"sub": req.id}))
        self.subscriptions[sub.id] = sub

    def _unsubscribe(self, req: Request) -> None:
        sub_id = req.args.get("sub")
        if sub_id not in self.subscriptions:
            self.send_reply(
                protocol.error_reply(req.id, protocol.NOT_FOUND, f"no subscription {sub_id!r} on this connection")
            )
            return
        # Events already queued go out before this reply; none follow it.
        del self.subscriptions[sub_id]
        self.send_reply(Reply(id=req.id, ok=True, result={"ok": True}))


def _parse_subscribe(req: Request) -> _Sub:
    args = dict(req.args)
    topics = args.pop("topics", None)
    if isinstance(topics, str):
        topics = [topics]
    if not isinstance(topics, list) or not topics or not all(isinstance(t, str) for t in topics):
        raise ProtocolError(
            protocol.BAD_REQUEST, f"subscribe needs 'topics': a non-empty list of {list(protocol.TOPICS)}"
        )
    unknown = [t for t in topics if t not in protocol.TOPICS]
    if unknown:
        raise ProtocolError(protocol.BAD_REQUEST, f"unknown topic(s) {unknown}; known: {list(protocol.TOPICS)}")
    filters = {}
    for name, kind in (("run", int), ("stage", str), ("rank", int)):
        if name not in args:
            continue
        value = args.pop(name)
        if value is None:
            continue
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ProtocolError(
                protocol.BAD_REQUEST, f"subscribe filter {name!r} must be {kind.__name__}, not {value!r}"
            )
        filters[_FILTER_KEYS[name]] = value
    if args:
        raise ProtocolError(
            protocol.BAD_REQUEST, f"subscribe does not take {sorted(args)}; it takes topics, run, stage, rank"
        )
    return _Sub(req.id, frozenset(topics), filters)


def _salvage_id(line: bytes) -> int | str | None:
    """The id of a request that failed validation, when the line is a JSON object with one."""
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return None
    id_ = obj.get("id") if isinstance(obj, dict) else None
    return id_ if isinstance(id_, (int, str)) and not isinstance(id_, bool) else None
