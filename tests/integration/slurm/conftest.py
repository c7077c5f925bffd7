"""The one-node Slurm cluster the tests of this folder share (tests/support/slurm_world.py)."""

from __future__ import annotations

import pytest
import slurm_world


@pytest.fixture(scope="session")
def slurm():
    """A running one-node cluster for the whole session (its bring-up takes seconds); skips with
    the reason where Slurm is neither installed nor installable."""
    reason = slurm_world.slurm_unavailable()
    if reason:
        pytest.skip(reason)
    with slurm_world.running() as world:
        yield world
