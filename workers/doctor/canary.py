"""`eyas doctor --canary`: the run's canaries as more checks: the extraction's (workers/canary/run.py) and, for a run that regenerates, the generation's (workers/canary/generate.py).

The doctor's other checks read files and metadata only; these start the run's engine on a
shrunken, dummy-weight copy of the target (tens of seconds on a CPU), so they run only when
asked for and only when every other check passed: a broken install or a missing target would
only fail them again, less clearly. The generation's runs after the extraction's, so a failed
extraction canary leaves it not run.
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
GENERATE_NAME = "generation path"
HEADLINE_CHARS = 300  # a failure's detail; the whole message is in the check's traceback (--json)


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
            head = headline(exc)
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


def check_generate(cfg: RunConfig, output_dir: str, before: list[Check]) -> Check | None:
    """The regenerate stage's canary: its engine, TP size, engine options and sampling answering
    a few of the run's prompts on the shrunken target. None when the pipeline has no regenerate."""
    if "regenerate" not in cfg.pipeline:
        return None
    if not cfg.regenerate.canary:
        return passed(GROUP, GENERATE_NAME, "not run: regenerate.canary = false (the preflight skips it too)")
    bad = sum(c.verdict == FAIL for c in before)
    if bad:
        return warned(
            GROUP,
            GENERATE_NAME,
            f"not run: {bad} check(s) failed above",
            "fix the failed checks, then run the doctor again",
        )
    from eyas.workers.canary import generate as generate_canary
    from eyas.workers.canary.run import CanaryFailed

    with tempfile.TemporaryDirectory(prefix="eyas-canary-") as work, _stdout_to_stderr():
        try:
            report = generate_canary.run(cfg, Path(output_dir), Path(work) / "canary-generate")
        except Exception as exc:
            text = str(exc) or type(exc).__name__
            head = headline(exc)
            return failed(
                GROUP,
                GENERATE_NAME,
                head if isinstance(exc, CanaryFailed) else f"{type(exc).__name__}: {head}",
                "the run's regenerate stage fails the same way once the target has loaded: fix "
                "[stages.regenerate] options.vllm, regenerate.tensor_parallel_size or the target (an "
                "architecture this vLLM loads, its code); the traceback is in --json",
                traceback=text if isinstance(exc, CanaryFailed) else traceback.format_exc(),
            )
    answers = report["answers"]
    stopped = sum(a["finish"] == "stop" for a in answers)
    return passed(
        GROUP,
        GENERATE_NAME,
        f"vllm at TP {report['tensor_parallel_size']}, dummy weights, {report['layers'][1]} of "
        f"{report['layers'][0]} layers: {len(answers)} of {report['prompts']} prompts answered "
        f"({sum(a['tokens'] for a in answers)} tokens, {stopped} at a stop token), answers checked, "
        f"{report['seconds']:.1f} s",
        **report,
    )


def headline(exc: BaseException) -> str:
    """What went wrong, in one line: the first line of the message, or for a pydantic
    ValidationError (vLLM checks its configs with pydantic) its first error rather than the
    count of them; a long one is cut at a sentence's end (vLLM lists every architecture it
    supports after saying which it does not)."""
    text = ""
    errors = getattr(exc, "errors", None)
    if type(exc).__name__ == "ValidationError" and callable(errors):
        try:
            text = str(errors()[0].get("msg", "")).removeprefix("Value error, ")
        except Exception:  # noqa: BLE001 - another library's ValidationError: fall back to its text
            text = ""
    lines = (text or str(exc)).strip().splitlines()
    head = lines[0] if lines else type(exc).__name__
    if len(head) > HEADLINE_CHARS:
        end = head.rfind(". ", 0, HEADLINE_CHARS)
        head = (head[: end + 1] if end > 0 else head[:HEADLINE_CHARS] + " ...") + " (the whole message is in --json)"
    return head


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
