"""`eyas doctor --canary`: the run's extraction canary (workers/canary/run.py) as one more check.

The doctor's other checks read files and metadata only; this one starts the run's engine on a
shrunken, dummy-weight copy of the target (tens of seconds on a CPU), so it runs only when
asked for and only when every other check passed: a broken install or a missing target would
only fail it again, less clearly.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import traceback
from pathlib import Path

from eyas.state.runconfig import RunConfig
from eyas.workers.doctor.check import FAIL, Check, failed, passed, warned

GROUP = "canary"
NAME = "extraction path"


def check(cfg: RunConfig, output_dir: str, before: list[Check]) -> Check:
    if "extract" not in cfg.pipeline:
        return passed(GROUP, NAME, "not run: the pipeline has no extract stage")
    bad = sum(c.verdict == FAIL for c in before)
    if bad:
        return warned(
            GROUP, NAME, f"not run: {bad} check(s) failed above", "fix the failed checks, then run the doctor again"
        )
    from eyas.workers.canary import run as canary

    with tempfile.TemporaryDirectory(prefix="eyas-canary-") as work, _stdout_to_stderr():
        try:
            report = canary.run(cfg, Path(output_dir), Path(work) / "canary")
        except Exception as exc:
            text = str(exc) or type(exc).__name__
            head = text.splitlines()[0]
            return failed(
                GROUP,
                NAME,
                head if isinstance(exc, canary.CanaryFailed) else f"{type(exc).__name__}: {head}",
                "the run's extraction fails the same way once the target has loaded: fix the worker "
                "extension, the engine options or the target's code (the traceback is in --json)",
                traceback=text if isinstance(exc, canary.CanaryFailed) else traceback.format_exc(),
            )
    ids = report["layer_ids"]
    return passed(
        GROUP,
        NAME,
        f"{report['backend']} at TP {report['tensor_parallel_size']}, {report['model_class']}: "
        f"{report['samples']} samples through {report['layers'][1]} of {report['layers'][0]} layers "
        f"(ids {ids['run']} -> {ids['canary']}), captures checked, {report['seconds']['total']:.1f} s",
        **report,
    )


def check_without_config() -> Check:
    return warned(GROUP, NAME, "not run: the config has mistakes", "fix the config checks above, then run again")


@contextlib.contextmanager
def _stdout_to_stderr():
    """The engine's processes inherit this one's stdout and print to it; the report is the
    doctor's only stdout (--json is read by tools), so their lines go to stderr meanwhile."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
