"""`eyas runs`, `eyas show`, `eyas errors`: a real store, the real command, exact output."""

from __future__ import annotations

import calendar
import csv
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyas.cli import output
from eyas.state import display, paths, queries, schema, store

GiB = 2**30
T1 = calendar.timegm((2025, 11, 30, 9, 0, 0))  # run 1, succeeded
T2 = calendar.timegm((2025, 12, 1, 12, 0, 0))  # run 2, failed
T3 = calendar.timegm((2025, 12, 1, 18, 0, 0))  # run 3, cancelled
PEAK = 13207024435  # bytes: 12.3 GiB

ROOT_TB = (
    "Traceback (most recent call last):\n"
    '  File "/app/eyas/workers/stages/extract.py", line 40, in main\n'
    "    raise RuntimeError()\n"
    "RuntimeError"
)
OOM_TB = (
    "Traceback (most recent call last):\n"
    '  File "/app/eyas/workers/stages/extract.py", line 52, in main\n'
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
)


# What the evaluate stage writes (workers/stages/evaluate.py), abridged.
EVALUATE = {
    "outputs": ["/data/out/1/evaluate/results.json"],
    "num_speculative_tokens": 3,
    "prompts": 64,
    "prompt_source": "validation split",
    "max_tokens": 256,
    "vllm_version": "0.33.0",
    "device": "cuda",
    "tensor_parallel_size": 1,
    "acceptance_length": 2.4567,
    "acceptance_rate": 0.4856,
    "per_position": [0.71, 0.46, 0.2867],
    "baseline_acceptance_length": 1.0123,
    "baseline_acceptance_rate": 0.0041,
    "baseline_per_position": [0.0101, 0.0022, 0.0],
    "target_tok_s": 4012.25,
    "draft_tok_s": 7388.5,
    "baseline_tok_s": 3320.0,
    "speedup": 1.8415,
    "lossless": True,
    "mismatched_prompts": 0,
}


