"""The `selftest` stage: exercises the supervisor without a model (tests and benchmarks).

It runs `steps` steps of `step_time` seconds, reports progress every step, can flood its log
at a set rate, resumes where an earlier attempt stopped, and fails on demand in every way a
real rank can: an exception, an empty exception, sys.exit, a segfault, SIGKILL, leftover
child processes, a hang, or (as a vLLM driver) a TP worker's exception. It can also misbehave the ways a rank hangs on its way out or
looks hung while alive: a long silent phase with only heartbeats (heartbeat_for), a rank that
never returns after its steps (hang_at_end), a non-daemon thread left running (linger_thread),
and the gloo teardown deadlock (gloo_teardown = "naive"; "safe" is eyas's teardown of the same
state). Options come from config["stages"]["selftest"]["options"]; state/specs.py
(SelftestOptions) declares them.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

from eyas.state import contract
from eyas.state.runconfig import stage_options
from eyas.workers.runtime import atomic

log = logging.getLogger("eyas.selftest")


def main(ctx) -> None:
    opts = stage_options("selftest", ctx.options)  # state/specs.py: SelftestOptions
    if opts.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    steps = opts.steps
    if opts.duration is not None:
        steps = max(1, round(opts.duration / opts.step_time))
        log.info("flooding %d lines/s for %.2f s: %d steps", opts.lines_per_sec, opts.duration, steps)
    will_fail = (
        opts.fail is not None
        and opts.fail_rank in (-1, ctx.rank)
        and (opts.fail_attempts is None or ctx.attempt in opts.fail_attempts)
    )

    done_path = ctx.stage_dir / f"rank-{ctx.rank}.done"
    start = _first_undone(done_path, steps)
    if start:
        log.info("resuming at step %d", start)
    tps = opts.tokens_per_step
    ctx.progress.update(samples=start, tokens=start * tps, samples_total=steps, tokens_total=steps * tps, force=True)
    if opts.heartbeat_for > 0:
        _silent_phase(ctx, opts)

    lines = 0
    with open(done_path, "a") as done:
        for step in range(start, steps):
            if will_fail and step == opts.fail_at_step:
                if opts.summary_on_fail and ctx.rank == 0:
                    atomic.write_json(
                        ctx.attempt_dir / contract.SUMMARY, {"failed_at_step": step, "attempt": ctx.attempt}
                    )
                _fail(opts.fail, ctx, step)
            log.info("step %d/%d", step + 1, steps)
            if opts.lines_per_sec > 0:
                lines = _flood(ctx.rank, lines, round(opts.lines_per_sec * opts.step_time), opts.step_time)
            else:
                time.sleep(opts.step_time)
            # Flushed per step: a kill right after must not redo a finished step.
            done.write(f"{step}\n")
            done.flush()
            ctx.progress.update(samples=step + 1, tokens=(step + 1) * tps, loss=1.0 / (step + 1))
    if will_fail and opts.fail_at_step >= steps:
        _fail(opts.fail, ctx, steps)
    ctx.progress.flush()
    if opts.hang_at_end and opts.fail_rank in (-1, ctx.rank):
        threading.Event().wait()  # silently: no log line, no progress
    if opts.gloo_teardown is not None:
        gloo_teardown(ctx, opts.gloo_teardown)
    if opts.lines_per_sec > 0:
        log.info("wrote %d lines", lines)
    atomic.write_json(
        ctx.stage_dir / f"rank-{ctx.rank}.result.json", {"steps_run_this_attempt": steps - start, "steps_total": steps}
    )
    if opts.linger_thread:
        # Non-daemon: the interpreter's shutdown joins it for ever; only the runtime's os._exit ends the rank.
        threading.Thread(target=threading.Event().wait, name="selftest-linger").start()
        log.info("left a thread that never ends")


def _silent_phase(ctx, opts) -> None:
    """`heartbeat_for` seconds that write nothing but heartbeats, with the evidence chosen by
    `heartbeat_evidence`; beats far more often than a real phase's, so that tests stay short."""
    t0 = time.monotonic()
    ticks = {"ticks": lambda: {"ticks": int((time.monotonic() - t0) * 10)}}.get(opts.heartbeat_evidence)
    with ctx.progress.beating(
        "selftest heartbeat_for", every=1.0, kind="load", budget=opts.phase_budget, evidence=ticks
    ):
        if opts.heartbeat_evidence != "child":
            time.sleep(opts.heartbeat_for)
            return
        # An engine's stand-in: a child that burns CPU for the phase, named as vLLM names its
        # EngineCore (argv[0]), which the rank waits for as a driver waits for its engine.
        code = f"import time\nend = time.time() + {opts.heartbeat_for}\nwhile time.time() < end: pass\n"
        child = subprocess.Popen(
            ["selftest::EngineCore", "-c", code], executable=sys.executable, stdin=subprocess.DEVNULL
        )
        atomic.write_json(ctx.file(contract.CHILDREN), {"children": [child.pid], "grandchildren": []})
        if child.wait() != 0:
            raise RuntimeError(f"the selftest engine child ended with {child.returncode}")


