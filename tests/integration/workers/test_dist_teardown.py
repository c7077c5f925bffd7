"""The gloo teardown deadlock, reproduced on purpose: the old order hangs a rank for good, eyas's ends it.

Two real ranks (the monitor, the rank runtime, the selftest stage's gloo_teardown option) train
a tiny DDP model on gloo and tear the group down. The selftest forces the race a loaded
machine loses now and then (workers/stages/selftest.py, gloo_teardown): rank 0's gloo worker
waits for the GIL to free a finished allreduce while the main thread holds the GIL.
"""

from __future__ import annotations

import re
import signal
import socket
import time

from rank_harness import DEADLINE, start_rank, wait_for  # noqa: F401 (start_rank is a fixture)

HANG_S = 15.0  # the naive teardown's GIL hold ends 4 s after its log line; a deadlock outlasts it by far


def _pair(start_rank, mode: str):  # noqa: F811
    with socket.socket() as s:  # a free port for the group's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = {"steps": 2, "step_time": 0.01, "gloo_teardown": mode}
    return [start_rank(options, rank=r, world_size=2, env={"MASTER_PORT": str(port)}) for r in (0, 1)]


def test_the_old_teardown_order_deadlocks_in_the_process_group_destructor(start_rank):  # noqa: F811
    r0, r1 = _pair(start_rank, "naive")
    r0.wait_log("eyas.selftest: gloo teardown: naive")
    assert r1.wait() == 0  # the other rank freed its work itself and ended
    peer_done = time.monotonic()
    time.sleep(HANG_S)
    alive = time.monotonic() - peer_done
    assert r0.proc.poll() is None, "rank 0 ended: the naive teardown did not deadlock"
    assert "gloo teardown: done" not in r0.log()
    assert not r0.file("done.json").exists()
    # Where it hangs: faulthandler (SIGUSR1) names the line that freed the Reducer.
    r0.proc_json()
    import os

    os.kill(r0.json("proc.json")["pid"], signal.SIGUSR1)
    wait_for(lambda: "in gloo_teardown" in r0.log(), "rank 0's stacks in its log")
    main = r0.log().split("Current thread", 1)[1]
    assert re.search(r'File ".*selftest\.py", line \d+ in gloo_teardown', main), main
    print(f"naive teardown: rank 0 still hung {alive:.1f} s after rank 1 ended; killed")


def test_the_safe_teardown_ends_both_ranks_and_destroys_the_group(start_rank):  # noqa: F811
    r0, r1 = _pair(start_rank, "safe")
    assert r1.wait() == 0
    assert r0.wait() == 0
    for r in (r0, r1):
        took = float(re.search(r"gloo teardown: done in ([\d.]+) s; 0 gloo threads left", r.log()).group(1))
        assert took < 5.0, took
        print(f"safe teardown: rank {r.rank} closed the group in {took:.2f} s")
        assert r.json("done.json")["exit_code"] == 0
