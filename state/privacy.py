"""Which of eyas's files are owner-only and which keep the user's umask: the daemon's and its
ranks' umask, a run's output folder, and the tightening of a state directory made before.

The state directory holds the user's prompts, data paths, errors and tracebacks (eyas.db,
daemon.log, every rank's log and records), so the daemon sets umask 077 before it makes
anything, and every process it starts (rank monitors, ranks, their children, a Slurm job)
inherits it. The one exception is a run's outputs in an `output_dir` the user named: a
trained draft, hidden states or prepared data a team may share. There the ranks write with
the umask the daemon was started with, which the daemon hands on in `EYAS_USER_UMASK`, and
the daemon makes the missing folders of that path with it too. The default output folder,
`<run>/out`, is part of the state and stays owner-only.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping, MutableMapping
from pathlib import Path

from eyas.state import contract

OWNER_ONLY = 0o077  # the umask of the daemon and of ranks whose outputs are the state's own
# The umask the daemon was started with (octal), for the ranks that write a user-chosen output_dir.
USER_UMASK = "EYAS_USER_UMASK"


def go_private(environ: MutableMapping[str, str] = os.environ) -> int:
    """Set this process's umask to 077 and keep the one it replaces in `environ[USER_UMASK]`,
    where every process this one starts finds it; return the replaced umask.

    Always the umask this process had, never an inherited EYAS_USER_UMASK: the daemon's own
    start is the user's (the CLI that started it runs with their umask).
    """
    old = os.umask(OWNER_ONLY)
    environ[USER_UMASK] = f"{old:03o}"
    return old


def user_umask(environ: Mapping[str, str] = os.environ) -> int:
    """The umask the daemon was started with; owner-only when `EYAS_USER_UMASK` is unset or not
    an octal umask (a rank that cannot know the user's umask shares nothing)."""
    try:
        value = int(environ.get(USER_UMASK) or "", 8)
    except ValueError:
        return OWNER_ONLY
    return value if 0 <= value <= 0o777 else OWNER_ONLY


def shares_outputs(output_dir: str | os.PathLike[str], run_dir: str | os.PathLike[str]) -> bool:
    """Whether `output_dir` is one the user chose: anywhere but inside the run's own folder,
    where the default one (`<run>/out`, daemon/api.py) lies."""
    return not Path(os.path.abspath(output_dir)).is_relative_to(os.path.abspath(run_dir))


def rank_umask(environ: Mapping[str, str]) -> int:
    """The umask a rank's stage runs with: the user's when its outputs go to a folder the user
    chose, else owner-only. `environ` is the rank contract's, whose attempt folder is
    `<run>/<stage>/attempt-<n>` (daemon/scheduler.py)."""
    output_dir, attempt_dir = environ.get(contract.OUTPUT_DIR), environ.get(contract.ATTEMPT_DIR)
    if not output_dir or not attempt_dir:
        return OWNER_ONLY
    run_dir = Path(os.path.abspath(attempt_dir)).parent.parent
    return user_umask(environ) if shares_outputs(output_dir, run_dir) else OWNER_ONLY


def make_output_dir(
    output_dir: str | os.PathLike[str], run_dir: str | os.PathLike[str], environ: Mapping[str, str] = os.environ
) -> None:
    """Create a run's output folder and its missing parents, as the daemon does before each start.

    Inside the run's folder: owner-only, like the rest of the state. A folder the user chose:
    every folder made here gets the mode their umask gives (`mkdir -p` in their shell would
    give the same), set with chmod because the daemon's own umask is 077. A folder that exists
    already is left as it is, whoever made it.
    """
    path = Path(output_dir)
    if not shares_outputs(path, run_dir):
        path.mkdir(parents=True, exist_ok=True)
        return
    mode = 0o777 & ~user_umask(environ)
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, mode)
        except FileExistsError:  # made meanwhile by someone else: theirs, and left alone
            continue
        os.chmod(folder, mode)
    Path(output_dir).mkdir(exist_ok=True)  # a file there raises FileExistsError, as before


def tighten(paths: Iterable[str | os.PathLike[str]]) -> list[str]:
    """Take the group and other bits off each of `paths` that is ours and has any; one line
    per change ("PATH: 0755 -> 0700"), for the log.

    For a state directory an older eyas made with the user's umask: the daemon passes the state
    directory itself and the names eyas gives its files there. A symbolic link is left alone
    (chmod would change what it points at), and so is what another user owns.
    """
    changed = []
    for raw in paths:
        path = os.fspath(raw)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid():
            continue
        mode = stat.S_IMODE(st.st_mode)
        if mode & OWNER_ONLY:
            os.chmod(path, mode & ~OWNER_ONLY)
            changed.append(f"{path}: {mode:04o} -> {mode & ~OWNER_ONLY:04o}")
    return changed
