"""The Ranks screen: one row per rank of a stage's latest attempt, the processes under each
live rank (vLLM's TP workers) as sub-rows, with GPU memory, sparklines, CPU, RSS and how long
since each rank last wrote (quiet ranks and partly exited stages marked: state/liveness.py)."""

from __future__ import annotations

import json

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Static

from eyas.state import contract, display, liveness

from .. import format as fmt
from ..history import attempt_dir
from ..live import WINDOW_S, Changes
from ..procs import ProcWatch
from .base import EyasScreen

SERIES = ("gpu_mem_bytes", "tok_s", "cpu_percent", "rss_bytes")


class RanksScreen(EyasScreen):
    DEFAULT_CSS = """
    RanksScreen #head { height: auto; padding: 0 1; }
    RanksScreen #nogpu { height: 1; padding: 0 1; color: $warning; display: none; }
    RanksScreen #nogpu.shown { display: block; }
    RanksScreen DataTable { height: 1fr; }
    """
    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("l", "logs", "Logs of rank"),
        Binding("e", "errors", "Errors"),
    ]

    def __init__(self, run_id: int, stage: str) -> None:
        super().__init__()
        self.run_id, self.stage_name = run_id, stage
        self.attempt: dict | None = None
        self._layout: tuple[bool, bool] | None = None
        self.series: dict[tuple[int, str], list[tuple[float, float]]] = {}
        self.kids: dict[int, list[dict]] = {}
        self.procs = ProcWatch()

    def title_text(self) -> str:
        return f"run {self.run_id} › {self.stage_name} › ranks"

    def compose_body(self) -> ComposeResult:
        yield Static("", id="head")
        yield Static("no GPUs: CPU figures only", id="nogpu")
        yield DataTable(id="ranks", cursor_type="row")

    def on_resize(self) -> None:
        self._fill()

    def on_mount(self) -> None:
        self.reload()
        self.set_interval(1.0, self._sample_children)
        self.set_interval(5.0, self._poll_history)
        self.query_one(DataTable).focus()

    # -- data ---------------------------------------------------------------------------------

    def reload(self) -> None:
        run = self.app.history.run(self.run_id)
        stage = next((s for s in run["stages"] if s["name"] == self.stage_name), None) if run else None
        self.attempt = stage["attempt_list"][-1] if stage and stage["attempt_list"] else None
        if self.attempt is None:
            head = self.query_one("#head", Static)
            head.update(f"Stage {self.stage_name} of run {self.run_id} has not started: no ranks yet.")
            self.query_one(DataTable).clear(columns=True)
            return
        self._load_series()
        self._fill()

    def _ranks(self) -> list[dict]:
        """The attempt's ranks, each last write as fresh as the daemon's events have it."""
        a = self.attempt
        return self.app.live.with_writes(self.run_id, self.stage_name, a["number"], a["ranks"])

    def _show_head(self, ranks: list[dict], now: float) -> None:
        a = self.attempt
        head = Text.assemble(
            (f"{self.stage_name} attempt {a['number']} ", "bold"),
            fmt.badge(a["state"]),
            f"  ·  {a['world_size']} rank{'s' if a['world_size'] != 1 else ''}"
            f"  ·  devices {','.join(map(str, a['devices'])) or 'cpu'}"
            f"  ·  {display.duration(a['duration'])}",
        )
        note = liveness.stage_note(ranks, now, liveness.quiet_after()) if a["state"] == "running" else ""
        if note:
            head.append(f"\n{note}", style="bold yellow")
        self.query_one("#head", Static).update(head)

    def _load_series(self) -> None:
        a = self.attempt
        self.series = {}
        for name in SERIES:
            for t, rank, value in self.app.history.series(self.run_id, self.stage_name, a["number"], name, WINDOW_S):
                self.series.setdefault((rank, name), []).append((t, value))

    def _poll_history(self) -> None:
        # With the daemon connected, events say when to re-read; without it nothing moves,
        # but a daemon that comes back is noticed within a poll.
        if not self.app.link.connected or (self.attempt and self.attempt["state"] == "running"):
            self.reload()

    def on_live(self, changes: Changes) -> None:
        if changes.overflow or self.run_id in changes.runs:
            self.reload()
        elif self.run_id in changes.metrics:
            self._fill()

    def _values(self, rank: int, name: str) -> list[float]:
        """The rank's samples of the last minutes: history, then what arrived live since."""
        stored = self.series.get((rank, name), [])
        last = stored[-1][0] if stored else float("-inf")
        live = self.app.live.series(
            self.run_id, self.stage_name, self.attempt["number"], rank, name, now=self.app.history.clock()
        )
        return [v for _, v in stored] + [v for t, v in live if t > last]

    # Below this width a rank takes two lines: figures above, their sparklines below.
    WIDE = 150

    def _columns(self, gpu: bool, wide: bool) -> list[tuple[str, str, int]]:
        if wide:
            cols = [("rank", "rank", 4), ("pid", "pid", 8), ("state", "state", 10), ("exit", "exit", 13)]
            cols += [("wrote", "last write", 12)]
            if gpu:
                cols += [("gpu", "GPU memory", 28), ("gpu_spark", "GPU mem (5 min)", 16)]
            cols += [
                ("tok_spark", "tok/s (5 min)", 16 if gpu else 34),
                ("tok_s", "tok/s", 8),
                ("cpu", "CPU %", 6),
                ("rss", "RSS", 9),
            ]
            return cols
        # The compact layout has no room for a column: the last write is the state's second line.
        cols = [("rank", "rank", 4), ("pid", "pid", 7), ("state", "state", 9), ("exit", "exit", 8 if gpu else 13)]
        if gpu:
            cols += [("gpu", "GPU memory", 17)]
        cols += [("tok_s", "tok/s", 10 if gpu else 20), ("cpu", "CPU/RSS", 7)]
        return cols

    def _fill(self) -> None:
        a = self.attempt
        if a is None:
            return
        gpu = bool(a["devices"])
        self.query_one("#nogpu").set_class(not gpu, "shown")
        table = self.query_one(DataTable)
        wide = (self.size.width or 80) >= self.WIDE
        layout = (gpu, wide)
        if layout != self._layout or not table.columns:
            self._layout = layout
            table.clear(columns=True)
            for key, label, w in self._columns(gpu, wide):
                table.add_column(label, key=key, width=w)
        cols = [c[0] for c in self._columns(gpu, wide)]
        widths = {k: w for k, _, w in self._columns(gpu, wide)}
        gpu_mem = self.app.history.gpu_memory() if gpu else {}
        now = self.app.history.clock()
        ranks = self._ranks()
        self._show_head(ranks, now)
        quiet_after = liveness.quiet_after()
        rows = []
        for r in _ordered(ranks):
            cells = self._rank_cells(r, gpu_mem, widths)
            wrote = _last_write(r, now, quiet_after)
            if "wrote" not in widths and wrote.plain:
                cells["state"] = Text("\n").join([cells["state"], _compact_write(r, now, quiet_after)])
            cells["wrote"] = wrote
            rows.append((str(r["rank"]), [cells.get(c, Text("")) for c in cols], 1 if wide else 2))
            for kid in self.kids.get(r["rank"], []):
                kc = self._child_cells(kid, widths)
                rows.append((f"{r['rank']}.{kid['pid']}", [kc.get(c, Text("")) for c in cols], 1))
        keys = [k for k, _, _ in rows]
        if [str(k.value) for k in table.rows] == keys:
            for key, cells, _ in rows:
                for col, cell in zip(cols, cells):
                    table.update_cell(key, col, cell)
        else:
            cursor = table.cursor_row
            table.clear()
            for key, cells, height in rows:
                table.add_row(*cells, key=key, height=height)
            if table.row_count:
                table.move_cursor(row=min(cursor, table.row_count - 1))

    def _rank_cells(self, r: dict, gpu_mem: dict, widths: dict[str, int]) -> dict:
        """Cells by column key; in the compact layout, two-line cells: figure, then sparkline."""
        rank = r["rank"]
        alive = r["state"] == "running"
        toks = self._values(rank, "tok_s")
        cpu = self._values(rank, "cpu_percent")
        rss = self._values(rank, "rss_bytes")
        label = f"└tp{r['tp_rank']}" if r.get("role") == "tp-worker" else str(rank)
        cells = {
            "rank": Text(label),
            "pid": Text(str(r["pid"] or "")),
            "state": fmt.badge(r["state"]),
            "exit": Text(display.exit_text(r), style="red" if r["state"] == "failed" else ""),
        }
        tok_now = display.count(toks[-1] if toks and alive else r["tok_s"])
        cpu_now = f"{cpu[-1]:.0f}%" if cpu and alive else ""
        rss_now = display.size(rss[-1]).replace(" GiB", "G").replace(" MiB", "M") if rss and alive else ""
        if "gpu" in widths:
            mem = self._values(rank, "gpu_mem_bytes")
            devices = [int(d) for d in (r["device"] or "").split(",") if d.strip().isdigit()]
            total = sum(gpu_mem.get(d, {}).get("mem_total", 0) for d in devices) or None
            used = (mem[-1] if mem else None) if alive else r["peak_gpu_mem"]
            bar = fmt.bar(used, total, widths["gpu"] - 7)
            spark = fmt.sparkline(mem, widths.get("gpu_spark", widths["gpu"]), top=total, style="green")
            cells["gpu"] = bar if "gpu_spark" in widths else Text("\n").join([bar, spark])
            cells["gpu_spark"] = spark
        tok_spark = fmt.sparkline(toks, widths.get("tok_spark", widths["tok_s"]))
        if "tok_spark" in widths:
            cells.update(
                tok_spark=tok_spark,
                tok_s=Text(tok_now),
                cpu=Text(cpu_now.rstrip("%")),
                rss=Text(display.size(rss[-1]) if rss and alive else ""),
            )
        else:
            cells.update(
                tok_s=Text("\n").join([Text(tok_now), tok_spark]), cpu=Text("\n").join([Text(cpu_now), Text(rss_now)])
            )
        return cells

    def _child_cells(self, kid: dict, widths: dict[str, int]) -> dict:
        """A process under a rank: its name and status where the rank has state and exit."""
        dim = "dim"
        cpu = f"{kid['cpu_percent']:.0f}"
        rss = display.size(kid["rss"])
        cells = {
            "rank": Text("└", style=dim),
            "pid": Text(str(kid["pid"]), style=dim),
            "state": Text(kid["name"][:9], style=dim),
            "exit": Text(kid["status"], style=dim),
        }
        if "rss" in widths:
            cells.update(cpu=Text(cpu, style=dim), rss=Text(rss, style=dim))
        else:  # the compact layout's CPU/RSS column
            cells["cpu"] = Text(f"{cpu}% {rss.replace(' GiB', 'G').replace(' MiB', 'M')}", style=dim)
        return cells

    # -- processes under live ranks -------------------------------------------------------------

    def _sample_children(self) -> None:
        a = self.attempt
        if a is None or a["state"] != "running":
            if self.kids:
                self.kids = {}
                self._fill()
            return
        targets = [
            (r["rank"], r["pid"], self._create_time(a, r["rank"]))
            for r in a["ranks"]
            if r["state"] == "running" and r["pid"]
        ]
        self.run_worker(lambda: self._children_of(targets), thread=True, group="procs", exclusive=True)

    def _children_of(self, targets: list[tuple[int, int, float | None]]) -> None:
        # TP workers the daemon registered have rows of their own: not listed twice.
        known = {pid for _, pid, _ in targets}
        found = {
            rank: [k for k in self.procs.descendants(pid, ct) if k["pid"] not in known] for rank, pid, ct in targets
        }
        self.app.call_from_thread(self._show_children, found)

    def _show_children(self, found: dict[int, list[dict]]) -> None:
        if found != self.kids:
            self.kids = found
            self._fill()

    def _create_time(self, attempt: dict, rank: int) -> float | None:
        try:
            proc = json.loads(
                (attempt_dir(attempt, self.app.history.home) / contract.rank_file(rank, contract.PROC)).read_text()
            )
            return proc.get("create_time")
        except (OSError, ValueError):
            return None

    # -- views --------------------------------------------------------------------------------

    def selected_rank(self) -> int | None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        return int(str(key).split(".")[0])

    def action_logs(self) -> None:
        from .logs import LogsScreen

        self.app.push_screen(LogsScreen(self.run_id, self.stage_name, rank=self.selected_rank()))

    def action_errors(self) -> None:
        from .errors import ErrorsScreen

        self.app.push_screen(ErrorsScreen(self.run_id))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_logs()