def build(home: Path, now: float) -> dict:
    """Five runs, one in every run state; the terminal ones at fixed times, the live ones
    relative to `now` (so that --since and the running run's duration are testable)."""
    db = store.open_writer(paths.db_path(home))
    rid = {}

    # 1: succeeded, three stages, roll-ups set as the daemon will, an evaluate summary.
    r = rid["succeeded"] = store.create_run(
        db,
        name="llama-eagle",
        model="meta-llama/Llama-3.1-8B",
        stages=[{"name": "prepare"}, {"name": "train"}, {"name": "evaluate"}],
        output_dir="/data/out/1",
        now=T1,
    )
    store.move_run(db, r, "running", "started", now=T1 + 60)
    t = T1 + 60
    for name, took in (("prepare", 600), ("train", 2885), ("evaluate", 240)):
        store.move_stage(db, r, name, "running", "started", now=t)
        a, _ = store.new_attempt(db, r, name, dir=str(paths.attempt_dir(r, name, 1, home)), world_size=1, now=t)
        store.upsert_rank(db, a, 0, pid=1000, state="exited", exit_code=0)
        store.move_attempt(db, a, "succeeded", "all ranks exited 0", now=t + took)
        store.move_stage(db, r, name, "succeeded", "all ranks exited 0", now=t + took)
        t += took
    db["stages"].update(
        store.stage_row(db, r, "train")["id"],
        {"summary_json": json.dumps({"outputs": {"draft": "/data/out/1/train/draft"}})},
    )
    db["stages"].update(store.stage_row(db, r, "evaluate")["id"], {"summary_json": json.dumps(EVALUATE)})
    store.move_run(db, r, "succeeded", "all stages succeeded", now=t)
    db["runs"].update(r, {"peak_gpu_mem": PEAK, "tok_s": 1234.4})

    # 2: failed in extract after a restart; root causes with an empty message and an OOM.
    r = rid["failed"] = store.create_run(
        db,
        name="qwen-draft",
        model="Qwen/Qwen3-8B",
        config_path="/cfg/qwen.toml",
        stages=[{"name": "prepare"}, {"name": "extract", "max_restarts": 1}, {"name": "vocab"}],
        output_dir="/data/out/2",
        now=T2,
    )
    store.move_run(db, r, "running", "started", now=T2 + 10)
    store.move_stage(db, r, "prepare", "running", "started", now=T2 + 10)
    a, _ = store.new_attempt(
        db, r, "prepare", dir=str(paths.attempt_dir(r, "prepare", 1, home)), world_size=1, now=T2 + 10
    )
    store.upsert_rank(db, a, 0, pid=100, state="exited", exit_code=0, tok_s=2500.0)
    store.move_attempt(db, a, "succeeded", "all ranks exited 0", now=T2 + 70)
    store.move_stage(
        db,
        r,
        "prepare",
        "succeeded",
        "all ranks exited 0",
        now=T2 + 70,
        summary_json=json.dumps({"outputs": ["/data/out/2/prepare/data.jsonl"]}),
    )
    db["stages"].update(store.stage_row(db, r, "prepare")["id"], {"tok_s": 2500.0})

    store.move_stage(db, r, "extract", "running", "started", now=T2 + 70)
    a1, _ = store.new_attempt(
        db, r, "extract", dir=str(paths.attempt_dir(r, "extract", 1, home)), world_size=2, now=T2 + 70
    )
    store.upsert_rank(db, a1, 0, pid=200, host="gpu-a", state="failed", exit_code=1)
    store.upsert_rank(db, a1, 1, pid=201, host="gpu-a", state="failed", exit_code=1)
    store.record_error(
        db,
        a1,
        rank=1,
        pid=201,
        host="gpu-a",
        type="RuntimeError",
        message="",
        traceback=ROOT_TB,
        time_=T2 + 100,
        root_cause=True,
        source="error_file",
        path="/runs/2/extract/attempt-1/rank-1.error.json",
    )
    store.record_error(
        db,
        a1,
        rank=0,
        pid=200,
        host="gpu-a",
        type="torch.distributed.DistBackendError",
        message="NCCL communicator was aborted",
        traceback="Traceback (most recent call last):\n"
        "torch.distributed.DistBackendError: NCCL communicator was aborted",
        time_=T2 + 101,
        root_cause=False,
        source="error_file",
    )
    store.move_attempt(db, a1, "failed", "rank 1 failed", now=T2 + 110)
    db["stages"].update(store.stage_row(db, r, "extract")["id"], {"restarts": 1})

    a2, _ = store.new_attempt(
        db, r, "extract", dir=str(paths.attempt_dir(r, "extract", 2, home)), world_size=2, now=T2 + 120
    )
    store.upsert_rank(db, a2, 0, pid=300, host="gpu-a", state="failed", signal=9, oom_killed=1)
    store.upsert_rank(db, a2, 1, pid=301, host="gpu-a", state="killed", signal=15)
    db["ranks"].update(
        next(db["ranks"].rows_where("attempt_id = ? and rank = 0", [a2]))["id"], {"peak_gpu_mem": PEAK, "tok_s": 1234.4}
    )
    db["ranks"].update(
        next(db["ranks"].rows_where("attempt_id = ? and rank = 1", [a2]))["id"],
        {"peak_gpu_mem": 512 * 2**20, "tok_s": 999.5},
    )
    store.record_error(
        db,
        a2,
        rank=1,
        pid=301,
        host="gpu-a",
        type="SIGTERM",
        message="stopped with the group after rank 0 failed",
        traceback="",
        time_=T2 + 181,
        root_cause=False,
        source="exit",
    )
    store.record_error(
        db,
        a2,
        rank=0,
        pid=300,
        host="gpu-a",
        type="torch.OutOfMemoryError",
        message="CUDA out of memory. Tried to allocate 2.00 GiB",
        traceback=OOM_TB,
        time_=T2 + 180,
        root_cause=True,
        source="error_file",
    )
    store.move_attempt(db, a2, "failed", "rank 0 failed", now=T2 + 190)
    store.move_stage(db, r, "extract", "failed", "rank 0 failed", now=T2 + 190)
    store.move_run(db, r, "failed", "extract failed", now=T2 + 195)
    db["runs"].update(r, {"tok_s": 56.7})

    # 3: cancelled 12 s after it started.
    r = rid["cancelled"] = store.create_run(db, name="cancelled_one", model="m", stages=[{"name": "prepare"}], now=T3)
    store.move_run(db, r, "running", "started", now=T3 + 5)
    store.move_stage(db, r, "prepare", "running", "started", now=T3 + 5)
    store.move_stage(db, r, "prepare", "cancelled", "eyas stop", now=T3 + 17)
    store.move_run(db, r, "cancelled", "eyas stop", now=T3 + 17)

    # 4: running for 2h00m05s (shown as 2h00m for the next 55 s).
    started = now - 7205
    r = rid["running"] = store.create_run(
        db, name="running-one", model="m", stages=[{"name": "train"}], now=started - 1
    )
    store.move_run(db, r, "running", "started", now=started)
    store.move_stage(db, r, "train", "running", "started", now=started)
    a, _ = store.new_attempt(db, r, "train", dir=str(paths.attempt_dir(r, "train", 1, home)), world_size=1, now=started)
    store.upsert_rank(db, a, 0, pid=400, state="running")
    db["runs"].update(r, {"peak_gpu_mem": 2 * GiB, "tok_s": 10.0})

    # 5: submitted a minute ago.
    rid["pending"] = store.create_run(db, name="pending-one", model="m", stages=[{"name": "prepare"}], now=now - 60)
    db.conn.close()
    return rid


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    h = tmp_path_factory.mktemp("home")
    now = time.time()
    build(h, now)
    return h, now


