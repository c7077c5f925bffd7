"""What eyas refuses of a run's target before any stage loads it: weights that are not on disk for a stage that loads them, and tensor-parallel sizes the target's shape does not allow; one Problem (key, problem, fix) each.

Read from config.json and the directory's listing alone (state/weightfiles.py,
state/tpsizes.py): no torch, no vLLM, so `eyas submit` and `eyas validate` run these checks
and print each Problem as the run config's other mistakes (`<file>: <key>: <problem>; <fix>`),
and `eyas doctor` and the preflight stage report the same words as failed checks
(workers/doctor/target.py). Only a target that is a local directory is read: a hub name cannot
be read here (and `runconfig.validate` refuses a target.path that does not exist).

Which stages load the target's weights: regenerate (vLLM), extract (vLLM, or transformers'
from_pretrained on the hf backend), train (speculators reads the verifier's embeddings, lm_head
and norm from them) and evaluate (vLLM). A vLLM stage loads none when its engine arguments ask
for random weights, `[stages.<stage>] options.vllm.load_format = "dummy"` (vLLM's own option,
passed through as given); transformers and speculators have no such option. The preflight's
canary uses dummy weights on its shrunken copy whatever the run says (workers/canary/run.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from eyas.state import tpsizes
from eyas.state.runconfig import RunConfig
from eyas.state.target import read_model_config
from eyas.state.weightfiles import INDEX, WeightFiles, scan

DUMMY = "dummy"


@dataclass(frozen=True)
class Problem:
    key: str  # the run config's key to change, e.g. "target.path", "extract.tensor_parallel_size"
    problem: str  # what is wrong, with the numbers
    fix: str  # what to do

    def line(self, source: str) -> str:
        """As `eyas validate` and `eyas submit` print a config mistake."""
        return f"{source}: {self.key}: {self.problem}; {self.fix}"

    @property
    def detail(self) -> str:
        """As `eyas doctor` prints it (its fix on the next line)."""
        return f"{self.key}: {self.problem}"


@dataclass(frozen=True)
class Loader:
    stage: str
    engine: str  # "vllm", "transformers" or "speculators"
    dummy: bool  # the stage asked vLLM for random weights

    def __str__(self) -> str:
        return f"{self.stage} ({self.engine})"


def vllm_options(cfg: RunConfig, stage: str) -> dict:
    """`[stages.<stage>] options.vllm` as written ({} when unset)."""
    sc = cfg.stages.get(stage)
    opts = sc.options.get("vllm") if sc is not None else None
    return opts if isinstance(opts, dict) else {}


def loaders(cfg: RunConfig) -> list[Loader]:
    """The run's stages that load the target's weights, in pipeline order."""
    out = []
    for stage in cfg.pipeline:
        if stage == "extract":
            engine = "vllm" if cfg.extract.backend == "vllm" else "transformers"
        elif stage in ("evaluate", "regenerate"):
            engine = "vllm"
        elif stage == "train":
            engine = "speculators"
        else:
            continue
        dummy = engine == "vllm" and vllm_options(cfg, stage).get("load_format") == DUMMY
        out.append(Loader(stage, engine, dummy))
    return out


def _names(items: list) -> str:
    words = [str(i) for i in items]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def weights_problem(cfg: RunConfig, files: WeightFiles) -> Problem | None:
    """The weights' Problem, or None: the weights are all there, or no stage loads them."""
    if files.complete and files.safetensors:
        return None
    needing = [ld for ld in loaders(cfg) if not ld.dummy]
    if not needing:
        return None
    path = files.path
    who = f"{_names(needing)} load{'s' if len(needing) == 1 else ''} them"
    if files.index_error is not None:
        problem = f"{path}/{INDEX} is unusable ({files.index_error}), and {who}"
        fix = f"restore the checkpoint's original {INDEX}"
    elif files.missing:
        k, n = len(files.missing), len(files.shards)
        problem = (
            f"{path}/{INDEX} names {n} shard{'s' if n != 1 else ''}, {k} of them missing "
            f"({files.missing[0]}{', ...' if k > 1 else ''}), and {who}"
        )
        fix = "finish downloading the checkpoint (every file the index names)"
    elif files.pickles:
        problem = (
            f"{path} holds only pickled weights ({_names(list(files.pickles[:3]))}{', ...' if len(files.pickles) > 3 else ''}), "
            f"no *.safetensors, and {who}"
        )
        fix = "eyas never unpickles a checkpoint: use its *.safetensors files (or convert the pickles where you trust them)"
    else:
        problem = f"{path} holds no weights (no *.safetensors file), and {who}"
        fix = "put the checkpoint's *.safetensors files (and its index) there"
    if all(ld.engine == "vllm" for ld in needing):
        keys = " and ".join(f'stages.{ld.stage}.options.vllm.load_format = "{DUMMY}"' for ld in needing)
        fix += f", or, to run on random weights, set {keys}"
    return Problem("target.path", problem, fix)


