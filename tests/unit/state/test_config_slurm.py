"""[resources] executor and the [slurm] table (state/executiontables.py): local by default, Slurm by
choice with its keys checked, and each mistake one line naming the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from eyas.state.runconfig import ConfigError, RunConfig, load


def write(tmp_path: Path, text: str = "") -> Path:
    path = tmp_path / "run.toml"
    path.write_text(f'name = "t"\npipeline = ["selftest"]\n{text}')
    return path


def errors(tmp_path: Path, text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load(write(tmp_path, text))
    return caught.value.errors


def test_local_is_the_default(tmp_path):
    cfg = load(write(tmp_path))
    assert cfg.resources.executor == "local" and cfg.slurm.partition is None and cfg.slurm.sbatch_args == ()


def test_a_slurm_run_keeps_every_key_through_the_round_trip(tmp_path):
    text = (
        '[resources]\nexecutor = "slurm"\n[slurm]\npartition = "gpu"\naccount = "spec"\ntime_limit = "2-00:00:00"\n'
        f'nodes = 4\ngpus_per_node = 8\nsbatch_args = ["--qos=high", "--exclusive"]\nstate_dir = "{tmp_path}/shared"\n'
    )
    cfg = load(write(tmp_path, text))
    back = RunConfig.from_dict(cfg.to_dict())
    assert back.slurm == cfg.slurm
    assert (back.slurm.nodes, back.slurm.gpus_per_node, back.slurm.sbatch_args) == (4, 8, ("--qos=high", "--exclusive"))
    assert back.slurm.state_dir == str(tmp_path / "shared")


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ('[resources]\nexecutor = "slurmm"\n', "resources.executor: unknown value 'slurmm'"),
        ('[slurm]\npartition = "gpu"\n', 'slurm: is read only by resources.executor = "slurm"'),
        (
            '[resources]\nexecutor = "slurm"\n[slurm]\nsbatch_args = ["--ntasks=4"]\n',
            "slurm.sbatch_args: '--ntasks=4': eyas writes --ntasks itself; remove it",
        ),
        (
            '[resources]\nexecutor = "slurm"\n[slurm]\nsbatch_args = ["exclusive"]\n',
            "slurm.sbatch_args: 'exclusive' is not an sbatch option",
        ),
        ('[resources]\nexecutor = "slurm"\n[slurm]\nnodes = 0\n', "slurm.nodes:"),
        (
            '[resources]\nexecutor = "slurm"\n[slurm]\nparttion = "gpu"\n',
            "slurm.parttion: unknown key; did you mean 'slurm.partition'?",
        ),
    ],
)
def test_a_mistake_is_one_line_naming_the_key(tmp_path, text, line):
    found = errors(tmp_path, text)
    assert any(line in e for e in found), found
