"""The extract stage on the vllm backend (vLLM's CPU build): hidden states against the hf
backend, tensor-parallel workers supervised as ranks, the seed regression (speculators 0.3.0's
patched forward on a DeepSeek-V3-shaped target at TP=2), per-rank logs, a SIGKILLed worker.

Engines take 20-50 s to start here, so each one serves several assertions: the TP=2 runs go
through a real daemon in module-scoped fixtures, and the tests read what they left behind.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from daemon_harness import Daemon, wait_for
from rank_context import rank_context
from runtoml import extract_toml
from safetensors.torch import load_file
from vllm_world import VLLM_ENV, build_models, token_rows, vllm_daemon, write_dataset, write_extensions

from eyas.daemon import logsplit
from eyas.state import queries, runconfig, schema, store
from eyas.workers.extract import hswriter
from eyas.workers.models import adapters
from eyas.workers.stages import extract
from eyas.workers.vllm import engine as vllm_engine
from eyas.workers.vllm import layout as vllm_layout
from eyas.workers.vllm import version as vllm_version

pytestmark = pytest.mark.slow

N_LAYERS = 8
ALL_IDS = list(range(N_LAYERS + 1))


# --- assets ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("vllm-targets"))


@pytest.fixture(scope="module")
def ext_dir(tmp_path_factory):
    return write_extensions(tmp_path_factory.mktemp("vllm-ext"))


def config(target: Path, backend="vllm", tp=1, batch_size=4, options=None, layer_ids=ALL_IDS) -> dict:
    return {
        "name": "t",
        "target": {"path": str(target), "dtype": "float32"},
        "extract": {"backend": backend, "layer_ids": layer_ids, "tensor_parallel_size": tp, "batch_size": batch_size},
        "resources": {"ranks": 1, "devices": "cpu"},
        "stages": {"extract": {"options": options or {}}},
    }


def hf_reference(output_dir: Path, target: Path, rows: list[list[int]]) -> Path:
    """The hf backend's files for the same rows (in process: tiny models load in a second)."""
    write_dataset(output_dir, rows)
    attempt = output_dir / "attempt"
    attempt.mkdir()
    ctx = rank_context("extract", attempt, output_dir, config(target, backend="hf"), progress_interval=0)
    extract.main(ctx)
    ctx.progress.close()
    return output_dir / "extract" / "hidden_states"


def drive(output_dir: Path, target: Path, rows, ext_dir: Path, tp=1, options=None, batch_size=4, timeout=300) -> Path:
    """One vllm-backend attempt run the way the daemon runs a rank: python -m eyas.workers.runtime.rank
    with the rank contract's environment, output to rank-0.log."""
    write_dataset(output_dir, rows)
    cfg_path = output_dir / "config.json"
    cfg_path.write_text(json.dumps(config(target, tp=tp, options=options, batch_size=batch_size)))
    attempt = output_dir / "attempt-1"
    attempt.mkdir()
    env = {
        **os.environ,
        **VLLM_ENV,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "EYAS_STAGE": "extract",
        "EYAS_ATTEMPT": "1",
        "EYAS_ATTEMPT_DIR": str(attempt),
        "EYAS_OUTPUT_DIR": str(output_dir),
        "EYAS_CONFIG": str(cfg_path),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(ext_dir), os.environ.get("PYTHONPATH", "")]),
    }
    with open(attempt / "rank-0.log", "wb") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "eyas.workers.runtime.rank"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
            cwd=attempt,
        )
    assert proc.returncode == 0, (attempt / "rank-0.log").read_text()[-6000:]
    return attempt


def assert_matches(got_dir: Path, want_dir: Path, rows: list[list[int]], atol: float = 1e-4) -> float:
    """Sample by sample: same token ids, same shape, every state within atol. Returns the worst."""
    worst = 0.0
    for idx, row in enumerate(rows):
        got = load_file(got_dir / f"hs_{idx}.safetensors")
        want = load_file(want_dir / f"hs_{idx}.safetensors")
        assert got["token_ids"].tolist() == row
        assert (
            got["hidden_states"].shape
            == want["hidden_states"].shape
            == (len(row), len(ALL_IDS), want["hidden_states"].shape[-1])
        )
        assert got["hidden_states"].dtype == torch.float32
        torch.testing.assert_close(got["hidden_states"], want["hidden_states"], atol=atol, rtol=0)
        worst = max(worst, (got["hidden_states"] - want["hidden_states"]).abs().max().item())
    return worst


# Mixed lengths: batches of 4 hold very different prompts, and with a 32-token step budget
# (llama) most prompts are split across steps.
LENGTHS = [37, 5, 23, 61, 12, 48, 29, 17, 3, 55, 90, 8]


# --- units: no engine ------------------------------------------------------------------------


def test_replies_take_a_list_per_rank_or_one_value():
    r0, r1 = {"tp_rank": 0, "samples": [1]}, {"tp_rank": 1}
    assert vllm_engine.replies([r0, r1], 2) == [r0, r1]  # LLM.collective_rpc
    assert vllm_engine.replies(r0, 2) == [r0]  # executor, unique_reply_rank=0
    assert vllm_engine.reply_of([r1, r0], 2, 0) is r0  # by the rank it names, not the index
    assert vllm_engine.reply_of(r0, 2, 0) is r0
    with pytest.raises(RuntimeError, match="collective_rpc returned 3 replies for 2 TP ranks"):
        vllm_engine.replies([r0, r1, r1], 2)
    # speculators' bug: a single reply that is itself a list (of layer tensors) read as per-rank.
    with pytest.raises(RuntimeError, match="collective_rpc returned list, not eyas's dict replies"):
        vllm_engine.replies([torch.zeros(2), torch.zeros(2)], 2)


