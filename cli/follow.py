"""`eyas submit --follow` and the demo: live progress of one run until it ends."""

from __future__ import annotations

import threading

from eyas.state import paths, queries
from eyas.state.display import duration as human_duration
from eyas.wire.client import Client

TERMINAL_RUN = ("succeeded", "failed", "cancelled")


def _snapshot(run_id: int) -> dict:
    db = queries.connect(paths.db_path())
    try:
        return queries.get_run(db, run_id)
    finally:
        db.close()


def follow(run_id: int, console=None) -> int:
    """Show stage bars, tok/s and loss until the run ends; 0 if it succeeded."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console()
    progress = Progress(
        TextColumn("{task.description:<10}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
    )
    tasks: dict[str, int] = {}
    shown: dict[str, dict] = {}  # the latest loss, accuracy and validation loss of each stage
    client = Client(timeout=None)
    events = client.subscribe(["state", "metric"], run=run_id)
    run = _snapshot(run_id)
    for s in run["stages"]:
        done = s["state"] in ("succeeded", "skipped")
        tasks[s["name"]] = progress.add_task(s["name"], total=1.0, completed=1.0 if done else 0.0, info=s["state"])
    final = run["state"] if run["state"] in TERMINAL_RUN else None
    stop = threading.Event()
    try:
        with progress:
            for ev in [] if final else events:
                d = ev.data
                if ev.event == "state":
                    if d.get("entity") == "stage" and d.get("stage") in tasks:
                        done = d["to_state"] in ("succeeded", "skipped")
                        progress.update(tasks[d["stage"]], info=d["to_state"], **({"completed": 1.0} if done else {}))
                    elif (
                        d.get("entity") == "rank"
                        and "killed" in (d.get("reason") or "")
                        or d.get("entity") == "stage"
                        and d.get("to_state") == "failed"
                    ):
                        progress.console.print(f"[red]{d.get('stage')}: {d.get('reason')}[/red]")
                    if d.get("entity") == "run" and d.get("to_state") in TERMINAL_RUN:
                        final = d["to_state"]
                        break
                elif ev.event == "metric" and d.get("stage") in tasks:
                    live = d.get("live") or {}
                    bits = []
                    if live.get("tok_s"):
                        bits.append(f"{live['tok_s']:,.0f} tok/s")
                    latest = {s["name"]: s["value"] for s in d.get("samples", [])}
                    if "loss" in latest:
                        shown[d["stage"]] = {
                            **shown.get(d["stage"], {}),
                            "loss": latest["loss"],
                            "acc": latest.get("acc_0"),
                        }
                    if "val_loss" in latest:
                        shown[d["stage"]] = {**shown.get(d["stage"], {}), "val": latest["val_loss"]}
                    for key in ("accept_len", "baseline_accept_len"):
                        if key in latest:
                            shown[d["stage"]] = {**shown.get(d["stage"], {}), key: latest[key]}
                    for key, label in (
                        ("loss", "loss {:.4f}"),
                        ("acc", "acc₀ {:.2f}"),
                        ("val", "val {:.4f}"),
                        ("accept_len", "accept {:.2f}"),
                        ("baseline_accept_len", "untrained {:.2f}"),
                    ):
                        value = shown.get(d["stage"], {}).get(key)
                        if value is not None:
                            bits.append(label.format(value))
                    if live.get("eta_s") is not None:
                        bits.append(f"ETA {human_duration(live['eta_s'])}")
                    progress.update(
                        tasks[d["stage"]],
                        completed=float(live.get("progress") or 0.0),
                        info="running " + " · ".join(bits),
                    )
    except KeyboardInterrupt:
        stop.set()
        raise
    finally:
        client.close()
    run = _snapshot(run_id)
    summary(run, console)
    return 0 if run["state"] == "succeeded" else 1


def summary(run: dict, console) -> None:
    """The run's table (one row per stage: state, attempts, duration, tok/s, what it made), its
    root causes, and each stage's output paths."""
    from rich.table import Table

    table = Table(title=f"run {run['id']} {run['name']}: {run['state']}")
    for col in ("stage", "state", "attempts", "duration", "tok/s", "result"):
        table.add_column(col)
    for s in run["stages"]:
        table.add_row(
            s["name"],
            s["state"],
            str(s["attempts"]),
            human_duration(s["duration"]),
            f"{s['tok_s']:,.0f}" if s["tok_s"] else "",
            result(s["name"], s.get("summary")),
        )
    console.print(table)
    for s in run["stages"]:
        for a in s["attempt_list"]:
            rc = a["root_cause"]
            if rc and a is s["attempt_list"][-1]:
                console.print(
                    f"[red]{s['name']} attempt {a['number']}: rank {rc['rank']} {rc['type']}"
                    f"{': ' + rc['message'] if rc['message'] else ''}[/red]"
                )
    for s in run["stages"]:
        outputs = (s.get("summary") or {}).get("outputs") or []
        if outputs:
            console.print(f"{s['name']:<8} -> {', '.join(outputs)}", highlight=False, soft_wrap=True)
    if run.get("output_dir"):
        console.print(f"outputs: {run['output_dir']}", highlight=False, soft_wrap=True)


def _num(value, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "?"


def result(stage: str, s: dict | None) -> str:
    """One line of what a stage made, from its summary.json (known stages; else nothing)."""
    if not s:
        return ""
    if stage == "prepare" and "rows_out" in s:
        return f"{s['rows_out']} rows, {s.get('tokens', 0):,} tokens, {s.get('skipped_total', 0)} skipped"
    if stage == "extract" and "samples" in s:
        return f"{s['samples']} samples, layers {s.get('layer_ids')}"
    if stage == "vocab" and "draft_vocab_size" in s:
        return (
            f"{s['draft_vocab_size']} of {s.get('target_vocab_size')} tokens, coverage {_num(s.get('coverage'), '.0%')}"
        )
    if stage == "train" and "val_loss" in s:
        accs = "/".join(_num(s[f"val_acc_{k}"], ".2f") for k in range(16) if f"val_acc_{k}" in s)
        return (
            f"loss {_num(s.get('loss'), '.4f')}, val {_num(s.get('val_loss'), '.4f')} "
            f"(from {_num(s.get('val_loss_initial'), '.4f')}), val acc {accs}"
        )
    if stage == "evaluate" and "acceptance_length" in s:
        rates = "/".join(_num(r, ".2f") for r in s.get("per_position") or [])
        base = _num(s.get("baseline_acceptance_length"), ".2f")
        return (
            f"accept {_num(s['acceptance_length'], '.2f')} (untrained {base}), per position {rates}, "
            f"{_num(s.get('draft_tok_s'), ',.0f')} tok/s with the draft, {_num(s.get('target_tok_s'), ',.0f')} "
            f"without, {'lossless' if s.get('lossless') else 'NOT lossless'}"
        )
    return ""
