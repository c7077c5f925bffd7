"""Where eyas keeps its state, its lock, its socket and the record that finds the socket.

The lock (`daemon.lock`) and the record (`daemon.json`) live in the state directory, next to
the database they guard: the runtime directory that holds the socket can vanish under a live
daemon (systemd-logind removes `/run/user/<uid>` at the last logout, tmpfiles ages `/tmp`),
and neither "one daemon per state directory" nor "a client finds the daemon" may depend on it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import socket
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
    """The old layout's attempt folder, `runs/<id>/<stage>/attempt-<n>/`. Only for building
    fixtures: an attempt's real folder is the one its `attempts.dir` records."""
    return runs_dir(base) / str(run_id) / stage / f"attempt-{attempt}"


def run_dir(run: dict, base: Path | None = None) -> Path:
    """A run's folder: the one its row records (`runs.dir`), else, for a run recorded before
    runs had that column, the old layout's `runs/<id>/`."""
    return Path(run["dir"]) if run.get("dir") else runs_dir(base) / str(run["id"])


def folder_ids(base: Path | None = None) -> dict[int, Path]:
    """The run folders in `runs/` whose names are run ids, by id."""
    try:
        entries = list(os.scandir(runs_dir(base)))
    except FileNotFoundError:
        return {}
    return {int(e.name): Path(e.path) for e in entries if e.name.isdecimal() and e.is_dir(follow_symlinks=False)}


def claim_run_dir(at_least: int, base: Path | None = None) -> tuple[int, Path]:
    """Create the folder of a new run and return (its id, its folder).

    The id is at least `at_least` (the database's next) and above every run folder already in
    `runs/`, and the folder is created exclusively (mkdir without exist_ok): a database that
    was deleted or restored from an older backup would reissue ids whose folders still hold
    another run's logs, error files and outputs, and nothing of those may be mixed into this
    run's. Ids stay plain numbers, the same as `eyas show <id>` takes.
    """
    root = runs_dir(base)
    root.mkdir(parents=True, exist_ok=True)
    run_id = max([at_least - 1, *folder_ids(base)]) + 1
    while True:
        path = root / str(run_id)
        try:
            path.mkdir()
            return run_id, path
        except FileExistsError:  # a file of that name, or a folder made since the scan
            run_id += 1


def unused(path: Path) -> Path:
    """`path` when nothing is there yet, else the first of `<path>-2`, `<path>-3`, ... that is
    free. A restored older database counts a run's attempts from a lower number than its
    folder already holds; the new attempt gets a folder of its own rather than another's."""
    candidate, n = path, 1
    while os.path.lexists(candidate):
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def lock_path(base: Path | None = None) -> Path:
    """The daemon's flock: one daemon per state directory, however the runtime directory fares."""
    return (base or state_dir()) / "daemon.lock"