def utc_minute(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(t))


def utc_iso(t: float) -> str:
    return (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t))
        + (f".{round((t % 1) * 1e6):06d}" if t % 1 else "")
        + "+00:00"
    )


HEADER = [
    "id  name           model                    state      stage     started           duration  peak_gpu_mem  tok_s  accept",
    "--  -------------  -----------------------  ---------  --------  ----------------  --------  ------------  -----  ------",
]


def table_rows(now: float) -> dict[int, str]:
    return {
        5: f" 5  pending-one    m                        pending              {utc_minute(now - 60)}",
        4: f" 4  running-one    m                        running    train     {utc_minute(now - 7205)}     2h00m       2.0 GiB     10",
        3: " 3  cancelled_one  m                        cancelled  prepare   2025-12-01 18:00       12s",
        2: " 2  qwen-draft     Qwen/Qwen3-8B            failed     extract   2025-12-01 12:00     3m05s                   57",
        1: " 1  llama-eagle    meta-llama/Llama-3.1-8B  succeeded  evaluate  2025-11-30 09:01     1h02m      12.3 GiB  1,234    2.46",
    }


def test_runs_table_exact(home, eyas_cli):
    h, now = home
    p = eyas_cli(h, "runs")
    assert (p.returncode, p.stderr) == (0, "")
    rows = table_rows(now)
    assert p.stdout.splitlines() == HEADER + [rows[i] for i in (5, 4, 3, 2, 1)]


