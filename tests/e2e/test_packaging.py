"""A regular (non-editable) install lays out one `eyas` namespace and an `eyas` script."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_maps_folders_into_the_eyas_namespace(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    wheel = next((tmp_path / "dist").glob("eyas-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"eyas", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    for module in (
        "eyas/cli/main.py",
        "eyas/wire/client.py",
        "eyas/daemon/core.py",
        "eyas/state/store.py",
        "eyas/state/specs.py",
        "eyas/tui/__init__.py",
        "eyas/workers/examples/demo.toml",
    ):
        assert module in names, module
    # Every package folder of the tree is in the wheel: a sub-package missing from
    # pyproject's explicit list would import in the editable install and vanish here.
    for folder in ("state", "wire", "cli", "daemon", "workers", "tui"):
        namespace = f"eyas/{folder}"
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.relative_to(ROOT / folder).as_posix()
            assert f"{namespace}/{rel}" in names, f"{folder}/{rel} is not packaged"
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "eyas = eyas.cli.main:main" in entry

    # Import from the unpacked wheel alone: -S keeps the editable finder of the dev venv out.
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    deps = sysconfig.get_paths()["purelib"]
    out = subprocess.run(
        [sys.executable, "-S", "-c", "import eyas.state.store, eyas.cli.main as c; print(c.__file__)"],
        env={"PYTHONPATH": f"{target}:{deps}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(target / "eyas" / "cli" / "main.py")


def test_editable_install_serves_the_working_tree():
    import eyas.cli.main
    import eyas.state.store

    assert Path(eyas.state.store.__file__).resolve() == ROOT / "state" / "store.py"
    assert Path(eyas.cli.main.__file__).resolve() == ROOT / "cli" / "main.py"
