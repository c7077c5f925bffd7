"""A real one-node Slurm cluster for tests: munged, slurmctld and slurmd started from a private
temporary folder, reachable through `SlurmWorld.env` (SLURM_CONF), and stopped with every
process they started.

`slurm_unavailable()` installs Debian's `slurm-wlm` and `munge` when they are missing and the
tests run as root (apt-get, once, under a lock), else says why the tests must skip. `start()`
writes the cluster's files into a new temporary folder: a munge key, a `slurm.conf` whose
state, spool, log and pid files all lie there, on ports free at the time; it starts the three
daemons in the foreground as children of the test process, and returns once `sinfo` shows the
node idle. `SlurmWorld.stop()` cancels the jobs left, ends the daemons (SIGTERM, then SIGKILL),
and ends any process of the world still alive (a job's tasks carry its mark in their
environment, a step daemon holds its log open), so no process outlives the world.

On a 2-core VM the bring-up takes about 1.1 s (munged started to the node idle) and installing
the packages about 10 s, once. The settings are the ones these machines need: no cgroups
(`proctrack/linuxproc`, `task/none`), everything as root, a private munged on its own socket and key so a system
munged is never met, and `OverTimeLimit=0` with a short `KillWait` so that a time limit ends a
job as soon as slurmctld's periodic check (every 30 s) sees it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

PACKAGES = ("slurm-wlm", "munge")
# The programs the harness runs: daemons live in sbin, which a non-login PATH may lack.
PROGRAMS = ("munged", "slurmctld", "slurmd", "sinfo", "squeue", "sbatch", "srun", "scancel", "scontrol")
_SEARCH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])
INSTALL_LOCK = Path(tempfile.gettempdir()) / "eyas-slurm-install.lock"
MARK = "EYAS_SLURM_WORLD"  # set in every daemon's and job's environment: how stop() finds what is left
PARTITION = "debug"


def program(name: str) -> str | None:
    return shutil.which(name, path=_SEARCH)


def missing_programs() -> list[str]:
    return [p for p in PROGRAMS if program(p) is None]


def slurm_unavailable(install: bool = True) -> str | None:
    """None when Slurm's and munge's programs are installed (installing them first where they
    are missing, `install` allows it and this is root on a Debian-like system), else why the
    Slurm tests cannot run."""
    missing = missing_programs()
    if not missing:
        return None
    why = f"Slurm is not installed ({', '.join(missing)} missing)"
    if os.environ.get("EYAS_SLURM_NO_INSTALL") or not install:
        return f"{why}; EYAS_SLURM_NO_INSTALL forbids installing it"
    if os.geteuid() != 0:
        return f"{why} and installing {' '.join(PACKAGES)} needs root: run `apt-get install -y {' '.join(PACKAGES)}`"
    apt = program("apt-get")
    if apt is None:
        return f"{why} and there is no apt-get to install {' '.join(PACKAGES)} with"
    # Under a lock: two test sessions at once would otherwise race for dpkg's own lock and one fail.
    with open(INSTALL_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not missing_programs():
            return None
        error = _apt_install(apt)
    missing = missing_programs()
    if missing:
        return f"{why}; `apt-get install {' '.join(PACKAGES)}` did not provide {', '.join(missing)}: {error or ''}"
    return None


def _apt_install(apt: str) -> str | None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Debian's packages start their system services on install; the harness runs its own
    # daemons, so a policy-rc.d that refuses every start (Docker images ship one) is put in
    # place for the install unless one is there already, and removed after.
    policy = Path("/usr/sbin/policy-rc.d")
    placed = False
    if not policy.exists():
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
        placed = True
    try:
        for argv in (
            [apt, "update", "-q"],
            [apt, "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
        ):
            p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
            if p.returncode:
                return f"`{' '.join(argv[1:])}` exited {p.returncode}: {(p.stderr or p.stdout).strip()[-600:]}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"apt-get failed: {exc}"
    finally:
        if placed:
            policy.unlink(missing_ok=True)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_name() -> str:
    """The node's name in the cluster: this host's short name, as `hostname -s` prints it."""
    return socket.gethostname().split(".")[0]


def slurm_conf(root: Path, node: str, cpus: int, ctld_port: int, slurmd_port: int, munge_socket: Path) -> str:
    """A one-node slurm.conf whose files all lie under `root`."""
    return "\n".join(
        [
            "ClusterName=eyastest",
            f"SlurmctldHost={node}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'run' / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # No cgroups on these machines (a container): track processes by their parents.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "ReturnToService=2",
            # A time limit ends a job at its first check past the limit, and its tasks get 2 s
            # between SIGTERM and SIGKILL: a TIMEOUT test waits about a minute, not three.
            "OverTimeLimit=0",
            "KillWait=2",
            "InactiveLimit=0",
            # Finished jobs stay visible to `scontrol show job` for ten minutes.
            "MinJobAge=600",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            # The node's CPUs as configured, not as slurmd counts sockets and cores: a container's
            # view of the hardware may differ from os.cpu_count() and would drain the node.
            "SlurmdParameters=config_overrides",
            f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname={node} CPUs={cpus} State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


@dataclass
class SlurmWorld:
    root: Path  # the cluster's files; `shared` below it is where jobs and tests exchange files
    node: str
    conf: Path
    env: dict[str, str]  # the environment of a client command (sbatch, srun, squeue, ...)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    startup_seconds: float = 0.0  # from the first daemon's start to the node idle
    swept: list[int] = field(default_factory=list)  # pids stop() had to end by their mark

    @property
    def shared(self) -> Path:
        return self.root / "shared"

    def run(
        self, *argv: str, timeout: float = 60, check: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster, with `env` added to its environment
        (srun and sbatch pass it on to the job's tasks); text output."""
        exe = program(argv[0]) or argv[0]
        p = subprocess.run(
            [exe, *argv[1:]], capture_output=True, text=True, env={**self.env, **(env or {})}, timeout=timeout
        )
        if check and p.returncode:
            raise AssertionError(
                f"{' '.join(argv)} exited {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}\n{self.logs()}"
            )
        return p

    def sbatch(self, *args: str) -> int:
        """Submit a job (`sbatch --parsable ARGS`); its id."""
        out = self.run("sbatch", "--parsable", f"--chdir={self.shared}", *args).stdout.strip()
        return int(out.split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job -o`'s fields of a job; {} once slurmctld has forgotten it."""
        p = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        if p.returncode:
            return {}
        # "Key=Value Key=Value ...": values have no spaces, except the last field's command lines,
        # which are not read here.
        return dict(re.findall(r"(\w+)=(\S*)", p.stdout))

    def wait_state(self, job_id: int, states: set[str], timeout: float = 60) -> dict[str, str]:
        """Wait until the job's JobState is one of `states`; its fields then."""
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} never reached {sorted(states)} in {timeout}s: {fields}\n{self.logs()}")

    def wait_idle(self, timeout: float = 30) -> None:
        """Wait until the node is idle again (the jobs before have left it)."""
        deadline = time.monotonic() + timeout
        while self.node_state() != "idle":
            if time.monotonic() > deadline:
                raise AssertionError(f"node {self.node} is {self.node_state()!r}, not idle, after {timeout}s")
            time.sleep(0.1)

    def node_state(self) -> str:
        p = self.run("sinfo", "-h", "-N", "-n", self.node, "-o", "%T", check=False)
        return p.stdout.strip() if p.returncode == 0 else ""

    def logs(self, lines: int = 30) -> str:
        """The tail of each daemon's log, for a failure's message."""
        out = []
        for path in sorted((self.root / "log").glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def marked(self) -> list[psutil.Process]:
        """Live processes of this world (this one and its ancestors aside): those that carry its
        mark in their environment, and those with a file of its folder open. Slurm's step
        daemons and slurmctld's script daemon rewrite their title over the environment that
        /proc shows, so only their open log file tells them apart from another cluster's."""
        mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
        prefix = f"{self.root}{os.sep}"
        found = []
        for proc in psutil.process_iter():
            if proc.pid in mine:
                continue
            with contextlib.suppress(psutil.Error):
                if proc.environ().get(MARK) == str(self.root) or any(
                    f.path.startswith(prefix) for f in proc.open_files()
                ):
                    found.append(proc)
        return found

    def stop(self, grace: float = 10) -> None:
        """Cancel every job, end the daemons, then whatever still carries the mark."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                ids = self.run("squeue", "-h", "-o", "%i", check=False, timeout=15).stdout.split()
                if ids:
                    self.run("scancel", *ids, check=False, timeout=15)
                    deadline = time.monotonic() + 15
                    while time.monotonic() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
                        time.sleep(0.2)
        # slurmd before slurmctld (it reports to it), munged last (both talk through it).
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(grace)
        # A step daemon finishes its cleanup after its job left the queue: a moment to end on
        # its own, then SIGKILL for whatever is left.
        _, left = psutil.wait_procs(self.marked(), timeout=3)
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(left, timeout=grace)
        self.swept = [p.pid for p in left]


def _spawn(world: SlurmWorld, name: str, argv: list[str]) -> None:
    # The child holds its own copy of the log's descriptor; this one closes with the block.
    with open(world.root / "log" / f"{name}.out", "wb") as out:
        # Its own session: a Ctrl-C at the terminal reaches pytest only, and stop() ends the daemons.
        world.procs[name] = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=world.env, start_new_session=True
        )


def _wait(world: SlurmWorld, what: str, predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = {n: p.returncode for n, p in world.procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(
                f"{', '.join(f'{n} exited {rc}' for n, rc in dead.items())} before {what}\n{_outs(world)}"
            )
        if predicate():
            return
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout}s waiting for {what}\n{_outs(world)}")


def _outs(world: SlurmWorld) -> str:
    parts = [world.logs()]
    for path in sorted((world.root / "log").glob("*.out")):
        parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}")
    return "\n".join(parts)


def start(timeout: float = 60) -> SlurmWorld:
    """A one-node cluster, up with its node idle; stop() it. Slurm must be installed
    (slurm_unavailable() first)."""
    # A short path of its own: munge's socket path must fit a unix socket's 108 bytes.
    root = Path(tempfile.mkdtemp(prefix="eyas-slurm-"))
    for sub in ("state", "spool", "log", "run", "munge", "shared"):
        (root / sub).mkdir(mode=0o700)
    # munged wants its socket's folder, and every folder above it, searchable by all users.
    for folder in (root, root / "munge", root / "shared"):
        folder.chmod(0o755)
    node = node_name()
    munge_socket = root / "munge" / "munge.socket"
    key = root / "munge" / "munge.key"
    # munged refuses a key readable by others; 1 KiB of randomness is what mungekey writes.
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(1024))
    conf = root / "slurm.conf"
    ctld_port = free_port()
    slurmd_port = free_port()
    while slurmd_port == ctld_port:  # the kernel may hand the same free port out twice
        slurmd_port = free_port()
    conf.write_text(slurm_conf(root, node, os.cpu_count() or 1, ctld_port, slurmd_port, munge_socket))
    # An outer allocation's variables (a suite run under Slurm) would make srun join that job.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update({"SLURM_CONF": str(conf), MARK: str(root)})
    world = SlurmWorld(root=root, node=node, conf=conf, env=env)
    t0 = time.monotonic()
    try:
        _spawn(
            world,
            "munged",
            [
                program("munged"),
                "--foreground",
                f"--key-file={key}",
                f"--socket={munge_socket}",
                f"--pid-file={root / 'run' / 'munged.pid'}",
                f"--log-file={root / 'log' / 'munged.log'}",
                f"--seed-file={root / 'munge' / 'munged.seed'}",
            ],
        )
        _wait(world, "munged's socket", munge_socket.exists, timeout)
        _spawn(world, "slurmctld", [program("slurmctld"), "-D", "-i", "-f", str(conf)])
        _spawn(world, "slurmd", [program("slurmd"), "-D", "-N", node, "-f", str(conf)])
        _wait(world, f"node {node} idle in sinfo", lambda: world.node_state() == "idle", timeout)
    except BaseException:
        world.stop()
        shutil.rmtree(root, ignore_errors=True)  # the error's message carries the logs
        raise
    world.startup_seconds = time.monotonic() - t0
    return world


@contextlib.contextmanager
def running(timeout: float = 60):
    """start() ... stop(), the cluster's folder removed after."""
    world = start(timeout)
    try:
        yield world
    finally:
        world.stop()
        shutil.rmtree(world.root, ignore_errors=True)
