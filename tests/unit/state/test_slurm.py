"""The rank contract from a Slurm task's environment (state/slurm.py): hostlists, each task's
torch.distributed names and GPUs, eyas's exports, and each node's share of an extraction."""

from __future__ import annotations

import random

import pytest

from eyas.state import contract, slurm
from eyas.workers.extract.plan import plan_batches

# -- hostlists --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("node7", ["node7"]),
        ("n[8-10]", ["n8", "n9", "n10"]),  # the lower bound's width: no padding
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a[1-2]-ib,b3", ["a1-ib", "a2-ib", "b3"]),  # a suffix: read here, though 22.05's scontrol refuses it
        ("gpu[001-002], cpu[9]", ["gpu001", "gpu002", "cpu9"]),
    ],
)
def test_hostlists_expand_as_slurm_writes_them(text, hosts):
    assert slurm.expand_hostlist(text) == hosts
    # Where there is no scontrol, hostnames() is the same expansion.
    assert slurm.hostnames(text, scontrol=None) == hosts
    assert slurm.hostnames(text, scontrol="no-such-scontrol-here") == hosts


@pytest.mark.parametrize(
    "text, why",
    [
        ("n[1-", "without"),
        ("n1]", "without"),
        ("n[[1]]", "nested"),
        ("n[a-b]", "not a number"),
        ("n[3-1]", "backwards"),
    ],
)
def test_a_malformed_hostlist_is_refused(text, why):
    with pytest.raises(slurm.SlurmEnvError, match=why):
        slurm.expand_hostlist(text)


def test_hostnames_asks_scontrol_first_and_falls_back(tmp_path):
    # A stand-in scontrol that prints what a site's own HostFormat might: its answer wins.
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "%s-a\\n%s-b\\n" "$3" "$3"\n')
    fake.chmod(0o755)
    assert slurm.hostnames("x[1-2]", scontrol=str(fake)) == ["x[1-2]-a", "x[1-2]-b"]
    # One that fails (no slurm.conf to read, as on a login node): the pure expansion.
    fake.write_text("#!/bin/sh\necho 'scontrol: fatal: Could not establish a configuration source' >&2\nexit 1\n")
    assert slurm.hostnames("x[1-2]", scontrol=str(fake)) == ["x1", "x2"]


def test_tasks_per_node_expand():
    assert slurm.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm.expand_tasks_per_node("8") == [8]
    with pytest.raises(slurm.SlurmEnvError, match="neither N nor N"):
        slurm.expand_tasks_per_node("2x3")


# -- one task's environment ----------------------------------------------------------------------------

NODES, PER_NODE, GPUS, JOB = 2, 8, 8, 4242


def task_environ(rank: int, nodes: int = NODES, per_node: int = PER_NODE, **extra) -> dict[str, str]:
    """What Slurm gives task `rank` of `srun --nodes=N --ntasks-per-node=P` on gpu[07-08] with
    every GPU of the node visible to each task (--gpus-per-node)."""
    env = {
        "SLURM_JOB_ID": str(JOB),
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_LOCALID": str(rank % per_node),
        "SLURM_NODEID": str(rank // per_node),
        "SLURM_JOB_NODELIST": f"gpu[07-{7 + nodes - 1:02d}]",
        "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})",
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(GPUS))),
    }
    env.update(extra)
    return env


EXPORTS = slurm.attempt_exports(
    run_id=3, stage="train", attempt=1, attempt_dir="/shared/runs/3/train/attempt-1", output_dir="/shared/out/3"
)


