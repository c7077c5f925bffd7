"""The metrics sampler against real process trees and real files; only the GPU is faked."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pynvml
import pytest

from eyas.daemon.progressfile import read_new
from eyas.daemon.sampler import RankRef, Sampler
from eyas.workers.nvml import FAKE_ENV, GpuProbe, JsonFakeNvml, load_nvml

DEADLINE_S = 30.0  # generous: the machine has 2 cores shared with other test runs


# --- fakes for what cannot exist here: a GPU -------------------------------------------------


class DictNvml:
    """An in-test NVML: devices as plain dicts, errors from pynvml itself.

    Unlike the JSON fake it has no nvmlDeviceGetGraphicsRunningProcesses (older drivers
    and some bindings lack it), returns bytes names like old pynvml, and a device whose
    "util" is None raises NotSupported, as MIG slices do.
    """

    NVMLError = pynvml.NVMLError

    def __init__(self, devices: list[dict]):
        self.devices = devices
        self.inits = self.shutdowns = 0

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.devices[h]["name"].encode()

    def nvmlDeviceGetUUID(self, h):
        return self.devices[h]["uuid"]

    def nvmlDeviceGetMemoryInfo(self, h):
        d = self.devices[h]
        return SimpleNamespace(used=d["used"], total=d["total"], free=d["total"] - d["used"])

    def nvmlDeviceGetUtilizationRates(self, h):
        if self.devices[h]["util"] is None:
            raise pynvml.NVMLError_NotSupported()
        return SimpleNamespace(gpu=self.devices[h]["util"], memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in self.devices[h]["procs"].items()]


class NoDriverNvml:
    """pynvml on a host without the NVIDIA driver."""

    NVMLError = pynvml.NVMLError

    def __init__(self):
        self.calls = 0

    def nvmlInit(self):
        self.calls += 1
        raise pynvml.NVMLError_LibraryNotFound()

    def __getattr__(self, name):  # anything after a failed init would be a bug in GpuProbe
        raise AssertionError(f"GpuProbe called {name} after nvmlInit failed")


# --- real process trees ----------------------------------------------------------------------

PARENT = textwrap.dedent("""
    import subprocess, sys, time
    burn = "import time\\nend = time.time() + 90\\nwhile time.time() < end: pass"
    kids = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(2)]
    print(" ".join(str(k.pid) for k in kids), flush=True)
    time.sleep(90)
""")


@pytest.fixture
def burner():
    """A parent python with two CPU-burning children, in its own session like a rank's monitor."""
    proc = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, start_new_session=True)
    kids: list[int] = []
    try:
        kids = [int(x) for x in proc.stdout.readline().split()]
        assert len(kids) == 2, "the parent did not report its children"
        root = psutil.Process(proc.pid)
        yield SimpleNamespace(pid=proc.pid, create_time=root.create_time(), kids=kids, proc=proc)
    finally:
        for pid in [proc.pid, *kids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        proc.stdout.close()
        for pid in kids:
            _wait_gone(pid)


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return  # reparented to init, which reaps it; nothing of ours is left running
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)


def ref_for(
    tree,
    tmp_path: Path,
    *,
    rank: int = 0,
    attempt_id: int = 7,
    create_time: float | None = None,
    stage: str = "train",
    progress: Path | None = None,
    **kw,
) -> RankRef:
    return RankRef(
        run_id=1,
        stage=stage,
        attempt=2,
        attempt_id=attempt_id,
        rank=rank,
        root_pid=tree.pid if tree else None,
        root_create_time=(tree.create_time if create_time is None else create_time) if tree else None,
        progress_path=progress or tmp_path / f"rank-{rank}.progress.jsonl",
        **kw,
    )


def rows(res, name: str, rank: int | None = 0) -> list[dict]:
    return [m for m in res.metrics if m["name"] == name and m["rank"] == rank]


def one(res, name: str, rank: int | None = 0) -> float:
    found = rows(res, name, rank)
    assert len(found) == 1, f"{name} rank {rank}: {found}"
    return found[0]["value"]


# --- CPU, RSS, process trees -----------------------------------------------------------------


