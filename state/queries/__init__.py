"""Read-only queries behind `eyas runs`, `eyas show` and the TUI, each a function of a database connection that only reads.

They read roll-up columns kept by the daemon, never the raw metrics, so that they stay fast on a
store with millions of samples; the curves alone read samples, downsampled in SQL from an index
that holds them. By what they answer:

- connection.py: `connect`, the plain read-only connection, and the schema version it reads;
- runs.py: the list of runs and one run with its stages, attempts, ranks and errors;
- streaming.py: a streaming run's window between extract and train;
- phases.py: what a running stage's ranks wait for, in words;
- samples.py: one metric's samples, its newest value, the GPUs' memory, every series;
- curves.py: the curves the TUI and `eyas show --plot` draw.

Every query takes either a sqlite_utils.Database or a plain sqlite3.Connection: they only call
`db.execute`. Importing sqlite_utils costs about 0.5 s here (it imports pandas and numpy when
they are installed), which alone would break the CLI's 0.5 s budget, so this package never
imports it and `connect` opens a plain read-only connection.

Callers import the package and call `queries.<name>`: every query is re-exported here.
"""

from __future__ import annotations

from eyas.state.queries.connection import SCHEMA_VERSION, connect
from eyas.state.queries.curves import (
    CURVE_POINTS,
    CURVES,
    Curve,
    curve_names,
    metric_curve,
    metric_names,
    metric_ranks,
    stage_curves,
    stage_metric_names,
)
from eyas.state.queries.phases import phase_text
from eyas.state.queries.runs import (
    NO_RATE_STAGES,
    RUN_COLUMNS,
    acceptance_lengths,
    errors,
    events,
    get_run,
    list_runs,
    rate,
    stage_attempts,
    stage_state,
)
from eyas.state.queries.samples import (
    SERIES_ORDER,
    TIME_ORDER,
    gpu_memory,
    latest_metric,
    metric_rows,
    metric_series,
    series_summary,
)
from eyas.state.queries.streaming import stream_window, window_lines

__all__ = [
    "CURVES",
    "CURVE_POINTS",
    "NO_RATE_STAGES",
    "RUN_COLUMNS",
    "SCHEMA_VERSION",
    "SERIES_ORDER",
    "TIME_ORDER",
    "Curve",
    "acceptance_lengths",
    "connect",
    "curve_names",
    "errors",
    "events",
    "get_run",
    "gpu_memory",
    "latest_metric",
    "list_runs",
    "metric_curve",
    "metric_names",
    "metric_ranks",
    "metric_rows",
    "metric_series",
    "phase_text",
    "rate",
    "series_summary",
    "stage_attempts",
    "stage_curves",
    "stage_metric_names",
    "stage_state",
    "stream_window",
    "window_lines",
]
