"""eyas.cli: the `eyas` command line; it reaches the daemon only through eyas.wire, and reads history from eyas.state.

Never imported by the daemon process. Each subcommand's module is imported lazily (cli/main.py),
so that `eyas runs` never pays for torch or textual.
"""