def test_tree_cpu_rss_and_descendants(burner, tmp_path):
    s = Sampler(nvml=NoDriverNvml())
    ref = ref_for(burner, tmp_path)
    first = s.sample([ref])
    # First sight of each process: psutil has no earlier reading to diff against.
    assert one(first, "cpu_percent") == 0.0
    assert first.metrics[0] == {
        "time": first.metrics[0]["time"],
        "run_id": 1,
        "stage": "train",
        "attempt": 2,
        "rank": 0,
        "name": "cpu_percent",
        "value": 0.0,
    }
    expected = {burner.pid: burner.create_time, **{k: psutil.Process(k).create_time() for k in burner.kids}}
    assert dict(first.descendants[(7, 0)]) == expected

    deadline = time.monotonic() + DEADLINE_S
    cpu = 0.0
    while cpu <= 50 and time.monotonic() < deadline:
        time.sleep(0.5)
        res = s.sample([ref])
        cpu = one(res, "cpu_percent")
    assert cpu > 50, "two busy children should show in the tree's CPU"
    rss = one(res, "rss_bytes")
    own = sum(psutil.Process(p).memory_info().rss for p in expected)
    assert 0.5 * own < rss < 2 * own  # three pythons' RSS, read moments apart
    assert res.ranks[(7, 0)]["cpu_percent"] == cpu and res.ranks[(7, 0)]["rss"] == rss
    assert "peak_gpu_mem" not in res.ranks[(7, 0)]  # no GPU: no GPU figures at all
    assert dict(res.descendants[(7, 0)]) == expected


def test_wrong_create_time_is_a_stranger(burner, tmp_path):
    s = Sampler(nvml=NoDriverNvml())
    res = s.sample([ref_for(burner, tmp_path, create_time=burner.create_time - 100)])
    assert res.metrics == []
    assert res.ranks == {} and res.stages == {}
    assert res.descendants == {(7, 0): []}


def test_orphans_of_a_dead_monitor_stay_measured(burner, tmp_path):
    s = Sampler(nvml=NoDriverNvml())
    ref = ref_for(burner, tmp_path)
    assert {p for p, _ in s.sample([ref]).descendants[(7, 0)]} == {burner.pid, *burner.kids}
    os.kill(burner.pid, signal.SIGKILL)
    burner.proc.wait()
    res = s.sample([ref])
    # The children were reparented away from the tree, yet they are still this rank's load.
    assert {p for p, _ in res.descendants[(7, 0)]} == set(burner.kids)
    assert one(res, "rss_bytes") > 0
    s.forget(7)
    assert s.sample([ref]).descendants == {(7, 0): []}  # root gone, caches dropped: nothing


def test_rank_without_process_yet(tmp_path):
    s = Sampler(nvml=NoDriverNvml())
    res = s.sample([ref_for(None, tmp_path)])
    assert res.metrics == [] and res.ranks == {} and res.descendants == {(7, 0): []}


# --- GPUs through NVML -----------------------------------------------------------------------


def test_gpu_memory_per_rank_from_an_nvml_object(burner, tmp_path):
    k1, k2 = burner.kids
    nvml = DictNvml(
        [
            {
                "name": "NVIDIA H200",
                "uuid": "GPU-a",
                "used": 9000,
                "total": 150_000,
                "util": 40,
                "procs": {burner.pid: 1000, k1: 2000, 999_999_999: 5000},
            },  # last: not ours
            {
                "name": "NVIDIA H200",
                "uuid": "GPU-b",
                "used": 7000,
                "total": 150_000,
                "util": None,
                "procs": {k1: 4000, k2: None},
            },  # None: NVML could not say
        ]
    )
    s = Sampler(nvml=nvml)
    assert s.gpu_available and nvml.inits == 1
    ref = ref_for(burner, tmp_path)
    res = s.sample([ref], now=5000.0)
    assert one(res, "gpu_mem_bytes") == 7000  # 1000 + 2000 + 4000 + 0
    assert res.ranks[(7, 0)]["peak_gpu_mem"] == 7000
    assert res.stages[(1, "train")] == {"peak_gpu_mem": 7000}
    assert res.gpus == [
        {"index": 0, "name": "NVIDIA H200", "uuid": "GPU-a", "mem_used": 9000, "mem_total": 150_000, "util_gpu": 40},
        {"index": 1, "name": "NVIDIA H200", "uuid": "GPU-b", "mem_used": 7000, "mem_total": 150_000, "util_gpu": None},
    ]
    device_rows = sorted((m["name"], m["value"]) for m in res.metrics if m["run_id"] is None)
    assert device_rows == [
        ("gpu0.mem_total", 150_000),
        ("gpu0.mem_used", 9000),
        ("gpu0.util", 40),
        ("gpu1.mem_total", 150_000),
        ("gpu1.mem_used", 7000),
    ]
    assert all(
        m["time"] == 5000.0 and m["stage"] is None and m["attempt"] is None for m in res.metrics if m["run_id"] is None
    )

    nvml.devices[0]["procs"] = {burner.pid: 10}
    nvml.devices[1]["procs"] = {}
    res = s.sample([ref])
    assert one(res, "gpu_mem_bytes") == 10
    assert res.ranks[(7, 0)]["peak_gpu_mem"] == 7000  # the peak outlives the drop
    s.close()
    assert nvml.shutdowns == 1 and not s.gpu_available