def test_runs_json_csv_nl_raw_values(home, eyas_cli):
    h, now = home
    p = eyas_cli(h, "runs", "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert p.stdout.startswith('[\n  {\n    "id": 5,\n')  # indent 2
    assert [r["id"] for r in data] == [5, 4, 3, 2, 1]
    assert data[4] == {
        "id": 1,
        "name": "llama-eagle",
        "model": "meta-llama/Llama-3.1-8B",
        "state": "succeeded",
        "stage": "evaluate",
        "started": "2025-11-30T09:01:00+00:00",
        "duration": 3725.0,
        "peak_gpu_mem": 13207024435.0,
        "tok_s": 1234.4,
        "accept": 2.4567,
    }
    assert data[3] == {
        "id": 2,
        "name": "qwen-draft",
        "model": "Qwen/Qwen3-8B",
        "state": "failed",
        "stage": "extract",
        "started": "2025-12-01T12:00:10+00:00",
        "duration": 185.0,
        "peak_gpu_mem": None,
        "tok_s": 56.7,
        "accept": None,
    }
    assert data[0] == {
        "id": 5,
        "name": "pending-one",
        "model": "m",
        "state": "pending",
        "stage": None,
        "started": utc_iso(now - 60),
        "duration": None,
        "peak_gpu_mem": None,
        "tok_s": None,
        "accept": None,
    }
    running = data[1]
    assert abs(running.pop("duration") - 7205) < 60
    assert running == {
        "id": 4,
        "name": "running-one",
        "model": "m",
        "state": "running",
        "stage": "train",
        "started": utc_iso(now - 7205),
        "peak_gpu_mem": 2.0 * GiB,
        "tok_s": 10.0,
        "accept": None,
    }

    p = eyas_cli(h, "runs", "--csv", "--state", "failed")
    assert p.stdout == (
        "id,name,model,state,stage,started,duration,peak_gpu_mem,tok_s,accept\n"
        "2,qwen-draft,Qwen/Qwen3-8B,failed,extract,2025-12-01T12:00:10+00:00,185.0,,56.7,\n"
    )
    assert list(csv.DictReader(io.StringIO(eyas_cli(h, "runs", "--csv").stdout)))[4]["peak_gpu_mem"] == "13207024435.0"

    p = eyas_cli(h, "runs", "--nl", "--state", "cancelled")
    assert p.stdout == (
        '{"id": 3, "name": "cancelled_one", "model": "m", "state": "cancelled", "stage": "prepare", '
        '"started": "2025-12-01T18:00:05+00:00", "duration": 12.0, "peak_gpu_mem": null, "tok_s": null, '
        '"accept": null}\n'
    )


@pytest.mark.parametrize(
    "args, ids",
    [
        (["--state", "pending"], [5]),
        (["--state", "running"], [4]),
        (["--state", "succeeded"], [1]),
        (["--state", "failed"], [2]),
        (["--state", "cancelled"], [3]),
        (["--since", "7d"], [5, 4]),
        (["--since", "3h"], [5, 4]),
        (["--since", "90s"], [5]),
        (["--since", "1w", "--state", "running"], [4]),
        (["--limit", "2"], [5, 4]),
        (["--limit", "1", "--state", "failed"], [2]),
        (["llama"], [1]),  # name and model both match: listed once
        (["QWEN3"], [2]),  # the model, case-insensitively
        (["ing-one"], [5, 4]),
        (["_one"], [3]),  # "_" is literal, not LIKE's wildcard
        (["%"], []),
    ],
)
def test_runs_selection(home, eyas_cli, args, ids):
    h, _ = home
    p = eyas_cli(h, "runs", "--json", *args)
    assert p.returncode == 0, p.stderr
    assert [r["id"] for r in json.loads(p.stdout)] == ids


def test_runs_selection_table_says_no_match(home, eyas_cli):
    h, _ = home
    p = eyas_cli(h, "runs", "nothing-like-this")
    assert (p.returncode, p.stdout.splitlines(), p.stderr) == (
        0,
        [
            "id  name  model  state  stage  started  duration  peak_gpu_mem  tok_s  accept",
            "--  ----  -----  -----  -----  -------  --------  ------------  -----  ------",
        ],
        "eyas runs: no runs match\n",
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--since", "7x"], "eyas runs: --since '7x': use a number with s, m, h, d or w, e.g. 7d\n"),
        (["--since", "d"], "eyas runs: --since 'd': use a number with s, m, h, d or w, e.g. 7d\n"),
        (["--state", "done"], "eyas runs: --state 'done': use one of pending, running, succeeded, failed, cancelled\n"),
        (["--limit", "0"], "eyas runs: --limit 0: use a positive number\n"),
    ],
)
def test_runs_bad_input(home, eyas_cli, args, message):
    p = eyas_cli(home[0], "runs", *args)
    assert (p.returncode, p.stdout, p.stderr) == (2, "", message)


def test_no_database_yet(tmp_path, eyas_cli):
    p = eyas_cli(tmp_path, "runs")
    assert (p.returncode, p.stderr) == (0, "eyas runs: no runs yet\n")
    assert p.stdout.splitlines()[0] == "id  name  model  state  stage  started  duration  peak_gpu_mem  tok_s  accept"
    assert len(p.stdout.splitlines()) == 2
    for fmt, expected in (
        ("--json", "[]\n"),
        ("--nl", ""),
        ("--csv", "id,name,model,state,stage,started,duration,peak_gpu_mem,tok_s,accept\n"),
    ):
        p = eyas_cli(tmp_path, "runs", fmt)
        assert (p.returncode, p.stdout, p.stderr) == (0, expected, "")
    for cmd in ("show", "errors", "logs"):
        p = eyas_cli(tmp_path, cmd, "5")
        assert (p.returncode, p.stdout, p.stderr) == (1, "", "eyas: no run 5\n")
    assert not (tmp_path / "eyas.db").exists()  # reading never creates the store


