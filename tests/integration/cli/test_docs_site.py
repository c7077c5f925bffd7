"""The docs site builds under `mkdocs build --strict` with its generated references, a broken link or a missing page fails that build, and the README's links lead to pages that exist.

`make lint` runs the same strict build; these tests show that it can fail, and keep the README
(which links into docs/ by relative path, for GitHub) honest without the site.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MKDOCS = Path(sys.executable).with_name("mkdocs")

needs_mkdocs = pytest.mark.skipif(not MKDOCS.exists(), reason="mkdocs is not installed (the dev extra has it)")


def _build(project: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(site)],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _copy_project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    shutil.copytree(ROOT / "docs", project / "docs")
    shutil.copy(ROOT / "mkdocs.yml", project / "mkdocs.yml")
    return project


@needs_mkdocs
def test_the_site_builds_strict_with_both_references(tmp_path):
    done = _build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stderr
    config = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "train.batch_tokens" in config and "stages.train.options.scheduler" in config
    assert "eyas logs" in cli and "--follow" in cli
    assert (tmp_path / "site" / "ARCHITECTURE" / "index.html").exists()
    assert not (tmp_path / "site" / "hooks").exists()  # the hook is code, not a page


@needs_mkdocs
def test_a_broken_link_fails_the_strict_build(tmp_path):
    project = _copy_project(tmp_path)
    with open(project / "docs" / "concepts.md", "a") as f:
        f.write("\nSee [the missing page](no-such-page.md).\n")
    done = _build(project, tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stderr


@needs_mkdocs
def test_a_page_missing_from_nav_fails_the_strict_build(tmp_path):
    project = _copy_project(tmp_path)
    (project / "docs" / "tui.md").unlink()
    done = _build(project, tmp_path / "site")
    assert done.returncode != 0
    assert "tui.md" in done.stderr


def test_the_readme_is_short_and_its_links_lead_to_pages():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    links = [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)\)", text) if "://" not in m.group(1)]
    assert links, "the README links into docs/"
    for link in links:
        path = link.split("#", 1)[0]
        assert path.startswith("docs/"), link
        assert (ROOT / path).is_file(), f"README links to {link}, which does not exist"
    for command in ("make demo", "make test", ".venv/bin/eyas", "EYAS_HOME"):
        assert command in text
