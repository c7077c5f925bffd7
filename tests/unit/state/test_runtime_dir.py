"""The /tmp fallback of the socket's directory (state/paths.py): made 0700 without following a
link, and anything else found at `/tmp/eyas-<uid>` refused with its path, its fault and the fix.

Each case runs the real path logic on the real `/tmp/eyas-<uid>`, in a child process with a
mount namespace of its own and a fresh tmpfs over /tmp (`unshare --mount`), so the host's /tmp
is never touched. The child prints what it saw as one JSON line.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

UID = os.getuid()
FALLBACK = f"/tmp/eyas-{UID}"
VICTIM = "/tmp/victim"  # a directory we own that a planted link points at (/usr, for root)
OTHER_UID = 4242


@functools.cache
def namespace_unavailable() -> str | None:
    """Why a private /tmp cannot be had here, or None."""
    if not shutil.which("unshare"):
        return "util-linux's unshare is not installed"
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", "mount -t tmpfs eyas-test /tmp"],
        capture_output=True,
        text=True,
    )
    if probe.returncode:
        return f"no private mount namespace with a tmpfs on /tmp here (needs root): {probe.stderr.strip()}"
    return None


def in_private_tmp(setup: str, check: str, *, timeout: float = 60) -> dict:
    """Run `setup` (shell), then the Python `check`, in a fresh mount namespace whose /tmp is an
    empty tmpfs; return the dict `check` assigns to `seen`. XDG_RUNTIME_DIR is unset, so eyas
    takes the /tmp fallback."""
    reason = namespace_unavailable()
    if reason:
        pytest.skip(reason)
    program = (
        "import json, os, stat, sys\nfrom pathlib import Path\nfrom eyas.state import paths\nseen = {}\n"
        + textwrap.dedent(check)
        + "\nprint(json.dumps(seen))\n"
    )
    script = f'mount -t tmpfs -o mode=1777 eyas-test /tmp && {setup} && exec {sys.executable} -c "$0"'
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "EYAS_HOME")}
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, program],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"the child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# What the child does after the setup: ask for the daemon's runtime directory, as the daemon
# does (create=True), and record what happened and what the victim looks like afterwards.
LOOK = f"""
for name in ("{FALLBACK}", "{VICTIM}"):
    if os.path.lexists(name):
        st = os.lstat(name)
        seen[name] = {{"mode": stat.S_IMODE(st.st_mode), "link": stat.S_ISLNK(st.st_mode), "uid": st.st_uid}}
if os.path.isdir("{VICTIM}"):
    seen["victim_entries"] = sorted(os.listdir("{VICTIM}"))
"""
ASK = (
    """
try:
    seen["dir"] = str(paths.runtime_dir(Path("/tmp/home")))
except paths.UnsafeRuntimeDir as exc:
    seen["refused"] = str(exc)
"""
    + LOOK
)


def test_a_planted_symlink_is_refused_and_its_target_keeps_its_mode():
    seen = in_private_tmp(f"mkdir -m 755 {VICTIM} && touch {VICTIM}/mine && ln -s {VICTIM} {FALLBACK}", ASK)
    assert "dir" not in seen, f"eyas used the link: {seen}"
    assert seen["refused"].startswith(f"{FALLBACK} is a symbolic link to {VICTIM}, not a directory"), seen
    assert f"rm {FALLBACK}" in seen["refused"]
    # The target is as it was: its mode, and nothing made inside it.
    assert seen[VICTIM] == {"mode": 0o755, "link": False, "uid": UID}
    assert seen["victim_entries"] == ["mine"]
    assert seen[FALLBACK]["link"]


def test_a_dangling_symlink_is_refused_and_nothing_is_made_where_it_points():
    seen = in_private_tmp(f"ln -s {VICTIM} {FALLBACK}", ASK)
    assert seen["refused"].startswith(f"{FALLBACK} is a symbolic link to {VICTIM}"), seen
    assert VICTIM not in seen


def test_a_regular_file_is_refused_and_left_as_it_was():
    seen = in_private_tmp(
        f"echo planted > {FALLBACK} && chmod 644 {FALLBACK}", ASK + f"\nseen['text'] = open('{FALLBACK}').read()"
    )
    assert seen["refused"].startswith(f"{FALLBACK} is a regular file of uid {UID}, not a directory"), seen
    assert seen[FALLBACK] == {"mode": 0o644, "link": False, "uid": UID}
    assert seen["text"] == "planted\n"


def test_a_directory_of_another_uid_is_refused_and_left_as_it_was():
    seen = in_private_tmp(f"mkdir -m 700 {FALLBACK} && chown {OTHER_UID} {FALLBACK}", ASK)
    assert seen["refused"].startswith(f"{FALLBACK} belongs to uid {OTHER_UID}, not to us ({UID})"), seen
    assert seen[FALLBACK] == {"mode": 0o700, "link": False, "uid": OTHER_UID}


def test_our_own_directory_with_a_wider_mode_is_refused_with_the_fix_and_not_chmod_ed():
    seen = in_private_tmp(f"mkdir -m 755 {FALLBACK}", ASK + f"\nseen['entries'] = os.listdir('{FALLBACK}')")
    assert seen["refused"].startswith(f"{FALLBACK} is mode 0755, not 0700"), seen
    assert f"chmod 700 {FALLBACK}" in seen["refused"]
    assert seen[FALLBACK] == {"mode": 0o755, "link": False, "uid": UID}
    assert seen["entries"] == []  # no socket folder made in it


def test_a_symlink_in_place_of_the_socket_folder_inside_is_refused_too():
    # Only we can write in a 0700 /tmp/eyas-<uid>, but every folder eyas makes is judged alike.
    check = (
        f"""
