"""What the daemon may know of the stages: names, entry points and launch defaults.

Pure data and stdlib: the daemon imports this module, so it must never pull in torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageSpec:
    name: str
    entry: str                  # "module:function" run by the rank runtime inside each rank
    description: str
    distributed: bool = True    # False: always one rank, whatever the run's ranks
    max_restarts: int = 0
    needs_target: bool = True   # the stage reads the target model
    needs_data: bool = False    # the stage reads the dataset
    gpus: bool = True           # False: runs on CPU (tokenizing, counting, checks) and holds no GPU
    # The hang bounds' defaults (README, "How it works → Hangs"); a run overrides them in
    # [stages.<name>], where 0 turns one off. Every legitimately silent phase of a real stage
    # (weight load, engine start-up, checkpoint save) writes a heartbeat line every ~30 s, so
    # ten quiet minutes mean a hang, not a slow step.
    stall_timeout: float = 600.0  # seconds with nothing written to the attempt dir
    exit_timeout: float = 60.0    # seconds a rank may outlive its own work or its peers


STAGES: dict[str, StageSpec] = {
    spec.name: spec
    for spec in (
        # `eyas doctor`'s checks, run first in every run that reads a target (config.py puts it
        # there): a failed check stops the run before any rank group loads anything.
        StageSpec("preflight", "eyas.workers.stages.preflight:main", "check versions, target, adapter, "
                  "tokenizer and resources", distributed=False, gpus=False),
        StageSpec("prepare", "eyas.workers.stages.prepare:main", "render chats, build loss masks",
                  distributed=False, needs_data=True, gpus=False),
        StageSpec("extract", "eyas.workers.stages.extract:main", "capture the target's hidden states"),
        StageSpec("vocab", "eyas.workers.stages.vocab:main", "build the draft vocabulary mapping",
                  distributed=False, gpus=False),
        StageSpec("train", "eyas.workers.stages.train:main", "train the EAGLE-3 draft"),
        StageSpec("evaluate", "eyas.workers.stages.evaluate:main", "measure acceptance in vLLM",
                  distributed=False),
        # A stage for tests and benchmarks: prints, reports progress, sleeps and fails on demand.
        # Its short stall default lets tests exercise the watchdog as a run gets it by default.
        StageSpec("selftest", "eyas.workers.stages.selftest:main", "exercise the supervisor",
                  needs_target=False, stall_timeout=20.0),
    )
}

# The pipeline a run gets when its config names none.
DEFAULT_PIPELINE = ("prepare", "extract", "vocab", "train", "evaluate")


def argv(python: str) -> list[str]:
    """The command line of one rank: the rank monitor, which runs the rank runtime."""
    return [python, "-m", "eyas.workers.monitor"]
