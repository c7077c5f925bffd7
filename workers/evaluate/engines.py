"""The evaluate stage's vLLM measurements, each in a child process of the rank.

`measure_all(specs)` (in the rank) starts `python -m eyas.workers.evaluate.engines <spec.json>
<result.json>` per measurement. Each child builds one `vllm.LLM` (the target alone, or the
target with an EAGLE-3 draft), warms it up, says it is ready, and waits on its stdin for the
word to go; it then generates greedily for the prompts, timed, and writes what it generated,
the wall time and vLLM's speculative-decoding counters to result.json. The parent says go to
one child at a time, so a timed run never shares the machine with another engine's work.

Why a process per engine: vLLM's CPU build does not tear an engine down reliably in-process
(its EngineCore child and OpenMP threads outlive `del llm`), and vLLM's counters live in the
process-wide Prometheus registry, so a second engine in the same process would count on top
of the first. A fresh process per engine gives clean counters and a clean exit; the parent
waits for that exit (vLLM's own shutdown unlinks its shared memory, a SIGKILL would leak it).

The child's stdout and stderr pass through the rank, line by line, into the rank's log, with
vLLM's own process prefixes, so `eyas logs` shows the engines. The last lines are also kept:
when a child fails, the parent raises EngineFailed with the child's own exception (type,
message, traceback from result.json) or, if it died without writing one (a signal, a native
crash), how it ended and the first error line of its output; never an empty message.

Counters (vllm.v1.metrics.reader through LLM.get_metrics()): vllm:spec_decode_num_drafts,
vllm:spec_decode_num_draft_tokens, vllm:spec_decode_num_accepted_tokens (Counter) and
vllm:spec_decode_num_accepted_tokens_per_pos (Vector, one value per draft position). They are
read before and after the timed run and subtracted, so the warm-up does not count.
LLM.get_metrics() needs disable_log_stats=False.

Per prompt (the evaluate stage's intervals are bootstrapped over prompts): vLLM's per-request
speculative-decoding metrics (engine argument per_request_spec_decode_metrics="summary", vLLM
0.32 on; CompletionOutput.spec_decode_metrics on each finished request): a histogram of the
draft tokens accepted at each verify step of that request (index j: j accepted) and the draft
tokens it proposed. The scheduler updates it where it updates the aggregate counters, from the
same numbers (vllm/v1/core/sched/scheduler.py: update_from_output), so the per-prompt counts
add up to the counters exactly, and they come from the timed run itself: one list increment
per request and step, nothing a tok/s figure can see. The alternatives would cost more or
measure something else: a separate acceptance pass doubles each engine's generation time, and
counters read around groups of prompts would break the one batch the throughput is timed on.
A vLLM without the argument gives aggregate counters only (per_prompt None; the stage then
reports no interval).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eyas.workers.runtime import atomic
from eyas.workers.vllm.settings import with_native_rotary

COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
TAIL_LINES = 60
# The engine arguments the evaluate stage sets itself, which [stages.evaluate] options.vllm may not
# override, are listed (and checked when a run is submitted) in state/specs.py: EVALUATE_ENGINE_ARGS.


class EngineFailed(RuntimeError):
    """A measurement's vLLM child failed; the message names the measurement and the cause."""


@dataclass
class Spec:
    """Everything one child needs (written to spec.json)."""

    label: str  # "target", "trained", "baseline", ...
    target: str
    draft: str | None  # a speculators eagle3 checkpoint, or None: the target alone
    num_speculative_tokens: int
    dtype: str
    tensor_parallel_size: int
    trust_remote_code: bool
    prompts: list[list[int]]
    max_tokens: int
    max_num_seqs: int
    enforce_eager: bool
    cpu_mla: bool = False  # vLLM's CPU build with an MLA target (see engine_args)
    engine_options: dict[str, Any] = field(default_factory=dict)
    warmup_tokens: int = 8