def write_fake(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)  # atomic, as a test editing a live daemon's fake should


def test_json_fake_nvml_through_the_environment(burner, tmp_path, monkeypatch, caplog):
    k1, k2 = burner.kids
    fake = tmp_path / "gpus.json"
    write_fake(
        fake,
        {
            "devices": [
                {
                    "name": "NVIDIA H200",
                    "uuid": "GPU-0",
                    "mem_total": 150_000_000_000,
                    "mem_used": 1000,
                    "util": 7,
                    "processes": [{"pid": burner.pid, "mem": 5000}, {"pid": k1, "mem": 300}],
                    "graphics_processes": [{"pid": k1, "mem": 300}],
                },  # C+G: counted once
                {
                    "name": "NVIDIA H200",
                    "uuid": "GPU-1",
                    "mem_total": 150_000_000_000,
                    "mem_used": 2000,
                    "util": 0,
                    "processes": [{"pid": k2, "mem": 700}],
                },
            ]
        },
    )
    monkeypatch.setenv(FAKE_ENV, str(fake))
    assert isinstance(load_nvml(), JsonFakeNvml)
    log = logging.getLogger("test.sampler.jsonfake")
    caplog.set_level(logging.INFO, logger=log.name)
    s = Sampler(log=log)  # nvml=None: load_nvml() finds the fake
    assert s.gpu_available
    ref = ref_for(burner, tmp_path)
    res = s.sample([ref])
    assert one(res, "gpu_mem_bytes") == 6000
    assert [(g["uuid"], g["mem_used"], g["util_gpu"]) for g in res.gpus] == [("GPU-0", 1000, 7), ("GPU-1", 2000, 0)]

    # The daemon keeps running; the test moves memory and loses a GPU.
    write_fake(
        fake,
        {
            "devices": [
                {
                    "name": "NVIDIA H200",
                    "uuid": "GPU-0",
                    "mem_total": 150_000_000_000,
                    "mem_used": 64_000,
                    "util": 99,
                    "processes": [{"pid": burner.pid, "mem": 60_000}],
                },
                {"name": "NVIDIA H200", "uuid": "GPU-1", "error": "GpuIsLost"},
            ]
        },
    )
    for _ in range(3):
        res = s.sample([ref])
        assert one(res, "gpu_mem_bytes") == 60_000
        assert one(res, "gpu0.mem_used", None) == 64_000 and one(res, "gpu0.util", None) == 99
        assert [g["index"] for g in res.gpus] == [0]
        assert rows(res, "gpu1.mem_used", None) == []
    assert res.ranks[(7, 0)]["peak_gpu_mem"] == 60_000
    lost = [r for r in caplog.records if "GpuIsLost" in r.getMessage()]
    # One line per distinct failure (the device query, the process list), not one per second.
    assert len(lost) == 2 and all(r.levelno == logging.WARNING for r in lost)


def test_json_fake_without_driver(tmp_path, monkeypatch, caplog):
    fake = tmp_path / "gpus.json"
    write_fake(fake, {"error": "LibraryNotFound"})
    monkeypatch.setenv(FAKE_ENV, str(fake))
    caplog.set_level(logging.INFO, logger="test.sampler.nodriver")
    probe = GpuProbe(log=logging.getLogger("test.sampler.nodriver"))
    assert probe.start() is False
    assert probe.devices() == [] and probe.process_gpu_memory() == {} and probe.device_count() == 0
    probe.shutdown()
    assert [r.getMessage() for r in caplog.records] == [
        "no NVML (NVMLError_LibraryNotFound: NVML Shared Library Not Found): GPU metrics off, CPU figures only"
    ]


