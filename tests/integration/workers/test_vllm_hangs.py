"""A hang inside vLLM's engine start is found and named: vLLM's EngineCore stopped (SIGSTOP) while
the extract rank sits in its "vllm engine start" phase, whose heartbeat thread beats on, through a
real daemon and vLLM's CPU build."""

from __future__ import annotations

import os
import signal
import time
import tomllib
from pathlib import Path

import psutil
import pytest
import tomli_w
from daemon_harness import wait_for
from runtoml import extract_toml
from vllm_world import build_models, token_rows, vllm_daemon, write_dataset, write_extensions

pytestmark = pytest.mark.slow

STALL = 20.0
SLACK = 8.0  # the 1 Hz sampler, py-spy over every process, the teardown, a loaded machine


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("vllm-targets"))


@pytest.fixture(scope="module")
def vdaemon(tmp_path_factory):
    with vllm_daemon(write_extensions(tmp_path_factory.mktemp("vllm-ext"))) as d:
        yield d


def _engine_core(d, run_id: int) -> psutil.Process:
    """vLLM's EngineCore under the driver rank, as soon as it exists (it renames itself)."""

    def found():
        ranks = d.ranks(run_id, "extract")
        driver = next((r for r in ranks if r["rank"] == 0 and r["pid"]), None)
        if driver is None:
            return None
        try:
            for p in psutil.Process(driver["pid"]).children(recursive=True):
                if p.cmdline()[:1] and p.cmdline()[0].startswith("VLLM::EngineCore"):
                    return p
        except psutil.Error:
            return None
        return None

    return wait_for(found, 240, 0.02, "vLLM's EngineCore")


@pytest.mark.parametrize("tp", [1, 2])
def test_a_stopped_engine_core_during_engine_start_is_stalled_and_named(vdaemon, models, tmp_path, tp):
    out = tmp_path / "out"
    write_dataset(out, token_rows([12, 30, 7, 21], seed=3))
    cfg = tomllib.loads(extract_toml("stopped-core", out, models["llama"], backend="vllm", tp=tp))
    cfg.setdefault("stages", {}).setdefault("extract", {})["stall_timeout"] = STALL
    run_id = vdaemon.submit(tomli_w.dumps(cfg), f"stopped-core-{tp}.toml")
    core = _engine_core(vdaemon, run_id)
    stopped_at = time.time()  # before the signal: a loaded machine may pause this process after it
    os.kill(core.pid, signal.SIGSTOP)
    run = vdaemon.wait_run(run_id, timeout=STALL + 90)
    attempt = run["stages"][0]["attempt_list"][-1]
    root = attempt["root_cause"]
    found = root["time"] - stopped_at
    print(f"TP {tp}: stopped EngineCore found {found:.1f} s after SIGSTOP (stall_timeout {STALL:g})")
    assert (run["state"], root["type"], root["pid"], root["rank"]) == ("failed", "Stalled", core.pid, 0), root
    # From the group's last sign of life, which may be a second or two before the stop.
    assert STALL - 2 <= found <= STALL + SLACK, found
    assert root["message"].startswith(
        f"VLLM::EngineCore under rank 0 (pid {core.pid}) has been stopped (SIGSTOP or a debugger holds it) for "
    ), root["message"]
    assert "rank 0 was in its phase 'vllm engine start'" in root["message"], root["message"]
    tb = root["traceback"]
    assert f"VLLM::EngineCore under rank 0 (pid {core.pid}): stopped" in tb.split("\n\n")[0], tb[:2000]
    assert "no native stacks: it is stopped" in tb
    assert "wait_for_engine_startup" in tb or "vllm engine start" in root["message"]
    # Nothing of the group is left, the stopped process included.
    assert not psutil.pid_exists(core.pid) or core.status() == psutil.STATUS_ZOMBIE
    assert not list(Path(out, "extract", "hidden_states").glob("hs_*.safetensors"))
