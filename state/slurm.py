"""The rank contract under Slurm: from a Slurm task's environment, the environment a rank of eyas
reads (state/contract.py's names), and each node's share of an extraction's batches.

Pure and stdlib only (one optional `scontrol` call aside), so that both sides can import it: the
daemon, which writes the sbatch script of an attempt and exports eyas's own variables into it
(`attempt_exports`), and the rank, which starts under `srun` and turns what Slurm gave its task
into torch.distributed's names (`rank_env`). Slurm's variables read here:

- `SLURM_PROCID`, `SLURM_NTASKS`: the task's global rank and the step's task count;
- `SLURM_LOCALID`, `SLURM_NODEID`: its rank on its node, and its node's index in the step;
- `SLURM_STEP_TASKS_PER_NODE` (else `SLURM_TASKS_PER_NODE`): tasks per node, "2(x3),1";
- `SLURM_STEP_NODELIST` (else `SLURM_JOB_NODELIST`, `SLURM_NODELIST`): a hostlist;
- `SLURM_JOB_ID`: the job, from which the rendezvous port is derived;
- `CUDA_VISIBLE_DEVICES` (else `SLURM_STEP_GPUS`, `SLURM_JOB_GPUS`): the GPUs the task may use.

MASTER_ADDR is the first host of the step's expanded node list: task 0 runs on node 0 under
every distribution Slurm offers but `arbitrary`. MASTER_PORT is `PORT_BASE + job_id % PORT_SPAN`,
so every task of a job computes the same port without talking to another; the range sits below
Linux's ephemeral ports (32768-60999), so no outgoing connection on the node holds it by chance.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import contract

PORT_BASE = 20000
PORT_SPAN = 10000  # ports 20000-29999


class SlurmEnvError(ValueError):
    """The environment is not a Slurm task's, or holds a value Slurm never writes."""


# -- hostlists ------------------------------------------------------------------------------------

_HOSTLIST_PART = re.compile(r"\[([^\[\]]*)\]")


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist syntax expanded, in order: "gpu[01-03,07],login1" -> gpu01, gpu02,
    gpu03, gpu07, login1. Ranges keep the zero padding of their lower bound ("[08-10]" ->
    08, 09, 10); several bracket groups in one name multiply ("r[1-2]n[1-2]" -> r1n1, r1n2,
    r2n1, r2n2)."""
    hosts: list[str] = []
    for name in _split_top_level(text.strip()):
        hosts.extend(_expand_name(name))
    return hosts


def _split_top_level(text: str) -> list[str]:
    """The comma-separated names of a hostlist; commas inside brackets belong to a range."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise SlurmEnvError(f"hostlist {text!r}: nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmEnvError(f"hostlist {text!r}: ']' without '['")
        elif ch == "," and depth == 0:
            names.append(text[start:i])
            start = i + 1
    if depth:
        raise SlurmEnvError(f"hostlist {text!r}: '[' without ']'")
    names.append(text[start:])
    return [n.strip() for n in names if n.strip()]


def _expand_name(name: str) -> list[str]:
    m = _HOSTLIST_PART.search(name)
    if not m:
        return [name]
    prefix, rest = name[: m.start()], name[m.end() :]
    tails = _expand_name(rest)
    return [f"{prefix}{part}{tail}" for part in _expand_ranges(m.group(1), name) for tail in tails]


