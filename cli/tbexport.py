"""`eyas metrics RUN --tensorboard DIR`: a run's stored samples written as TensorBoard event files, for runs that had no [tracking] or ran before it, read straight from the store, daemon or not.

The files are the live writer's (daemon/tensorboard.py), sample for sample: the same folder
(`DIR/run-<id>-<name>`), tags and steps (state/tbevents.py), fed the store's rows in the order
they were taken, an attempt at a time. A folder that already holds event files is refused
rather than added to: TensorBoard would draw every sample twice.
"""

from __future__ import annotations

import sys
from pathlib import Path

from eyas.state import tbevents

CHUNK = 5000  # rows handed to the step clock at a time: a long run is never held whole


def export(db, run: dict, args) -> int:
    base = Path(args.tensorboard).expanduser()
    folder = tbevents.run_folder(base, run["id"], run["name"])
    old = sorted(folder.glob("events.out.tfevents.*")) if folder.is_dir() else []
    if old:
        print(
            f"eyas metrics: {folder} already holds TensorBoard events ({len(old)} file{'s' * (len(old) > 1)}); "
            "remove them or choose another --tensorboard folder",
            file=sys.stderr,
        )
        return 2
    clock, out, written = tbevents.StepClock(), None, 0
    chunk: list[dict] = []
    last = None
    try:
        for t, stage, attempt, rank, name, value in tbevents.stored_rows(db, run["id"], args.stage, args.name):
            if len(chunk) >= CHUNK and (stage, attempt, t) != last:  # never cut one record in two
                out = _write(out, folder, clock, chunk)
                written += len(chunk)
                chunk = []
            chunk.append({"time": t, "stage": stage, "attempt": attempt, "rank": rank, "name": name, "value": value})
            last = (stage, attempt, t)
        if chunk:
            out = _write(out, folder, clock, chunk)
            written += len(chunk)
    except OSError as exc:
        print(f"eyas metrics: cannot write TensorBoard events in {folder}: {exc}", file=sys.stderr)
        return 1
    finally:
        if out is not None:
            out.close()
    if out is None:
        where = f" in {args.stage}" if args.stage else ""
        print(f"eyas metrics: run {run['id']} has no recorded metrics{where}: no events written", file=sys.stderr)
        return 0
    print(f"wrote {written:,} samples of run {run['id']} as {out.events:,} TensorBoard events: {out.path}")
    print(f"view them with: tensorboard --logdir {base}")
    return 0


def _write(out: tbevents.EventFile | None, folder: Path, clock: tbevents.StepClock, rows: list[dict]):
    out = out or tbevents.EventFile(folder)
    out.write(clock.events(rows))
    return out
