"""The import rules: import-linter's contracts (pyproject.toml, run by `make lint`) shown to
fail on a planted violation, and the finer rules they do not express (which few modules of
eyas.workers the daemon may know, which of eyas.state the TUI may read), checked here by
walking every import statement with `ast`, lazy ones inside functions too."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {
    "daemon": "eyas.daemon",
    "state": "eyas.state",
    "workers": "eyas.workers",
    "tui": "eyas.tui",
    "wire": "eyas.wire",
    "cli": "eyas.cli",
}
ENGINES = {"torch", "transformers", "vllm", "textual", "speculators", "safetensors", "datasets", "numpy"}
# The only parts of eyas.workers the daemon may know: pure modules (stdlib; pynvml for nvml).
# The stage specs and the run config are eyas.state's (specs.py, runconfig.py).
WORKER_SPECS = {"eyas.workers", "eyas.workers.nvml"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [FOLDERS[rel.parts[0]], *rel.with_suffix("").parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str | None = None) -> set[str]:
    """Every module that `path` imports (as module `module`, by default the one its place in
    the tree names), with relative imports resolved."""
    module = module or _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            found.add(prefix)
            # `from . import x` and `from eyas.workers import config` import submodules.
            found.update(f"{prefix}.{alias.name}" for alias in node.names)
    return found


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _top(name: str) -> str:
    return name.split(".")[0]


def _eyas_module(name: str) -> bool:
    return name == "eyas" or name.startswith("eyas.")


def _violations(folder: str, rule) -> list[str]:
    bad = []
    for path in sources(folder):
        for name in sorted(imports_of(path)):
            why = rule(name)
            if why:
                bad.append(f"{path.relative_to(ROOT)} imports {name}: {why}")
    return bad


def _is_real_module(name: str) -> bool:
    """`from eyas.workers import config` adds eyas.workers.config; `from x import func`
    adds x.func, which is no module: only names that exist as files count."""
    parts = name.split(".")
    if parts[0] != "eyas" or len(parts) < 2 or parts[1] not in {v.split(".")[1] for v in FOLDERS.values()}:
        return True
    folder = next(k for k, v in FOLDERS.items() if v == ".".join(parts[:2]))
    target = ROOT / folder / Path(*parts[2:]) if len(parts) > 2 else ROOT / folder
    return target.with_suffix(".py").exists() or (target / "__init__.py").exists()


def test_state_imports_nothing_of_eyas():
    assert (
        _violations(
            "state",
            lambda n: (
                "eyas.state must not import other eyas code"
                if _eyas_module(n) and not n.startswith("eyas.state") and _is_real_module(n)
                else "eyas.state is stdlib, sqlite-utils and pydantic only"
                if _top(n) in ENGINES
                else None
            ),
        )
        == []
    )


def test_daemon_imports_no_engines_and_only_worker_specs():
    def rule(n):
        if _top(n) in ENGINES:
            return "the daemon must start fast and stay small"
        if n.startswith("eyas.workers") and n not in WORKER_SPECS and _is_real_module(n):
            return "the daemon may know only eyas.workers.nvml of the workers"
        if n.startswith("eyas.tui") and _is_real_module(n):
            return "the daemon never imports the TUI"
        if n.startswith("eyas.cli") and _is_real_module(n):
            return "the daemon process never imports the CLI"
        return None

    assert _violations("daemon", rule) == []


def test_worker_specs_are_stdlib_only():
    """What the daemon imports of eyas.workers must itself pull nothing heavy."""
    bad = []
    for name in WORKER_SPECS - {"eyas.workers"}:
        path = ROOT / "workers" / (name.rsplit(".", 1)[1] + ".py")
        for imp in imports_of(path):
            if _top(imp) in ENGINES or (_eyas_module(imp) and imp not in WORKER_SPECS and _is_real_module(imp)):
                bad.append(f"{path.name} imports {imp}")
    assert bad == []


def test_workers_import_no_daemon_or_tui():
    assert (
        _violations(
            "workers",
            lambda n: (
                "workers meet the daemon only through the rank contract"
                if n.startswith(("eyas.daemon", "eyas.tui", "eyas.wire", "eyas.cli")) and _is_real_module(n)
                else None
            ),
        )
        == []
    )


def test_tui_uses_only_client_protocol_and_read_only_state():
    allowed_wire = {"eyas.wire", "eyas.wire.client", "eyas.wire.protocol"}
    allowed_state = {
        "eyas.state",
        "eyas.state.queries",
        "eyas.state.paths",
        "eyas.state.machine",
        "eyas.state.display",
        "eyas.state.axes",
        "eyas.state.liveness",
        "eyas.state.logtime",
        "eyas.state.procs",
        "eyas.state.logcut",
        "eyas.state.contract",
    }

    def rule(n):
        if n.startswith(("eyas.daemon", "eyas.cli")) and _is_real_module(n):
            return "the TUI talks to the daemon only through eyas.wire"
        if n.startswith("eyas.wire") and n not in allowed_wire and _is_real_module(n):
            return "the TUI talks to the daemon only through eyas.wire.client"
        if n.startswith("eyas.state") and n not in allowed_state and _is_real_module(n):
            return "the TUI reads state only through the read-only queries"
        if n.startswith("eyas.workers") or _top(n) in {"torch", "transformers", "vllm"}:
            return "the TUI loads no engines"
        return None

    assert _violations("tui", rule) == []


def test_the_checker_sees_violations(tmp_path):
    """The rule walker must catch a lazy import inside a function; otherwise the tests above prove nothing."""
    probe = tmp_path / "_probe_import_rules.py"  # never inside the package tree
    probe.write_text("def f():\n    import torch\n    from ..workers import runtime\n")
    found = imports_of(probe, "eyas.daemon._probe_import_rules")
    assert {"torch", "eyas.workers.runtime"} <= found


def _lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """`make lint`'s import check (lint-imports, the contracts in pyproject.toml) on a copy of
    the source under `tree`, found first on the path."""
    return subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree / "src")},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_make_lint_fails_on_a_planted_forbidden_import(tmp_path):
    """The daemon importing torch (lazily, inside a function) and the TUI importing the
    daemon's process group each break a contract; the untouched copy keeps them all."""
    src = tmp_path / "src" / "eyas"
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    clean = _lint_imports(tmp_path)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    with open(src / "daemon" / "core.py", "a") as f:
        f.write("\n\ndef _planted():\n    import torch  # noqa: F401\n")
    with open(src / "tui" / "app.py", "a") as f:
        f.write("\n\nfrom eyas.daemon import group  # noqa: E402, F401\n")
    broken = _lint_imports(tmp_path)
    assert broken.returncode != 0
    assert "The daemon process loads no engine, no TUI and never the CLI BROKEN" in broken.stdout, broken.stdout
    assert "The TUI talks to the daemon only through the wire BROKEN" in broken.stdout
    assert "eyas.daemon.core -> torch" in broken.stdout and "eyas.tui.app -> eyas.daemon.group" in broken.stdout