def gloo_teardown(ctx, mode: str) -> None:
    """Train a tiny DDP model on a gloo group, leave rank 0's gloo thread a collective to free late,
    and tear down the old way ("naive": rank 0 deadlocks) or through eyas.workers.runtime.dist ("safe").

    The deadlock (Dist.close explains it) needs rank 0's gloo worker to free an allreduce, which
    needs the GIL, while the main thread holds the GIL in the group's destructor. In a real run
    that is a race a loaded machine loses now and then; here it is forced. Rank 0 lets go of
    an allreduce that cannot finish before the other ranks join, 2 s later, and holds the GIL
    meanwhile (a switch interval of days, a busy loop): its gloo worker finishes the allreduce
    and waits for the GIL, holding the group's work mutex. Then the last owner of the group
    goes: in "naive", destroy_process_group() came first and the last owner is the DDP Reducer
    (as when a trainer is freed after the old close), freed with the GIL held, and the rank
    never gets past it; in "safe", Dist.close's order. The other ranks wait for their allreduce
    and keep its work, so that they end either way.
    """
    import gc

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from eyas.workers.runtime.dist import Dist, gloo_threads

    if ctx.world_size < 2:
        raise ValueError("selftest option gloo_teardown needs 2 or more ranks")
    group = Dist(ctx, "cpu")
    torch.manual_seed(0)
    model = group.track(DistributedDataParallel(torch.nn.Linear(16, 16)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(8, 16)).sum().backward()  # DDP's allreduce of the gradients
        optimizer.step()
    late = torch.ones(1 << 20)
    work = None
    if ctx.rank == 0:
        dist.all_reduce(late, async_op=True)  # its work is dropped here: the gloo worker frees it
    else:
        time.sleep(2.0)
        work = dist.all_reduce(late, async_op=True)
        work.wait()  # and kept: this rank's worker has nothing to free late
    log.info("gloo teardown: %s", mode)
    reducer = None
    if mode == "naive":
        dist.destroy_process_group()
        reducer = model.reducer  # the Reducer outlives the DDP module, as its last C++ owner
        del model, optimizer
        gc.collect()
    switch = sys.getswitchinterval()
    if ctx.rank == 0:
        # Keep the GIL from here on: a waiting thread asks the holder to drop it only after the
        # switch interval, and the busy loop neither sleeps nor does I/O, which would release it.
        sys.setswitchinterval(1e6)
        end = time.perf_counter() + 4.0
        while time.perf_counter() < end:
            pass
    t0 = time.perf_counter()  # no log line before the teardown: writing one releases the GIL
    if mode == "naive":
        del reducer  # rank 0: ~Reducer -> ~ProcessGroupGloo, GIL held: deadlock
    else:

        def release() -> None:
            nonlocal model, optimizer
            model = optimizer = None

        group.close(release)
    took = time.perf_counter() - t0
    sys.setswitchinterval(switch)
    del work
    log.info("gloo teardown: done in %.2f s; %d gloo threads left", took, gloo_threads())


def _first_undone(done_path, steps: int) -> int:
    """The first step not yet done by an earlier attempt (a torn last line counts as not done)."""
    try:
        text = done_path.read_text()
    except FileNotFoundError:
        return 0
    done = {int(line) for line in text.splitlines() if line.strip().isdigit()}
    step = 0
    while step < steps and step in done:
        step += 1
    return step


def _flood(rank: int, first: int, count: int, seconds: float) -> int:
    """Write `count` numbered lines to stdout, spread over `seconds` in batches; return the next number.

    Batches (one write of joined lines every ~10 ms) are how a real rank's burst looks to the
    log; the numbers let a test prove that no line was lost or doubled, and the `@time`
    stamp lets a benchmark measure how late a subscriber sees each line.
    """
    t0 = time.monotonic()
    written = 0
    while True:
        elapsed = time.monotonic() - t0
        target = count if elapsed >= seconds else int(count * elapsed / seconds)
        if target > written:
            # Each line carries the wall time of its batch, so a reader can measure how late
            # it saw the line.
            stamp = f"{time.time():.3f}"
            sys.stdout.write("".join([f"r{rank} line {n} @{stamp}\n" for n in range(first + written, first + target)]))
            sys.stdout.flush()
            written = target
        if written >= count and elapsed >= seconds:
            return first + count
        time.sleep(min(0.01, max(0.0, seconds - elapsed)) or 0.001)


def _fail(mode: str, ctx, step: int) -> None:
    log.info("failing at step %d: %s", step, mode)
    if mode == "raise":
        raise RuntimeError("selftest failure")
    if mode == "raise-empty":
        raise RuntimeError("")
    if mode == "exit":
        sys.exit(3)
    if mode == "segfault":
        import ctypes

        ctypes.string_at(0)
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "children":
        kids = [subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL) for _ in range(2)]
        # The shell exits at once, so its sleep is orphaned and reparented: the case where
        # only the process group still finds it.
        out = subprocess.run(
            ["sh", "-c", "sleep 300 </dev/null >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True
        ).stdout
        atomic.write_json(ctx.file(contract.CHILDREN), {"children": [k.pid for k in kids], "grandchildren": [int(out)]})
        raise RuntimeError("selftest failure")
    if mode == "hang":
        log.info("hanging")
        while True:
            time.sleep(3600)
    if mode == "tp-worker":
        # A vLLM driver's failure without vLLM: two stand-ins for its TP workers, registered
        # and recording their errors through eyas's worker extension as real ones do; worker 1
        # raises, and the driver waits on them, as vLLM's does, until the teardown ends it.
        for k in range(2):
            code = f"from eyas.workers.stages.selftest import tp_worker; tp_worker({k}, {k == 1})"
            subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)
        while True:
            time.sleep(3600)


def tp_worker(tp_rank: int, fail: bool) -> None:
    """One stand-in TP worker of the "tp-worker" fail mode: registered (tp-<k>.proc.json), then
    raising uncaught (the extension's excepthook writes tp-<k>.error.json) or waiting."""
    from eyas.workers.vllm import ext

    ext.register(tp_rank)
    time.sleep(0.5)  # the daemon sees it registered before it fails
    if not fail:
        threading.Event().wait()
    raise RuntimeError(f"selftest TP worker {tp_rank} failure")
