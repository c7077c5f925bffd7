"""The regenerate stage on vLLM's CPU build: its generation throughput against a bare `LLM.generate` of the same prompts and sampling.

A tiny llama, its head fitted to the synthetic chats (eyas.workers.models.assets, as the
regenerate tests build it: answers in the chats' words, most ended by <|end|>), answers the
assistant turns of `--rows` chats (one to three turns each, prepared by the prepare stage) at
TP=1, then TP=2. Each TP size is one fresh process holding two engines (an engine takes 20-50 s
to start here; an idle one sleeps):

- eyas: the regenerate stage's entry, run as a rank runs it (eyas.workers.runtime.rank.main with
  the rank contract's environment, a fresh output folder each run): the dataset load and its
  digest, the batch plan, the turn-by-turn calls of workers/vllm/generate.py (add_request +
  step, outputs as deltas, the progress counts), every finished batch appended to its rows file
  with an fsync, then rank 0's assembly and publication of the dataset. Its engine is the one
  generate.launch started with the stage's own arguments (worker extension included) in a
  first, untimed run, kept for the next ones (the launch and the shutdown are the only calls
  replaced);
- generate: a bare `vllm.LLM(...)` with the engine options eyas uses on the CPU build (model,
  dtype, TP size, max_model_len, the mp executor, eager mode, no prefix caching, the seed),
  written out here and without the worker extension: `llm.generate(prompts,
  [SamplingParams(...)])` of the very requests of each of the stage's generate calls (same
  prompts, max_tokens, stop tokens, temperature), made beside that call, before it and after
  it in turn. This machine is shared and noisy: interleaved call by call, a slow spell hits
  both sides alike. eyas's time is the stage's run less the bare engine's calls inside it.

The ratio eyas tok/s / generate tok/s of each of `--repeats` stage runs counts; the median is
printed with its min-max, and the same for the generate calls alone (workers/vllm/generate.py
against LLM.generate). Target: >= 0.95 at TP=1 and at TP=2.

`generate by turn` (in each round, before or after the stage's run in turn) is what a caller of
vLLM alone would send: every row's turn k in one call, so as many sequences in flight as the
engine takes (vLLM's max_num_seqs: 256 per TP rank on the CPU build) and one wait for the
slowest answer per turn. The stage sends regenerate.batch_size rows at a time, each batch
whole and waited for (what makes a resumed batch byte-identical), so at most batch_size in
flight and a wait per turn per batch: eyas / by turn is what the batch plan costs (`--batch`).

Run: python tests/bench/bench_regenerate.py [--rows 512 --batch 256 --max-tokens 64 --repeats 5 --tp 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_RATIO = 0.95
CACHE = Path(tempfile.gettempdir()) / "eyas-bench-regenerate-v1"
FIT_STEPS = 100  # tests/support/regen_world.py's: answers that end with <|end|>, or run to max_tokens
MAX_LENGTH = 512  # data.max_length, and the engine's max_model_len
CHILD_TIMEOUT_S = 3000


def build(root: Path, rows: int) -> tuple[Path, Path]:
    """The fitted tiny llama and a chat file of `rows` chats (kept for reruns)."""
    from eyas.workers.models import assets

    target = root / "llama"
    if not (target / "model.safetensors").exists():
        assets.build_model(target, "llama")
        assets.fit_to_chats(target, FIT_STEPS)
    chats = root / f"chats-{rows}.jsonl"
    if not chats.exists():
        assets.write_dataset(chats, n=rows, seed=3, malformed=False)
    return target, chats


def config_json(root: Path, target: Path, chats: Path, tp: int, batch: int, max_tokens: int) -> Path:
    """The run's config as the daemon hands it to a rank (runconfig.load(...).to_dict())."""
    import tomli_w

    from eyas.state import runconfig

    name = f"bench-regenerate-tp{tp}-b{batch}-m{max_tokens}-{chats.stem}"
    toml = root / f"{name}.toml"
    toml.write_text(
        tomli_w.dumps(
            {
                "name": name,
                "pipeline": ["prepare", "regenerate"],
                "preflight": False,
                "output_dir": str(root / name),
                "target": {"path": str(target), "dtype": "float32"},
                "data": {"path": str(chats), "max_length": MAX_LENGTH, "validation_fraction": 0.1},
                "resources": {"devices": "cpu"},
                "regenerate": {"batch_size": batch, "max_tokens": max_tokens, "tensor_parallel_size": tp},
                "draft": {"vocab_size": 256},
            }
        )
    )
    path = root / f"{name}.json"
    path.write_text(json.dumps(runconfig.load(toml).to_dict()))
    return path


