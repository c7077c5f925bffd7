"""The run config's `[tracking]` table: where a run's curves go besides eyas's own store, for the trackers users already have.

```toml
[tracking]
tensorboard = true              # event files in <output_dir>/tensorboard/run-<id>-<name>/
# tensorboard = "../tb"         # or under a folder of your own (relative to this file)
```

The daemon writes the event files while the run goes, from the same samples it hands the
store (daemon/tensorboard.py); `eyas metrics RUN --tensorboard DIR` writes them for any run
afterwards. `tensorboard --logdir <folder>` shows them. Stdlib and pydantic, like the rest of
eyas.state: state/runconfig.py holds this table in RunConfig.tracking.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, ValidationInfo

from eyas.state.specs import Table
from eyas.state.tomlcheck import describe

DEFAULT_FOLDER = "tensorboard"  # under the run's output_dir, for tensorboard = true


def _tensorboard(value: Any, info: ValidationInfo) -> bool | str:
    """true, false, or a folder: absolute, or relative to the TOML file's folder (the
    validation context's base_dir; without one the path is kept as given)."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected true, false or a folder path, got {describe(value)}")
    if not value.strip():
        raise ValueError("empty; write true (event files under the run's output_dir) or a folder path")
    base = (info.context or {}).get("base_dir")
    if base is None:
        return value
    path = os.path.normpath(Path(base) / Path(value).expanduser())
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} is a file; point it at a folder (it is created if missing)")
    return path


class TrackingConfig(Table):
    """[tracking]: the trackers a run's samples are written to while it runs."""

    # Each run writes into its own run-<id>-<name> folder there (state/tbevents.py).
    tensorboard: Annotated[bool | str, BeforeValidator(_tensorboard)] = Field(
        False,
        description="TensorBoard event files of the run's samples, written while it runs: `true` under "
        "`<output_dir>/tensorboard/`, or a folder (relative to this file), each run in `run-<id>-<name>/`.",
    )


def tensorboard_dir(config: dict, output_dir: str | os.PathLike) -> Path | None:
    """The folder a run's TensorBoard runs go under, from its resolved config (config.json,
    RunConfig.to_dict()); None when it tracks none."""
    value = (config.get("tracking") or {}).get("tensorboard", False)
    if value is True:
        return Path(output_dir) / DEFAULT_FOLDER
    if isinstance(value, str) and value:
        return Path(value)
    return None