def test_json_fake_bad_file_is_named(tmp_path, monkeypatch):
    fake = tmp_path / "gpus.json"
    fake.write_text("{not json")
    with pytest.raises(ValueError, match=f"{FAKE_ENV}=.*gpus.json: not valid fake NVML JSON"):
        JsonFakeNvml(fake).nvmlInit()


def _no_nvml_case(s: Sampler, burner, tmp_path, caplog, logger: str) -> None:
    assert s.gpu_available is False
    ref = ref_for(burner, tmp_path)
    for _ in range(5):
        res = s.sample([ref])
        assert res.gpus == []
        assert {m["name"] for m in res.metrics} == {"cpu_percent", "rss_bytes"}
    lines = [r for r in caplog.records if r.name == logger]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert lines[0].getMessage().startswith("no NVML (")
    assert lines[0].getMessage().endswith("): GPU metrics off, CPU figures only")


def test_no_nvml_fake_object(burner, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="test.sampler.nonvml")
    nvml = NoDriverNvml()
    s = Sampler(nvml=nvml, log=logging.getLogger("test.sampler.nonvml"))
    _no_nvml_case(s, burner, tmp_path, caplog, "test.sampler.nonvml")
    assert nvml.calls == 1
    s.close()


def test_no_nvml_real_pynvml(burner, tmp_path, caplog, monkeypatch):
    monkeypatch.delenv(FAKE_ENV, raising=False)
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver; the no-GPU path cannot be shown with real pynvml")
    caplog.set_level(logging.INFO, logger="test.sampler.realnvml")
    s = Sampler(log=logging.getLogger("test.sampler.realnvml"))
    _no_nvml_case(s, burner, tmp_path, caplog, "test.sampler.realnvml")
    assert "NVMLError_LibraryNotFound" in caplog.records[0].getMessage()


# --- progress files --------------------------------------------------------------------------


def tokens_at(i: int) -> int:
    """50 tok/s for ten seconds, then 200 tok/s: a window rate and a mean rate differ."""
    return 50 * i if i <= 10 else 500 + 200 * (i - 10)


def progress_lines(scale: float, total: int, upto: int = 20) -> str:
    return "".join(
        json.dumps(
            {
                "time": 1000.0 + i,
                "samples": i,
                "samples_total": 100,
                "tokens": tokens_at(i) * scale,
                "tokens_total": total,
                "loss": 2.0 / (i + 1),
                "lr": 1e-4,
                "note": "text is skipped",
                "rank": 0,
                "diverged": False,
            }
        )
        + "\n"
        for i in range(upto + 1)
    )


def test_progress_rates_eta_and_pass_through(tmp_path):
    p0, p1 = tmp_path / "rank-0.progress.jsonl", tmp_path / "rank-1.progress.jsonl"
    p0.write_text(progress_lines(1, 10_000))
    p1.write_text(progress_lines(0.5, 5000))
    refs = [ref_for(None, tmp_path, rank=0, progress=p0), ref_for(None, tmp_path, rank=1, progress=p1)]
    s = Sampler(nvml=NoDriverNvml(), rate_window_s=10.0)
    res = s.sample(refs, now=1020.5)

    assert one(res, "tok_s", 0) == 200.0  # (2500 - 500) / (1020 - 1010): the window, not the start
    assert one(res, "tok_s", 1) == 100.0
    assert res.ranks[(7, 0)] == {"tok_s": 125.0}  # mean: 2500 tokens over 20 s
    assert res.ranks[(7, 1)] == {"tok_s": 62.5}
    assert res.stages[(1, "train")] == {
        "tok_s": 300.0,
        "eta_s": 37.5,  # (7500 + 3750) tokens left at 300 tok/s
        "progress": 0.25,
        "samples": 40,
        "samples_total": 200,
        "tokens": 3750,
        "tokens_total": 15_000,
    }
    stage_rows = {m["name"]: m for m in res.metrics if m["rank"] is None}
    assert {n: m["value"] for n, m in stage_rows.items()} == {"tok_s": 300.0, "eta_s": 37.5, "progress": 0.25}
    assert all(m["time"] == 1020.5 and m["attempt"] == 2 and m["run_id"] == 1 for m in stage_rows.values())

    loss = rows(res, "loss", 0)
    assert [(m["time"], m["value"]) for m in loss] == [(1000.0 + i, 2.0 / (i + 1)) for i in range(21)]
    assert [m["value"] for m in rows(res, "tokens", 1)] == [tokens_at(i) * 0.5 for i in range(21)]
    names = {m["name"] for m in res.metrics if m["rank"] == 0}
    assert names == {"samples", "samples_total", "tokens", "tokens_total", "loss", "lr", "tok_s"}

    # Nothing new, later: the same window rate, no repeated rows.
    res = s.sample(refs, now=1025.0)
    assert [m["name"] for m in res.metrics if m["rank"] == 0] == ["tok_s"]
    assert one(res, "tok_s", 0) == 200.0
    # Silent for longer than three windows: the rate drops to 0 and the ETA becomes unknown.
    res = s.sample(refs, now=1051.0)
    assert one(res, "tok_s", 0) == 0.0
    assert res.stages[(1, "train")]["tok_s"] == 0.0 and "eta_s" not in res.stages[(1, "train")]
    assert res.ranks[(7, 0)] == {"tok_s": 125.0}