def engine_args(spec: Spec) -> dict[str, Any]:
    """vLLM.LLM arguments; the same for the three measurements apart from the draft, so that
    the target computes the same function in each (the lossless check depends on it).

    - the tokenizer loads (prompts are token ids, but without it vLLM knows no EOS token and
      would generate past the end of every answer);
    - enable_prefix_caching off: the warm-up would otherwise leave the first prompt's prefix
      cached, and the timed run would read KV computed in another batch;
    - disable_log_stats off: the speculative-decoding counters exist only with stats on;
    - on vLLM's CPU build, for MLA targets, vLLM's PyTorch-native rotary embedding: the CPU
      rotary kernel mis-rotates MLA's strided query view (eyas.workers.vllm.backend says how);
      the draft learnt transformers' numbers, which the native path matches.
    """
    longest = max((len(p) for p in spec.prompts), default=1)
    args: dict[str, Any] = {
        "model": spec.target,
        "tokenizer": spec.target,
        "dtype": spec.dtype,
        "tensor_parallel_size": spec.tensor_parallel_size,
        "pipeline_parallel_size": 1,
        "trust_remote_code": spec.trust_remote_code,
        "enable_prefix_caching": False,
        "disable_log_stats": False,
        "enforce_eager": spec.enforce_eager,
        "seed": 0,
        "max_num_seqs": spec.max_num_seqs,
        # Room for the longest prompt, its answer and one round of drafts past the end.
        "max_model_len": longest + spec.max_tokens + spec.num_speculative_tokens + 8,
    }
    if spec.draft is not None:
        args["speculative_config"] = {
            "method": "eagle3",
            "model": spec.draft,
            "num_speculative_tokens": spec.num_speculative_tokens,
        }
    args.update(spec.engine_options)
    if spec.draft is not None and per_request_metrics_supported():
        # After the user's options: the per-prompt counts are the intervals' data.
        args["per_request_spec_decode_metrics"] = "summary"
    if spec.cpu_mla:
        args = with_native_rotary(args)
    return args


def per_request_metrics_supported() -> bool:
    """Whether the installed vLLM counts speculative decoding per request (0.32 on)."""
    import dataclasses

    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:  # no vLLM here (the parent process, a unit test): the child decides
        return True
    return any(f.name == "per_request_spec_decode_metrics" for f in dataclasses.fields(EngineArgs))


def prompt_counts(metrics: Any, k: int) -> dict[str, Any] | None:
    """One request's counts (drafts, draft_tokens, accepted, accepted_per_pos: the counters'
    shape) from its RequestSpecDecodeMetrics; None without one. vLLM accepts a prefix of each
    draft, so a step that accepted j tokens accepted positions 0..j-1."""
    if metrics is None:
        return None
    hist = [int(n) for n in metrics.histogram]
    return {
        "drafts": sum(hist),
        "draft_tokens": int(metrics.num_draft_tokens),
        "accepted": sum(j * n for j, n in enumerate(hist)),
        "accepted_per_pos": [sum(hist[j] for j in range(i + 1, len(hist))) for i in range(k)],
    }


def counters(metrics: list) -> dict[str, Any]:
    """The speculative-decoding counters of one LLM.get_metrics() snapshot (summed over engines)."""
    out: dict[str, Any] = {name: 0 for name in COUNTERS.values()}
    out["accepted_per_pos"] = []
    for m in metrics:
        if m.name in COUNTERS and hasattr(m, "value"):
            out[COUNTERS[m.name]] += int(m.value)
        elif m.name == PER_POSITION and hasattr(m, "values"):
            per = out["accepted_per_pos"]
            per.extend([0] * (len(m.values) - len(per)))
            for i, v in enumerate(m.values):
                per[i] += int(v)
    return out


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out = {k: after[k] - before[k] for k in COUNTERS.values()}
    per_b = list(before["accepted_per_pos"]) + [0] * len(after["accepted_per_pos"])
    out["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], per_b)]
    return out


# --- the child ------------------------------------------------------------------------------

READY = "eyas-evaluate-ready"
GO = "go"


def _child(spec_path: str, result_path: str) -> int:
    spec = Spec(**json.loads(Path(spec_path).read_text()))
    try:
        result = _generate(spec)
    except BaseException as exc:  # noqa: BLE001 - the parent needs whatever stopped us
        atomic.write_json(
            Path(result_path),
            {
                "error": {
                    "type": type(exc).__qualname__
                    if type(exc).__module__ == "builtins"
                    else f"{type(exc).__module__}.{type(exc).__qualname__}",
                    "message": str(exc),
                    "traceback": "".join(traceback.format_exception(exc)),
                }
            },
        )
        traceback.print_exc()
        return 1
    if result is not None:
        atomic.write_json(Path(result_path), result)
    return 0


def _generate(spec: Spec) -> dict[str, Any] | None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    args = engine_args(spec)
    print(
        f"eyas evaluate [{spec.label}]: vLLM engine {json.dumps({k: v for k, v in args.items() if k != 'model'})}",
        flush=True,
    )
    t0 = time.monotonic()
    llm = LLM(**args)
    load_s = time.monotonic() - t0
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in spec.prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, detokenize=False)
    # A short warm-up first: the first steps pay one-off costs (kernel selection, allocations)
    # that would otherwise count against whichever engine runs first.
    llm.generate(
        prompts[: spec.max_num_seqs],
        SamplingParams(temperature=0.0, max_tokens=spec.warmup_tokens, detokenize=False),
        use_tqdm=False,
    )
    # Loaded: wait for the parent's word, so that the timed run has the machine to itself.
    print(f"{READY} [{spec.label}] engine up in {load_s:.1f}s", flush=True)
    if sys.stdin.readline().strip() != GO:
        return None  # the parent is gone or gave up: nothing to measure
    before = counters(llm.get_metrics())
    t1 = time.perf_counter()
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    seconds = time.perf_counter() - t1
    after = counters(llm.get_metrics())
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    generated = sum(len(t) for t in token_ids)
    per_prompt = None
    if spec.draft is not None:
        per_prompt = [
            prompt_counts(getattr(o.outputs[0], "spec_decode_metrics", None), spec.num_speculative_tokens) for o in outs
        ]
        if any(p is None for p in per_prompt):
            per_prompt = None  # this vLLM does not count per request
    result = {
        "label": spec.label,
        "token_ids": token_ids,
        "tokens": generated,
        "seconds": seconds,
        "tok_s": generated / seconds if seconds > 0 else None,
        "load_seconds": load_s,
        "counters": delta(after, before) if spec.draft is not None else None,
        "per_prompt": per_prompt,
    }
    print(
        f"eyas evaluate [{spec.label}]: {len(token_ids)} prompts, {generated} tokens in {seconds:.2f}s "
        f"({result['tok_s']:.1f} tok/s); engine up in {load_s:.1f}s"
        + (f"; counters {json.dumps(result['counters'])}" if result["counters"] else ""),
        flush=True,
    )
    return result