def rank_env(stage: str, cfg: Path, out: Path, attempt_dir: Path) -> dict[str, str]:
    """The rank contract's environment of a lone rank (daemon/group.py: _start_rank)."""
    from eyas.state import contract

    attempt_dir.mkdir(parents=True, exist_ok=True)
    return {
        **os.environ,
        contract.RANK: "0",
        contract.WORLD_SIZE: "1",
        contract.LOCAL_RANK: "0",
        contract.LOCAL_WORLD_SIZE: "1",
        contract.STAGE: stage,
        contract.ATTEMPT: "1",
        contract.ATTEMPT_DIR: str(attempt_dir),
        contract.OUTPUT_DIR: str(out),
        contract.CONFIG: str(cfg),
        "PYTHONUNBUFFERED": "1",
    }


def prepare(cfg: Path, out: Path) -> Path:
    """prepare's dataset of the chats, by the prepare stage itself (kept for reruns)."""
    if not (out / "prepare" / "summary.json").exists():
        env = rank_env("prepare", cfg, out, out / "attempts" / "prepare")
        proc = subprocess.run(
            [sys.executable, "-m", "eyas.workers.runtime.rank"], env=env, capture_output=True, text=True, timeout=600
        )
        if proc.returncode != 0:
            raise SystemExit(f"prepare failed:\n{proc.stderr[-4000:]}")
    return out / "prepare"


def bare_args(target: str, tp: int, max_model_len: int) -> dict:
    """vLLM's engine as eyas starts it on the CPU build (workers/vllm/engine.py: engine_args,
    generate.engine_options), written out here: no worker extension."""
    return {
        "model": target,
        "dtype": "float32",
        "tensor_parallel_size": tp,
        "max_model_len": max_model_len,
        "distributed_executor_backend": "mp",
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "skip_tokenizer_init": True,
        "seed": 0,
        "disable_log_stats": True,
    }


# --- the child: both engines of one TP size -------------------------------------------------


