"""Streams new rank-log lines to subscribed clients.

The ranks write their logs themselves; the daemon only reads them, and only while some
client subscribes to logs, so that a run nobody watches costs the daemon nothing.
"""

from __future__ import annotations

import os

from .protocol import MAX_LOG_CHUNK


class LogTail:
    def __init__(self, groups: dict, publish, wants):
        self.groups = groups          # the core's live groups, by attempt id
        self.publish = publish
        self.wants = wants
        self.offsets: dict[tuple[int, int], int] = {}

    def tick(self) -> None:
        if not self.wants("log"):
            # Nobody is watching: forget positions; a new subscriber starts at the end.
            self.offsets.clear()
            return
        for attempt_id, group in list(self.groups.items()):
            for rank in group.ranks:
                self._pump(attempt_id, group, rank)

    def _pump(self, attempt_id: int, group, rank) -> None:
        key = (attempt_id, rank.rank)
        try:
            size = os.path.getsize(rank.log_path)
        except OSError:
            return
        offset = self.offsets.setdefault(key, size)
        if size < offset:  # truncated or replaced
            offset = 0
        while size > offset:
            with open(rank.log_path, "rb") as f:
                f.seek(offset)
                chunk = f.read(min(size - offset, MAX_LOG_CHUNK))
            end = chunk.rfind(b"\n")
            if end < 0:
                if len(chunk) < MAX_LOG_CHUNK:
                    break  # a line still being written: wait for its end
                end = len(chunk) - 1  # one enormous line: pass it on in pieces
            offset += end + 1
            self.publish("log", {"run_id": group.run_id, "stage": group.stage, "attempt": group.attempt,
                                 "rank": rank.rank, "text": chunk[:end + 1].decode("utf-8", "replace")})
        self.offsets[key] = offset
