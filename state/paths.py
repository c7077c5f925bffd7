"""Where eyas keeps its state, its socket and its lock."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path


def state_dir() -> Path:
    """`$EYAS_HOME`, else `$XDG_STATE_HOME/eyas`, else `~/.local/state/eyas`."""
    home = os.environ.get("EYAS_HOME")
    if home:
        return Path(home).expanduser().absolute()
    xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(xdg).expanduser().absolute() / "eyas"


def db_path(base: Path | None = None) -> Path:
    return (base or state_dir()) / "eyas.db"


def runs_dir(base: Path | None = None) -> Path:
    return (base or state_dir()) / "runs"


def attempt_dir(run_id: int, stage: str, attempt: int, base: Path | None = None) -> Path:
    return runs_dir(base) / str(run_id) / stage / f"attempt-{attempt}"


def _private_dir(path: Path) -> Path:
    """Create `path` as a 0700 directory owned by us, or refuse one that is not private."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to us ({os.getuid()})")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def runtime_dir(base: Path | None = None) -> Path:
    """A private 0700 directory for the socket and the lock of the daemon of `base`.

    One state directory has one daemon, so the directory is keyed by a hash of the state
    path: a short name keeps the socket path under the 108-byte AF_UNIX limit.
    """
    base = base or state_dir()
    key = hashlib.sha1(str(base).encode()).hexdigest()[:12]
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    root = Path(xdg) / "eyas" if xdg else Path("/tmp") / f"eyas-{os.getuid()}"
    _private_dir(root)
    return _private_dir(root / key)


def socket_path(base: Path | None = None) -> Path:
    return runtime_dir(base) / "daemon.sock"


def lock_path(base: Path | None = None) -> Path:
    return runtime_dir(base) / "daemon.lock"