def test_show_missing_run(home, eyas_cli):
    p = eyas_cli(home[0], "show", "5000")
    assert (p.returncode, p.stdout, p.stderr) == (1, "", "eyas: no run 5000\n")


def test_show_exact(home, eyas_cli):
    p = eyas_cli(home[0], "show", "2")
    assert (p.returncode, p.stderr) == (0, "")
    assert p.stdout.splitlines() == [
        "run 2: qwen-draft",
        "  model:      Qwen/Qwen3-8B",
        "  state:      failed (extract failed)",
        "  stage:      extract",
        "  config:     /cfg/qwen.toml",
        "  output dir: /data/out/2",
        "  started:    2025-12-01 12:00",
        "  duration:   3m05s",
        "",
        "stages:",
        "  stage    state      attempts  duration  tok/s",
        "  -------  ---------  --------  --------  -----",
        "  prepare  succeeded         1     1m00s  2,500",
        "  extract  failed            2     2m00s",
        "  vocab    pending           0",
        "",
        "failures:",
        "  extract attempt 1, rank 1: RuntimeError (empty message)",
        "    Traceback (most recent call last):",
        "    ...",
        "    RuntimeError",
        "  extract attempt 2, rank 0: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "    Traceback (most recent call last):",
        "    ...",
        "    torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "",
        "ranks (latest attempt of each stage):",
        "  stage    attempt  rank  pid  state   exit           peak_gpu_mem  tok/s",
        "  -------  -------  ----  ---  ------  -------------  ------------  -----",
        "  prepare        1     0  100  exited  exit 0                       2,500",
        "  extract        2     0  300  failed  SIGKILL (OOM)      12.3 GiB  1,234",
        "  extract        2     1  301  killed  SIGTERM           512.0 MiB  1,000",
        "",
        "outputs:",
        "  /data/out/2",
        "  prepare: /data/out/2/prepare/data.jsonl",
    ]


def test_show_succeeded_outputs_and_missing_config(home, eyas_cli):
    out = eyas_cli(home[0], "show", "1").stdout.splitlines()
    assert out[:8] == [
        "run 1: llama-eagle",
        "  model:      meta-llama/Llama-3.1-8B",
        "  state:      succeeded (all stages succeeded)",
        "  stage:      evaluate",
        "  config:",
        "  output dir: /data/out/1",
        "  started:    2025-11-30 09:01",
        "  duration:   1h02m",
    ]
    assert "failures:" not in out
    assert out[-4:] == [
        "outputs:",
        "  /data/out/1",
        "  train draft: /data/out/1/train/draft",
        "  evaluate: /data/out/1/evaluate/results.json",
    ]
    # The evaluate stage's figures, after the stages: the trained draft beside its untrained
    # baseline and the target alone.
    at = out.index("stages:")
    assert out[at + 6 : at + 15] == [
        "",
        "evaluate (k=3, 64 prompts from the validation split, up to 256 tokens, vLLM 0.33.0 on cuda, "
        "tensor parallel 1):",
        "  draft      accept len  accept rate  per position    tok/s",
        "  ---------  ----------  -----------  --------------  -----",
        "  trained         2.457        48.6%  0.71/0.46/0.29  7,388",
        "  untrained       1.012         0.4%  0.01/0.00/0.00  3,320",
        "  no draft                                            4,012",
        "  speedup x1.84; lossless: yes (greedy outputs with each draft vs without)",
        "",
    ]
    assert out[at + 15] == "ranks (latest attempt of each stage):"


