"""The rank contract from Slurm (state/slurm.py) in real Slurm tasks: `srun --ntasks=2` of a
script that imports it and prints the environment it computes."""

from __future__ import annotations

import json
import sys

import pytest

from eyas.state import contract
from eyas.state import slurm as slurm_env

SCRIPT = """
import json, os
from eyas.state import slurm
task = slurm.task_from_environ()
pure = slurm.task_from_environ(scontrol=None)  # the expansion without scontrol
print(json.dumps({"env": slurm.rank_env(task), "job": os.environ["SLURM_JOB_ID"],
                  "hosts": task.hosts, "pure_hosts": pure.hosts}))
"""


def test_two_tasks_compute_the_rank_contract(slurm, tmp_path):
    script = slurm.shared / "rank_env.py"
    script.write_text(SCRIPT)
    exports = slurm_env.attempt_exports(
        run_id=7, stage="selftest", attempt=2, attempt_dir=tmp_path / "attempt-2", output_dir=tmp_path / "out"
    )
    p = slurm.run("srun", "--ntasks=2", f"--chdir={slurm.shared}", sys.executable, str(script), env=exports)
    records = sorted((json.loads(line) for line in p.stdout.splitlines()), key=lambda r: int(r["env"][contract.RANK]))
    assert [r["env"][contract.RANK] for r in records] == ["0", "1"]
    job = int(records[0]["job"])
    for r in records:
        env = r["env"]
        assert r["hosts"] == r["pure_hosts"] == [slurm.node]
        assert env[contract.WORLD_SIZE] == "2"
        assert env[contract.LOCAL_RANK] == env[contract.RANK]
        assert env[contract.LOCAL_WORLD_SIZE] == "2"
        assert env[contract.MASTER_ADDR] == slurm.node
        assert env[contract.MASTER_PORT] == str(slurm_env.master_port(job))
        assert {k: env[k] for k in exports} == exports


# Lists as Slurm 22.05 writes them (it refuses a suffix after a name's last bracket group, which
# expand_hostlist() reads all the same).
@pytest.mark.parametrize(
    "nodelist", ["gpu[01-03,07],login1", "r[1-2]n[08-10]", "n[8-10]", "node7", "a[1-2],b[3-4]c[01-02]"]
)
def test_the_pure_expansion_agrees_with_scontrol(slurm, monkeypatch, nodelist):
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))  # scontrol reads it before it expands anything
    by_scontrol = slurm.run("scontrol", "show", "hostnames", nodelist).stdout.split()
    assert slurm_env.hostnames(nodelist) == by_scontrol
    assert slurm_env.expand_hostlist(nodelist) == by_scontrol