def lock_holder(base: Path | None = None) -> int | None:
    """The pid the lock file names: the daemon holding the lock, or the last one that did."""
    try:
        return int(lock_path(base).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def record_path(base: Path | None = None) -> Path:
    """The running daemon's record: {pid, create_time, socket, started}, 0600."""
    return (base or state_dir()) / "daemon.json"


class UnsafeRuntimeDir(PermissionError):
    """A directory eyas would keep its socket in is not a private directory of ours."""


def _refuse(path: Path, why: str, fix: str) -> UnsafeRuntimeDir:
    return UnsafeRuntimeDir(f"{path} {why}; eyas keeps its socket only in a 0700 directory of its own: {fix}")


def _private_dir(path: Path, create: bool = True) -> Path:
    """Create `path` as a 0700 directory owned by us, or refuse whatever else is there.

    Never through a link: under /tmp anyone can plant a symlink at our name, and a stat()
    that followed it would let them aim our mkdir, and an older eyas's chmod, at any directory
    we own (/usr, for root). So the directory is opened with O_NOFOLLOW | O_DIRECTORY and
    judged by fstat on that descriptor: a link or anything not a directory, a directory of
    another uid, or one with any group or other bit is refused with its path, what is wrong
    and the fix.

    A wider directory of ours is refused, not tightened: eyas makes these 0700 and never widens
    them, so someone else did, and whoever could write in it meanwhile may have left a socket or
    a link inside that a chmod would not take back. Only a directory made by this very call is
    chmod-ed (fchmod on its descriptor), to 0700 whatever the umask let mkdir give it.

    Never with parents: a missing $XDG_RUNTIME_DIR must stay missing (see _runtime_root).
    With create=False (clients) nothing is made or changed, and a missing directory is no
    error, but anything there is judged the same: whoever else could write in it could
    put their own socket there.
    """
    made = False
    if create:
        try:
            os.mkdir(path, 0o700)
            made = True
        except FileExistsError:
            pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if create:
            raise
        return path
    except OSError as exc:  # ELOOP: a link (O_NOFOLLOW); ENOTDIR: a file, a socket, ...
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise _refuse(path, _what_is_there(path), f"remove it (rm {path}) and start again") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise _refuse(
                path,
                f"belongs to uid {st.st_uid}, not to us ({os.getuid()})",
                f"have it removed (as root: rm -r {path}), or set XDG_RUNTIME_DIR to a private directory",
            )
        mode = stat.S_IMODE(st.st_mode)
        if made:
            if mode != 0o700:
                os.fchmod(fd, 0o700)
        elif mode & 0o077:
            raise _refuse(
                path,
                f"is mode {mode:04o}, not 0700, and eyas did not make it so",
                f"remove it (rm -r {path}), or if it is yours to keep, chmod 700 {path}",
            )
    finally:
        os.close(fd)
    return path


def _what_is_there(path: Path) -> str:
    """What stands at `path` instead of a directory, for the refusal."""
    try:
        st = os.lstat(path)
    except OSError:
        return "is not a directory"
    if stat.S_ISLNK(st.st_mode):
        try:
            return f"is a symbolic link to {os.readlink(path)}, not a directory"
        except OSError:
            return "is a symbolic link, not a directory"
    kind = "a regular file" if stat.S_ISREG(st.st_mode) else "not a directory"
    return f"is {kind} of uid {st.st_uid}, not a directory"


def _runtime_root() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    # logind creates $XDG_RUNTIME_DIR at login, removes it when the user's last session ends
    # and mounts a fresh tmpfs there at the next login. A directory made in its place meanwhile
    # would be hidden under that mount (and /run/user is root's anyway), so while it is gone
    # the daemon and its clients both use /tmp, and agree without talking.
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "eyas"
    return Path("/tmp") / f"eyas-{os.getuid()}"


def runtime_dir(base: Path | None = None, create: bool = True) -> Path:
    """A private 0700 directory for the socket of the daemon of `base`.

    One state directory has one daemon, so the directory is keyed by a hash of the state
    path: a short name keeps the socket path under the 108-byte AF_UNIX limit.
    """
    base = base or state_dir()
    key = hashlib.sha1(str(base).encode()).hexdigest()[:12]
    root = _private_dir(_runtime_root(), create)
    return _private_dir(root / key, create)


def socket_path(base: Path | None = None, create: bool = True) -> Path:
    """Where the daemon of `base` binds its socket (create=False: compute it, make nothing)."""
    return runtime_dir(base, create) / "daemon.sock"


def write_record(base: Path, **fields) -> None:
    """Replace the daemon's record atomically: a reader sees the old one or the new one."""
    import tempfile  # here: every CLI command imports this module, and only the daemon writes

    fd, tmp = tempfile.mkstemp(dir=base, prefix=".daemon.json.")  # mkstemp makes it 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(fields, f)
        os.replace(tmp, record_path(base))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_record(base: Path | None = None) -> dict | None:
    try:
        record = json.loads(record_path(base).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _answers(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except TimeoutError:
        return True  # there, but its backlog is full: the client's own connect will wait
    except OSError:
        return False
    finally:
        probe.close()
    return True


def find_socket(base: Path | None = None) -> Path:
    """The socket a client of the daemon of `base` should use.

    The computed path when the daemon's record names it, or when something answers there; else
    the socket the record names,
    while the recorded process (pid and create time) lives: the daemon may serve from another
    runtime directory than this process computes (no $XDG_RUNTIME_DIR in a cron job, a runtime
    directory removed under it). Else the computed path, so that errors name it.
    """
    computed = socket_path(base, create=False)
    record = read_record(base)
    # The common cases cost one small file read: no daemon recorded, or it serves where we look.
    # Only a record naming another socket is worth a probe (and psutil) before it is followed.
    if (
        not record
        or not isinstance(record.get("pid"), int)
        or record.get("create_time") is None
        or not isinstance(record.get("socket"), str)
        or Path(record["socket"]) == computed
    ):
        return computed
    if _answers(computed):
        return computed
    # psutil only on this fallback: importing the client stays stdlib-only.
    from eyas.state import procs

    return Path(record["socket"]) if procs.alive(record["pid"], record["create_time"]) else computed
