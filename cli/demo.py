"""`eyas demo`: the main job on embedded defaults, through a private daemon.

It starts a daemon for the demo's own state directory when none runs, builds the tiny test
assets (a DeepSeek-V3-shaped target and synthetic chats) in a child process, submits the
whole pipeline (prepare -> extract -> vocab -> train on 2 ranks with the transformers backend,
then evaluate: the trained draft's acceptance in vLLM beside an untrained one) with
workers/examples/demo.toml as its config, shows live progress and ends with a summary table
and the command that opens the TUI on the run. Ctrl-C cancels the run and stops the daemon
it started: nothing is left running.

On CPU (vLLM's CPU build installed) it submits demo.toml as it is. On a GPU host with the CUDA
stack (vLLM's GPU build installed, as `make setup` does where nvidia-smi lists a GPU) and a GPU
that NVML sees, it submits demo.toml with three lines changed (for_gpus): the GPUs the daemon
finds instead of "cpu", one rank per GPU up to 2, and bfloat16, the only dtypes besides float16
that vLLM's MLA kernels take on GPU.

The CLI process never imports torch: the assets are built by `python -m eyas.workers.models.assets`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import eyas.workers
from eyas.cli import output
from eyas.state import contract, paths, privacy
from eyas.state import runconfig as run_config
from eyas.wire.client import Client, DaemonError, DaemonNotRunning

# The demo's config is the commented example shipped with the package.
DEMO_TOML = Path(eyas.workers.__file__).parent / "examples" / "demo.toml"
# What for_gpus changes in demo.toml: each key's whole line (its comment too), matched once.
GPU_LINES = {
    "dtype": 'dtype = "bfloat16"                  # vLLM\'s MLA kernels on GPU take bfloat16 or float16 only',
    "ranks": "ranks = {ranks}                           # extract and train: one rank per GPU (nccl when 2)",
    "devices": 'devices = "auto"                    # the GPUs the daemon finds',
}
# The demo's target has its output head fitted to the chats (eyas.workers.models.assets.fit_to_chats),
# so that its answers are something a draft can learn to predict.
FIT_STEPS = 300


# What the demo builds: the DeepSeek-shaped target and the chats (the tests' tiny-llama is not used).
ASSETS = ("tiny-deepseek", "chat.jsonl")


def demo_home(chosen: str | None = None) -> Path:
    """The demo's own state directory: `eyas --home DIR demo`'s DIR, else `.eyas-demo` here.

    $EYAS_HOME is not used: it names the user's real state directory, which a demo's tiny
    target, chats and runs would clutter."""
    return Path(chosen).absolute() if chosen else Path.cwd() / ".eyas-demo"


def eyas_command() -> str:
    """How the user's shell runs this eyas: `eyas` when that name on PATH is this install,
    else its full path (a fresh shell after `make demo` has no .venv/bin on PATH)."""
    import shutil

    mine = Path(sys.executable).parent / "eyas"  # the console script beside this interpreter
    if not mine.exists():
        return f"{sys.executable} -m eyas.cli.main"
    found = shutil.which("eyas")
    if found and Path(found).resolve() == mine.resolve():
        return "eyas"
    return str(mine.absolute())


def gpu_count() -> int:
    """The GPUs the demo runs on: those NVML sees where vLLM's GPU build is installed, else 0 (CPU)."""
    from eyas.workers.nvml import GpuProbe
    from eyas.workers.vllm import version as vllm_version

    if vllm_version.installed()[0] != "vllm":
        return 0
    probe = GpuProbe(log=logging.getLogger("eyas.demo.nvml"))
    try:
        return probe.device_count() if probe.start() else 0
    finally:
        probe.shutdown()


def for_gpus(text: str, gpus: int) -> str:
    """demo.toml's text for a host with `gpus` GPUs (unchanged for 0)."""
    if gpus <= 0:
        return text
    lines = text.splitlines(keepends=True)
    for key, new in GPU_LINES.items():
        found = [i for i, line in enumerate(lines) if line.startswith(f"{key} = ")]
        if len(found) != 1:
            raise ValueError(f"{DEMO_TOML}: expected one `{key} = ` line to set for the GPUs")
        lines[found[0]] = new.format(ranks=min(2, gpus)) + "\n"
    return "".join(lines)


def _ensure_daemon() -> bool:
    """Start the demo's daemon unless one runs; True when this call started it."""
    try:
        with Client(timeout=2) as c:
            c.request("ping")
            return False
    except (DaemonNotRunning, DaemonError, OSError, TimeoutError):
        pass
    from argparse import Namespace

    from .lifecycle import start

    if start(Namespace(foreground=False, grace=10.0)) != 0:
        raise SystemExit(1)
    return True