@dataclass(frozen=True)
class TpSetting:
    stage: str
    size: int
    expert_parallel: bool  # options.vllm.enable_expert_parallel

    @property
    def key(self) -> str:
        return f"{self.stage}.tensor_parallel_size"


def tp_settings(cfg: RunConfig) -> list[TpSetting]:
    """The run's vLLM tensor-parallel sizes: regenerate's, extract's (vllm backend; hf runs at 1)
    and evaluate's."""
    out = []
    if "regenerate" in cfg.pipeline:
        size = cfg.regenerate.tensor_parallel_size or cfg.extract.tensor_parallel_size
        out.append(TpSetting("regenerate", size, _ep(cfg, "regenerate")))
    if "extract" in cfg.pipeline and cfg.extract.backend == "vllm":
        out.append(TpSetting("extract", cfg.extract.tensor_parallel_size, _ep(cfg, "extract")))
    if "evaluate" in cfg.pipeline:
        size = cfg.evaluate.tensor_parallel_size or cfg.extract.tensor_parallel_size
        out.append(TpSetting("evaluate", size, _ep(cfg, "evaluate")))
    return out


def _ep(cfg: RunConfig, stage: str) -> bool:
    return vllm_options(cfg, stage).get("enable_expert_parallel") is True


def tp_problems(cfg: RunConfig, model_cfg: dict) -> list[Problem]:
    """One Problem per TP key whose size the target's shape does not allow. Evaluate's and
    regenerate's sizes (which default to extract's) are told with extract's when they are the same."""
    out: list[Problem] = []
    settings = tp_settings(cfg)
    for s in settings:
        earlier = [
            e for e in settings if e.stage != s.stage and (e.size, e.expert_parallel) == (s.size, s.expert_parallel)
        ]
        if s.stage != "extract" and any(e.stage == "extract" for e in earlier):
            continue  # told with extract's
        found = tpsizes.rules(model_cfg, s.expert_parallel)
        bad = tpsizes.broken(s.size, found)
        if not bad:
            continue
        others = [e.stage for e in earlier]
        also = f" ({', '.join(others)} {'runs' if len(others) == 1 else 'run'} at {s.size} too)" if others else ""
        problem = tpsizes.describe(s.size, bad) + also
        fix = f"sizes that work: {', '.join(map(str, tpsizes.sizes_that_work(found)))}"
        if not s.expert_parallel and not tpsizes.broken(s.size, tpsizes.rules(model_cfg, expert_parallel=True)):
            fix += f", or keep {s.size} with whole experts per rank: set stages.{s.stage}.options.vllm.enable_expert_parallel = true"
        out.append(Problem(s.key, problem, fix))
    return out


def problems(cfg: RunConfig) -> list[Problem]:
    """Every Problem of the run's target; [] without a target, or one that is not a local
    directory with a readable config.json (what cannot be read here is not judged here)."""
    if cfg.target is None or not os.path.isdir(cfg.target.path):
        return []
    try:
        model_cfg = read_model_config(cfg.target.path)
        files = scan(cfg.target.path)
    except (OSError, ValueError):
        return []
    weights = weights_problem(cfg, files)
    return ([weights] if weights else []) + tp_problems(cfg, model_cfg)


def lines(cfg: RunConfig, source: str) -> list[str]:
    """The problems as `eyas validate` and `eyas submit` print them."""
    return [p.line(source) for p in problems(cfg)]
