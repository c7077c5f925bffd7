"""Streams new rank-log lines to subscribed clients.

The ranks write their logs themselves; the daemon only reads them, and only while some
client subscribes to logs, so that a run nobody watches costs the daemon nothing. A log cut
at its bound (state/logcut.py) is followed on from the cut: subscribers get the marker line,
then what follows it.
"""

from __future__ import annotations

from eyas.state.logcut import Tail
from eyas.wire.protocol import MAX_LOG_CHUNK


class LogTail:
    def __init__(self, groups: dict, publish, wants):
        self.groups = groups  # the core's live groups, by attempt id
        self.publish = publish
        self.wants = wants
        self.tails: dict[tuple[int, int], Tail] = {}

    def tick(self) -> None:
        if not self.wants("log"):
            # Nobody is watching: forget positions; a new subscriber starts at the end.
            self._forget(list(self.tails))
            return
        for attempt_id, group in list(self.groups.items()):
            for rank in group.ranks:
                self._pump(attempt_id, group, rank)
        self._forget([key for key in self.tails if key[0] not in self.groups])

    def _forget(self, keys) -> None:
        for key in keys:
            self.tails.pop(key).close()

    def _pump(self, attempt_id: int, group, rank) -> None:
        key = (attempt_id, rank.rank)
        tail = self.tails.get(key)
        if tail is None:
            tail = self.tails[key] = Tail(rank.log_path, offset=None)
        while chunk := tail.read(limit=MAX_LOG_CHUNK):
            self.publish(
                "log",
                {
                    "run_id": group.run_id,
                    "stage": group.stage,
                    "attempt": group.attempt,
                    "rank": rank.rank,
                    "text": chunk.decode("utf-8", "replace"),
                },
            )