# --- the parent -----------------------------------------------------------------------------

_ERROR_LINE = re.compile(r"\b[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b(:|$)")


def _root_line(tail: list[str]) -> str | None:
    """The first line of the child's output that names an exception: the root cause vLLM
    points at with "See root cause above", ahead of the generic one it raises last."""
    for line in tail:
        if _ERROR_LINE.search(line) and "Traceback" not in line:
            return line.strip()
    return None


class Child:
    """One measurement's child process: started, then told to go once loaded, then reaped."""

    def __init__(self, spec: Spec, workdir: Path, env: dict[str, str]):
        workdir.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        self.spec_path, self.result_path = workdir / f"{spec.label}.spec.json", workdir / f"{spec.label}.result.json"
        self.result_path.unlink(missing_ok=True)
        atomic.write_json(self.spec_path, asdict(spec))
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.ready = threading.Event()
        # Its own session: on a timeout, the engine's processes (EngineCore, workers) go with it.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "eyas.workers.evaluate.engines", str(self.spec_path), str(self.result_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
        self.pump = threading.Thread(target=self._pump, daemon=True, name=f"eyas-eval-{spec.label}")
        self.pump.start()

    def _pump(self) -> None:
        """The child's lines into this process's stdout (the rank's log), the last ones kept."""
        sink = sys.stdout.buffer
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(line)
            if line.startswith(READY):
                self.ready.set()
            try:
                sink.write(raw)
                sink.flush()
            except (OSError, ValueError):
                pass

    def wait_ready(self, deadline: float | None) -> None:
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None:
                self.ready.wait(2)  # the pump may still be reading its last lines
                if not self.ready.is_set():
                    raise self.failure()
            self._check_deadline(deadline)

    def go(self) -> None:
        try:
            self.proc.stdin.write(f"{GO}\n".encode())
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # it died after loading: finish() reports why

    def finish(self, deadline: float | None) -> dict:
        """Wait for the child to exit (vLLM's own shutdown frees its shared memory); its result."""
        while self.proc.poll() is None:
            time.sleep(0.1)
            self._check_deadline(deadline)
        # vLLM's EngineCore (a grandchild) may hold the pipe a moment longer; never wait on it for good.
        self.pump.join(timeout=10)
        result = json.loads(self.result_path.read_text()) if self.result_path.exists() else None
        if self.proc.returncode == 0 and result is not None and "error" not in result:
            return result
        raise self.failure(result)

    def _check_deadline(self, deadline: float | None) -> None:
        if deadline is not None and time.monotonic() > deadline:
            self.kill()
            raise EngineFailed(
                f"{self.spec.label}: vLLM did not finish in time; lower evaluate.max_prompts or evaluate.max_tokens"
            )

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def failure(self, result: dict | None = None) -> EngineFailed:
        if result is None and self.result_path.exists():
            result = json.loads(self.result_path.read_text())
        code = self.proc.poll()
        spec, tail = self.spec, list(self.tail)
        what = "the target alone" if spec.draft is None else f"the target with the {spec.label} draft"
        if result is not None and "error" in result:
            err = result["error"]
            message = (err.get("message") or "").strip()
            if not message or "root cause" in message or "stack trace above" in message:
                root = _root_line(tail[:-1])
                message = f"{message} ({root})" if message and root else (message or root or "(empty message)")
            exc = EngineFailed(f"vLLM with {what} failed: {err['type']}: {message.splitlines()[0]}")
            exc.add_note(f"the child's traceback:\n{err.get('traceback', '')}")
        else:
            how = (
                f"was killed by {signal.Signals(-code).name}"
                if code is not None and code < 0
                else f"exited {code} without a result"
            )
            root = _root_line(tail)
            exc = EngineFailed(f"vLLM with {what} {how}" + (f": {root}" if root else ""))
        exc.add_note("the child's last output lines:\n" + "\n".join(tail))
        return exc


