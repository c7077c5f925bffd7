"""`eyas runs`, `eyas show` and `eyas errors`: history read straight from the store.

They work with no daemon: the database is opened read-only through a plain sqlite3
connection (queries.connect), and nothing heavier than json/csv is imported unless a
table is drawn on a terminal.
"""

from __future__ import annotations

import json
import re
import sys
import time

from eyas.state import display, liveness, machine, paths, queries
from eyas.state.display import exit_text

from . import output as out

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SINCE = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")

RUN_COLUMNS = [
    out.Column("id", right=True),
    out.Column("name"),
    out.Column("model"),
    out.Column("state"),
    out.Column("stage"),
    out.Column("started", display.local_minute, display.iso_utc),
    out.Column("duration", display.duration, right=True),
    out.Column("peak_gpu_mem", display.size, right=True),
    out.Column("tok_s", display.count, right=True),
    # The trained draft's mean acceptance length in vLLM (the evaluate stage), blank without one.
    out.Column("accept", lambda v: "" if v is None else f"{v:.2f}", right=True),
]

STAGE_COLUMNS = [
    out.Column("name"),
    out.Column("state"),
    out.Column("attempts", right=True),
    out.Column("restarts", right=True),
    out.Column("started_at", display.local_minute, display.iso_utc),
    out.Column("duration", display.duration, right=True),
    out.Column("peak_gpu_mem", display.size, right=True),
    out.Column("tok_s", display.count, right=True),
]

