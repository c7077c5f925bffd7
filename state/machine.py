"""The legal states and transitions of runs, stages and attempts.

One table here, so that the store, the daemon and the CLI refuse the same things with
the same words.
"""

from __future__ import annotations

RUN_STATES = ("pending", "running", "succeeded", "failed", "cancelled")
TERMINAL = frozenset({"succeeded", "failed", "cancelled", "skipped"})

_STAGE_MOVES = {
    "pending": {"running", "skipped", "cancelled"},
    "running": {"succeeded", "failed", "cancelled"},
    "failed": {"pending", "skipped"},
    "cancelled": {"pending", "skipped"},
    "skipped": {"pending"},
    "succeeded": set(),
}
_RUN_MOVES = {
    "pending": {"running", "cancelled", "failed"},
    "running": {"succeeded", "failed", "cancelled", "pending"},
    "failed": {"pending"},
    "cancelled": {"pending"},
    "succeeded": set(),
}
_ATTEMPT_MOVES = {
    "running": {"succeeded", "failed", "cancelled"},
    "succeeded": set(),
    "failed": set(),
    "cancelled": set(),
}
_TABLES = {"stage": _STAGE_MOVES, "run": _RUN_MOVES, "attempt": _ATTEMPT_MOVES}


class IllegalTransition(ValueError):
    """A state change that the state machine refuses; the message says why and what is legal."""


def check(kind: str, current: str, new: str, what: str = "") -> None:
    """Raise IllegalTransition unless `kind` may move from `current` to `new`; `what`
    names the thing in the message ("stage train of run 3")."""
    moves = _TABLES[kind]
    if new not in moves.get(current, ()):
        legal = ", ".join(sorted(moves.get(current, ()))) or "none: it is final"
        label = what or kind
        raise IllegalTransition(f"{label} is {current}; it cannot become {new} (from {current}: {legal})")


def allowed(kind: str, current: str, new: str) -> bool:
    return new in _TABLES[kind].get(current, ())