# vLLM's shared-memory readers spin for a second after their last read before they sleep
# (shm_broadcast.SpinCondition, busy_loop_s=1): an engine that has just warmed up is left that
# long to go quiet before another engine's timed run starts.
SETTLE_S = 1.5


def measure_all(
    specs: list[Spec],
    workdir: Path,
    env: dict[str, str] | None = None,
    loads_at_once: int = 1,
    timeout: float | None = None,
    on_result=None,
    progress=None,
) -> dict[str, dict]:
    """Run the measurements in order; their results by label (`on_result(label, result)` is
    called as each one ends).

    Engines load in batches of `loads_at_once`, all of a batch at the same time, which saves
    minutes where loading dominates and memory is plentiful (vLLM's CPU build: process start-up,
    imports, profiling). The timed runs never overlap anything: a batch's engines are told to
    generate one at a time, once the whole batch has loaded and gone quiet, each after the one
    before it has exited. With 1 (GPUs, where every engine takes most of the GPU's memory) each
    engine starts after the previous one has exited.

    With a ProgressWriter as `progress`, the rank writes heartbeats while the children load and
    generate: the engines run in child processes, whose output is no file of the attempt's.
    """
    deadline = time.monotonic() + timeout if timeout else None
    results: dict[str, dict] = {}
    step = max(1, loads_at_once)
    for first in range(0, len(specs), step):
        batch = [Child(spec, workdir, env or {}) for spec in specs[first : first + step]]
        labels = ", ".join(child.spec.label for child in batch)
        try:
            with _beating(
                progress, f"starting {_engines(first, len(batch), len(specs))} ({labels})", kind="engine_start"
            ):
                for child in batch:
                    child.wait_ready(deadline)
            if len(batch) > 1:
                time.sleep(SETTLE_S)
            for child in batch:
                child.go()
                n = first + batch.index(child)
                with _beating(progress, f"timed run on {_engines(n, 1, len(specs))} ({child.spec.label})"):
                    results[child.spec.label] = child.finish(deadline)
                if on_result is not None:
                    on_result(child.spec.label, results[child.spec.label])
        finally:
            for child in batch:
                child.kill()
    return results


def _engines(first: int, count: int, total: int) -> str:
    """`vLLM engine 2 of 3`, `vLLM engines 1-2 of 3`: the phases' names say which engines of the
    stage's measurements a batch is (the TUI and the follow show them as they are)."""
    if count == 1:
        return f"vLLM engine {first + 1} of {total}"
    return f"vLLM engines {first + 1}-{first + count} of {total}"


def _beating(progress, phase: str, **how):
    # The engines are child processes of this rank: the daemon sees their CPU as the phase's
    # evidence, and each engine's own start-up timeout bounds it (no budget here).
    return progress.beating(phase, **how) if progress is not None else contextlib.nullcontext()


def measure(spec: Spec, workdir: Path, env: dict[str, str] | None = None, timeout: float | None = None) -> dict:
    """One measurement in a child process; its result dict, or EngineFailed."""
    return measure_all([spec], workdir, env, 1, timeout)[spec.label]


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2]))
