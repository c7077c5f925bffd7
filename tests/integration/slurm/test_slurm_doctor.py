"""`eyas doctor`'s Slurm checks against a real one-node Slurm: a job step proves the state directory
shared, and a Python the nodes cannot start fails the check with Slurm's words."""

from __future__ import annotations

import pytest

from eyas.state.executiontables import ResourcesConfig, SlurmConfig
from eyas.state.runconfig import RunConfig
from eyas.workers.doctor import cluster


def slurm_cfg(state_dir) -> RunConfig:
    return RunConfig(name="d", resources=ResourcesConfig(executor="slurm"), slurm=SlurmConfig(state_dir=str(state_dir)))


@pytest.fixture
def on_cluster(slurm, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    return slurm


def test_a_job_step_proves_the_state_directory_shared(on_cluster, tmp_path):
    checks = cluster.check(slurm_cfg(tmp_path))
    assert [(c.name, c.verdict) for c in checks] == [("clients", "pass"), ("shared state", "pass")]
    assert checks[1].data == {"state": str(tmp_path), "node": on_cluster.node}
    assert not list(tmp_path.glob(".eyas-shared-check-*"))  # the probe is cleaned up


def test_a_python_the_nodes_cannot_start_fails_with_slurms_words(on_cluster, tmp_path):
    (check,) = [
        c for c in cluster.check(slurm_cfg(tmp_path), python="/nonexistent/python3") if c.name == "shared state"
    ]
    assert check.verdict == "fail"
    assert "job step failed" in check.detail and "/nonexistent/python3" in check.fix


def test_a_local_run_has_no_slurm_checks(tmp_path):
    assert cluster.check(RunConfig(name="d")) == []


def test_missing_clients_fail_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "_SEARCH", str(tmp_path))  # a PATH with no Slurm on it
    (check,) = cluster.check(slurm_cfg(tmp_path))
    assert (check.name, check.verdict) == ("clients", "fail")
    assert check.data["missing"] == list(cluster.CLIENTS) and "login node" in check.fix
