"""`eyas submit | stop | retry | skip | resume | stacks`: requests to the daemon."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from eyas.state import preload
from eyas.state import runconfig as run_config
from eyas.wire.client import Client, DaemonError, DaemonNotRunning


def _request(op: str, **args):
    try:
        with Client() as c:
            return c.request(op, **args)
    except DaemonNotRunning as exc:
        print(f"eyas {op}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except DaemonError as exc:
        print(f"eyas {op}: {exc.message}", file=sys.stderr)
        raise SystemExit(2 if exc.code in ("invalid_config", "bad_request") else 1) from None


def submit(args) -> int:
    path = Path(args.config)
    # Validate here first: a mistake is reported even when the daemon is down. Then what can be
    # refused of the target without loading it (weights on disk, TP against its heads and
    # experts: state/preload.py), before the daemon creates anything.
    try:
        cfg = run_config.load(path)
    except run_config.ConfigError as exc:
        print("\n".join(exc.errors), file=sys.stderr)
        return 2
    refused = preload.lines(cfg, str(path))
    if refused:
        print("\n".join(refused), file=sys.stderr)
        return 2
    result = _request("submit", config_path=str(path.absolute()))
    run_id = result["run_id"]
    print(f"run {run_id} submitted: {' → '.join(result['stages'])}")
    if args.follow:
        from .follow import follow

        return follow(run_id)
    return 0


def stop(args) -> int:
    r = _request("stop", run=args.run, **({"stage": args.stage} if args.stage else {}))
    said = f"run {r['run_id']}: {'stopping' if r['stopping'] else 'stopped'} {r['stage'] or ''}".rstrip()
    if r.get("recorded") is False:  # signalled, durable beside the attempt, not in eyas.db yet
        busy, full = r.get("store_busy"), r.get("full")
        if busy:
            held = max(0.0, time.time() - busy["since"])
            why = f"another process has held eyas.db locked for {held:.0f} s, so the stop is recorded once the store is free"
        elif full:
            why = f"the state directory is full ({full['what']}), so the stop is recorded once there is space"
        else:
            why = "the stop is being recorded"
        said += f": its ranks signalled; {why}"
    print(said)
    return 0


def retry(args) -> int:
    r = _request("retry", run=args.run, **({"stage": args.stage} if args.stage else {}))
    print(f"run {r['run_id']}: {r['stage']} will run again as a new attempt")
    return 0


def skip(args) -> int:
    r = _request("skip", run=args.run, stage=args.stage)
    print(f"run {r['run_id']}: {r['stage']} skipped")
    return 0


def resume(args) -> int:
    r = _request("resume", run=args.run)
    again = ", ".join(r["stages"]) or "the remaining stages"
    print(f"run {r['run_id']}: resuming ({again})")
    return 0


def stacks(args) -> int:
    from eyas.wire.stacks import dump_of, render, who

    r = _request("stacks", run=args.run, **({"stage": args.stage} if args.stage else {}))
    asked = [x for x in r["ranks"] if "offset" in x]
    deadline = time.monotonic() + args.wait
    # The daemon waited for the Python dumps before running py-spy; only those missing then
    # are looked for again.
    dumps: dict[int, str] = {x["pid"]: x.get("python") or "" for x in asked}
    # faulthandler dumps from its C signal handler, so even a rank blocked in native code (a
    # collective) answers at once; the wait only covers a machine too loaded to schedule it.
    while True:
        for x in asked:
            dumps[x["pid"]] = dumps[x["pid"]] or dump_of(x)
        if all(dumps.values()) or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    print(f"run {r['run_id']}: {r['stage']} attempt {r['attempt']}")
    for x in r["ranks"]:
        if "skipped" in x:
            print(f"\n{who(x)} (pid {x['pid']}): not dumped: {x['skipped']}")
            continue
        python = dumps.get(x["pid"]) or (
            f"(no Python stacks within {args.wait:g} s; if it writes them later, they are in {x['log_path']})"
        )
        where = f", also in {x['log_path']}" if dumps.get(x["pid"]) else ""
        print(f"\n{who(x)} (pid {x['pid']}){where}:\n{render(x, python)}")
    live = [x for x in r["ranks"] if "skipped" not in x]
    return 0 if live and all(dumps.get(x["pid"]) or x.get("native") for x in live) else 1
