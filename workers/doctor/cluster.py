"""The doctor's checks of a Slurm run (`[resources] executor = "slurm"`): Slurm's client commands are here, and eyas's state directory is the same folder on a node as on this host.

The shared folder is proved the only way that cannot be fooled by a path that merely exists on
both sides: a one-task job step writes a file with a fresh token into the state directory, with
the same Python the ranks will run, and this host reads the token back. The step also proves that
the nodes can start eyas's Python at that path. Inside a Slurm job (the preflight stage of a
Slurm run) nothing is submitted: that job's own rank files already landed in the folder.
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from eyas.state import paths
from eyas.workers.doctor.check import Check, failed, passed, warned

GROUP = "slurm"
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "squeue")
STEP_TIMEOUT_S = 120.0  # a queue that does not start a one-task step in this long: said, not waited out
_SEARCH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin", "/usr/local/bin"])


def check(cfg, python: str = sys.executable, timeout: float = STEP_TIMEOUT_S) -> list[Check]:
    """The Slurm checks of `cfg` ([] for a local run)."""
    if cfg.resources.executor != "slurm":
        return []
    missing = [c for c in CLIENTS if shutil.which(c, path=_SEARCH) is None]
    if missing:
        return [
            failed(
                GROUP,
                "clients",
                f"{', '.join(missing)} not found on this host",
                "run the daemon on a host with Slurm's client commands (a login node), or set "
                'resources.executor = "local"',
                missing=missing,
            )
        ]
    checks = [passed(GROUP, "clients", f"{', '.join(CLIENTS)} found")]
    state = Path(cfg.slurm.state_dir) if cfg.slurm.state_dir else paths.state_dir()
    checks.append(shared_folder(state, cfg.slurm, python, timeout))
    return checks


def shared_folder(state: Path, slurm, python: str, timeout: float) -> Check:
    """A job step writes a token into `state`; this host must read the same token there."""
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        return passed(
            GROUP, "shared state", f"inside Slurm job {job}: its ranks' files are in {state}", state=str(state)
        )
    try:
        state.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return failed(
            GROUP, "shared state", f"cannot create {state}: {exc}", "set [slurm] state_dir to a shared folder"
        )
    token = secrets.token_hex(8)
    probe = state / f".eyas-shared-check-{token}"
    code = f"import pathlib, socket; pathlib.Path({str(probe)!r}).write_text({token!r} + ' ' + socket.gethostname())"
    argv = [shutil.which("srun", path=_SEARCH), "--nodes=1", "--ntasks=1", f"--job-name=eyas-doctor-{token[:6]}"]
    for key, flag in (("partition", "--partition"), ("account", "--account")):
        if getattr(slurm, key, None):
            argv.append(f"{flag}={getattr(slurm, key)}")
    argv += ["--time=0:02:00", python, "-c", code]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return warned(
            GROUP,
            "shared state",
            f"a one-task job step did not run within {timeout:.0f}s (the queue is busy?): {state} not checked",
            f"run `eyas doctor` again when the partition has a free node, or check by hand: {shlex.join(argv)}",
        )
    try:
        said = probe.read_text().split()
    except OSError:
        said = []
    finally:
        probe.unlink(missing_ok=True)
    if p.returncode != 0:
        words = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return failed(
            GROUP,
            "shared state",
            f"the job step failed (exit {p.returncode}): {' / '.join(words) or 'no output'}",
            f"check that {python} exists on the nodes and the partition/account are right: {shlex.join(argv)}",
        )
    if not said or said[0] != token:
        return failed(
            GROUP,
            "shared state",
            f"a job step wrote {probe.name} into {state} on its node, and this host does not see it there",
            "put eyas's state directory on a filesystem every node mounts at the same path "
            "(EYAS_HOME, or [slurm] state_dir)",
            state=str(state),
        )
    node = said[1] if len(said) > 1 else "a node"
    return passed(
        GROUP, "shared state", f"{state} is shared: {node} wrote it, this host read it", state=str(state), node=node
    )
