"""What a running stage's ranks wait for, in the words the live views (`eyas logs -f`, the TUI's Run screen) use: their open phases, as the daemon's "metric" events carry them."""

from __future__ import annotations

from eyas.state import display

# A phase's name as the ranks write it (workers/runtime/phases.py), in the words the live
# views use for it; a name not listed is shown as written.
_PHASE_WORDS = {
    "load target": "loading the target",
    "vllm engine start": "starting the vLLM engine",
    "canary engine start": "starting the canary's vLLM engine",
    "build draft model": "building the draft model",
    "count rows": "counting the data's rows",
    "save dataset": "saving the dataset",
    "publish dataset": "publishing the dataset",
}


def phase_text(phases: dict[str, dict] | None, now: float) -> str:
    """What a running stage's ranks wait for, from their open phases ({rank: {"phase", "since",
    "budget", ...}}, as the daemon's "metric" events carry them): the phase most ranks are in,
    for how long, and its budget; "" when no rank is in one. `starting the vLLM engine 2 of 3
    (trained draft) for 14s`, `rank 1: saving checkpoint epoch-1 for 3s (budget 2m00s)`."""
    if not phases:
        return ""
    by_name: dict[str, list[tuple[str, dict]]] = {}
    for rank, p in phases.items():
        by_name.setdefault(str(p.get("phase") or "?"), []).append((str(rank), p))
    name, members = max(by_name.items(), key=lambda kv: len(kv[1]))
    words = _PHASE_WORDS.get(name) or ("saving " + name if name.startswith("checkpoint ") else name)
    if len(members) > 1:
        words += f" on {len(members)} ranks"
    elif len(phases) == 1 and members[0][0] != "0":
        words = f"rank {members[0][0]}: {words}"
    since = min((p["since"] for _, p in members if isinstance(p.get("since"), (int, float))), default=None)
    if since is not None:
        words += f" for {display.duration(max(0.0, now - since))}"
    budget = members[0][1].get("budget")
    if isinstance(budget, (int, float)):
        words += f" (budget {display.duration(budget)})"
    return words