key = paths.runtime_dir(Path("/tmp/home"), create=False).name
os.mkdir("{FALLBACK}", 0o700)
os.symlink("{VICTIM}", "{FALLBACK}/" + key)
"""
        + ASK
    )
    seen = in_private_tmp(f"mkdir -m 755 {VICTIM}", check)
    assert "is a symbolic link to /tmp/victim" in seen["refused"] and seen["refused"].startswith(f"{FALLBACK}/"), seen
    assert seen[VICTIM]["mode"] == 0o755 and seen["victim_entries"] == []


@pytest.mark.parametrize("umask", [0o022, 0o000, 0o277])
def test_a_fresh_fallback_is_made_0700_whatever_the_umask(umask):
    check = (
        f"os.umask({umask:#o})\n"
        + ASK
        + "\nd = Path(seen['dir'])\nseen['modes'] = [stat.S_IMODE(os.lstat(p).st_mode) for p in (d.parent, d)]"
    )
    seen = in_private_tmp("true", check)
    assert "refused" not in seen, seen
    assert seen["dir"].startswith(FALLBACK + "/")
    assert seen["modes"] == [0o700, 0o700]
    assert seen[FALLBACK] == {"mode": 0o700, "link": False, "uid": UID}


def test_a_client_makes_nothing_and_refuses_a_planted_link_too():
    check = """
seen["missing"] = str(paths.socket_path(Path("/tmp/home"), create=False))
seen["made"] = os.path.lexists(os.path.dirname(os.path.dirname(seen["missing"])))
os.symlink("/tmp", os.path.dirname(os.path.dirname(seen["missing"])))
try:
    paths.find_socket(Path("/tmp/home"))
except paths.UnsafeRuntimeDir as exc:
    seen["refused"] = str(exc)
"""
    seen = in_private_tmp("true", check)
    assert seen["missing"].startswith(FALLBACK + "/") and seen["made"] is False
    assert seen["refused"].startswith(f"{FALLBACK} is a symbolic link to /tmp, not a directory"), seen


def test_the_daemon_refuses_to_start_on_a_planted_link_and_the_cli_says_why():
    """The real daemon and CLI: one line each, naming the path, and the link's target untouched."""
    eyas = os.path.join(os.path.dirname(sys.executable), "eyas")
    check = (
        f"""
import subprocess
d = subprocess.run([sys.executable, "-m", "eyas.daemon.main", "--home", "/tmp/home"], capture_output=True, text=True, timeout=30)
seen["daemon"] = [d.returncode, d.stderr]
c = subprocess.run(["{eyas}", "--home", "/tmp/home", "daemon", "status"], capture_output=True, text=True, timeout=60)
seen["cli"] = [c.returncode, c.stderr]
"""
        + LOOK
    )
    seen = in_private_tmp(f"mkdir -m 755 {VICTIM} && ln -s {VICTIM} {FALLBACK}", check, timeout=120)
    code, err = seen["daemon"]
    assert code == 1 and err.startswith(f"eyas daemon: {FALLBACK} is a symbolic link to {VICTIM}"), err
    assert len(err.strip().splitlines()) == 1, err  # no traceback
    code, err = seen["cli"]
    assert code == 1 and err.startswith(f"eyas daemon: {FALLBACK} is a symbolic link to {VICTIM}"), err
    assert len(err.strip().splitlines()) == 1, err
    assert seen[VICTIM] == {"mode": 0o755, "link": False, "uid": UID}
    assert seen["victim_entries"] == []
