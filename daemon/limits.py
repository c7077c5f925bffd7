"""A run's per-stage limits as the daemon reads them from the run's config JSON: the log bound, the watchdog's bounds, the restart backoff; each falls back to the declared default."""

from __future__ import annotations

from eyas.state import specs
from eyas.state.executiontables import LOG_MAX_MB


def stage_value(cfg: dict, stage: str, key: str, default: float) -> float:
    """A [stages.<stage>] setting from a run's config JSON; `default` where the table or key is absent."""
    value = ((cfg.get("stages") or {}).get(stage) or {}).get(key)
    return float(default if value is None else value)


def log_max_mb(cfg: dict, stage: str) -> float:
    """stages.<stage>.log_max_mb of a run; the declared default for a config written without it."""
    return stage_value(cfg, stage, "log_max_mb", LOG_MAX_MB)


def set_bounds(group, cfg: dict) -> None:
    """The hang watchdog's bounds of the group's stage: the run's, else the stage spec's."""
    spec = specs.STAGES[group.stage]
    group.stall_timeout = stage_value(cfg, group.stage, "stall_timeout", spec.stall_timeout)
    group.exit_timeout = stage_value(cfg, group.stage, "exit_timeout", spec.exit_timeout)
    budgets = ((cfg.get("stages") or {}).get(group.stage) or {}).get("phase_budgets") or {}
    group.phase_budgets = {str(k): float(v) for k, v in budgets.items()}
