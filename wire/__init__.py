"""eyas.wire: the daemon's socket protocol and the client that speaks it; all the TUI and the CLI know of the daemon.

Imports nothing of eyas but the run model (eyas.state), and no engine.
"""