class Bare:
    """A bare vllm.LLM, and the generate calls it makes of eyas's requests."""

    def __init__(self, target: str, tp: int, max_model_len: int):
        from vllm import LLM

        self.llm = LLM(**bare_args(target, tp, max_model_len))
        self.seconds, self.tokens = 0.0, 0

    def generate(self, requests, *, temperature: float, top_p: float, stop_token_ids, **_) -> None:
        """`llm.generate(prompts, [SamplingParams(...)])` of eyas's requests, the prompts and the
        sampling built as a caller of vLLM builds them; timed, its tokens counted."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt)) for r in requests]
        sampling = [
            SamplingParams(
                max_tokens=r.max_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=r.seed if temperature > 0 else None,
                stop_token_ids=list(stop_token_ids),
                detokenize=False,
            )
            for r in requests
        ]
        outs = self.llm.generate(prompts, sampling, use_tqdm=False)
        self.seconds += time.perf_counter() - t0
        self.tokens += sum(len(o.outputs[0].token_ids) for o in outs)


class Stage:
    """The regenerate stage's entry, run in this process as a rank runs it, on one kept engine;
    with a Bare beside it, each of its generate calls is made by both, in alternating order."""

    def __init__(self, cfg: Path, source: Path, scratch: Path):
        from eyas.workers.vllm import engine as vllm_engine
        from eyas.workers.vllm import generate as vllm_generate

        self.cfg, self.source, self.scratch = cfg, source, scratch
        self.engine = None
        self.launched: dict = {}
        self.engine_args: dict = {}
        self.calls: list[list] = []  # the first run's: [[prompt, max_tokens, turn], ...] per call
        self.bare: Bare | None = None
        self.marks: dict[str, float] = {}
        self.runs = self.n_calls = 0
        launch, args_of, generate = vllm_generate.launch, vllm_engine.engine_args, vllm_generate.generate
        self._real_shutdown = vllm_engine.Engine.shutdown

        def kept_launch(**kw):
            if self.engine is None:
                self.engine, self.launched = launch(**kw), kw
            elif kw != self.launched:
                raise RuntimeError(f"the stage launched its engine otherwise: {kw} after {self.launched}")
            self.marks["up"] = time.perf_counter()
            return self.engine

        def kept_shutdown(engine):
            self.marks["down"] = time.perf_counter()

        def recorded_args(*a, **kw):
            self.engine_args = args_of(*a, **kw)
            return self.engine_args

        def each_call(engine, requests, **kw):
            if self.runs == 1:  # the request's key is "<row>-<turns done>" (regenerate/run.py: Generator)
                self.calls.append([[list(r.prompt), r.max_tokens, int(r.key.split("-")[1])] for r in requests])
                self.sampling = {k: v for k, v in kw.items() if k != "on_tokens"}
            if self.bare is None:
                return generate(engine, requests, **kw)
            self.n_calls += 1
            first = self.n_calls % 2 == 1
            if first:
                self.bare.generate(requests, **kw)
            t0 = time.perf_counter()
            out = generate(engine, requests, **kw)
            self.marks["calls_s"] += time.perf_counter() - t0
            if not first:
                self.bare.generate(requests, **kw)
            return out

        vllm_generate.launch, vllm_generate.generate = kept_launch, each_call
        vllm_engine.Engine.shutdown, vllm_engine.engine_args = kept_shutdown, recorded_args

    def run(self) -> dict:
        """One run of the stage; with a Bare, the bare engine's time is taken out of its time."""
        from eyas.workers.runtime import rank

        self.runs += 1
        out = self.scratch / f"eyas-{self.runs}"
        out.mkdir()
        (out / "prepare").symlink_to(self.source)
        attempt_dir = out / "attempts" / "regenerate"
        env = rank_env("regenerate", self.cfg, out, attempt_dir)
        bare = (self.bare.seconds, self.bare.tokens) if self.bare else (0.0, 0)
        self.marks["calls_s"] = 0.0
        t0 = time.perf_counter()
        code = rank.main(env)
        seconds = time.perf_counter() - t0
        if code != 0:
            raise SystemExit(f"the regenerate rank failed (exit {code}); its log is above")
        summary = json.loads((attempt_dir / "summary.json").read_text())
        shutil.rmtree(out)
        result = {
            "tokens": summary["attempt"]["tokens_generated"],
            "rows": summary["rows"],
            "rows_failed": summary["rows_failed"],
            "turns": summary["turns"],
            "seconds": seconds,
            "calls_s": self.marks["calls_s"],
        }
        if self.bare is not None:
            result["bare_s"], result["bare_tokens"] = self.bare.seconds - bare[0], self.bare.tokens - bare[1]
            result["seconds"] -= result["bare_s"]
        return result

    def shutdown(self) -> None:
        if self.engine is not None:
            self._real_shutdown(self.engine)