def test_heartbeat_lines_count_for_nothing(tmp_path):
    """A rank in a long silent phase writes {"time", "heartbeat"}: no counts, so no rate, ETA or rows."""
    plain, beating = tmp_path / "rank-0.progress.jsonl", tmp_path / "rank-1.progress.jsonl"
    plain.write_text(progress_lines(1, 10_000))
    beats = [json.dumps({"time": 1000.25 + i, "heartbeat": "checkpoint epoch-1"}) for i in range(21)]
    beating.write_text("".join(f"{a}{b}\n" for a, b in zip(progress_lines(1, 10_000).splitlines(keepends=True), beats)))
    results = []
    for path in (plain, beating):
        s = Sampler(nvml=NoDriverNvml(), rate_window_s=10.0)
        results.append(s.sample([ref_for(None, tmp_path, progress=path)], now=1020.5))
    a, b = results
    assert b.metrics == a.metrics and b.ranks == a.ranks == {(7, 0): {"tok_s": 125.0}}
    assert b.stages == a.stages
    assert "heartbeat" not in {m["name"] for m in b.metrics}
    # Only heartbeats for a while (a long checkpoint): the rate decays as with silence, counts stay.
    with beating.open("a") as f:
        f.write("".join(json.dumps({"time": 1021.0 + i, "heartbeat": "checkpoint epoch-1"}) + "\n" for i in range(40)))
    res = s.sample([ref_for(None, tmp_path, progress=beating)], now=1061.0)
    assert one(res, "tok_s") == 0.0 and res.ranks[(7, 0)] == {"tok_s": 125.0}
    assert res.stages[(1, "train")]["tokens"] == 2500


def test_progress_half_written_and_corrupt_lines(tmp_path, caplog):
    path = tmp_path / "rank-0.progress.jsonl"
    path.write_text(progress_lines(1, 10_000, upto=2) + '{"time": 1003.0, "tok')
    caplog.set_level(logging.WARNING, logger="test.sampler.progress")
    s = Sampler(nvml=NoDriverNvml(), log=logging.getLogger("test.sampler.progress"))
    ref = ref_for(None, tmp_path, progress=path)
    res = s.sample([ref], now=1003.5)
    assert [m["value"] for m in rows(res, "tokens")] == [0, 50, 100]
    assert res.bad_lines == {}

    with path.open("a") as f:  # the writer finishes its line, then something scribbles
        f.write(
            'ens": 150, "samples": 3}\n'
            + "garbage\n"
            + "[1, 2]\n"
            + json.dumps({"time": 1004.0, "tokens": 200, "loss": float("nan")})
            + "\n"
        )
    res = s.sample([ref], now=1004.5)
    assert [(m["time"], m["value"]) for m in rows(res, "tokens")] == [(1003.0, 150), (1004.0, 200)]
    assert rows(res, "loss") == []  # NaN has no place in a NOT NULL REAL column
    assert res.bad_lines == {(7, 0): 2}
    assert one(res, "tok_s") == 50.0 and res.ranks[(7, 0)]["tok_s"] == 50.0
    assert len([r for r in caplog.records if "corrupt line" in r.getMessage()]) == 1


