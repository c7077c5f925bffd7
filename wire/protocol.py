"""The daemon's wire protocol: JSON lines over a unix socket.

Every line is one JSON object. A client sends requests; the daemon answers each with one
reply carrying the same id, and streams events for subscriptions:

    request  {"v": 1, "id": 7, "op": "submit", "args": {...}}
    reply    {"v": 1, "id": 7, "ok": true, "result": {...}}
    error    {"v": 1, "id": 7, "ok": false, "error": {"code": "...", "message": "..."}}
    event    {"v": 1, "sub": 9, "event": "log", "data": {...}}

A subscription is a request with op "subscribe"; its events carry the request's id as
"sub" until the client sends "unsubscribe" or goes away.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

VERSION = 1
# A request line longer than this is refused with "too_large" and the rest of the line
# discarded; log chunks in events are cut well below it.
MAX_LINE = 1 << 20
MAX_LOG_CHUNK = 256 * 1024

OPS = {
    "ping": "liveness check; returns the daemon's pid and version",
    "status": "daemon pid, uptime, socket, database and active runs",
    "submit": "validate a run config (args: config_path) and queue the run; returns run_id",
    "stop": "cancel a run or one stage (args: run, stage?)",
    "retry": "new attempt of a failed or cancelled stage (args: run, stage?)",
    "skip": "skip a stage (args: run, stage)",
    "resume": "continue a failed or cancelled run from its first unfinished stage (args: run)",
    "stacks": "live ranks of the running stage write their Python stacks to their logs (args: run, stage?)",
    "subscribe": "stream events (args: topics [state, log, metric], run?, stage?, rank?)",
    "unsubscribe": "end a subscription (args: sub)",
    "shutdown": "stop the daemon gracefully (args: grace?)",
}
TOPICS = ("state", "log", "metric")

# Error codes a reply may carry.
BAD_REQUEST = "bad_request"
UNKNOWN_OP = "unknown_op"
TOO_LARGE = "too_large"
VERSION_MISMATCH = "version"
FORBIDDEN = "forbidden"
NOT_FOUND = "not_found"
ILLEGAL = "illegal_transition"
INVALID_CONFIG = "invalid_config"
INTERNAL = "internal"
STATE_FULL = "state_full"  # the state directory is full: nothing was done, try again later
STORE_BUSY = "store_busy"  # another process holds the database locked: nothing was done, try again


class ProtocolError(ValueError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Request:
    id: int | str
    op: str
    args: dict[str, Any] = field(default_factory=dict)
    v: int = VERSION

    def encode(self) -> bytes:
        return encode(asdict(self))


@dataclass(frozen=True)
class Reply:
    id: int | str | None
    ok: bool
    result: Any = None
    error: dict[str, str] | None = None
    v: int = VERSION

    def encode(self) -> bytes:
        body = {"v": self.v, "id": self.id, "ok": self.ok}
        body["result" if self.ok else "error"] = self.result if self.ok else self.error
        return encode(body)


@dataclass(frozen=True)
class Event:
    sub: int | str
    event: str
    data: dict[str, Any]
    v: int = VERSION

    def encode(self) -> bytes:
        return encode(asdict(self))


def encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), default=str).encode() + b"\n"


def error_reply(id_: Any, code: str, message: str) -> Reply:
    return Reply(id=id_, ok=False, error={"code": code, "message": message})


def parse_request(line: bytes) -> Request:
    """Decode one request line, or raise ProtocolError naming what is wrong with it."""
    if len(line) > MAX_LINE:
        raise ProtocolError(TOO_LARGE, f"message of {len(line)} bytes exceeds the {MAX_LINE}-byte limit")
    try:
        obj = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(BAD_REQUEST, f"not a JSON object: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(BAD_REQUEST, "a request must be a JSON object")
    if obj.get("v") != VERSION:
        raise ProtocolError(
            VERSION_MISMATCH, f"protocol version {obj.get('v')!r} is not supported (this daemon speaks {VERSION})"
        )
    if "id" not in obj or not isinstance(obj["id"], (int, str)) or isinstance(obj["id"], bool):
        raise ProtocolError(BAD_REQUEST, "a request needs an integer or string 'id'")
    op = obj.get("op")
    if op not in OPS:
        raise ProtocolError(UNKNOWN_OP, f"unknown op {op!r}; known: {', '.join(sorted(OPS))}")
    args = obj.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError(BAD_REQUEST, "'args' must be a JSON object")
    return Request(id=obj["id"], op=op, args=args)


def parse_message(line: bytes) -> Reply | Event:
    """Decode one line from the daemon (client side)."""
    obj = json.loads(line)
    if "event" in obj:
        return Event(sub=obj["sub"], event=obj["event"], data=obj.get("data") or {}, v=obj.get("v", VERSION))
    return Reply(
        id=obj.get("id"),
        ok=bool(obj.get("ok")),
        result=obj.get("result"),
        error=obj.get("error"),
        v=obj.get("v", VERSION),
    )