def child(tp: int, target: str, cfg: Path, source: Path, scratch: Path, repeats: int) -> dict:
    stage = Stage(cfg, source, scratch)
    first = stage.run()  # untimed: starts eyas's engine, records the calls
    max_model_len = int(stage.engine.llm.llm_engine.model_config.max_model_len)
    stage.bare = bare = Bare(target, tp, max_model_len)
    turns = sorted({t for c in stage.calls for _, _, t in c})
    by_turn = [[(p, b) for c in stage.calls for p, b, t in c if t == turn] for turn in turns]

    def generate_by_turn() -> dict:
        """Every row's turn k in one call, as a caller of vLLM alone would send them."""
        from eyas.workers.vllm.generate import Request

        seconds, tokens = bare.seconds, bare.tokens
        for k, call in enumerate(by_turn):
            bare.generate([Request(f"{k}-{i}", tuple(p), b) for i, (p, b) in enumerate(call)], **stage.sampling)
        return {"seconds": bare.seconds - seconds, "tokens": bare.tokens - tokens}

    generate_by_turn()  # untimed: the bare engine's first steps
    load = os.getloadavg()[0]
    rounds = []
    for r in range(repeats):
        order = ("eyas", "by_turn") if r % 2 == 0 else ("by_turn", "eyas")
        rnd = {side: stage.run() if side == "eyas" else generate_by_turn() for side in order}
        rounds.append(rnd)
        print(f"round {r + 1}: {json.dumps(rnd)}", file=sys.stderr, flush=True)
    stage.shutdown()
    bare_engine = bare_args(target, tp, max_model_len)
    return {
        "first": first,
        "rounds": rounds,
        "calls": len(stage.calls),
        "turn_calls": len(by_turn),
        "load": [load, os.getloadavg()[0]],
        "engine_args_differ": {k: v for k, v in sorted(stage.engine_args.items()) if bare_engine.get(k) != v},
    }


# --- the parent -----------------------------------------------------------------------------


