"""One check of `eyas doctor`, and the report they make: a table for people, JSON for tools.

Stdlib only. Every warn and fail carries a one-line fix; a check without one is a bug here,
so `Check` refuses it at construction.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

PASS, WARN, FAIL = "pass", "warn", "fail"
VERDICTS = (PASS, WARN, FAIL)


@dataclass(frozen=True)
class Check:
    group: str  # versions, target, layer ids, adapter, tokenizer, resources, config
    name: str  # what was checked, e.g. "transformers", "embedding", "disk"
    verdict: str  # pass | warn | fail
    detail: str  # one line: what was found
    fix: str = ""  # one line: what to do (required for warn and fail)
    data: dict[str, Any] = field(default_factory=dict)  # figures for --json and the tests

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r}: use one of {', '.join(VERDICTS)}")
        if self.verdict != PASS and not self.fix:
            raise ValueError(f"check {self.group}/{self.name} is {self.verdict} without a fix")

    @property
    def label(self) -> str:
        return f"{self.group}: {self.name}" if self.name and self.name != self.group else self.group


def human_bytes(n: float) -> str:
    """Bytes in decimal units, as disks and GPU specs are sold: 595.00 GB, 1.00 MB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def passed(group: str, name: str, detail: str, **data: Any) -> Check:
    return Check(group, name, PASS, detail, "", data)


def warned(group: str, name: str, detail: str, fix: str, **data: Any) -> Check:
    return Check(group, name, WARN, detail, fix, data)


def failed(group: str, name: str, detail: str, fix: str, **data: Any) -> Check:
    return Check(group, name, FAIL, detail, fix, data)


def overall(checks: list[Check]) -> str:
    verdicts = {c.verdict for c in checks}
    return FAIL if FAIL in verdicts else WARN if WARN in verdicts else PASS


def exit_code(checks: list[Check]) -> int:
    """0 when nothing failed (warnings allowed), 1 when any check failed."""
    return 1 if overall(checks) == FAIL else 0


def table(checks: list[Check]) -> list[str]:
    """The report as text lines: verdict, check, what was found; a fix line under each warn and fail.

    Hand-formatted rather than a rich Table: the same lines go to a terminal, a rank log and
    the tests, and must not wrap or change with the terminal's width.
    """
    width = max((len(c.label) for c in checks), default=0)
    lines = []
    for c in checks:
        lines.append(f"{c.verdict.upper():4}  {c.label.ljust(width)}  {c.detail}")
        if c.fix:
            lines.append(f"{'':4}  {''.ljust(width)}  fix: {c.fix}")
    counts = {v: sum(c.verdict == v for c in checks) for v in VERDICTS}
    lines.append(f"{overall(checks)}: {counts[PASS]} passed, {counts[WARN]} warned, {counts[FAIL]} failed")
    return lines


def as_json(checks: list[Check], **extra: Any) -> dict[str, Any]:
    return {**extra, "verdict": overall(checks), "checks": [asdict(c) for c in checks]}


def dumps(checks: list[Check], **extra: Any) -> str:
    return json.dumps(as_json(checks, **extra), indent=2, default=str)


def failures_line(checks: list[Check]) -> str:
    """One line naming every failed check and its fix: the preflight stage's error message."""
    bad = [c for c in checks if c.verdict == FAIL]
    parts = [f"{c.label}: {c.detail} (fix: {c.fix})" for c in bad]
    return f"preflight: {len(bad)} check{'s' if len(bad) != 1 else ''} failed: " + "; ".join(parts)