def _expand_ranges(body: str, name: str) -> list[str]:
    out = []
    for item in body.split(","):
        item = item.strip()
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise SlurmEnvError(f"hostlist name {name!r}: {item!r} is not a number or a range of numbers")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise SlurmEnvError(f"hostlist name {name!r}: range {item!r} runs backwards")
        width = len(lo)  # Slurm pads to the lower bound's digits: [8-10] is 8, 9, 10; [08-10] 08, 09, 10
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def hostnames(nodelist: str, *, scontrol: str | None = "scontrol") -> list[str]:
    """The hosts of a Slurm node list, in Slurm's order.

    `scontrol show hostnames` is asked first where it is installed: it is the authority on the
    syntax, which has more forms than the common one expand_hostlist() covers (multi-dimensional
    names on torus machines, a site's own HostFormat). expand_hostlist() is the answer where it
    is missing (a node that runs tasks but carries no client commands, a container, unit tests)
    and where it fails. `scontrol=None` skips it."""
    path = shutil.which(scontrol) if scontrol else None
    if path:
        try:
            out = subprocess.run(
                [path, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
            ).stdout.split()
        except (OSError, subprocess.SubprocessError):
            out = []
        if out:
            return out
    return expand_hostlist(nodelist)


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed task counts per node expanded: "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise SlurmEnvError(f"tasks per node {text!r}: {item!r} is neither N nor N(xK)")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


# -- one task ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlurmTask:
    """One task of a Slurm job step, as its environment describes it."""

    job_id: int
    rank: int  # SLURM_PROCID
    world_size: int  # SLURM_NTASKS
    local_rank: int  # SLURM_LOCALID
    node_index: int  # SLURM_NODEID
    hosts: tuple[str, ...]  # the step's nodes, expanded
    tasks_per_node: tuple[int, ...]
    gpus: tuple[str, ...] | None  # the GPUs the task sees, None where Slurm names none

    @property
    def node_count(self) -> int:
        return len(self.hosts)

    @property
    def local_world_size(self) -> int:
        return self.tasks_per_node[self.node_index]

    @property
    def master_addr(self) -> str:
        return self.hosts[0]

    @property
    def master_port(self) -> int:
        return master_port(self.job_id)

    def devices(self) -> tuple[str, ...] | None:
        """The GPUs of this rank, by the daemon's rule on one machine (daemon/group.py's
        rank_devices): each of the node's ranks takes an equal slice of what the node's tasks
        see; a single rank on its node (a vLLM driver and its TP workers) takes them all. Where
        the task's GPUs do not split evenly among the node's tasks, Slurm has bound them per
        task already (--gpus-per-task, --gpu-bind), and its binding stands."""
        if self.gpus is None:
            return None
        n, lws = len(self.gpus), self.local_world_size
        if lws <= 1 or n < lws or n % lws:
            return self.gpus
        per = n // lws
        return self.gpus[self.local_rank * per : (self.local_rank + 1) * per]


def master_port(job_id: int) -> int:
    """The rendezvous port of a job: the same for every task, in [PORT_BASE, PORT_BASE + PORT_SPAN)."""
    return PORT_BASE + job_id % PORT_SPAN


def _int(environ: Mapping[str, str], *names: str) -> int:
    for name in names:
        raw = environ.get(name)
        if raw is None or raw == "":
            continue
        try:
            return int(raw)
        except ValueError:
            raise SlurmEnvError(f"{name}={raw!r}: Slurm writes an integer here") from None
    raise SlurmEnvError(f"{' or '.join(names)} is not set: this process is not a task of a Slurm job step (srun)")


def _first(environ: Mapping[str, str], *names: str) -> str | None:
    return next((environ[n] for n in names if environ.get(n)), None)


def task_from_environ(
    environ: Mapping[str, str] | None = None, *, hosts: Sequence[str] | None = None, scontrol: str | None = "scontrol"
) -> SlurmTask:
    """The Slurm task this environment (by default the process's) describes. `hosts`, when
    given, is the step's node list already expanded; else it is expanded here (hostnames())."""
    env = os.environ if environ is None else environ
    job_id = _int(env, "SLURM_JOB_ID", "SLURM_JOBID")
    rank = _int(env, "SLURM_PROCID")
    world_size = _int(env, "SLURM_NTASKS", "SLURM_NPROCS")
    local_rank = _int(env, "SLURM_LOCALID")
    node_index = _int(env, "SLURM_NODEID")
    if hosts is None:
        nodelist = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if nodelist is None:
            raise SlurmEnvError("SLURM_STEP_NODELIST or SLURM_JOB_NODELIST is not set: no node list to find rank 0 on")
        hosts = hostnames(nodelist, scontrol=scontrol)
    hosts = tuple(hosts)
    per_node_text = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if per_node_text is not None:
        per_node = tuple(expand_tasks_per_node(per_node_text))
    elif world_size % len(hosts) == 0:
        # Older Slurm leaves the counts out for a single node; an even spread is then the only reading.
        per_node = (world_size // len(hosts),) * len(hosts)
    else:
        raise SlurmEnvError("SLURM_TASKS_PER_NODE is not set and the tasks do not spread evenly over the nodes")
    if len(per_node) != len(hosts):
        raise SlurmEnvError(f"{len(per_node)} nodes' task counts for {len(hosts)} nodes ({', '.join(hosts)})")
    if sum(per_node) != world_size:
        raise SlurmEnvError(f"the nodes' task counts {list(per_node)} do not add up to SLURM_NTASKS={world_size}")
    if not (0 <= rank < world_size and 0 <= node_index < len(hosts) and 0 <= local_rank < per_node[node_index]):
        raise SlurmEnvError(
            f"SLURM_PROCID={rank}, SLURM_NODEID={node_index}, SLURM_LOCALID={local_rank} do not fit "
            f"{world_size} tasks on nodes {list(per_node)}"
        )
    gpu_text = _first(env, "CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS")
    gpus = tuple(g.strip() for g in gpu_text.split(",") if g.strip()) if gpu_text is not None else None
    return SlurmTask(job_id, rank, world_size, local_rank, node_index, hosts, per_node, gpus)


# -- the rank's environment --------------------------------------------------------------------------


def rank_env(task: SlurmTask, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the rank runtime reads (state/contract.py), for `task`: torch.distributed's names
    from Slurm's, eyas's own (`EYAS_*`) passed through from `environ` (the sbatch script
    exported them: attempt_exports()), and CUDA_VISIBLE_DEVICES narrowed to this rank's GPUs
    where Slurm named any. Raises SlurmEnvError when the stage or attempt directory is missing,
    as workers/runtime/rank.py would, but before the rank starts."""
    env = os.environ if environ is None else environ
    for name in (contract.STAGE, contract.ATTEMPT_DIR):
        if not env.get(name):
            raise SlurmEnvError(f"{name} is not set: the attempt's sbatch script exports it (attempt_exports)")
    out = {
        contract.RANK: str(task.rank),
        contract.WORLD_SIZE: str(task.world_size),
        contract.LOCAL_RANK: str(task.local_rank),
        contract.LOCAL_WORLD_SIZE: str(task.local_world_size),
        contract.MASTER_ADDR: task.master_addr,
        contract.MASTER_PORT: str(task.master_port),
    }
    out.update({name: env[name] for name in EYAS_NAMES if env.get(name)})
    devices = task.devices()
    if devices is not None:
        out["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    return out


# eyas's own names of the contract: the same for every rank of an attempt, so the daemon
# exports them once into the job and Slurm hands them to every task.
EYAS_NAMES = (
    contract.RUN_ID,
    contract.STAGE,
    contract.ATTEMPT,
    contract.ATTEMPT_DIR,
    contract.OUTPUT_DIR,
    contract.CONFIG,
    contract.LOG_MAX_MB,
    contract.RANK_FINALIZE,
)


def attempt_exports(
    *,
    run_id: int,
    stage: str,
    attempt: int,
    attempt_dir: Path | str,
    output_dir: Path | str,
    config_path: Path | str | None = None,
    log_max_mb: float | None = None,
) -> dict[str, str]:
    """The variables the daemon exports into an attempt's job (the sbatch script): eyas's own
    names of the contract, the same for every rank. Slurm adds the per-task rest, which
    rank_env() turns into torch.distributed's names."""
    out = {
        contract.RUN_ID: str(run_id),
        contract.STAGE: stage,
        contract.ATTEMPT: str(attempt),
        contract.ATTEMPT_DIR: str(attempt_dir),
        contract.OUTPUT_DIR: str(output_dir),
    }
    if config_path is not None:
        out[contract.CONFIG] = str(config_path)
    if log_max_mb is not None:
        out[contract.LOG_MAX_MB] = f"{log_max_mb:g}"
    return out


# -- extraction across nodes ------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineLayout:
    """Extraction across nodes: one vLLM engine per node, TP over the node's GPUs."""

    node_index: int
    node_count: int
    tensor_parallel_size: int


def engine_per_node(task: SlurmTask) -> EngineLayout:
    """The layout of an extraction step launched with one task per node (`srun
    --ntasks-per-node=1`): that task is the node's vLLM driver and its TP workers take all
    the node's GPUs."""
    if task.local_world_size != 1:
        raise SlurmEnvError(
            f"{task.local_world_size} tasks on node {task.hosts[task.node_index]}: extraction runs one "
            "vLLM engine per node; launch it with --ntasks-per-node=1"
        )
    return EngineLayout(task.node_index, task.node_count, len(task.gpus) if task.gpus else 1)


def node_batches(
    plan: Sequence[Sequence[int]], lengths: Sequence[int], node_index: int, node_count: int
) -> list[list[int]]:
    """Node `node_index`'s share of `plan` (batches of dataset rows, workers/extract/plan.py's
    plan_batches), in the plan's order, so the largest of its batches still comes first.

    Every batch goes to exactly one node, whole, so each node's batches (and their padding) are
    the ones a single machine computes. Batches are dealt largest first (by tokens, ties by their
    place in the plan) to the node with the fewest tokens so far (ties to the lowest index): the
    nodes' token counts then differ by at most one batch's tokens. A pure function: every node
    computes the same deal without talking to another."""
    if node_count < 1:
        raise ValueError(f"node_count = {node_count}: use 1 or more")
    if not 0 <= node_index < node_count:
        raise ValueError(f"node_index = {node_index} is not one of {node_count} nodes")
    tokens = [sum(lengths[i] for i in batch) for batch in plan]
    load = [0] * node_count
    owner = [0] * len(plan)
    for b in sorted(range(len(plan)), key=lambda b: (-tokens[b], b)):
        node = min(range(node_count), key=lambda n: (load[n], n))
        owner[b] = node
        load[node] += tokens[b]
    return [list(batch) for b, batch in enumerate(plan) if owner[b] == node_index]
