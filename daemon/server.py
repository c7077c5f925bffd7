"""The daemon's socket server: a 0600 unix socket that it keeps bound (rebinding a socket file someone removed), the connections (daemon/connection.py), and the event bus."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import stat
import struct
from pathlib import Path

from eyas.wire import protocol

from .connection import Connection, Handler

# When close() is called, queued output gets this long to reach the clients.
CLOSE_FLUSH_S = 1.0


class DaemonAlreadyRunning(RuntimeError):
    """A live daemon already answers on the socket path."""

    def __init__(self, path: Path, pid: int | None = None):
        who = f" (pid {pid})" if pid else ""
        super().__init__(f"an eyas daemon is already running{who} on {path}; stop it with `eyas daemon stop`")
        self.path = path
        self.pid = pid


class Server:
    """Serve `handler` on the unix socket `path`; publish events to subscribers."""

    def __init__(
        self, path: Path, handler: Handler, log: logging.Logger | None = None, max_queue_bytes: int = 64 << 20
    ):
        self.path = Path(path)
        self.handler = handler
        self.log = log or logging.getLogger("eyas.daemon.server")
        self.max_queue_bytes = max_queue_bytes
        self._conns: dict[Connection, tuple[asyncio.Task, asyncio.Task]] = {}
        self._server: asyncio.AbstractServer | None = None
        self._inode: tuple[int, int] | None = None

    @property
    def connections(self) -> list[Connection]:
        return list(self._conns)

    async def start(self) -> None:
        """Bind the socket (0600 from the first instant), replacing a stale one, and serve."""
        self._server = await self._listen(self.path)
        self.log.debug("listening on %s", self.path)

    async def _listen(self, path: Path) -> asyncio.AbstractServer:
        self._clear_stale(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old = os.umask(0o177)  # the socket is born 0600: no window with looser permissions
            try:
                sock.bind(str(path))
            finally:
                os.umask(old)
            os.chmod(path, 0o600)
            st = os.stat(path)
            server = await asyncio.start_unix_server(self._accept, sock=sock, backlog=128)
        except BaseException:
            sock.close()
            raise
        self.path, self._inode = Path(path), (st.st_dev, st.st_ino)
        return server

    def lost(self) -> str | None:
        """Why the socket path no longer reaches us ("is gone", "was replaced"), or None.

        One lstat: cheap enough to ask every second. A removed directory takes the socket
        file with it; the listening socket lives on, unreachable by any path.
        """
        if self._server is None:
            return None
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return "is gone"
        except OSError as exc:
            return f"cannot be checked ({exc})"
        return None if (st.st_dev, st.st_ino) == self._inode else "was replaced"

    async def rebind(self, path: Path) -> None:
        """Serve on `path` from now on; connections already open are kept."""
        old = self._server
        self._server = await self._listen(path)
        if old is not None:
            old.close()  # the unreachable listener; asyncio leaves accepted connections open

    def _clear_stale(self, path: Path) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(f"{path} exists and is not a socket; remove it, then start the daemon again")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(2.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            self.log.info("removing stale socket %s", path)
            path.unlink(missing_ok=True)
            return
        except (TimeoutError, BlockingIOError):
            raise DaemonAlreadyRunning(path) from None  # alive but its backlog is full
        else:
            pid, _, _ = struct.unpack(
                "3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            )
            raise DaemonAlreadyRunning(path, pid)
        finally:
            probe.close()

    async def close(self) -> None:
        """Stop accepting, give queued output a moment to leave, close every connection, unlink.

        In-flight requests are cancelled. A handler that wants its own reply delivered (e.g.
        "shutdown") returns first and lets close() run after it (loop.call_soon, an Event).
        """
        if self._server is not None:
            self._server.close()
            self._server = None
            self._unlink()
        me = asyncio.current_task()
        for conn, (reader, _) in list(self._conns.items()):
            reader.cancel()
            for t in list(conn._tasks):
                if t is not me:  # close() called from inside a handler must not cancel itself
                    t.cancel()
            conn._closing = True
            conn._wake.set()
        writers = [w for _, w in self._conns.values()]
        if writers:
            _, pending = await asyncio.wait(writers, timeout=CLOSE_FLUSH_S)
            for w in pending:
                w.cancel()
        for conn in list(self._conns):
            conn._writer.close()
        self._conns.clear()

    def _unlink(self) -> None:
        # Only our own socket: a newer daemon may have replaced a file we think is ours.
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._inode:
            self.path.unlink(missing_ok=True)

    def publish(self, topic: str, data: dict) -> None:
        """Queue an event for every matching subscription. Never blocks; loop thread only."""
        if topic not in protocol.TOPICS:
            raise ValueError(f"unknown event topic {topic!r}; known: {protocol.TOPICS}")
        body: str | None = None
        for conn in self._conns:
            for sub in conn.subscriptions.values():
                if not sub.matches(topic, data):
                    continue
                if body is None:  # encode the data once, however many subscribers
                    body = json.dumps(data, separators=(",", ":"), default=str)
                line = f'{{"v":{protocol.VERSION},"sub":{json.dumps(sub.id)},"event":"{topic}","data":{body}}}\n'
                conn._publish(sub, line.encode())

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            pid, uid, gid = struct.unpack(
                "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            )
        except OSError:
            writer.close()
            return
        if uid != os.getuid():
            self.log.warning("refused a connection from pid %s uid %s", pid, uid)
            reply = protocol.error_reply(
                None,
                protocol.FORBIDDEN,
                f"eyas daemon: uid {uid} may not use this daemon; it belongs to uid {os.getuid()}",
            )
            try:
                writer.write(reply.encode())
                await asyncio.wait_for(writer.drain(), 5)
            except (ConnectionError, OSError, TimeoutError):
                pass
            writer.close()
            return
        conn = Connection(self, reader, writer, pid, uid, gid)
        self.log.debug("connection %s opened by pid %s", conn.id, pid)
        write_task = asyncio.create_task(conn._write_loop())
        read_task = asyncio.current_task()
        self._conns[conn] = (read_task, write_task)
        try:
            await conn._read_loop()
            # EOF: finish what was asked (`echo req | socat` half-closes, then reads), but
            # stream no more events.
            conn.subscriptions.clear()
            if conn._tasks:
                await asyncio.wait(list(conn._tasks))
        except (ConnectionError, OSError):
            pass  # reset by the peer
        except asyncio.CancelledError:
            return  # close() takes over
        finally:
            conn.subscriptions.clear()
        conn._closing = True
        conn._wake.set()
        try:
            await write_task
        except asyncio.CancelledError:
            return
        self._conns.pop(conn, None)
        conn.closed = True
        self.log.debug("connection %s (pid %s) closed", conn.id, pid)