ERROR_KEYS = [
    "stage",
    "attempt",
    "rank",
    "root_cause",
    "type",
    "message",
    "time",
    "pid",
    "host",
    "source",
    "path",
    "traceback",
    # Which process of a vLLM driver it was: role "tp-worker" with its TP rank (else both null).
    "role",
    "tp_rank",
]


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit 2."""


def parse_since(text: str) -> float:
    """`30m`, `12h`, `7d`... as seconds."""
    m = _SINCE.fullmatch(text.strip())
    if not m:
        raise UsageError(f"--since {text!r}: use a number with s, m, h, d or w, e.g. 7d")
    return float(m.group(1)) * _UNITS[m.group(2)]


def open_store():
    """The read-only connection, or None when nothing has been submitted yet."""
    try:
        return queries.connect(paths.db_path())
    except FileNotFoundError:
        return None


def runs(args) -> int:
    """List runs, newest first."""
    try:
        if args.state and args.state not in machine.RUN_STATES:
            raise UsageError(f"--state {args.state!r}: use one of {', '.join(machine.RUN_STATES)}")
        since = time.time() - parse_since(args.since) if args.since else None
        if args.limit is not None and args.limit < 1:
            raise UsageError(f"--limit {args.limit}: use a positive number")
    except UsageError as exc:
        print(f"eyas runs: {exc}", file=sys.stderr)
        return 2
    db = open_store()
    rows = []
    if db is not None:
        rows = queries.list_runs(db, state=args.state, since=since, limit=args.limit, match=args.match)
        accept = queries.acceptance_lengths(db, [r["id"] for r in rows])
        for r in rows:
            r["accept"] = accept.get(r["id"])
    out.emit(rows, RUN_COLUMNS, args.fmt)
    if not rows and args.fmt in (None, "table"):
        filtered = args.state or args.since or args.match
        print("eyas runs: " + ("no runs match" if db is not None and filtered else "no runs yet"), file=sys.stderr)
    return 0


def _load(run_id: int):
    """(connection, the run's dict), or (None, None) when there is no such run."""
    db = open_store()
    if db is None:
        return None, None
    try:
        return db, queries.get_run(db, run_id)
    except KeyError:
        return None, None


def load_stage_scoped(args, command: str):
    """(connection, run) for a command on `args.run` limited to `args.stage`; (None, None) after
    saying why on stderr when the run, or that stage of it, does not exist."""
    db, run = _load(args.run)
    if run is None:
        print(f"eyas: no run {args.run}", file=sys.stderr)
        return None, None
    names = [s["name"] for s in run["stages"]]
    if args.stage and args.stage not in names:
        print(
            f"eyas {command}: run {args.run} has no stage {args.stage!r} (its stages: {', '.join(names)})",
            file=sys.stderr,
        )
        return None, None
    return db, run


def show(args) -> int:
    """One run: header, stages, failed attempts' root causes, ranks, outputs."""
    _, run = _load(args.run)
    if run is None:
        print(f"eyas: no run {args.run}", file=sys.stderr)
        return 1
    if args.fmt in ("json", "nl"):
        sys.stdout.write(json.dumps(run, indent=2 if args.fmt == "json" else None) + "\n")
    elif args.fmt == "csv":
        out.emit(run["stages"], STAGE_COLUMNS, "csv")
    else:
        sys.stdout.write("".join(line + "\n" for line in show_lines(run)))
        if getattr(args, "plot", False):
            from .plot import show_plot

            return show_plot(run, args)
    return 0


def error_title(err: dict) -> str:
    """`Type: message`, or `Type (empty message)`: an empty message is still an error."""
    message = err.get("message") or ""
    return f"{err['type']}: {message}" if message.strip() else f"{err['type']} (empty message)"


def _outputs(run: dict) -> list[str]:
    """The run's output dir, then every "outputs" entry of the stage summaries."""
    found = [run["output_dir"]] if run.get("output_dir") else []
    for stage in run["stages"]:
        listed = (stage.get("summary") or {}).get("outputs") if isinstance(stage.get("summary"), dict) else None
        if isinstance(listed, str):
            listed = [listed]
        if isinstance(listed, dict):
            found += [f"{stage['name']} {k}: {v}" for k, v in listed.items()]
        elif isinstance(listed, list):
            found += [f"{stage['name']}: {v}" for v in listed]
    return found


def show_lines(run: dict, now: float | None = None) -> list[str]:
    now = time.time() if now is None else now
    quiet_after = liveness.quiet_after()
    reason = run.get("reason")
    current = next((s for s in run["stages"] if s["state"] == "running" and s["attempt_list"]), None)
    if run["state"] == "running" and current is not None:
        # What runs now, from the stage's rows: the run's stored reason is the event that last
        # moved it, stale once a stage runs (as the TUI's Run screen says it too).
        a = current["attempt_list"][-1]
        reason = f"{current['name']} attempt {a['number']} {a['state']}"
    state = run["state"] + (f" ({reason})" if reason else "")
    header = [
        ("model", run["model"]),
        ("state", state),
        ("stage", run["stage"]),
        ("config", run["config_path"]),
        ("output dir", run["output_dir"]),
        ("started", display.local_minute(run["started_at"] or run["created_at"])),
        ("duration", display.duration(run["duration"])),
    ]
    lines = [f"run {run['id']}: {run['name']}"]
    lines += [f"  {k + ':':<12}{out.text(v)}".rstrip() for k, v in header]

    lines += ["", "stages:"]
    cells = [
        [s["name"], s["state"], str(s["attempts"]), display.duration(s["duration"]), display.count(s["tok_s"])]
        for s in run["stages"]
    ]
    lines += out.plain_table(
        ["stage", "state", "attempts", "duration", "tok/s"], cells, [False, False, True, True, True], indent="  "
    )
    # A running attempt whose ranks are quiet or partly exited says so (state/liveness.py).
    for s in run["stages"]:
        a = s["attempt_list"][-1] if s["attempt_list"] else None
        note = liveness.stage_note(a["ranks"], now, quiet_after) if a and a["state"] == "running" else ""
        if note:
            lines.append(f"  {s['name']} attempt {a['number']}: {note}")

    lines += ["  " + line for line in queries.window_lines(run.get("window"))]
    # Where each Slurm attempt ran (a local attempt ran on the daemon's host).
    for s in run["stages"]:
        for a in s["attempt_list"]:
            if a.get("slurm_job"):
                lines.append(
                    f"  {s['name']} attempt {a['number']}: Slurm job {a['slurm_job']} on {a['nodes'] or '(no node yet)'}"
                )

    failures = []
    for s in run["stages"]:
        for a in s["attempt_list"]:
            if a["state"] != "failed":
                continue
            failures.append(f"  {s['name']} attempt {a['number']}" + _failure(a))
            tb = (a["root_cause"] or {}).get("traceback") or ""
            tb_lines = [ln for ln in tb.splitlines() if ln.strip()]
            if tb_lines:
                failures.append("    " + tb_lines[0])
                if len(tb_lines) > 2:
                    failures.append("    ...")
                if len(tb_lines) > 1:
                    failures.append("    " + tb_lines[-1])
    if failures:
        lines += ["", "failures:"] + failures
    lines += evaluate_lines(run)

    cells = []
    # How long since each rank of a running attempt last wrote, where the daemon recorded it
    # (older daemons did not); an ended attempt's ages would only say how old the run is.
    wrote = any(
        r.get("last_write") is not None
        for s in run["stages"]
        if s["attempt_list"] and s["attempt_list"][-1]["state"] == "running"
        for r in s["attempt_list"][-1]["ranks"]
    )
    for s in run["stages"]:
        if not s["attempt_list"]:
            continue
        latest = s["attempt_list"][-1]
        for r in latest["ranks"]:
            idle = liveness.idle(r, now) if latest["state"] == "running" else None
            quiet = " (quiet)" if liveness.is_quiet(r, now, quiet_after) else ""
            cells.append(
                [
                    s["name"],
                    str(latest["number"]),
                    str(r["rank"]),
                    out.text(r["pid"]),
                    out.text(r["state"]),
                    exit_text(r),
                    display.size(r["peak_gpu_mem"]),
                    display.count(r["tok_s"]),
                ]
                + ([display.duration(idle) + quiet] if wrote else [])
            )
    if cells:
        lines += ["", "ranks (latest attempt of each stage):"]
        lines += out.plain_table(
            ["stage", "attempt", "rank", "pid", "state", "exit", "peak_gpu_mem", "tok/s"]
            + (["last write"] if wrote else []),
            cells,
            [False, True, True, True, False, False, True, True] + ([True] if wrote else []),
            indent="  ",
        )

    outputs = _outputs(run)
    if outputs:
        lines += ["", "outputs:"] + [f"  {p}" for p in outputs]
    return lines


def _rates(values) -> str:
    return "/".join(f"{v:.2f}" for v in values) if isinstance(values, list) else ""


def _num(value, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) and not isinstance(value, bool) else ""


def _interval(lo, hi) -> str:
    """`[1.252, 1.617]`; empty without one (older summaries, a vLLM with no per-request counts)."""
    return f"[{_num(lo, '.3f')}, {_num(hi, '.3f')}]" if _num(lo, ".3f") and _num(hi, ".3f") else ""


def evaluate_lines(run: dict) -> list[str]:
    """The evaluate stage's figures: the trained draft beside its untrained baseline and the
    target alone; nothing when the run has no evaluate summary."""
    stage = next((s for s in run["stages"] if s["name"] == "evaluate"), None)
    s = stage.get("summary") if stage else None
    if not isinstance(s, dict) or "acceptance_length" not in s:
        return []
    head = (
        f"evaluate (k={s.get('num_speculative_tokens')}, {s.get('prompts')} prompts from the "
        f"{s.get('prompt_source')}, up to {s.get('max_tokens')} tokens, vLLM {s.get('vllm_version')} "
        f"on {s.get('device')}, tensor parallel {s.get('tensor_parallel_size')}):"
    )
    cells = [
        [
            "trained",
            _num(s["acceptance_length"], ".3f"),
            _interval(s.get("acceptance_length_lo"), s.get("acceptance_length_hi")),
            _num(s.get("acceptance_rate"), ".1%"),
            _rates(s.get("per_position")),
            _num(s.get("draft_tok_s"), ",.0f"),
        ],
        [
            "untrained",
            _num(s.get("baseline_acceptance_length"), ".3f"),
            _interval(s.get("baseline_acceptance_length_lo"), s.get("baseline_acceptance_length_hi")),
            _num(s.get("baseline_acceptance_rate"), ".1%"),
            _rates(s.get("baseline_per_position")),
            _num(s.get("baseline_tok_s"), ",.0f"),
        ],
        ["no draft", "", "", "", "", _num(s.get("target_tok_s"), ",.0f")],
    ]
    headers = ["draft", "accept len", "95 % interval", "accept rate", "per position", "tok/s"]
    right = [False, True, False, True, False, True]
    if not any(row[2] for row in cells):  # a summary from before the intervals
        cells, headers, right = ([c[:2] + c[3:] for c in cells], headers[:2] + headers[3:], right[:2] + right[3:])
    lines = ["", head]
    lines += out.plain_table(headers, cells, right, indent="  ")
    if isinstance(s.get("gain"), (int, float)):
        how = s.get("interval") or {}
        units = f"{how.get('units')} {how.get('unit')}s" if how.get("units") is not None else "the prompts"
        spread = _interval(s.get("gain_lo"), s.get("gain_hi"))
        gate = {
            "passed": f"quality gate passed (evaluate.min_gain = {_num(s.get('min_gain'), 'g')})",
            "failed": f"quality gate FAILED: below evaluate.min_gain = {_num(s.get('min_gain'), 'g')}",
            "off": "quality gate off (evaluate.min_gain = 0)",
        }.get(s.get("gate"), "")
        lines.append(
            f"  gain {_num(s['gain'], '.3f')}{' ' + spread if spread else ''} over the untrained draft "
            f"({round(100 * how.get('level', 0.95))} % paired bootstrap over {units}, "
            f"{s.get('answer_tokens')} answer tokens)" + (f"; {gate}" if gate else "")
        )
    differ = s.get("mismatched_prompts") or 0
    lines.append(
        f"  speedup x{_num(s.get('speedup'), '.2f')}; lossless: "
        + ("yes" if s.get("lossless") else f"NO, {differ} outputs differ from the target's")
        + " (greedy outputs with each draft vs without)"
    )
    return lines


def _failure(attempt: dict) -> str:
    err = attempt["root_cause"]
    if err is None:
        return ": no error recorded" + (f" ({attempt['reason']})" if attempt.get("reason") else "")
    first = error_title(err).splitlines()[0]
    return f", {display.rank_label(err)}: {first}"


def errors(args) -> int:
    """A run's errors, latest attempt first, its root cause first and marked."""
    db, run = load_stage_scoped(args, "errors")
    if run is None:
        return 1
    rows = queries.errors(db, args.run, args.stage)
    if args.fmt in ("json", "csv", "nl"):
        raw = [{k: (display.iso_utc(e[k]) if k == "time" else e[k]) for k in ERROR_KEYS} for e in rows]
        out.emit_raw(raw, ERROR_KEYS, args.fmt, sys.stdout)
        return 0
    if not rows:
        where = f" in {args.stage}" if args.stage else ""
        print(f"eyas errors: run {args.run} has no recorded errors{where}", file=sys.stderr)
        return 0
    sys.stdout.write("".join(line + "\n" for line in error_lines(rows)))
    return 0


def error_lines(rows: list[dict]) -> list[str]:
    lines: list[str] = []
    group = None
    for e in rows:
        if (e["stage"], e["attempt"]) != group:
            group = (e["stage"], e["attempt"])
            job = f" (Slurm job {e['slurm_job']})" if e.get("slurm_job") else ""
            lines += ([""] if lines else []) + [f"{e['stage']} attempt {e['attempt']}{job}:"]
        where = [display.rank_label(e)]
        where += [f"pid {e['pid']}"] if e["pid"] is not None else []
        where += [f"on {e['host']}"] if e["host"] else []
        where += [display.local_second(e["time"])]
        where += [f"from {e['source']}"] if e["source"] else []
        mark = "* root cause: " if e["root_cause"] else "  "
        lines.append(f"{mark}{', '.join(where)}")
        title = error_title(e).splitlines() or [""]
        lines += [f"    {ln}" for ln in title]
        lines += [f"      {ln}".rstrip() for ln in (e["traceback"] or "").splitlines()]
        if e["path"]:
            lines.append(f"    error file: {e['path']}")
    return lines
