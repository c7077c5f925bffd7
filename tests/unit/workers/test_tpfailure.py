"""workers/vllm/tpfailure.py: a driver whose TP workers the daemon cannot watch re-raises the first
worker's recorded exception, with the worker's type, message and traceback."""

from __future__ import annotations

import json

import pytest

from eyas.state import contract
from eyas.workers.runtime import rank as runtime
from eyas.workers.vllm import tpfailure


def write(folder, k, when, kind="AttributeError", message="boom", driver=1):
    folder.mkdir(exist_ok=True)
    record = {"type": kind, "message": message, "traceback": f"Traceback ...\n{kind}: {message}\n", "time": when}
    record.update(tp_rank=k, pid=100 + k, driver_rank=driver, role="tp-worker")
    (folder / contract.tp_file(k, contract.ERROR)).write_text(json.dumps(record))


def test_driver_0_on_the_daemons_host_is_left_to_the_daemon(tmp_path, monkeypatch):
    monkeypatch.delenv(contract.REMOTE, raising=False)
    write(tmp_path, 0, 1.0, driver=0)
    assert tpfailure.surfaced(RuntimeError(""), tmp_path, 0) is None
    monkeypatch.setenv(contract.REMOTE, "1")  # the same driver as a Slurm task: its own to report
    assert tpfailure.surfaced(RuntimeError(""), tmp_path, 0).eyas_record["type"] == "AttributeError"


def test_the_earliest_workers_error_of_this_driver_is_raised_as_itself(tmp_path, monkeypatch):
    monkeypatch.delenv(contract.REMOTE, raising=False)
    folder = tmp_path / contract.tp_dir_name(2)
    write(folder, 1, 5.0, "ValueError", "later", driver=2)
    write(
        folder, 0, 3.0, "AttributeError", "'DeepseekV2Model' object has no attribute 'get_input_embeddings'", driver=2
    )
    exc = tpfailure.surfaced(RuntimeError(""), tmp_path, 2)
    assert isinstance(exc, tpfailure.TPWorkerFailed)
    record = runtime.error_record(exc, rank=2, stage="extract", attempt=1)
    assert (record["type"], record["message"]) == (
        "AttributeError",
        "'DeepseekV2Model' object has no attribute 'get_input_embeddings'",
    )
    assert (
        "raised in TP rank 0 (pid 100) of rank 2's vLLM engine; the engine reported RuntimeError('')"
        in (record["traceback"])
    )
    assert record["rank"] == 2 and record["stage"] == "extract"


def test_without_a_worker_record_the_engines_own_error_stands(tmp_path, monkeypatch):
    monkeypatch.setenv(contract.REMOTE, "1")
    assert tpfailure.surfaced(RuntimeError("x"), tmp_path, 1) is None


@pytest.mark.parametrize(("driver", "name"), [(None, None), (0, None), (3, "driver-3")])
def test_where_each_drivers_workers_keep_their_files(driver, name):
    assert contract.tp_dir_name(driver) == name