def command(args) -> int:
    home = demo_home(getattr(args, "home", None))
    os.environ["EYAS_HOME"] = str(home)
    # Everything the demo makes is its private state directory's (its config, the tiny target,
    # the chats, the daemon it starts and that daemon's runs): owner-only, as eyas's state is.
    os.umask(privacy.OWNER_ONLY)
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    console = output.console()
    console.print(f"[bold]eyas demo[/bold]: state in {home} (the demo's own; `eyas --home DIR demo` picks another)")
    t0 = time.monotonic()
    started = _ensure_daemon()
    try:
        code = _run_demo(home, console)
        console.print(f"demo took {time.monotonic() - t0:.0f}s")
        return code
    except KeyboardInterrupt:
        console.print("stopped")
        return 130
    finally:
        if started:
            # The demo leaves nothing running behind it; history stays readable without it.
            from argparse import Namespace

            from .lifecycle import stop

            stop(Namespace(grace=None))


def build_assets(target_dir: Path, console) -> bool:
    """Build the tiny target and the chats in a child process (it imports torch, we do not),
    showing each step of the build as it reports it (contract.ASSET_PROGRESS lines on its stderr)."""
    what = f"building the demo's tiny target and chats in {target_dir}"
    console.print(f"{what} (about a minute, once) …", highlight=False, soft_wrap=True)
    cmd = [sys.executable, "-m", "eyas.workers.models.assets", str(target_dir), "--fit-steps", str(FIT_STEPS)]
    proc = subprocess.Popen(
        [*cmd, "--only", *ASSETS], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    other: list[str] = []  # the child's own stderr (warnings, a traceback), shown if it fails
    try:
        with console.status(what) as status:
            for line in proc.stderr:
                if line.startswith(contract.ASSET_PROGRESS):
                    step = line[len(contract.ASSET_PROGRESS) :].strip()
                    status.update(f"{what}: {step}")
                    if not console.is_terminal and not step.startswith("fitting the output head: step"):
                        # A spinner draws nothing in a pipe: one plain line per asset, not per step.
                        console.print(f"  {step}", highlight=False, soft_wrap=True)
                else:
                    other.append(line)
            proc.stdout.read()
            code = proc.wait()
    except BaseException:
        # Ctrl-C (or any error) here: the build must not outlive the demo.
        proc.kill()
        proc.wait()
        raise
    if code != 0:
        console.print(f"[red]building the demo assets failed (exit {code}):[/red]")
        console.print("".join(other)[-3000:], markup=False, highlight=False)
        return False
    console.print(f"assets ready in {target_dir}")
    return True


def _run_demo(home: Path, console) -> int:
    from .follow import follow

    if not build_assets(home / "assets", console):
        return 1
    gpus = gpu_count()
    config = home / "demo.toml"
    config.write_text(for_gpus(DEMO_TOML.read_text(), gpus))
    with Client() as c:
        try:
            run_id = c.request("submit", config_path=str(config))["run_id"]
        except DaemonError as exc:
            console.print(f"[red]{exc.message}[/red]")
            return 1
    where = f"on {min(2, gpus)} GPU{'s' if gpus > 1 else ''}" if gpus else "on CPU"
    console.print(f"run {run_id} submitted: {' -> '.join(_pipeline(config))}, {where}")
    try:
        code = follow(run_id, console)
    except KeyboardInterrupt:
        console.print("stopping the run…")
        with Client() as c:
            try:
                c.request("stop", run=run_id)
            except DaemonError as exc:
                console.print(exc.message)
        _wait_ended(run_id)
        return 130
    eyas = f"{eyas_command()} --home {home}"
    console.print(f"\nopen it in the TUI:  [bold]{eyas} tui {run_id}[/bold]", soft_wrap=True)
    console.print(
        f"or:                  [bold]{eyas} show {run_id}[/bold]   ·   [bold]{eyas} logs {run_id} --stage train[/bold]",
        soft_wrap=True,
    )
    if not eyas.startswith("eyas "):
        bin_dir = Path(sys.executable).parent.absolute()
        console.print(f'to type just `eyas`:  [bold]export PATH="{bin_dir}:$PATH"[/bold]', soft_wrap=True)
    return code


def _pipeline(config: Path) -> list[str]:
    """The stages the daemon will run for `config` (its own validation; the CLI has no torch)."""
    try:
        return list(run_config.load(config).pipeline)
    except run_config.ConfigError:
        return ["?"]


def _wait_ended(run_id: int, timeout: float = 60) -> None:
    from eyas.state import queries

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        db = queries.connect(paths.db_path())
        try:
            if queries.get_run(db, run_id)["state"] in ("succeeded", "failed", "cancelled"):
                return
        finally:
            db.close()
        time.sleep(0.2)
    print(f"run {run_id} did not end within {timeout:.0f}s", file=sys.stderr)