def test_each_of_two_by_eight_tasks_gets_its_rank():
    hosts = slurm.expand_hostlist(task_environ(0)["SLURM_JOB_NODELIST"])
    assert hosts == ["gpu07", "gpu08"]
    envs = []
    for r in range(NODES * PER_NODE):
        environ = {**task_environ(r), **EXPORTS}
        envs.append(slurm.rank_env(slurm.task_from_environ(environ, scontrol=None), environ))
    for r, env in enumerate(envs):
        assert env[contract.RANK] == str(r)
        assert env[contract.WORLD_SIZE] == str(NODES * PER_NODE)
        assert env[contract.LOCAL_RANK] == str(r % PER_NODE)
        assert env[contract.LOCAL_WORLD_SIZE] == str(PER_NODE)
        assert env[contract.MASTER_ADDR] == hosts[0]
        # One GPU per rank: the node's eight split among its eight tasks.
        assert env["CUDA_VISIBLE_DEVICES"] == str(r % PER_NODE)
        assert {k: env[k] for k in EXPORTS} == EXPORTS
    # Every task finds the same rendezvous without talking to another.
    assert {env[contract.MASTER_PORT] for env in envs} == {str(slurm.master_port(JOB))}


def test_the_step_node_list_and_counts_come_before_the_jobs():
    # A step on part of the job's nodes: rank 0 is on the step's first node, not the job's.
    environ = task_environ(
        2,
        nodes=2,
        per_node=2,
        SLURM_JOB_NODELIST="gpu[01-04]",
        SLURM_TASKS_PER_NODE="2(x4)",
        SLURM_STEP_NODELIST="gpu[03-04]",
        SLURM_STEP_TASKS_PER_NODE="2,2",
        SLURM_NODEID="1",
    )
    task = slurm.task_from_environ(environ, scontrol=None)
    assert task.hosts == ("gpu03", "gpu04")
    assert task.master_addr == "gpu03"
    assert (task.rank, task.local_rank, task.local_world_size, task.node_count) == (2, 0, 2, 2)


def test_uneven_tasks_per_node():
    # Three tasks on two nodes, Slurm's block distribution: 2 then 1.
    environ = task_environ(2, SLURM_NTASKS="3", SLURM_LOCALID="0", SLURM_NODEID="1", SLURM_TASKS_PER_NODE="2,1")
    task = slurm.task_from_environ(environ, scontrol=None)
    assert (task.local_world_size, task.node_index) == (1, 1)
    # The node's single rank takes all its GPUs.
    assert task.devices() == tuple(str(g) for g in range(GPUS))


def test_gpus_slurm_bound_per_task_stay_as_bound():
    # --gpus-per-task=1: each task sees its own GPU as device 0 (renumbered by the cgroup).
    task = slurm.task_from_environ(task_environ(5, CUDA_VISIBLE_DEVICES="0"), scontrol=None)
    assert task.devices() == ("0",)
    # Without CUDA_VISIBLE_DEVICES, the step's GPUs; without either, no GPUs are named.
    environ = task_environ(1)
    del environ["CUDA_VISIBLE_DEVICES"]
    environ["SLURM_STEP_GPUS"] = "4,5,6,7,0,1,2,3"
    assert slurm.task_from_environ(environ, scontrol=None).devices() == ("5",)
    del environ["SLURM_STEP_GPUS"]
    task = slurm.task_from_environ(environ, scontrol=None)
    assert task.devices() is None
    assert "CUDA_VISIBLE_DEVICES" not in slurm.rank_env(task, EXPORTS)


def test_the_port_is_in_its_range_and_follows_the_job():
    ports = {slurm.master_port(job) for job in range(1, 3 * slurm.PORT_SPAN, 7)}
    assert min(ports) >= slurm.PORT_BASE and max(ports) < slurm.PORT_BASE + slurm.PORT_SPAN
    assert slurm.PORT_BASE + slurm.PORT_SPAN <= 32768  # below Linux's ephemeral ports
    assert slurm.master_port(JOB) != slurm.master_port(JOB + 1)


def test_a_missing_or_impossible_variable_is_named():
    environ = task_environ(0)
    del environ["SLURM_PROCID"]
    with pytest.raises(slurm.SlurmEnvError, match="SLURM_PROCID is not set"):
        slurm.task_from_environ(environ, scontrol=None)
    with pytest.raises(slurm.SlurmEnvError, match="SLURM_NODEID='x'"):
        slurm.task_from_environ(task_environ(0, SLURM_NODEID="x"), scontrol=None)
    with pytest.raises(slurm.SlurmEnvError, match="do not add up"):
        slurm.task_from_environ(task_environ(0, SLURM_TASKS_PER_NODE="8,7"), scontrol=None)
    with pytest.raises(slurm.SlurmEnvError, match="do not fit"):
        slurm.task_from_environ(task_environ(0, SLURM_LOCALID="8"), scontrol=None)


