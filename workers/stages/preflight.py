"""The `preflight` stage: `eyas doctor`'s checks as the first step of a run.

Config validation puts it first in every pipeline that reads the target (state/runconfig.py,
`preflight = false` turns it off). It runs the same checks as `eyas doctor` (doctor/main.py: run_checks)
on the run's resolved config and output folder, logs the table, writes the report as the
stage's summary.json, and raises on any failed check, naming each with its fix, so the run
stops before any rank group loads a weight. Among them are those `eyas submit` refuses a run
for (state/preload.py: weights missing for a stage that loads them, a TP size the target's
heads or experts do not allow), so a run that reached the daemon another way (a client of the
socket, a target changed since) fails here, in seconds, not in extract or in vLLM's start.

When the checks pass and the run extracts (`extract.canary`, on by default), it then runs the
canary (workers/canary/run.py): the run's own extraction path on a shrunken, dummy-weight copy
of the target, in this rank, with the run's TP workers under the daemon like the extract
stage's. A failure there (a worker's exception, a wrong capture) fails the preflight with the
worker's own error as the root cause, before the real engine starts loading the target. A run
that regenerates (`regenerate.canary`, on by default) then runs the generation's canary the same
way (workers/canary/generate.py): a few short answers on the shrunken target, through the
regenerate stage's own engine and TP size.
"""

from __future__ import annotations

import logging
from pathlib import Path

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
    summary = doctor_check.as_json(checks)
    atomic.write_json(ctx.attempt_dir / contract.SUMMARY, summary)
    if doctor_check.exit_code(checks):
        raise PreflightFailed(doctor_check.failures_line(checks))
    if wants_canary(cfg):
        from eyas.workers.canary import run as canary

        report = canary.run(cfg, Path(output_dir), ctx.attempt_dir / "canary", progress=ctx.progress)
        summary = {**summary, "canary": report}
        atomic.write_json(ctx.attempt_dir / contract.SUMMARY, summary)
    from eyas.workers.canary import generate as generate_canary

    if generate_canary.wanted(cfg):
        report = generate_canary.run(cfg, Path(output_dir), ctx.attempt_dir / "canary-generate", progress=ctx.progress)
        atomic.write_json(ctx.attempt_dir / contract.SUMMARY, {**summary, "generate_canary": report})


def wants_canary(cfg: RunConfig) -> bool:
    return "extract" in cfg.pipeline and cfg.extract.canary
