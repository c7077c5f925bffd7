"""`eyas tui`: the Textual control panel.

    app.py          EyasApp and `command(args)`; owns the three parts below, hands them to screens
    link.py         DaemonLink: the AsyncClient, reconnection with backoff, batched events
    live.py         Live: what the daemon's events said (stage roll-ups, recent samples)
    history.py      History: read-only store queries (works with the daemon down)
    screens/        runs, run, ranks, logs, errors (one module each) and the shared base
    widgets/        the frame (title bar, banner), the log view, the pipeline, the modals
    logindex.py     LogFile: line offsets of a log, indexed in a thread, read by pread
    logsearch.py    Scan: regex filter and first-error scans over indexed logs
    logmodel.py     SingleModel / MergedModel: which rows a view shows (merged by time, lazily)
    logwatch.py     LogWatcher: the indexing and scanning thread
    procs.py        ProcWatch: processes under a live rank (TP workers), via psutil
    format.py       badges, figures, sparklines and bars as rich Text
    serve.py        `eyas tui --serve`: the app in a browser (textual-serve), loopback, behind a token

It imports only eyas.wire (client, protocol) and the read-only parts of eyas.state.
"""