def test_progress_samples_only_eta_and_metrics_since(tmp_path):
    path = tmp_path / "rank-0.progress.jsonl"
    path.write_text(
        "".join(
            json.dumps({"time": 2000.0 + i, "samples": 4 * i, "samples_total": 400, "acc_0": 0.5}) + "\n"
            for i in range(6)
        )
    )
    s = Sampler(nvml=NoDriverNvml())
    # A restarted daemon: rows up to 2003 are already in the store.
    res = s.sample([ref_for(None, tmp_path, progress=path, metrics_since=2003.0)], now=2005.0)
    assert [m["time"] for m in rows(res, "acc_0")] == [2004.0, 2005.0]
    assert res.stages[(1, "train")] == {"samples": 20, "samples_total": 400, "eta_s": 95.0, "progress": 0.05}
    assert rows(res, "tok_s") == [] and res.ranks == {}  # no tokens counted, no token rate


def test_progress_file_replaced(tmp_path):
    path = tmp_path / "rank-0.progress.jsonl"
    path.write_text(progress_lines(1, 10_000, upto=20))
    s = Sampler(nvml=NoDriverNvml())
    ref = ref_for(None, tmp_path, progress=path)
    s.sample([ref], now=1020.0)
    path.write_text(
        json.dumps({"time": 3000.0, "tokens": 10, "tokens_total": 100})
        + "\n"
        + json.dumps({"time": 3002.0, "tokens": 30, "tokens_total": 100})
        + "\n"
    )
    res = s.sample([ref], now=3002.0)
    assert one(res, "tok_s") == 10.0 and res.ranks[(7, 0)] == {"tok_s": 10.0}
    assert res.stages[(1, "train")]["eta_s"] == 7.0 and res.stages[(1, "train")]["progress"] == 0.3


def test_read_new(tmp_path):
    path = tmp_path / "p.jsonl"
    assert read_new(path, 0) == ([], 0, 0)
    assert read_new(path, 17) == ([], 17, 0)
    path.write_bytes(b'{"a": 1}\n\n\xff\xfe\n{"b": 2}\n{"c"')
    assert read_new(path, 0) == ([{"a": 1}, {"b": 2}], 22, 1)
    assert read_new(path, 22) == ([], 22, 0)
    assert read_new(path, 0, max_bytes=5) == ([{"a": 1}], 9, 0)  # whole lines even past the cap
    path.write_bytes(b'{"z": 0}\n')  # shorter than the offset: replaced
    assert read_new(path, 22) == ([{"z": 0}], 9, 0)


# --- cost ------------------------------------------------------------------------------------


