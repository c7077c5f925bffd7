"""One module per screen: runs, run, ranks, logs, errors."""
