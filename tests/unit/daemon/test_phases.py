"""The watchdog's evidence (daemon/phases.py): phases read from progress files, processes and their
held states, budgets, the CPU that counts only inside a phase, and the held process as root cause."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_failures import GLOO_LOST, _group, _raised

from eyas.daemon import failures
from eyas.daemon.phases import CPU_MOVE_S, Watch
from eyas.daemon.sampler import RankRef, Sampler


class NoNvml:
    def nvmlInit(self):  # noqa: N802 (NVML's name)
        raise RuntimeError("no driver here")


def _ref(tmp_path: Path) -> RankRef:
    return RankRef(1, "extract", 1, 7, 0, None, None, tmp_path / "rank-0.progress.jsonl", log_path=tmp_path / "r.log")


def _append(path: Path, *records: dict, mtime: float) -> None:
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    os.utime(path, (mtime, mtime))


def test_heartbeats_are_no_sign_of_life_but_moving_evidence_is(tmp_path):
    ref, s = _ref(tmp_path), Sampler(nvml=NoNvml())
    prog = ref.progress_path
    _append(prog, {"time": 100.0, "samples": 0, "samples_total": 5}, mtime=100.0)
    assert s.sample([ref], now=101.0).writes == {(7, 0): 100.0}
    beat = {"heartbeat": "load target", "phase": {"kind": "load", "since": 101.0, "budget": 900.0}}
    _append(prog, {"time": 101.0, **beat}, mtime=101.0)
    res = s.sample([ref], now=102.0)
    assert res.writes == {(7, 0): 101.0}  # the phase's start counts once
    assert res.phases[(7, 0)] == {
        "phase": "load target",
        "since": 101.0,
        "evidence_at": 101.0,
        "kind": "load",
        "budget": 900.0,
        "waits": None,
        "evidence": None,
        "time": 101.0,
    }
    _append(prog, {"time": 111.0, **beat}, {"time": 121.0, **beat}, mtime=121.0)
    assert s.sample([ref], now=122.0).writes == {(7, 0): 101.0}  # beats alone: quiet since 101
    moving = {**beat, "phase": {**beat["phase"], "evidence": {"rchar": 10}}}
    _append(prog, {"time": 131.0, **moving}, mtime=131.0)
    assert s.sample([ref], now=132.0).writes == {(7, 0): 131.0}  # evidence appeared: it moved
    _append(prog, {"time": 141.0, **moving}, mtime=141.0)
    assert s.sample([ref], now=142.0).writes == {(7, 0): 131.0}  # the same evidence: no move
    _append(prog, {"time": 145.0, "heartbeat": "load target", "ended": True}, mtime=145.0)
    res = s.sample([ref], now=146.0)
    assert res.phases == {} and res.writes == {(7, 0): 145.0}
    assert not [m for m in res.metrics if m["name"] in ("budget", "since", "ended")]  # no metric rows


def _procs(*rows):
    return [
        {"pid": pid, "create_time": 1.0, "state": state, "cpu": cpu, "title": title} for pid, state, cpu, title in rows
    ]


@pytest.fixture
def group():
    g = _group([_raised(0, 1000.0, "X", ""), _raised(1, 1000.0, "X", "")])
    g.ranks[0].pid, g.ranks[1].pid = 10, 11
    return g


def test_a_process_held_for_the_bound_is_found_and_named(group):
    w = Watch()
    w.update(
        group,
        0,
        _procs((10, "sleeping", 1.0, "python -m rank"), (20, "running", 5.0, "VLLM::EngineCore")),
        None,
        0.0,
        100.0,
    )
    w.update(group, 1, _procs((11, "running", 3.0, "python -m rank")), None, 0.0, 100.0)
    w.update(
        group,
        0,
        _procs((10, "sleeping", 1.0, "python -m rank"), (20, "stopped", 5.0, "VLLM::EngineCore")),
        None,
        0.0,
        105.0,
    )
    assert w.stuck_process(114.0, 10.0) is None  # stopped 9 s: under the bound
    held = w.stuck_process(115.0, 10.0)
    assert (held.pid, held.who(), held.since) == (20, "VLLM::EngineCore under rank 0 (pid 20)", 105.0)
    # A rank held as long is named before a descendant: it is what the user can act on.
    w.update(group, 1, _procs((11, "disk-sleep", 3.0, "python -m rank")), None, 0.0, 105.0)
    assert w.stuck_process(115.0, 10.0).who() == "rank 1 (pid 11)"
    # Continued: the clock of its state starts again.
    w.update(group, 1, _procs((11, "running", 3.5, "python -m rank")), None, 0.0, 116.0)
    w.update(
        group,
        0,
        _procs((10, "sleeping", 1.0, "python -m rank"), (20, "running", 5.0, "VLLM::EngineCore")),
        None,
        0.0,
        116.0,
    )
    assert w.stuck_process(200.0, 10.0) is None
    assert "VLLM::EngineCore under rank 0 (pid 20): running for 84 s, cpu 5.0 s" in w.table(200.0)


def test_budgets_the_rank_s_or_the_run_s_by_kind(group):
    w = Watch()
    phase = {"phase": "vllm engine start", "kind": "engine_start", "since": 100.0, "budget": 50.0}
    w.update(group, 0, [], phase, 100.0, 100.0)
    assert w.over_budget(150.0, {}) is None
    assert w.over_budget(150.5, {}) == (0, phase, 50.0)
    assert w.over_budget(150.5, {"engine_start": 60.0}) is None  # the run's own bound for its kind
    assert w.over_budget(161.0, {"engine_start": 60.0}) == (0, phase, 60.0)
    assert w.over_budget(10_000.0, {"engine_start": 0.0}) is None  # 0: no budget
    assert w.over_budget(10_000.0, {"load": 1.0}) == (0, phase, 50.0)  # another kind's: the rank's own


def test_cpu_counts_only_inside_a_phase_and_a_wait_lives_on_its_sibling(group):
    w = Watch()
    spin = _procs((10, "running", 0.0, "rank"))
    w.update(group, 0, spin, None, 100.0, 100.0)
    w.settle_cpu(100.0)
    w.update(group, 0, _procs((10, "running", 30.0, "rank")), None, 100.0, 130.0)
    w.settle_cpu(130.0)
    assert w.alive_at() == 100.0  # a rank spinning in a collective outside any phase is quiet
    w.update(
        group,
        0,
        _procs((10, "running", 30.0 + CPU_MOVE_S / 2, "rank")),
        {"phase": "load", "since": 131.0},
        100.0,
        135.0,
    )
    w.settle_cpu(135.0)
    assert w.alive_at() == 130.0  # inside a phase: the CPU that moved by CPU_MOVE_S counts
    w.update(group, 0, _procs((10, "running", 32.0, "rank")), {"phase": "load", "since": 131.0}, 100.0, 140.0)
    w.settle_cpu(140.0)
    assert w.alive_at() == 140.0
    w.update(
        group,
        0,
        _procs((10, "sleeping", 32.0, "rank")),
        {"phase": "wait", "since": 141.0, "waits": "train"},
        100.0,
        200.0,
    )
    w.settle_cpu(200.0)
    assert w.alive_at(lambda stage: {"train": 190.0}.get(stage)) == 190.0
    assert w.alive_at(lambda stage: None) == 140.0


def test_a_held_process_before_the_first_failure_is_the_root_cause(group):
    group.ranks[0].exit = _raised(0, 1000.0, "torch.distributed.DistBackendError", GLOO_LOST)
    group.ranks[1].exit = None
    group.vitals.update(group, 1, _procs((11, "stopped", 3.0, "python -m rank")), None, None, 990.0)
    records = failures.ordered(group, "vm", None)
    held = records[0][1]
    assert (held.type, held.rank, held.pid) == ("Stopped", 1, 11)
    assert held.message == (
        "rank 1 (pid 11) was stopped (SIGSTOP or a debugger holds it) from 10 s before the first failure; "
        "its peers' failures followed from waiting for it"
    )
    assert records[1][1].type == "torch.distributed.DistBackendError"
    # Stopped only a moment before: no cause of anything.
    group.vitals.update(group, 1, _procs((11, "running", 3.0, "python -m rank")), None, None, 995.0)
    group.vitals.update(group, 1, _procs((11, "stopped", 3.0, "python -m rank")), None, None, 999.5)
    assert failures.ordered(group, "vm", None)[0][1].type == "torch.distributed.DistBackendError"