@pytest.mark.parametrize("command", [["runs", "--json"], ["daemon", "status", "--json"], ["--help"]])
def test_light_commands_do_not_load_engines(tmp_path, command):
    code = (
        "import sys, os\n"
        "from eyas.cli.main import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "heavy = sorted(m for m in ('torch','transformers','vllm','textual','speculators') if m in sys.modules)\n"
        "print('HEAVY=' + ','.join(heavy), file=sys.stderr)\n"
    )
    env = {"EYAS_HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(tmp_path / "rt")}
    out = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True, env=env, timeout=60)
    assert "HEAVY=\n" in out.stderr, out.stderr


def test_every_import_of_eyas_names_a_module_that_exists():
    """A module moved without its importers fixed is caught here, lazy imports inside
    functions included (import-linter skips names it cannot find; ruff does not look)."""
    missing = []
    for folder in FOLDERS:
        for path in sources(folder):
            tree = ast.parse(path.read_text(), str(path))
            module = _module_name(path)
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = package.split(".")
                        base = base[: len(base) - node.level + 1]
                        names = [".".join(base + ([node.module] if node.module else []))]
                    else:
                        names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                else:
                    continue
                for name in names:
                    if _eyas_module(name) and name.count(".") >= 1 and not _is_real_module(name):
                        missing.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}, which does not exist")
    assert missing == []
