"""The TUI's connection to the daemon: one AsyncClient, reconnected with backoff, and the
event stream delivered in batches so that redraws happen at a bounded rate.

No Textual here: the app hands in two callbacks. `on_status(LinkStatus)` hears every
connect and disconnect; `on_batch(events)` gets the events gathered over at most one
`batch_interval`, so a flood of metric events costs a few redraws a second, not one each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from eyas.wire.client import AsyncClient, DaemonError, DaemonNotRunning
from eyas.wire.protocol import Event

TOPICS = ("state", "metric")


@dataclass(frozen=True)
class LinkStatus:
    connected: bool
    ever_connected: bool  # False: the daemon was down from the start
    message: str  # why we are disconnected ("" when connected)
    attempts: int  # failed attempts since the last success
    retry_in: float | None
    gpu: bool | None = None  # the daemon's sampler sees GPUs (None when unknown)
    full: str | None = None  # what failed, while the daemon's state directory is full
    busy: str | None = None  # what waits, while another process holds the daemon's database locked


class DaemonLink:
    def __init__(
        self,
        path: Path | Callable[[], Path],
        on_status: Callable[[LinkStatus], None],
        on_batch: Callable[[list[Event]], None],
        *,
        batch_interval: float = 0.25,
        min_backoff: float = 0.25,
        max_backoff: float = 5.0,
        timeout: float = 10.0,
    ):
        # A callable is asked again before each attempt: the daemon may have moved its socket
        # (its runtime directory was removed) since the last connection.
        self._locate = path if callable(path) else None
        self.path = Path(path) if self._locate is None else None
        self.on_status = on_status
        self.on_batch = on_batch
        self.batch_interval = batch_interval
        self.min_backoff, self.max_backoff = min_backoff, max_backoff
        self.timeout = timeout
        self.client: AsyncClient | None = None
        self.status = LinkStatus(False, False, "not connected yet", 0, None)
        self.first_attempt = asyncio.Event()
        self.batches = 0  # flushed so far (tests check the redraw bound with it)
        self._buffer: list[Event] = []
        self._flush_handle: asyncio.TimerHandle | None = None
        self._last_flush = 0.0
        self._wake = asyncio.Event()
        self._closing = False

    @property
    def connected(self) -> bool:
        return self.client is not None and self.client.connected

    async def request(self, op: str, **args: Any) -> Any:
        """One request to the daemon; DaemonNotRunning when it is not connected."""
        if not self.connected:
            raise DaemonNotRunning(
                self.path or "",
                "not connected to the eyas daemon; controls come back when it does (start it with `eyas daemon start`)",
            )
        return await self.client.request(op, **args)

    def retry_now(self) -> None:
        """Cut the current backoff short."""
        self._wake.set()

    async def run(self) -> None:
        """Connect, stream, and on any loss reconnect with exponential backoff; forever."""
        delay = self.min_backoff
        attempts = 0
        ever = False
        while not self._closing:
            client: AsyncClient | None = None
            reason = "the daemon closed the connection"
            try:
                if self._locate is not None:
                    self.path = await asyncio.to_thread(self._locate)  # it probes a socket: not on the loop
                client = AsyncClient(self.path, timeout=self.timeout)
                await client.connect()
                sub = await client.subscribe(list(TOPICS))
                info = await client.request("status")
                self.client = client
                ever, attempts, delay = True, 0, self.min_backoff
                self._set(
                    LinkStatus(
                        True,
                        True,
                        "",
                        0,
                        None,
                        info.get("gpu"),
                        _full_text(info.get("full")),
                        _busy_text(info.get("store_busy")),
                    )
                )
                self.first_attempt.set()
                async for ev in sub:
                    if ev.event == "state" and ev.data.get("entity") == "daemon":
                        self._set(replace(self.status, full=_full_text(ev.data.get("full"))))
                    elif ev.event == "state" and ev.data.get("entity") == "store":
                        self._set(replace(self.status, busy=_busy_text(ev.data.get("busy"))))
                    self._queue(ev)
            except DaemonNotRunning as exc:
                reason = str(exc)
            except (OSError, DaemonError, TimeoutError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
            finally:
                self.client = None
                if client is not None:
                    await client.close()
            if self._closing:
                break
            self._flush()
            attempts += 1
            self._set(LinkStatus(False, ever, reason, attempts, delay))
            self.first_attempt.set()
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except TimeoutError:
                pass
            delay = min(delay * 2, self.max_backoff)

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self.client is not None:
            await self.client.close()

    def _set(self, status: LinkStatus) -> None:
        self.status = status
        self.on_status(status)

    def _queue(self, ev: Event) -> None:
        self._buffer.append(ev)
        if self._flush_handle is None:
            wait = max(0.0, self._last_flush + self.batch_interval - time.monotonic())
            self._flush_handle = asyncio.get_running_loop().call_later(wait, self._flush)

    def _flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if not self._buffer:
            return
        events, self._buffer = self._buffer, []
        self._last_flush = time.monotonic()
        self.batches += 1
        self.on_batch(events)


def _full_text(full: dict | None) -> str | None:
    """The daemon's "state directory full" record (op_status, state events) as its one line."""
    return full.get("what") or "the state directory is full" if isinstance(full, dict) else None


def _busy_text(busy: dict | None) -> str | None:
    """The daemon's "store busy" record (op_status, state events) as its one line."""
    return f"waiting to record {busy['what']}" if isinstance(busy, dict) and busy.get("what") else None