def test_version_check_names_the_supported_versions():
    assert vllm_version.check("0.32.0") == "0.32.0"
    assert vllm_version.check("0.33.1+cu128") == "0.33.1+cu128"
    with pytest.raises(vllm_version.UnsupportedVllm) as err:
        vllm_version.check("0.16.0")
    assert str(err.value) == (
        "vLLM 0.16.0 is not supported by eyas's vllm backend (supported: 0.32 (the CPU build "
        'tested here); 0.33 (GPUs)); install one of them, or use backend = "hf"'
    )
    assert vllm_version.check() == "0.32.0"  # the installed CPU build


def test_engine_args_fix_what_capture_needs_and_refuse_overrides():
    args = vllm_engine.engine_args(
        "/m",
        "float32",
        2,
        False,
        90,
        vllm_engine.EXTENSION,
        {"max_num_batched_tokens": 64},
        {"kv_lora_rank": 512},
        cpu_build=True,
    )
    assert {
        k: args[k]
        for k in (
            "enforce_eager",
            "enable_prefix_caching",
            "tensor_parallel_size",
            "distributed_executor_backend",
            "max_model_len",
            "max_num_batched_tokens",
            "worker_extension_cls",
        )
    } == {
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "mp",
        "max_model_len": 91,
        "max_num_batched_tokens": 64,
        "worker_extension_cls": "eyas.workers.vllm.ext.EyasWorkerExtension",
    }
    assert args["compilation_config"] == {"custom_ops": ["-rotary_embedding"]}  # MLA on the CPU build
    assert "compilation_config" not in vllm_engine.engine_args("/m", "float32", 1, False, 9, "x", None, {}, True)
    # A float32 MLA target on the CPU build gets the reference MLA kernel: vLLM's AMX one (its
    # choice on hosts with AMX tiles) packs only bf16/fp16 weights and fails the load.
    mla = {"kv_lora_rank": 512}
    assert args["attention_backend"] == "CPU_MLA"
    assert "attention_backend" not in vllm_engine.engine_args("/m", "bfloat16", 1, False, 9, "x", None, mla, True)
    assert "attention_backend" not in vllm_engine.engine_args("/m", "float32", 1, False, 9, "x", None, mla, False)
    assert "attention_backend" not in vllm_engine.engine_args("/m", "float32", 1, False, 9, "x", None, {}, True)
    assert (
        vllm_engine.engine_args("/m", "float32", 1, False, 9, "x", {"attention_backend": "TORCH_SDPA"}, mla, True)[
            "attention_backend"
        ]
        == "TORCH_SDPA"
    )
    # Overriding what eyas sets is refused with the run's options (state/specs.py), before any engine.
    with pytest.raises(ValueError, match="options.vllm: sets enforce_eager, tensor_parallel_size, which eyas sets"):
        runconfig.stage_options("extract", {"vllm": {"tensor_parallel_size": 4, "enforce_eager": False}})
    assert vllm_engine.cpu_env(1) == {}
    assert set(vllm_engine.cpu_env(2)) == {"VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"}
    assert vllm_engine.cpu_env(2)["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1
    with pytest.raises(ValueError, match="worker extension 'nowhere.Ext' cannot be imported"):
        vllm_engine.load_extension("nowhere.Ext")
    with pytest.raises(ValueError, match="does not subclass eyas.workers.vllm.ext.EyasWorkerExtension"):
        vllm_engine.load_extension("eyas.workers.vllm.engine.Engine")


def test_layout_maps_rows_to_requests_and_refuses_a_wrong_one():
    """Three requests in one flattened step, the middle one a continued prompt (chunked
    prefill from position 20). A layout read in the wrong order must fail, not mis-slice."""
    a, b, c = (np.arange(100, 130), np.arange(200, 260), np.arange(300, 305))
    expected = {"a-x": (30, a), "b-y": (60, b), "c-z": (5, c)}
    positions = np.concatenate([np.arange(0, 30), np.arange(20, 40), np.arange(0, 5), [0, 0, 0]])  # 3 padding
    ids = np.concatenate([a, b[20:40], c, [0, 0, 0]])
    layout = vllm_layout.StepLayout.from_arrays(["a-x", "b-y", "c-z"], [0, 30, 50, 55], positions)
    assert layout.num_tokens == 55
    assert [(s.req_id, s.start, s.end, s.position) for s in layout.segments] == [
        ("a-x", 0, 30, 0),
        ("b-y", 30, 50, 20),
        ("c-z", 50, 55, 0),
    ]
    vllm_layout.verify(layout, positions, ids, expected)
    # The bug class of speculators #279: the same counts, requests in another order...
    swapped = vllm_layout.StepLayout.from_arrays(["b-y", "a-x", "c-z"], [0, 30, 50, 55], positions)
    with pytest.raises(
        vllm_layout.LayoutError,
        match=r"request b-y: rows 0:30 carry token ids \[100, 101, 102, 103, "
        r"..., 128, 129\], not its prompt's \[200, 201",
    ):
        vllm_layout.verify(swapped, positions, ids, expected)
    # ...or the wrong boundaries.
    shifted = vllm_layout.StepLayout.from_arrays(["a-x", "b-y", "c-z"], [0, 25, 50, 55], positions)
    with pytest.raises(
        vllm_layout.LayoutError,
        match=r"request b-y: rows 25:50 carry positions \[25, 26, 27, 28, "
        r"..., 38, 39\], not 25..49",
    ):
        vllm_layout.verify(shifted, positions, ids, expected)
    # Right positions, wrong tokens (two requests of equal length swapped).
    twin = {"a-x": (30, a), "b-y": (60, b), "c-z": (5, c + 1)}
    with pytest.raises(vllm_layout.LayoutError, match="request c-z: rows 50:55 carry token ids"):
        vllm_layout.verify(layout, positions, ids, twin)
    with pytest.raises(vllm_layout.LayoutError, match="step holds request 'd', which eyas did not send"):
        vllm_layout.verify(vllm_layout.StepLayout.from_arrays(["d"], [0, 2], positions), positions, ids, expected)
    with pytest.raises(vllm_layout.LayoutError, match="the step schedules 55 tokens but the model got 10 positions"):
        vllm_layout.StepLayout.from_arrays(["a-x", "b-y", "c-z"], [0, 30, 50, 55], positions[:10])


def test_vllm_tap_reads_each_layer_class_signature():
    class DeepseekV2DecoderLayer(torch.nn.Module):
        def forward(self, positions, hidden_states, residual, llama_4_scaling=None):
            return hidden_states, residual

    class HFStyleLayer(torch.nn.Module):
        def forward(self, hidden_states, attention_mask=None):
            return hidden_states

    read = adapters.TAPS["vllm"].bind(DeepseekV2DecoderLayer())
    h, r = torch.ones(3, 4), torch.full((3, 4), 2.0)
    assert torch.equal(read((torch.arange(3), h, r), {}), h + r)
    assert torch.equal(read((torch.arange(3), h, None), {}), h)  # layer 0: embeddings alone
    assert torch.equal(read((), {"positions": None, "hidden_states": h, "residual": r}), h + r)
    with pytest.raises(
        adapters.AdapterMismatch,
        match=r"HFStyleLayer.forward\(self, hidden_states, attention_mask=None\) "
        "has no 'residual' parameter",
    ):
        adapters.TAPS["vllm"].bind(HFStyleLayer())

    class DeepseekV2Model(torch.nn.Module):
        def embed_input_ids(self, input_ids):
            return input_ids

    decoder = adapters.Decoder(DeepseekV2Model(), [], None, 0, "model")
    assert decoder.api("embed", "vllm").__name__ == "embed_input_ids"
    with pytest.raises(adapters.AdapterMismatch) as err:
        decoder.api("embed", "hf")
    assert str(err.value) == (
        "'DeepseekV2Model' has no get_input_embeddings(), the hf API for embed; it has embed_input_ids()"
    )


def test_worker_records_its_first_error_before_vllm_flattens_it(tmp_path, monkeypatch):
    """What the extension does inside a worker, without one: the error file keeps the type,
    the message and the traceback once (vLLM adds a copy of it as a note); the first error stays."""
    import io
    import logging

    from eyas.workers.vllm import ext as vllm_ext

    monkeypatch.setenv("EYAS_ATTEMPT_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setitem(vllm_ext._state, "tp_rank", 1)
    monkeypatch.setitem(vllm_ext._state, "error_written", False)

    def patched_forward(model):
        return model.get_input_embeddings()

    try:
        patched_forward(torch.nn.Module())
    except AttributeError as exc:
        import traceback

        exc.add_note(traceback.format_exc())  # what vLLM's _execute_worker_rpc does
        record = logging.LogRecord(
            "vllm.v1.executor.multiproc_executor",
            logging.ERROR,
            __file__,
            1,
            "WorkerProc hit an exception.",
            None,
            (type(exc), exc, exc.__traceback__),
        )
        vllm_ext._ErrorHandler().emit(record)
    vllm_ext.record_error(RuntimeError(), "later")  # not the first: ignored
    rec = json.loads((tmp_path / "tp-1.error.json").read_text())
    assert (rec["type"], rec["message"], rec["tp_rank"], rec["role"], rec["driver_rank"]) == (
        "AttributeError",
        "'Module' object has no attribute 'get_input_embeddings'",
        1,
        "tp-worker",
        0,
    )
    assert rec["where"] == "vllm.v1.executor.multiproc_executor: WorkerProc hit an exception."
    assert rec["traceback"].count("Traceback (most recent call last)") == 1
    assert "in patched_forward" in rec["traceback"] and rec["pid"] == os.getpid()

    out = io.StringIO()
    prefixed = vllm_ext._Prefixed(out, "(Worker_TP1 pid=7) ")
    prefixed.write("hello ")
    prefixed.write("world\nsecond")
    prefixed.write(" line\n(Worker_TP1 pid=7) INFO from vLLM\n")
    prefixed.write("tail")
    prefixed.close_partial()
    assert out.getvalue() == (
        "(Worker_TP1 pid=7) hello world\n(Worker_TP1 pid=7) second line\n"
        "(Worker_TP1 pid=7) INFO from vLLM\n(Worker_TP1 pid=7) tail\n"
    )


RAW_LOG = [
    b"Triton is installed, but doesn't include CPU backend. Disabling Triton.\n",
    b"(MainProcess pid=100) INFO 12-02 14:09:03 [api_utils.py:286] non-default args\n",
    b"(EngineCore pid=101) INFO 12-02 14:09:16 [core.py:133] Initializing a V1 LLM engine\n",
    b"(VllmWorker-0 pid=200) INFO 12-02 14:09:42 [worker_base.py:317] Injected\n",
    b"(Worker pid=201) WARNING 12-02 14:09:42 [cpu_worker.py:114] libtcmalloc is not found\n",
    b"\x1b[0;36m(Worker_TP1 pid=201)\x1b[0;0m \x1b[32mINFO\x1b[0m 12-02 14:09:44 loading\n",
    b"(Worker_TP0 pid=200) ERROR 12-02 14:09:44 [multiproc_executor.py:1063] Traceback (most recent call last):\r\n",
    b"(Worker_TP0 pid=200) ERROR 12-02 14:09:44 [multiproc_executor.py:1063] AttributeError: boom\r\n",
    b"(VllmWorker rank=1 pid=999) INFO 01-01 00:00:00 older vLLM, unknown pid\n",
    b"(Worker_TP0 pid=200) progress 10%\rprogress 100%\n",
    b"(EngineCore pid=101) ERROR 12-02 14:10:19 [multiproc_executor.py:320] Worker proc VllmWorker-1 died "
    b"unexpectedly (exit code: -9), shutting down executor.\n",
    b"(Worker pid=555) a worker eyas never heard of\n",
    b"(APIServer pid=1) INFO served\n",
    b"(EngineCore pid=101) ERROR 12-02 14:10:19 [multiproc_executor.py:320] Worker proc VllmWorker-0 died "
    b"unexpectedly (exit code: None), shutting down executor.\n",
]


def _split_targets(directory: Path) -> dict[str, list[bytes]]:
    return {p.name: p.read_bytes().split(b"\n")[:-1] for p in sorted(directory.glob("*.log")) if p.name != "rank-0.log"}


def test_log_split_routes_every_line_once_and_resumes_exactly(tmp_path):
    pids = {200: 0, 201: 1}
    raw = tmp_path / "rank-0.log"
    raw.write_bytes(b"".join(RAW_LOG[:6]) + RAW_LOG[6][:20])  # a line still being written
    splitter = logsplit.LogSplitter(raw, tmp_path / "rank-0.split.json")
    assert splitter.pump(pids.get) == []
    with open(raw, "ab") as f:
        f.write(RAW_LOG[6][20:] + b"".join(RAW_LOG[7:]))
    # A daemon that dies after appending to the outputs but before saving its state...
    splitter._save = lambda: None
    splitter.pump(pids.get)
    # ...is replaced by one that cuts the outputs back to the saved sizes and reads on.
    resumed = logsplit.LogSplitter(raw, tmp_path / "rank-0.split.json")
    died = resumed.pump(pids.get, final=True)
    assert died == [(1, -9), (0, None)] and resumed.died == {1: -9, 0: None}
    assert logsplit.LogSplitter(raw, tmp_path / "rank-0.split.json").died == {1: -9, 0: None}  # kept
    logs = _split_targets(tmp_path)
    strip = lambda lines: [line + b"\n" for line in lines]  # noqa: E731
    assert strip(logs["tp-0.log"]) == [RAW_LOG[3], RAW_LOG[6], RAW_LOG[7], RAW_LOG[9]]
    assert strip(logs["tp-1.log"]) == [RAW_LOG[4], RAW_LOG[5], RAW_LOG[8]]
    assert strip(logs["driver.log"]) == [RAW_LOG[i] for i in (0, 1, 2, 10, 11, 12, 13)]
    # A partition of the raw log: every line in exactly one output, none changed.
    assert sorted(line for v in logs.values() for line in strip(v)) == sorted(RAW_LOG)
    assert sum(p.stat().st_size for p in tmp_path.glob("*.log") if p.name != "rank-0.log") == raw.stat().st_size


def test_migration_2_adds_tp_columns_to_an_existing_store(tmp_path):
    import sqlite_utils

    db = sqlite_utils.Database(tmp_path / "old.db")
    schema._m1_initial(db)
    db.execute("PRAGMA user_version = 1")
    db["runs"].insert({"id": 1, "name": "old", "state": "succeeded", "created_at": 1.0})
    db["attempts"].insert({"id": 1, "run_id": 1, "stage": "extract", "number": 1, "state": "succeeded"})
    db["ranks"].insert({"attempt_id": 1, "run_id": 1, "stage": "extract", "rank": 0, "state": "exited"})
    db.conn.commit()
    db.conn.close()
    db = store.open_writer(tmp_path / "old.db")
    assert schema.version(db) == schema.LATEST
    assert {"role", "tp_rank", "parent_rank"} <= set(db["ranks"].columns_dict)
    assert {"role", "tp_rank"} <= set(db["errors"].columns_dict)
    store.upsert_rank(db, 1, 1, role="tp-worker", tp_rank=0, parent_rank=0, state="running")
    rows = sorted(db.execute("SELECT rank, role, tp_rank, parent_rank FROM ranks").fetchall())
    assert rows == [(0, None, None, None), (1, "tp-worker", 0, 0)]


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)


def test_group_supervises_tp_workers_as_ranks_without_an_engine(tmp_path):
    """The daemon's side, with plain processes standing for the driver and two TP workers."""
    import asyncio

    from eyas.daemon import core as daemon_core
    from eyas.daemon.failures import describe_failure
    from eyas.daemon.group import Group
    from eyas.daemon.ranks import Rank, RankExit, create_time

    db = store.open_writer(tmp_path / "e.db")
    run_id = store.create_run(db, name="r", model="m", stages=[{"name": "extract"}])
    attempt_dir = tmp_path / "attempt-1"
    attempt_dir.mkdir()
    attempt_id, _ = store.new_attempt(db, run_id, "extract", dir=str(attempt_dir), world_size=1)
    driver, w0, w1 = _sleeper(), _sleeper(), _sleeper()
    try:
        group = Group(run_id, "extract", attempt_id, 1, attempt_dir, 1, [], 0)
        group.ranks.append(Rank(0, attempt_dir / "rank-0.log", driver.pid, create_time(driver.pid), driver))
        for k, w in enumerate((w0, w1)):
            (attempt_dir / f"tp-{k}.proc.json").write_text(
                json.dumps(
                    {
                        "tp_rank": k,
                        "rank": k,
                        "pid": w.pid,
                        "create_time": create_time(w.pid),
                        "device": "cpu",
                        "driver_rank": 0,
                        "time": time.time(),
                    }
                )
            )
        (attempt_dir / "rank-0.log").write_bytes(
            f"(Worker pid={w0.pid}) starting\n(Worker_TP1 pid={w1.pid}) loading\nplain driver line\n".encode()
        )
        learnt, exits = group.poll()
        assert [(r.rank, r.role, r.tp_rank, r.pid) for r in learnt] == [
            (1, "tp-worker", 0, w0.pid),
            (2, "tp-worker", 1, w1.pid),
        ]
        assert exits == [] and group.ranks[0].role == "driver"
        assert (attempt_dir / "tp-1.log").read_text() == f"(Worker_TP1 pid={w1.pid}) loading\n"
        assert {w0.pid, w1.pid, driver.pid} <= group.member_pids()

        async def kill_watched() -> float:
            # The daemon learns a worker's end from a pidfd in its event loop, not from a poll.
            group.watch(group.workers[1])
            killed = time.time()
            w1.kill()
            for _ in range(500):
                if group.workers[1].ended_at is not None:
                    break
                await asyncio.sleep(0.01)
            return killed

        killed = asyncio.run(kill_watched())
        assert 0 <= group.workers[1].ended_at - killed < 1.0 and group.pidfds == {}
        w1.wait()
        time.sleep(0.05)
        _, exits = group.poll()
        assert [(e.tp_rank, e.failed) for e in exits] == [(1, False)]  # vLLM has not spoken yet
        died_at = exits[0].time
        assert died_at == group.workers[1].ended_at
        with open(attempt_dir / "rank-0.log", "ab") as f:
            f.write(
                b"(EngineCore pid=1) ERROR Worker proc VllmWorker-1 died unexpectedly (exit code: -9), "
                b"shutting down executor.\n"
            )
        _, exits = group.poll()
        assert [(e.tp_rank, e.signal, e.unexpected, e.failed) for e in exits] == [(1, 9, True, True)]
        # A worker's error record that came first is the root cause, even while it still runs.
        (attempt_dir / "tp-0.error.json").write_text(
            json.dumps(
                {
                    "type": "AttributeError",
                    "message": "no",
                    "traceback": "Traceback...",
                    "pid": w0.pid,
                    "time": died_at - 1.0,
                    "tp_rank": 0,
                }
            )
        )
        _, exits = group.poll()
        assert [(e.tp_rank, e.error["type"]) for e in exits] == [(0, "AttributeError")]
        assert [(e.tp_rank, e.rank) for e in group.failures()] == [(0, 1), (1, 2)]
        rec = describe_failure(group, group.failures()[1], "host")
        assert (rec.type, rec.role, rec.tp_rank, rec.source) == ("SIGKILL", "tp-worker", 1, "signal")
        assert rec.message == (
            f"TP rank 1 (pid {w1.pid}) was killed by SIGKILL (signal 9): vLLM's executor "
            "reported that it died unexpectedly"
        )
        assert describe_failure(group, group.failures()[0], "host").path == str(attempt_dir / "tp-0.error.json")
        unknown = RankExit(2, w1.pid, None, None, died_at, tp_rank=1)
        Group._mark_unexpected(unknown, None)  # vLLM: "(exit code: None)"
        assert unknown.failed and describe_failure(group, unknown, "host").type == "WorkerDied"

        # A restarted daemon re-adopts the workers from the store and resumes the split.
        store.upsert_rank(
            db,
            attempt_id,
            0,
            monitor_pid=driver.pid,
            monitor_create_time=create_time(driver.pid),
            state="running",
            role="driver",
        )
        for k, w in enumerate((w0, w1)):
            store.upsert_rank(
                db,
                attempt_id,
                1 + k,
                pid=w.pid,
                create_time=create_time(w.pid) if k == 0 else 1.0,
                state="running" if k == 0 else "failed",
                signal=None if k == 0 else 9,
                role="tp-worker",
                tp_rank=k,
                parent_rank=0,
            )
        fresh = daemon_core.Core(db, tmp_path)
        asyncio.run(fresh.recover())
        again = fresh.groups[attempt_id]
        assert sorted((k, w.rank, w.pid, w.exit is not None) for k, w in again.workers.items()) == [
            (0, 1, w0.pid, False),
            (1, 2, w1.pid, True),
        ]
        assert again.splitter is not None and again.splitter.died == {1: -9}
        assert again.splitter.offset == (attempt_dir / "rank-0.log").stat().st_size

        asyncio.run(group.teardown(1.0, "test"))
        assert driver.poll() is not None and w0.poll() is not None
    finally:
        for p in (driver, w0, w1):
            if p.poll() is None:
                p.kill()
                p.wait()


# --- engines: TP=1, driven like a rank -----------------------------------------------------------


def test_tp1_llama_chunked_prefill_matches_hf(models, ext_dir, tmp_path):
    rows = token_rows(LENGTHS, seed=1)
    want = hf_reference(tmp_path / "hf", models["llama"], rows)
    attempt = drive(
        tmp_path / "vllm",
        models["llama"],
        rows,
        ext_dir,
        options={"vllm": {"max_num_batched_tokens": 32, "max_num_seqs": 4}},
    )
    worst = assert_matches(tmp_path / "vllm" / "extract" / "hidden_states", want, rows)
    assert worst < 1e-5
    summary = json.loads((attempt / "summary.json").read_text())
    steps = summary["vllm_steps"]
    # Several requests shared steps, and prompts were split across steps (chunked prefill).
    assert steps["max_requests_per_step"] >= 2 and steps["continued_segments"] >= 10
    assert steps["tokens"] == sum(LENGTHS)
    assert (summary["samples"], summary["files_written"], summary["backend"], summary["tensor_parallel_size"]) == (
        len(rows),
        len(rows),
        "vllm",
        1,
    )
    cfg = json.loads((tmp_path / "vllm" / "extract" / "data_config.json").read_text())
    assert (cfg["backend"], cfg["tensor_parallel_size"], cfg["layer_ids"]) == ("vllm", 1, ALL_IDS)
    assert cfg["vllm"] == {
        "version": "0.32.0",
        "model_class": "LlamaForCausalLM",
        "decoder_class": "LlamaModel",
        "layer_class": "LlamaDecoderLayer",
    }
    assert cfg["versions"]["vllm"] == "0.32.0"
    proc = json.loads((attempt / "tp-0.proc.json").read_text())
    assert (proc["tp_rank"], proc["device"], proc["driver_rank"]) == (0, "cpu", 0)
    assert not (attempt / "tp-0.error.json").exists()


def test_tp1_deepseek_mla_matches_hf(models, ext_dir, tmp_path):
    rows = token_rows(LENGTHS, seed=2)
    want = hf_reference(tmp_path / "hf", models["deepseek_v3"], rows)
    attempt = drive(tmp_path / "vllm", models["deepseek_v3"], rows, ext_dir)
    assert assert_matches(tmp_path / "vllm" / "extract" / "hidden_states", want, rows) < 1e-5
    assert json.loads((attempt / "summary.json").read_text())["vllm_steps"]["max_requests_per_step"] >= 2
    log = (attempt / "rank-0.log").read_text()
    assert "DeepseekV3ForCausalLM (deepseek_v3) -> DeepseekV2Model at model, 8 layers of DeepseekV2DecoderLayer" in log
    assert "embeddings via embed_input_ids()" in log


def test_wrapper_adapter_serves_the_kimi_nesting(models, ext_dir, tmp_path):
    """A vLLM model class with the decoder one level deeper (language_model.model, as
    Kimi-K2.5): the multimodal adapter finds it; the states are the plain model's."""
    rows = token_rows(LENGTHS[:8], seed=3)
    want = hf_reference(tmp_path / "hf", models["deepseek_v3"], rows)
    attempt = drive(
        tmp_path / "vllm", models["kimi"], rows, ext_dir, options={"worker_extension": "wrapper_ext.WrapperExtension"}
    )
    assert assert_matches(tmp_path / "vllm" / "extract" / "hidden_states", want, rows) < 1e-5
    cfg = json.loads((tmp_path / "vllm" / "extract" / "data_config.json").read_text())
    assert cfg["model"]["architecture"] == "KimiK25ForConditionalGeneration"
    assert (cfg["model"]["adapter"], cfg["model"]["decoder"]) == ("multimodal", "language_model.model")
    assert cfg["vllm"]["model_class"] == "TinyKimiK25" and cfg["vllm"]["decoder_class"] == "DeepseekV2Model"
    assert "TinyKimiK25 (multimodal) -> DeepseekV2Model at language_model.model" in (attempt / "rank-0.log").read_text()


# --- engines: TP=2 under the daemon --------------------------------------------------------------


def run_toml(
    name: str, output_dir: Path, target: Path, tp: int, options: dict | None = None, batch_size: int = 4
) -> str:
    return extract_toml(
        name, output_dir, target, backend="vllm", tp=tp, batch_size=batch_size, layer_ids=ALL_IDS, options=options or {}
    )


@pytest.fixture(scope="module")
def vdaemon(ext_dir):
    """A real daemon whose ranks find the test extensions and keep vLLM's CPU cache small."""
    with vllm_daemon(ext_dir) as d:
        yield d


def group_processes(d: Daemon, run_id: int, tp: int) -> list[psutil.Process]:
    """Once every TP worker has registered: the rank monitor, the driver and everything below
    it (EngineCore, the workers, multiprocessing's resource tracker). vLLM renames its
    processes (setproctitle), which blanks their /proc environ, so they are found by tree."""

    def ready():
        run = d.run(run_id)
        if run["state"] in ("succeeded", "failed", "cancelled"):
            raise AssertionError(
                f"run {run_id} ended before its TP workers were seen: {run['state']}, "
                f"{run['stages'][0]['attempt_list'][-1]}"
            )
        ranks = d.ranks(run_id, "extract")
        driver = next((r for r in ranks if r["rank"] == 0 and r["pid"]), None)
        if driver is None or sum(1 for r in ranks if r["role"] == "tp-worker") < tp:
            return None
        try:
            root = psutil.Process(driver["pid"])
            return [root.parent(), root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return None

    return wait_for(ready, 240, 0.05, "the TP workers to register")


def attempt_of(run: dict, number: int = -1) -> dict:
    return run["stages"][0]["attempt_list"][number]


def errors_of(d: Daemon, run_id: int) -> list[dict]:
    db = d.reader()
    try:
        return queries.errors(db, run_id)
    finally:
        db.conn.close()


SEED_LENGTHS = [44, 9, 71, 26, 58, 13, 35, 80, 19, 50]


@pytest.fixture(scope="module")
def seed_runs(vdaemon, models, tmp_path_factory):
    """The seed regression, then eyas's own extension on the same model and config."""
    out = tmp_path_factory.mktemp("seed")
    rows = token_rows(SEED_LENGTHS, seed=4)
    write_dataset(out, rows)
    seed = vdaemon.submit(
        run_toml("seed", out, models["deepseek_v3"], 2, {"worker_extension": "seed_ext.Speculators030Worker"}),
        "seed.toml",
    )
    seed_procs = group_processes(vdaemon, seed, 2)
    seed_run = vdaemon.wait_run(seed, timeout=300)
    ok = vdaemon.submit(run_toml("eyas", out, models["deepseek_v3"], 2), "eyas.toml")
    ok_procs = group_processes(vdaemon, ok, 2)
    ok_run = vdaemon.wait_run(ok, timeout=300)
    return {
        "out": out,
        "rows": rows,
        "seed": seed,
        "seed_run": seed_run,
        "seed_procs": seed_procs,
        "ok": ok,
        "ok_run": ok_run,
        "ok_procs": ok_procs,
    }


def test_seed_regression_root_cause_is_the_workers_attribute_error(vdaemon, seed_runs):
    run = seed_runs["seed_run"]
    assert run["state"] == "failed", run
    attempt = attempt_of(run)
    root = attempt["root_cause"]
    assert root["type"] == "AttributeError"
    assert root["message"] == "'DeepseekV2Model' object has no attribute 'get_input_embeddings'"
    assert root["role"] == "tp-worker" and root["tp_rank"] in (0, 1) and root["rank"] == 1 + root["tp_rank"]
    assert "get_input_embeddings(input_ids)" in root["traceback"] and "patched_forward" in root["traceback"]
    assert (
        root["traceback"]
        .rstrip()
        .endswith("AttributeError: 'DeepseekV2Model' object has no attribute 'get_input_embeddings'")
    )
    assert root["traceback"].count("Traceback (most recent call last)") == 1  # vLLM's note copy dropped
    assert root["path"].endswith(f"tp-{root['tp_rank']}.error.json")
    assert attempt["reason"] == (
        f"TP rank {root['tp_rank']} failed: AttributeError: 'DeepseekV2Model' object has "
        "no attribute 'get_input_embeddings'"
    )
    assert run["reason"] == f"extract: {attempt['reason']}"
    # Never vLLM's flattened message: the driver's error is recorded, after the worker's.
    errors = [e for e in errors_of(vdaemon, seed_runs["seed"]) if e["attempt"] == attempt["number"]]
    assert errors[0]["root_cause"] and errors[0]["tp_rank"] == root["tp_rank"]
    driver = [e for e in errors if e["rank"] == 0]
    assert all(not e["root_cause"] and e["time"] > root["time"] for e in driver)
    # Both TP ranks are ranks of the attempt, with their own logs; the group is gone.
    ranks = {r["rank"]: r for r in attempt["ranks"]}
    assert [(r["rank"], r["role"], r["tp_rank"]) for r in attempt["ranks"]] == [
        (0, "driver", None),
        (1, "tp-worker", 0),
        (2, "tp-worker", 1),
    ]
    assert ranks[1 + root["tp_rank"]]["state"] == "failed"
    assert all(r["pid"] for r in attempt["ranks"]) and ranks[1]["log_path"].endswith("/tp-0.log")
    procs = seed_runs["seed_procs"]
    titles = " ".join(p.name() + " " + " ".join(p.cmdline()) for p in procs if p.is_running())
    assert len(procs) >= 6, titles  # monitor, driver, resource tracker, EngineCore, 2 workers
    assert {r["pid"] for r in attempt["ranks"]} <= {p.pid for p in procs}
    assert [p for p in procs if p.is_running()] == []
    tp_logs = {k: Path(attempt["dir"], f"tp-{k}.log").read_text() for k in (0, 1)}
    for k in (0, 1):
        # The extension's plain print landed in its own worker's log, prefixed by eyas.
        assert f"seed extension: TP rank {k} patches the base model's forward" in tp_logs[k]
        assert f"seed extension: TP rank {1 - k} patches" not in tp_logs[k]
    assert (
        "AttributeError: 'DeepseekV2Model' object has no attribute 'get_input_embeddings'" in tp_logs[root["tp_rank"]]
    )


def test_then_eyas_extracts_the_same_target_at_tp2_matching_hf(seed_runs, models, tmp_path):
    run = seed_runs["ok_run"]
    assert run["state"] == "succeeded", run
    summary = run["stages"][0]["summary"]
    assert (summary["samples"], summary["files_written"], summary["tensor_parallel_size"]) == (10, 10, 2)
    rows = seed_runs["rows"]
    want = hf_reference(tmp_path / "hf", models["deepseek_v3"], rows)
    assert assert_matches(seed_runs["out"] / "extract" / "hidden_states", want, rows) < 1e-5
    attempt = attempt_of(run)
    assert [(r["rank"], r["role"], r["tp_rank"], r["state"]) for r in attempt["ranks"]] == [
        (0, "driver", None, "exited"),
        (1, "tp-worker", 0, "exited"),
        (2, "tp-worker", 1, "exited"),
    ]
    assert attempt["root_cause"] is None
    assert [p for p in seed_runs["ok_procs"] if p.is_running()] == []


def test_tp2_logs_are_split_per_worker_with_none_lost(seed_runs):
    for run in (seed_runs["seed_run"], seed_runs["ok_run"]):
        attempt = attempt_of(run)
        d = Path(attempt["dir"])
        pids = {json.loads((d / f"tp-{k}.proc.json").read_text())["pid"]: k for k in (0, 1)}
        raw = (d / "rank-0.log").read_bytes().split(b"\n")
        raw = [line + b"\n" for line in raw[:-1]] + ([raw[-1]] if raw[-1] else [])
        split = {name: (d / name).read_bytes() for name in ("driver.log", "tp-0.log", "tp-1.log")}
        assert sum(len(v) for v in split.values()) == len(b"".join(raw))
        lines = {name: [x + b"\n" for x in v.split(b"\n")[:-1]] for name, v in split.items()}
        assert sorted(x for v in lines.values() for x in v) == sorted(raw)
        for k in (0, 1):
            mine = lines[f"tp-{k}.log"]
            assert len(mine) >= 5
            for line in mine:
                m = logsplit.PREFIX.match(line)
                assert m is not None and pids.get(int(m.group("pid"))) == k, line
        for line in lines["driver.log"]:
            m = logsplit.PREFIX.match(line)
            assert m is None or int(m.group("pid")) not in pids, line
        assert any(b"(Worker_TP1 pid=" in x for x in lines["tp-1.log"])
        assert any(b"(Worker pid=" in x or b"(VllmWorker-0 pid=" in x for x in lines["tp-0.log"])
        assert any(b"(EngineCore" in x for x in lines["driver.log"])


KILL_LENGTHS = [random.Random(5).randint(40, 160) for _ in range(120)]


def test_sigkilled_tp_worker_is_the_root_cause_and_the_group_goes(vdaemon, models, tmp_path):
    rows = token_rows(KILL_LENGTHS, seed=6)
    out = tmp_path / "kill"
    write_dataset(out, rows)
    run_id = vdaemon.submit(
        run_toml("kill", out, models["llama"], 2, {"worker_extension": "slow_ext.SlowExtension"}), "kill.toml"
    )
    hs_dir = out / "extract" / "hidden_states"
    worker = wait_for(
        lambda: next((r for r in vdaemon.ranks(run_id, "extract") if r["tp_rank"] == 1 and r["pid"]), None),
        240,
        what="TP rank 1 to register",
    )
    members = group_processes(vdaemon, run_id, 2)
    assert len(members) >= 6  # monitor, driver, resource tracker, EngineCore, 2 workers
    wait_for(lambda: len(hswriter.existing(hs_dir)) >= 8, 240, 0.01, "8 files")
    assert all(p.is_running() for p in members)
    os.kill(worker["pid"], signal.SIGKILL)
    run = vdaemon.wait_run(run_id, timeout=120)
    assert run["state"] == "failed"
    attempt = attempt_of(run)
    root = attempt["root_cause"]
    # vLLM's executor names the exit code it saw; "None" when it looked before reaping the worker.
    report = re.search(
        r"Worker proc VllmWorker-1 died unexpectedly \(exit code: (-?\d+|None)\)",
        Path(attempt["dir"], "driver.log").read_text(),
    ).group(1)
    kind, how, sig = {
        "-9": ("SIGKILL", "was killed by SIGKILL (signal 9)", 9),
        "None": ("WorkerDied", "ended (its exit status was not known yet when vLLM looked)", None),
    }[report]
    assert (root["type"], root["rank"], root["role"], root["tp_rank"], root["pid"]) == (
        kind,
        2,
        "tp-worker",
        1,
        worker["pid"],
    )
    assert (
        root["message"] == f"TP rank 1 (pid {worker['pid']}) {how}: vLLM's executor reported that it died unexpectedly"
    )
    ranks = {r["rank"]: r for r in attempt["ranks"]}
    assert (ranks[2]["state"], ranks[2]["signal"]) == ("failed", sig)
    assert attempt["reason"].startswith(f"TP rank 1 failed: {kind}: TP rank 1 (pid {worker['pid']})")
    # Driver, EngineCore and the other worker are gone too.
    assert [p for p in members if p.is_running()] == []
    done = len(hswriter.existing(hs_dir))
    assert 8 <= done < len(rows)

    # Retry: it resumes, and the whole output matches transformers.
    assert vdaemon.cli("retry", run_id).returncode == 0
    run = vdaemon.wait_run(run_id, ("succeeded", "failed"), timeout=300)
    assert run["state"] == "succeeded", run
    summary = run["stages"][0]["summary"]
    assert (summary["samples"], summary["files_written"]) == (len(rows), len(rows) - done)
    want = hf_reference(tmp_path / "hf", models["llama"], rows)
    assert assert_matches(hs_dir, want, rows) < 1e-5
