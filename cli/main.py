"""The `eyas` command line. Each subcommand imports its module lazily, so that
`eyas runs` never pays for torch, textual or the daemon's internals."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> "module:function"; the function takes the parsed args and returns an exit code.
COMMANDS = {
    "daemon": "eyas.cli.lifecycle:command",
    "submit": "eyas.cli.control:submit",
    "stop": "eyas.cli.control:stop",
    "retry": "eyas.cli.control:retry",
    "skip": "eyas.cli.control:skip",
    "resume": "eyas.cli.control:resume",
    "stacks": "eyas.cli.control:stacks",
    "runs": "eyas.cli.history:runs",
    "show": "eyas.cli.history:show",
    "logs": "eyas.cli.logs:command",
    "errors": "eyas.cli.history:errors",
    "metrics": "eyas.cli.metrics:command",
    "validate": "eyas.cli.configcheck:command",
    "init": "eyas.cli.init:command",
    "doctor": "eyas.cli.doctor:command",
    "demo": "eyas.cli.demo:command",
    "tui": "eyas.tui.app:command",
}


RUN_HELP = "the run's id (eyas runs lists them)"


def _output_options(p: argparse.ArgumentParser) -> None:
    """The sqlite-utils style output flags every listing shares."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json", dest="fmt", action="store_const", const="json", help="a JSON array")
    g.add_argument("--csv", dest="fmt", action="store_const", const="csv", help="CSV with a header row")
    g.add_argument("--nl", dest="fmt", action="store_const", const="nl", help="newline-delimited JSON")
    g.add_argument("--table", dest="fmt", action="store_const", const="table", help="a table (the default)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eyas", description="Train EAGLE-3 draft models under a supervising daemon.")
    parser.add_argument("--home", help="state directory (default: $EYAS_HOME, else $XDG_STATE_HOME/eyas)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("daemon", help="start, stop or inspect the background daemon")
    dsub = d.add_subparsers(dest="action", required=True)
    start = dsub.add_parser("start", help="start the daemon (detached unless --foreground)")
    start.add_argument("--foreground", action="store_true", help="stay attached (for systemd and tests)")
    start.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL on stop")
    stop = dsub.add_parser("stop", help="stop the daemon; running groups get SIGTERM, then SIGKILL")
    stop.add_argument("--grace", type=float, default=None, help="override the daemon's grace period")
    status = dsub.add_parser("status", help="pid, uptime, socket, database and active runs")
    status.add_argument("--json", action="store_true", help="print the status as JSON")

    s = sub.add_parser("submit", help="validate a run config and queue it")
    s.add_argument("config", help="the run's TOML file")
    s.add_argument("--follow", "-f", action="store_true", help="stream progress until the run ends")

    for name, text, stage_help in (
        ("stop", "cancel a run, or one stage", "only this stage (default: the whole run)"),
        (
            "retry",
            "start a new attempt that resumes completed work",
            "the stage to run again (default: the one that failed or was cancelled)",
        ),
    ):
        c = sub.add_parser(name, help=text)
        c.add_argument("run", type=int, help=RUN_HELP)
        c.add_argument("--stage", help=stage_help)
    sk = sub.add_parser("skip", help="skip a stage")
    sk.add_argument("run", type=int, help=RUN_HELP)
    sk.add_argument("--stage", required=True, help="the stage to skip")
    r = sub.add_parser("resume", help="continue a failed or cancelled run")
    r.add_argument("run", type=int, help=RUN_HELP)
    st = sub.add_parser("stacks", help="print the Python and native stacks of a running stage's processes (for a hang)")
    st.add_argument("run", type=int, help=RUN_HELP)
    st.add_argument("--stage", help="the stage whose ranks to dump (default: the running one)")
    st.add_argument("--wait", type=float, default=2.0, help="seconds to wait for the ranks' dumps (default 2)")

    runs = sub.add_parser("runs", help="list runs, newest first (works without the daemon)")
    runs.add_argument("match", nargs="?", help="text to match in the run's name or model")
    runs.add_argument("--state", help="only runs in this state")
    runs.add_argument("--since", help="only runs created within this long, e.g. 30m, 12h, 7d")
    runs.add_argument("--limit", type=int, help="at most this many runs")
    _output_options(runs)

    show = sub.add_parser("show", help="one run: stages, attempts, errors, ranks, outputs")
    show.add_argument("run", type=int, help=RUN_HELP)
    show.add_argument(
        "--plot", action="store_true", help="draw the main curves (loss, accuracy, lr, tok/s, GPU memory)"
    )
    show.add_argument("--linear", action="store_true", help="with --plot: the losses on a linear y axis, not log")
    show.add_argument(
        "--smooth",
        type=float,
        metavar="W",
        help="with --plot: the EMA weight that smooths loss, accuracy and tok/s, as TensorBoard's "
        "slider (default 0.6; 0: the raw series)",
    )
    _output_options(show)

    logs = sub.add_parser("logs", help="a rank's log, or all ranks merged by time")
    logs.add_argument("run", type=int, help=RUN_HELP)
    logs.add_argument("--stage", help="the stage (default: the run's current stage, else the last one that ran)")
    logs.add_argument("--rank", type=int, help="only this rank's log (default: every rank, merged by time)")
    logs.add_argument("--attempt", type=int, help="this attempt of the stage (default: its latest)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing what is written, as tail -f")
    logs.add_argument("--grep", help="only lines matching this regular expression")

    met = sub.add_parser(
        "metrics",
        help="a run's recorded series: a summary, or the samples (works without the daemon)",
        description="One row per series (stage, attempt, metric, rank): its sample count, first and last time, "
        "minimum, maximum and newest value. The table shows each figure in its unit (sizes, durations, 6.9k); "
        "--csv, --json and --nl export the same rows with raw values. --samples exports the samples "
        "themselves instead (time, stage, attempt, rank, name, value), every one, or with --points N each "
        "series as N bucket means. --tensorboard DIR writes them as TensorBoard event files.",
    )
    met.add_argument("run", type=int, help=RUN_HELP)
    met.add_argument("--stage", help="only this stage")
    met.add_argument("--name", action="append", help="only this metric (repeat for more), e.g. loss")
    met.add_argument("--samples", action="store_true", help="the samples themselves, not one summary row per series")
    met.add_argument(
        "--points", type=int, help="the samples, each series downsampled to at most this many bucket means"
    )
    met.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="write the run's samples as TensorBoard event files under DIR/run-<id>-<name> (tensorboard --logdir DIR)",
    )
    _output_options(met)

    errs = sub.add_parser("errors", help="the root cause first, then the other ranks' failures")
    errs.add_argument("run", type=int, help=RUN_HELP)
    errs.add_argument("--stage", help="only this stage's errors")
    _output_options(errs)

    v = sub.add_parser("validate", help="check a run config without submitting it")
    v.add_argument("config", help="the run's TOML file")

    doc = sub.add_parser("doctor", help="check a run config, its target and this machine (no weights loaded)")
    doc.add_argument("config", help="the run's TOML file")
    doc.add_argument("--json", action="store_true", help="print the checks as JSON")
    doc.add_argument(
        "--canary",
        action="store_true",
        help="also run the canaries: the run's extraction engine, and its generation engine when it regenerates, "
        "on a shrunken, dummy-weight copy of the target",
    )

    ini = sub.add_parser("init", help="write a commented run config for a target, sized for the GPUs")
    ini.add_argument("target", help="the target model's folder (config.json, safetensors)")
    ini.add_argument("--data", required=True, help="the chats prepare reads (a .jsonl/.json file or a folder)")
    ini.add_argument("--gpus", type=int, help="GPUs the run will have (default: those NVML sees; 0: CPU)")
    ini.add_argument("--gpu-memory", type=float, metavar="GB", help="each GPU's memory in GB (default: NVML's)")
    ini.add_argument("-o", "--output", metavar="OUT.toml", help="where to write (default: <target>-eagle3.toml)")

    sub.add_parser("demo", help="the whole pipeline on a tiny built-in target")

    t = sub.add_parser("tui", help="the terminal UI")
    t.add_argument("run", type=int, nargs="?", help="open on this run (default: the list of runs)")
    t.add_argument("--readonly", action="store_true", help="hide and refuse every control")
    t.add_argument(
        "--serve", action="store_true", help="serve the TUI to a browser on 127.0.0.1, at a URL with a random token"
    )
    t.add_argument("--port", type=int, help="with --serve: the port to listen on (default: a free one)")
    t.add_argument("--host", help="with --serve: the address to bind (default 127.0.0.1; loopback only)")
    t.add_argument(
        "--i-know-this-is-not-loopback",
        dest="not_loopback",
        action="store_true",
        help="with --serve --host: allow an address other machines can reach (plain HTTP; a warning is printed)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.home:
        os.environ["EYAS_HOME"] = os.path.abspath(args.home)
    module_name, func = COMMANDS[args.command].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("eyas."):
            print(f"eyas {args.command}: not available in this build ({exc.name} is missing)", file=sys.stderr)
            return 2
        raise
    try:
        return getattr(module, func)(args) or 0
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `eyas runs | head` closes the pipe early; that is not an error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except TimeoutError:
        # A daemon that holds its socket but does not answer (stuck, or busy beyond the
        # request's limit) is one line for the user, not a socket traceback.
        from eyas.state import paths

        print(
            f"eyas {args.command}: the daemon did not answer in time on {paths.find_socket()}; "
            f"it is busy or stuck: see {paths.state_dir() / 'daemon.log'}",
            file=sys.stderr,
        )
        return 1
    except PermissionError as exc:
        from eyas.state import paths

        if not isinstance(exc, paths.UnsafeRuntimeDir):
            raise
        # A planted link or another user's folder where the socket would be: its path and the fix.
        print(f"eyas {args.command}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        damaged = _damaged_store(exc)
        if damaged is None:
            raise
        print(f"eyas {args.command}: {damaged}", file=sys.stderr)
        return 1


def _damaged_store(exc: Exception) -> str | None:
    """The one line for a history command that found the database damaged (SQLite's "file is
    not a database", "database disk image is malformed"), else None. Checked here, once, for
    every command that reads the store (runs, show, errors, logs, tui); sqlite3 is only looked
    at if a command already imported it."""
    if "sqlite3" not in sys.modules:
        return None
    from eyas.state import integrity, paths

    return str(integrity.DatabaseDamaged(paths.db_path(), str(exc))) if integrity.is_damage(exc) else None


if __name__ == "__main__":
    sys.exit(main())