def test_sample_is_cheap(tmp_path):
    """8 ranks of 3 processes each, progress files growing, 8 GPUs: a sample costs a few ms."""
    roots = []
    try:
        for _ in range(8):
            roots.append(subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True))
        deadline = time.monotonic() + DEADLINE_S
        while any(len(psutil.Process(r.pid).children()) < 2 for r in roots) and time.monotonic() < deadline:
            time.sleep(0.05)
        nvml = DictNvml(
            [
                {"name": "NVIDIA H200", "uuid": f"GPU-{i}", "used": 1, "total": 2, "util": 3, "procs": {r.pid: 1000}}
                for i, r in enumerate(roots)
            ]
        )
        refs = [
            RankRef(
                run_id=1,
                stage="train",
                attempt=1,
                attempt_id=1,
                rank=i,
                root_pid=r.pid,
                root_create_time=psutil.Process(r.pid).create_time(),
                progress_path=tmp_path / f"rank-{i}.progress.jsonl",
            )
            for i, r in enumerate(roots)
        ]
        s = Sampler(nvml=nvml)
        s.sample(refs)
        costs = []
        for n in range(30):
            for ref in refs:
                with ref.progress_path.open("a") as f:
                    f.write(
                        json.dumps(
                            {
                                "time": time.time(),
                                "tokens": n * 100,
                                "tokens_total": 10**6,
                                "samples": n,
                                "samples_total": 10**4,
                                "loss": 1.0,
                            }
                        )
                        + "\n"
                    )
            t0 = time.perf_counter()
            res = s.sample(refs)
            costs.append(time.perf_counter() - t0)
        assert all(len(res.descendants[(1, i)]) == 3 for i in range(8))
        assert one(res, "gpu_mem_bytes", 3) == 1000
        costs.sort()
        median = costs[len(costs) // 2]
        print(
            f"\nsample() over 8 ranks x 3 processes: median {median * 1e3:.2f} ms, "
            f"max {costs[-1] * 1e3:.2f} ms, {len(psutil.pids())} processes on the host"
        )
        assert median < 0.050
    finally:
        for r in roots:
            os.killpg(r.pid, signal.SIGKILL)
            r.wait()


def test_progress_reader_skips_an_endless_line(tmp_path):
    from eyas.daemon.progressfile import read_new

    path = tmp_path / "p.jsonl"
    path.write_bytes(b"x" * 50)  # longer than max_bytes and never finished: no writer makes one
    assert read_new(path, 0, max_bytes=40) == ([], 50, 1)
    path.write_bytes(b"x" * 30)  # shorter: still being written, so it waits
    assert read_new(path, 0, max_bytes=40) == ([], 0, 0)


def test_progress_reader_notices_a_replaced_file_that_is_longer(tmp_path):
    """A file replaced by a longer one (another inode) is read from its start, and the
    restart is counted: its size alone would not tell."""
    from eyas.daemon.progressfile import ProgressReader

    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"a": 1}\n')
    reader = ProgressReader(path)
    try:
        assert reader.read() == ([{"a": 1}], 0) and reader.restarts == 0
        new = tmp_path / "new.jsonl"
        new.write_bytes(b'{"b": 2}\n{"c": 3}\n')
        os.replace(new, path)
        assert reader.read() == ([{"b": 2}, {"c": 3}], 0)
        assert (reader.restarts, reader.offset) == (1, 18)
        with path.open("ab") as f:
            f.write(b'{"d": 4}\n')
        assert reader.read() == ([{"d": 4}], 0) and reader.restarts == 1
    finally:
        reader.close()


def test_last_write_is_the_newer_of_the_log_and_the_progress_file(tmp_path):
    log, progress = tmp_path / "rank-0.log", tmp_path / "rank-0.progress.jsonl"
    s = Sampler(nvml=NoDriverNvml())
    ref = ref_for(None, tmp_path, log_path=log)
    assert s.sample([ref], now=2000.0).writes == {}  # nothing written yet: unknown, not "now"
    log.write_text("step 1\n")
    os.utime(log, (1500.25, 1500.25))
    assert s.sample([ref], now=2000.0).writes == {(7, 0): 1500.25}
    progress.write_text(progress_lines(1, 100))
    os.utime(progress, (1700.5, 1700.5))
    res = s.sample([ref], now=2000.0)
    assert res.writes == {(7, 0): 1700.5}
    assert "last_write" not in res.ranks.get((7, 0), {})  # metrics.py joins it to the roll-up
    os.utime(log, (1800.0, 1800.0))  # a log line after the last progress record
    assert s.sample([ref], now=2000.0).writes == {(7, 0): 1800.0}


def test_a_remote_ranks_gpu_memory_comes_from_its_progress_file(tmp_path):
    # A Slurm rank: no process on this host (no root pid), its monitor on the node appends
    # NVML's figure to the progress file (workers/runtime/node_gpu.py).
    progress = tmp_path / "rank-0.progress.jsonl"
    now = time.time()
    lines = [
        {"time": now - 3, "samples": 1, "tokens": 10},
        {"time": now - 2, "gpu_mem_bytes": 5_000_000_000},
        {"time": now - 1, "gpu_mem_bytes": 4_000_000_000},
    ]
    progress.write_text("".join(json.dumps(x) + "\n" for x in lines))
    s = Sampler(nvml=NoDriverNvml())
    res = s.sample([ref_for(None, tmp_path, progress=progress)])
    assert [m["value"] for m in rows(res, "gpu_mem_bytes")] == [5e9, 4e9]
    assert res.ranks[(7, 0)]["peak_gpu_mem"] == 5e9  # the peak, not the last figure
    progress.write_text(progress.read_text() + json.dumps({"time": now, "gpu_mem_bytes": 6_000_000_000}) + "\n")
    assert s.sample([ref_for(None, tmp_path, progress=progress)]).ranks[(7, 0)]["peak_gpu_mem"] == 6e9
