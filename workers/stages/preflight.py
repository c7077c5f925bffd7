"""The `preflight` stage: `eyas doctor`'s checks as the first step of a run.

Config validation puts it first in every pipeline that reads the target (state/runconfig.py,
`preflight = false` turns it off). It runs the same checks as `eyas doctor` (doctor/main.py: run_checks)
on the run's resolved config and output folder, logs the table, writes the report as the
stage's summary.json, and raises on any failed check, naming each with its fix, so the run
stops before any rank group loads a weight.
"""

from __future__ import annotations

import logging

from eyas.state import contract
from eyas.state.runconfig import RunConfig
from eyas.workers.doctor import check as doctor_check
from eyas.workers.doctor.main import run_checks
from eyas.workers.runtime import atomic

log = logging.getLogger("eyas.preflight")


class PreflightFailed(RuntimeError):
    """One or more preflight checks failed."""


def main(ctx) -> None:
    cfg = RunConfig.from_dict(ctx.config)
    if cfg.target is None:
        raise PreflightFailed(
            "preflight needs [target] in the run's config; add it, or remove preflight from the pipeline"
        )
    output_dir = str(ctx.output_dir) if ctx.output_dir is not None else (cfg.output_dir or ".")
    checks = run_checks(cfg, output_dir)
    for line in doctor_check.table(checks):
        log.info("%s", line)
    atomic.write_json(ctx.attempt_dir / contract.SUMMARY, doctor_check.as_json(checks))
    if doctor_check.exit_code(checks):
        raise PreflightFailed(doctor_check.failures_line(checks))