def spawn(argv: list[str], env: dict[str, str], scratch: Path) -> dict:
    """The child in a session of its own, its output in files: when it has ended, whatever vLLM
    process it left behind is ended with its group (as the rank monitor's group ends), and no
    leftover holding a pipe open can keep the bench waiting."""
    out, err = scratch / "child.out", scratch / "child.err"
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--child", *argv], env=env, stdout=o, stderr=e, start_new_session=True
        )
        try:
            code = proc.wait(timeout=CHILD_TIMEOUT_S)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    if code != 0 or not lines:
        raise SystemExit(f"TP={argv[0]} failed (exit {code}):\n{stdout[-2000:]}\n{stderr[-5000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def measure(tp: int, target: Path, cfg: Path, source: Path, repeats: int, scratch: Path) -> dict:
    from eyas.workers.vllm.engine import cpu_env

    # What eyas's engine sets for itself (setdefault), given to both engines alike.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", **cpu_env(tp)}
    work = scratch / f"tp{tp}"
    work.mkdir()
    got = spawn([str(tp), str(target), str(cfg), str(source), str(work), str(repeats)], env, scratch)
    for r, rnd in enumerate(got["rounds"]):
        e, t = rnd["eyas"], rnd["by_turn"]
        e["tok_s"], e["bare_tok_s"], t["tok_s"] = (
            e["tokens"] / e["seconds"],
            e["bare_tokens"] / e["bare_s"],
            t["tokens"] / t["seconds"],
        )
        note = "" if e["tokens"] == e["bare_tokens"] else f"  (tokens: eyas {e['tokens']}, generate {e['bare_tokens']})"
        print(
            f"    TP={tp} round {r + 1}: generate {e['bare_tok_s']:5.0f} tok/s ({e['bare_s']:5.2f} s)  "
            f"eyas {e['tok_s']:5.0f} tok/s ({e['seconds']:5.2f} s, of which its generate calls {e['calls_s']:5.2f} s)  "
            f"ratio {e['tok_s'] / e['bare_tok_s']:.3f}  |  generate by turn {t['tok_s']:5.0f} tok/s ({t['seconds']:5.2f} s)"
            f"{note}",
            flush=True,
        )

    def ratio(num, den) -> list[float]:
        values = [num(rnd) / den(rnd) for rnd in got["rounds"]]
        return [statistics.median(values), min(values), max(values)]

    return {
        **got["first"],
        "calls": got["calls"],
        "turn_calls": got["turn_calls"],
        "tok_s": {
            "generate": statistics.median(rnd["eyas"]["bare_tok_s"] for rnd in got["rounds"]),
            "eyas": statistics.median(rnd["eyas"]["tok_s"] for rnd in got["rounds"]),
            "by_turn": statistics.median(rnd["by_turn"]["tok_s"] for rnd in got["rounds"]),
        },
        "ratio": ratio(lambda r: r["eyas"]["tok_s"], lambda r: r["eyas"]["bare_tok_s"]),
        "call_ratio": ratio(lambda r: r["eyas"]["bare_s"], lambda r: r["eyas"]["calls_s"]),
        "turn_ratio": ratio(lambda r: r["eyas"]["tok_s"], lambda r: r["by_turn"]["tok_s"]),
        "load": got["load"],
        "engine_args_differ": got["engine_args_differ"],
    }


def _spread(values: list[float]) -> str:
    return f"{values[0]:.3f} [{values[1]:.3f}-{values[2]:.3f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512, help="chats to regenerate")
    parser.add_argument("--batch", type=int, help="regenerate.batch_size (default: the stage's)")
    parser.add_argument("--max-tokens", type=int, default=64, help="regenerate.max_tokens")
    parser.add_argument("--repeats", type=int, default=5, help="stage runs (and by-turn runs) per TP size")
    parser.add_argument("--tp", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.batch is None:
        from eyas.state.regenerate import RegenerateConfig

        args.batch = RegenerateConfig().batch_size
    if args.child:
        tp, target, cfg, source, scratch, repeats = args.child
        result = child(int(tp), target, Path(cfg), Path(source), Path(scratch), int(repeats))
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)  # as a rank ends (runtime/rank.py: exit_rank): vLLM's leftovers never hold it

    CACHE.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    target, chats = build(CACHE, args.rows)
    print(
        f"target: tiny llama (hidden 128, 8 layers), head fitted to the chats, fp32, vLLM CPU build, "
        f"{os.cpu_count()} CPUs; {args.rows} chats, batches of {args.batch}, max_tokens {args.max_tokens}, "
        f"greedy; {args.repeats} stage runs per TP size, generate interleaved call by call",
        flush=True,
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="eyas-bench-regenerate-") as scratch:
        prepared = CACHE / f"prepared-{chats.stem}"
        source = prepare(config_json(CACHE, target, chats, 1, args.batch, args.max_tokens), prepared)
        for tp in args.tp:
            cfg = config_json(CACHE, target, chats, tp, args.batch, args.max_tokens)
            results[tp] = measure(tp, target, cfg, source, args.repeats, Path(scratch))
    ok = True
    for tp, r in results.items():
        met = r["ratio"][0] >= TARGET_RATIO
        ok = ok and met
        tok = r["tok_s"]
        print(
            f"TP={tp}: {r['rows']} rows, {r['turns']} turns, {r['tokens']} tokens generated; medians: "
            f"generate {tok['generate']:.0f} tok/s, eyas {tok['eyas']:.0f} tok/s, generate by turn {tok['by_turn']:.0f} tok/s"
        )
        print(
            f"       eyas / generate of the same {r['calls']} calls = {_spread(r['ratio'])} "
            f"(target >= {TARGET_RATIO:.2f}: {'met' if met else 'MISSED'}); its generate calls alone "
            f"(workers/vllm/generate.py against LLM.generate) {_spread(r['call_ratio'])}"
        )
        print(
            f"       eyas / generate by turn ({r['turn_calls']} calls: every row's turn k in one) = "
            f"{_spread(r['turn_ratio'])}: what the batch plan (batch_size) costs"
        )
        print(f"       load average {r['load'][0]:.1f} -> {r['load'][1]:.1f} on {os.cpu_count()} CPUs")
        print(f"       eyas's engine arguments the bare engine does not set alike: {r['engine_args_differ']}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