def test_rank_env_needs_the_attempts_exports():
    task = slurm.task_from_environ(task_environ(0), scontrol=None)
    environ = {k: v for k, v in EXPORTS.items() if k != contract.ATTEMPT_DIR}
    with pytest.raises(slurm.SlurmEnvError, match=contract.ATTEMPT_DIR):
        slurm.rank_env(task, environ)


def test_attempt_exports_name_the_contracts_variables():
    out = slurm.attempt_exports(
        run_id=9, stage="extract", attempt=4, attempt_dir="/a", output_dir="/o", config_path="/c.json", log_max_mb=2.5
    )
    assert out == {
        contract.RUN_ID: "9",
        contract.STAGE: "extract",
        contract.ATTEMPT: "4",
        contract.ATTEMPT_DIR: "/a",
        contract.OUTPUT_DIR: "/o",
        contract.CONFIG: "/c.json",
        contract.LOG_MAX_MB: "2.5",
    }
    assert set(out) <= set(slurm.EYAS_NAMES)


# -- extraction across nodes ------------------------------------------------------------------------------


def test_one_engine_per_node_takes_the_nodes_gpus():
    layouts = [
        slurm.engine_per_node(slurm.task_from_environ(task_environ(n, per_node=1), scontrol=None)) for n in (0, 1)
    ]
    assert layouts == [slurm.EngineLayout(n, NODES, GPUS) for n in (0, 1)]
    with pytest.raises(slurm.SlurmEnvError, match="--ntasks-per-node=1"):
        slurm.engine_per_node(slurm.task_from_environ(task_environ(0), scontrol=None))


def _dataset(seed: int, rows: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 4096) for _ in range(rows)]


@pytest.mark.parametrize(
    "seed, rows, batch_size, nodes", [(0, 1000, 8, 2), (1, 517, 16, 3), (2, 64, 4, 5), (3, 5, 2, 4)]
)
def test_the_nodes_share_every_batch_once_balanced_by_tokens(seed, rows, batch_size, nodes):
    lengths = _dataset(seed, rows)
    plan = plan_batches(lengths, 1, 0, batch_size)
    shares = [slurm.node_batches(plan, lengths, n, nodes) for n in range(nodes)]
    # Every batch exactly once, whole, and each node's in the plan's order.
    dealt = [tuple(b) for share in shares for b in share]
    assert sorted(dealt) == sorted(tuple(b) for b in plan)
    for share in shares:
        places = [plan.index(b) for b in share]
        assert places == sorted(places)
    tokens = [sum(lengths[i] for b in share for i in b) for share in shares]
    assert sum(tokens) == sum(lengths)
    largest_batch = max(sum(lengths[i] for i in b) for b in plan)
    assert max(tokens) - min(tokens) <= largest_batch


def test_the_split_is_a_pure_function():
    lengths = _dataset(4, 300)
    plan = plan_batches(lengths, 1, 0, 8)
    before = [list(b) for b in plan]
    first = [slurm.node_batches(plan, lengths, n, 3) for n in range(3)]
    again = [slurm.node_batches([list(b) for b in plan], list(lengths), n, 3) for n in range(3)]
    assert first == again
    assert plan == before  # the plan is not changed
    assert slurm.node_batches(plan, lengths, 0, 1) == plan  # one node: the whole plan


def test_the_split_refuses_a_node_outside_the_count():
    with pytest.raises(ValueError, match="node_count = 0"):
        slurm.node_batches([[0]], [1], 0, 0)
    with pytest.raises(ValueError, match="node_index = 2"):
        slurm.node_batches([[0]], [1], 2, 2)
