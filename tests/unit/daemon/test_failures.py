"""Which failure is the root cause when several ranks fail within moments of each other."""

from __future__ import annotations

import signal
from pathlib import Path

from eyas.daemon.failures import PEER_LOSS_WINDOW
from eyas.daemon.group import Group
from eyas.daemon.ranks import Rank, RankExit

GLOO_LOST = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500"


def _group(exits: list[RankExit]) -> Group:
    g = Group(
        run_id=1,
        stage="train",
        attempt_id=1,
        attempt=1,
        dir=Path("/nonexistent"),
        world_size=len(exits),
        devices=[],
        master_port=29500,
    )
    g.ranks = [
        Rank(
            rank=e.rank,
            log_path=Path(f"/nonexistent/rank-{e.rank}.log"),
            monitor_pid=0,
            monitor_create_time=None,
            exit=e,
        )
        for e in exits
    ]
    return g


def _raised(rank: int, t: float, type_: str, message: str) -> RankExit:
    return RankExit(
        rank=rank,
        pid=100 + rank,
        exit_code=1,
        signal=None,
        time=t + 0.05,
        error={"type": type_, "message": message, "time": t, "traceback": ""},
    )


def _killed(rank: int, t: float, sig: int = signal.SIGKILL) -> RankExit:
    return RankExit(rank=rank, pid=100 + rank, exit_code=None, signal=int(sig), time=t)


def test_a_peers_lost_connection_stamped_before_the_kill_is_not_the_root_cause():
    # rank 1 SIGKILLed; its monitor stamps the death 4 ms after rank 0's gloo error.
    exits = [_raised(0, 1000.000, "torch.distributed.DistBackendError", GLOO_LOST), _killed(1, 1000.004)]
    causes = _group(exits).failures()
    assert [(e.rank, e.signal) for e in causes] == [(1, signal.SIGKILL), (0, None)]


def test_a_segfault_is_preferred_the_same_way():
    exits = [_raised(0, 50.0, "RuntimeError", "Connection reset by peer"), _killed(1, 50.3, signal.SIGSEGV)]
    assert [e.rank for e in _group(exits).failures()] == [1, 0]


def test_a_real_error_before_a_death_stays_the_root_cause():
    # Not a lost connection: the exception is its own failure, whatever dies after it.
    exits = [_raised(0, 10.0, "RuntimeError", ""), _killed(1, 10.002)]
    assert [e.rank for e in _group(exits).failures()] == [0, 1]


def test_a_death_long_after_a_lost_connection_is_not_taken_as_its_cause():
    exits = [_raised(0, 10.0, "RuntimeError", GLOO_LOST), _killed(1, 10.0 + PEER_LOSS_WINDOW + 0.5)]
    assert [e.rank for e in _group(exits).failures()] == [0, 1]


def test_without_a_death_the_earliest_error_is_the_root_cause():
    exits = [_raised(0, 5.0, "RuntimeError", GLOO_LOST), _raised(1, 4.0, "ValueError", "bad batch")]
    assert [e.rank for e in _group(exits).failures()] == [1, 0]