def test_show_json_is_get_run(home, eyas_cli):
    h, _ = home
    p = eyas_cli(h, "show", "2", "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    db = queries.connect(paths.db_path(h))
    assert data == queries.get_run(db, 2)  # a finished run: nothing depends on the clock
    extract = data["stages"][1]
    assert [a["root_cause"]["type"] for a in extract["attempt_list"]] == ["RuntimeError", "torch.OutOfMemoryError"]
    assert extract["attempt_list"][0]["root_cause"]["traceback"] == ROOT_TB  # the whole traceback
    assert extract["attempt_list"][0]["root_cause"]["message"] == ""
    assert [(r["rank"], r["signal"], r["oom_killed"]) for r in extract["attempt_list"][1]["ranks"]] == [
        (0, 9, 1),
        (1, 15, None),
    ]
    p = eyas_cli(h, "show", "2", "--nl")
    assert p.stdout.count("\n") == 1 and json.loads(p.stdout) == data
    p = eyas_cli(h, "show", "2", "--csv")
    assert p.stdout.splitlines() == [
        "name,state,attempts,restarts,started_at,duration,peak_gpu_mem,tok_s",
        "prepare,succeeded,1,0,2025-12-01T12:00:10+00:00,60.0,,2500.0",
        "extract,failed,2,1,2025-12-01T12:01:10+00:00,120.0,,",
        "vocab,pending,0,0,,,,",
    ]


def test_errors_order_and_tracebacks(home, eyas_cli):
    p = eyas_cli(home[0], "errors", "2")
    assert (p.returncode, p.stderr) == (0, "")
    assert p.stdout.splitlines() == [
        "extract attempt 2:",
        "* root cause: rank 0, pid 300, on gpu-a, 2025-12-01 12:03:00, from error_file",
        "    torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "      Traceback (most recent call last):",
        '        File "/app/eyas/workers/stages/extract.py", line 52, in main',
        "      torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "  rank 1, pid 301, on gpu-a, 2025-12-01 12:03:01, from exit",
        "    SIGTERM: stopped with the group after rank 0 failed",
        "",
        "extract attempt 1:",
        "* root cause: rank 1, pid 201, on gpu-a, 2025-12-01 12:01:40, from error_file",
        "    RuntimeError (empty message)",
        "      Traceback (most recent call last):",
        '        File "/app/eyas/workers/stages/extract.py", line 40, in main',
        "          raise RuntimeError()",
        "      RuntimeError",
        "    error file: /runs/2/extract/attempt-1/rank-1.error.json",
        "  rank 0, pid 200, on gpu-a, 2025-12-01 12:01:41, from error_file",
        "    torch.distributed.DistBackendError: NCCL communicator was aborted",
        "      Traceback (most recent call last):",
        "      torch.distributed.DistBackendError: NCCL communicator was aborted",
    ]


def test_errors_json_stage_filter_and_bad_stage(home, eyas_cli):
    h, _ = home
    data = json.loads(eyas_cli(h, "errors", "2", "--json").stdout)
    assert [(e["attempt"], e["rank"], e["root_cause"]) for e in data] == [
        (2, 0, True),
        (2, 1, False),
        (1, 1, True),
        (1, 0, False),
    ]
    assert data[2] == {
        "stage": "extract",
        "attempt": 1,
        "rank": 1,
        "root_cause": True,
        "type": "RuntimeError",
        "message": "",
        "time": "2025-12-01T12:01:40+00:00",
        "pid": 201,
        "host": "gpu-a",
        "source": "error_file",
        "path": "/runs/2/extract/attempt-1/rank-1.error.json",
        "traceback": ROOT_TB,
        "role": None,
        "tp_rank": None,
    }
    p = eyas_cli(h, "errors", "2", "--stage", "prepare")
    assert (p.returncode, p.stdout, p.stderr) == (0, "", "eyas errors: run 2 has no recorded errors in prepare\n")
    p = eyas_cli(h, "errors", "2", "--stage", "train")
    assert (p.returncode, p.stderr) == (
        1,
        "eyas errors: run 2 has no stage 'train' (its stages: prepare, extract, vocab)\n",
    )
    p = eyas_cli(h, "errors", "2", "--stage", "extract", "--csv")
    rows = list(csv.DictReader(io.StringIO(p.stdout)))
    assert [(r["attempt"], r["rank"], r["root_cause"], r["type"]) for r in rows] == [
        ("2", "0", "True", "torch.OutOfMemoryError"),
        ("2", "1", "False", "SIGTERM"),
        ("1", "1", "True", "RuntimeError"),
        ("1", "0", "False", "torch.distributed.DistBackendError"),
    ]


HEAVY = ("torch", "transformers", "vllm", "textual", "sqlite_utils", "pandas", "numpy", "rich")


@pytest.mark.parametrize(
    "argv",
    [
        ["runs", "--json", "--limit", "50"],
        ["runs", "--state", "failed", "--csv"],
        ["show", "2", "--json"],
        ["show", "2"],
        ["errors", "2"],
        ["runs"],
        ["logs", "2", "--stage", "prepare"],
    ],
)
def test_no_heavy_imports(home, argv):
    """The history commands stay light: none of the ML stack, no sqlite_utils (0.5 s with
    pandas), and rich only for a table drawn on a terminal (never here: stdout is a pipe)."""
    code = (
        "import sys\n"
        "from eyas.cli.main import main\n"
        f"rc = main(['--home', {str(home[0])!r}] + {argv!r})\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}), rc, file=sys.stderr)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    last = p.stderr.strip().splitlines()[-1]
    # logs of a stage with no log file exits 1 with its message; the imports are what count.
    assert last in ("[] 0", "[] 1"), p.stderr


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_rich_table_on_a_terminal():
    buf = Tty()
    cols = [
        output.Column("id", right=True),
        output.Column("name"),
        output.Column("state"),
        output.Column("duration", display.duration),
    ]
    long_name = "[bold]" + "n" * 120  # wider than the 80 columns rich assumes here; not markup
    output.emit([{"id": 7, "name": long_name, "state": "failed", "duration": 65}], cols, None, out=buf)
    text = buf.getvalue()
    assert "\x1b[31mfailed" in text  # the state in red
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text)
    assert [ln.split() for ln in plain.splitlines()] == [
        ["id", "name", "state", "duration"],
        ["7", long_name, "failed", "1m05s"],
    ]


def test_terminal_table_of_many_rows_is_plain():
    # rich takes ~1 ms a row: a long listing on a terminal gets the plain table instead.
    buf = Tty()
    rows = [{"id": i} for i in range(output.RICH_MAX_ROWS + 1)]
    output.emit(rows, [output.Column("id", right=True)], None, out=buf)
    lines = buf.getvalue().splitlines()
    assert lines[:3] == [" id", "---", "  0"] and len(lines) == output.RICH_MAX_ROWS + 3


@pytest.mark.parametrize(
    "seconds, shown",
    [
        (None, ""),
        (0, "0s"),
        (12.9, "12s"),
        (60, "1m00s"),
        (185, "3m05s"),
        (3599, "59m59s"),
        (3725, "1h02m"),
        (86399, "23h59m"),
        (93784, "1d02h"),
        (-3, "0s"),
    ],
)
def test_duration_format(seconds, shown):
    assert display.duration(seconds) == shown


def test_value_formats():
    assert display.size(PEAK) == "12.3 GiB"
    assert display.size(512 * 2**20) == "512.0 MiB"
    assert display.size(None) == ""
    assert display.count(1234.4) == "1,234"
    assert display.count(1234567.8) == "1,234,568"
    assert display.count(None) == ""
    assert display.iso_utc(T2 + 10) == "2025-12-01T12:00:10+00:00"
    assert display.iso_utc(T2 + 0.25) == "2025-12-01T12:00:00.250000+00:00"


def test_query_schema_version_matches_schema():
    # queries.connect checks the version without importing schema (which imports sqlite_utils).
    assert queries.SCHEMA_VERSION == schema.LATEST


def test_connect_refuses_newer_schema(tmp_path):
    db = store.open_writer(paths.db_path(tmp_path))
    db.execute(f"PRAGMA user_version = {schema.LATEST + 1}")
    db.conn.close()
    with pytest.raises(RuntimeError, match="newer than this eyas"):
        queries.connect(paths.db_path(tmp_path))


def test_queries_same_through_sqlite_utils_and_plain_sqlite3(home):
    """The daemon and the TUI pass a sqlite_utils.Database, the CLI a plain connection."""
    path = paths.db_path(home[0])
    rich_db, plain = store.open_reader(path), queries.connect(path)
    for run_id in (1, 2, 3, 4, 5):
        assert queries.get_run(rich_db, run_id, now=T3) == queries.get_run(plain, run_id, now=T3)
        assert queries.errors(rich_db, run_id) == queries.errors(plain, run_id)
        assert queries.events(rich_db, run_id) == queries.events(plain, run_id)
    assert queries.list_runs(rich_db, now=T3) == queries.list_runs(plain, now=T3)
    assert queries.stage_attempts(plain, 2, "extract") == [
        {
            "number": 1,
            "state": "failed",
            "dir": str(paths.attempt_dir(2, "extract", 1, home[0])),
            "started_at": T2 + 70,
            "ended_at": T2 + 110,
        },
        {
            "number": 2,
            "state": "failed",
            "dir": str(paths.attempt_dir(2, "extract", 2, home[0])),
            "started_at": T2 + 120,
            "ended_at": T2 + 190,
        },
    ]
    assert queries.stage_state(plain, 2, "vocab") == "pending"
    assert queries.stage_state(plain, 2, "train") is None
    with pytest.raises(KeyError, match="no run 99"):
        queries.get_run(plain, 99)


def test_preflight_has_no_tok_s_in_runs_and_show(tmp_path, eyas_cli):
    """preflight's canaries count a batch or two of tokens: no throughput, so no tok/s anywhere,
    while the stages after it keep theirs (the daemon's roll-ups as it writes them)."""
    db = store.open_writer(paths.db_path(tmp_path))
    r = store.create_run(db, name="checks", model="m", stages=[{"name": "preflight"}, {"name": "prepare"}], now=T1)
    store.move_run(db, r, "running", "started", now=T1)
    store.move_stage(db, r, "preflight", "running", "started", now=T1)
    a, _ = store.new_attempt(
        db, r, "preflight", dir=str(paths.attempt_dir(r, "preflight", 1, tmp_path)), world_size=1, now=T1
    )
    store.upsert_rank(db, a, 0, pid=100, state="running", tok_s=6178.0)
    db["stages"].update(store.stage_row(db, r, "preflight")["id"], {"tok_s": 6178.0})
    db["runs"].update(r, {"tok_s": 6178.0})
    running = json.loads(eyas_cli(tmp_path, "runs", "--json").stdout)
    assert [(x["stage"], x["tok_s"]) for x in running] == [("preflight", None)]

    store.upsert_rank(db, a, 0, state="exited", exit_code=0)
    store.move_attempt(db, a, "succeeded", "ok", now=T1 + 3)
    store.move_stage(db, r, "preflight", "succeeded", "ok", now=T1 + 3)
    store.move_stage(db, r, "prepare", "running", "started", now=T1 + 3)
    a, _ = store.new_attempt(
        db, r, "prepare", dir=str(paths.attempt_dir(r, "prepare", 1, tmp_path)), world_size=1, now=T1 + 3
    )
    store.upsert_rank(db, a, 0, pid=101, state="exited", exit_code=0, tok_s=6295.0)
    db["stages"].update(store.stage_row(db, r, "prepare")["id"], {"tok_s": 6295.0})
    db["runs"].update(r, {"tok_s": 6295.0})
    store.move_attempt(db, a, "succeeded", "ok", now=T1 + 10)
    store.move_stage(db, r, "prepare", "succeeded", "ok", now=T1 + 10)
    store.move_run(db, r, "succeeded", "ok", now=T1 + 10)
    db.conn.close()
    shown = json.loads(eyas_cli(tmp_path, "show", r, "--json").stdout)
    assert [(s["name"], s["tok_s"]) for s in shown["stages"]] == [("preflight", None), ("prepare", 6295.0)]
    assert [r["tok_s"] for s in shown["stages"] for a in s["attempt_list"] for r in a["ranks"]] == [None, 6295.0]
    out = eyas_cli(tmp_path, "show", r).stdout.splitlines()
    assert [line.split() for line in out if line.startswith(("  preflight ", "  prepare "))] == [
        ["preflight", "succeeded", "1", "3s"],
        ["prepare", "succeeded", "1", "7s", "6,295"],
        ["preflight", "1", "0", "100", "exited", "exit", "0"],
        ["prepare", "1", "0", "101", "exited", "exit", "0", "6,295"],
    ]
    assert json.loads(eyas_cli(tmp_path, "runs", "--json").stdout)[0]["tok_s"] == 6295.0
