"""The mkdocs hook that adds the generated references to the site at each build, and makes a strict build fail while any of their entries has no description.

The pages themselves are written by eyas.cli.reference from the run config's models and the CLI's
parser; this hook only hands them to mkdocs as files (`reference/config.md`, `reference/cli.md`),
so that nav and links reach them like any page and nothing generated is ever committed.
"""

from __future__ import annotations

import logging

from mkdocs.structure.files import File

from eyas.cli import reference

# A logger under "mkdocs.": `mkdocs build --strict` counts its warnings and fails on them.
log = logging.getLogger("mkdocs.hooks.reference")


def on_files(files, config):
    for entry in reference.missing():
        log.warning("no description for %s: write one (Field(description=...) or the argument's help)", entry)
    for path, text in reference.pages().items():
        files.append(File.generated(config, path, content=text))
    return files