def _last_write(r: dict, now: float, quiet_after: float) -> Text:
    """The last write column: `4s`, `quiet 3m12s` (bold) once a running rank is quiet, dim once
    the rank ended; blank when the daemon kept no last write."""
    idle = liveness.idle(r, now)
    if idle is None:
        return Text("")
    if liveness.is_quiet(r, now, quiet_after):
        return Text(f"quiet {display.duration(idle)}", style="bold yellow")
    return Text(display.duration(idle), style="" if r["state"] == "running" else "dim")


def _compact_write(r: dict, now: float, quiet_after: float) -> Text:
    """The same in the nine cells under the state: `wrote 4s`, `quiet 3m`."""
    idle = liveness.idle(r, now)
    if liveness.is_quiet(r, now, quiet_after):
        return Text(f"quiet {liveness.ago(idle)}", style="bold yellow")
    return Text(f"wrote {liveness.ago(idle)}", style="dim")


def _ordered(ranks: list[dict]) -> list[dict]:
    """Ranks in order, each driver's tensor-parallel workers right under it."""
    workers: dict[int, list[dict]] = {}
    out = []
    for r in ranks:
        if r.get("role") == "tp-worker" and r.get("parent_rank") is not None:
            workers.setdefault(r["parent_rank"], []).append(r)
    for r in ranks:
        if r.get("role") == "tp-worker" and r.get("parent_rank") is not None:
            continue
        out.append(r)
        out += sorted(workers.pop(r["rank"], []), key=lambda w: w.get("tp_rank") or 0)
    return out + [w for ws in workers.values() for w in ws]  # orphans, if any
