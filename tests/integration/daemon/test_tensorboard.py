"""[tracking] tensorboard through a real daemon: a selftest run's event files, written live by the daemon and afterwards by `eyas metrics RUN --tensorboard DIR`, read back with TensorBoard's own EventAccumulator, hold every stored loss sample, step for step, at its own time."""

from __future__ import annotations

import struct
from pathlib import Path

from daemon_harness import daemon, selftest_toml, wait_for  # noqa: F401 (fixture)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from eyas.state import paths, queries

STEPS = 12


def _float32(v: float) -> float:
    """The value as an event holds it (`simple_value` is a float)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def _stored(home: Path, run_id: int, name: str) -> dict[int, list[tuple[float, int, float]]]:
    """{rank: [(time, step, value)]} of a selftest metric from the store, where a sample's step
    is the `samples` count of its progress record (the same rank, the same time)."""
    db = queries.connect(paths.db_path(home))
    try:
        rows = db.execute(
            "SELECT m.rank, m.time, s.value, m.value FROM metrics m JOIN metrics s "
            "ON s.run_id = m.run_id AND s.stage = m.stage AND s.attempt = m.attempt AND s.rank = m.rank "
            "AND s.time = m.time AND s.name = 'samples' WHERE m.run_id = ? AND m.name = ? ORDER BY m.time",
            [run_id, name],
        ).fetchall()
        count = db.execute("SELECT count(*) FROM metrics WHERE run_id = ? AND name = ?", [run_id, name]).fetchone()[0]
    finally:
        db.close()
    assert len(rows) == count  # every stored sample came with its record's count
    out: dict[int, list] = {}
    for rank, t, step, value in rows:
        out.setdefault(rank, []).append((t, int(step), _float32(value)))
    return out


def _events(folder: Path, tag: str) -> list[tuple[float, int, float]]:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        return []
    return [(e.wall_time, e.step, e.value) for e in acc.Scalars(tag)]


def _run(daemon, tmp_path: Path, tensorboard) -> tuple[int, Path]:
    toml = selftest_toml("tb", ranks=2, options={"steps": STEPS, "step_time": 0.3})
    out = tmp_path / "out"
    toml = f'output_dir = "{out}"\n' + toml + f"\n[tracking]\ntensorboard = {tensorboard}\n"
    run_id = daemon.submit(toml)
    daemon.wait_succeeded(run_id, timeout=120)
    return run_id, out


def test_live_events_and_the_export_hold_every_loss_sample(daemon, tmp_path):
    run_id, out = _run(daemon, tmp_path, "true")
    stored = _stored(daemon.home, run_id, "loss")
    assert sorted(stored) == [0, 1]
    # Every step ran, each with its loss 1/(step+1) (workers/stages/selftest.py); the writer's
    # throttle may merge steps, so the store is the reference, and it must hold most of them.
    assert all(len(samples) >= STEPS // 2 for samples in stored.values()), stored
    for samples in stored.values():
        assert [v for _, _, v in samples] == [_float32(1.0 / s) for _, s, _ in samples]

    live = out / "tensorboard" / f"run-{run_id}-tb"
    wanted = {f"selftest/loss{'/rank1' if r else ''}": samples for r, samples in stored.items()}
    # The daemon flushes after each second's rows: the last ones land just after the run ends.
    wait_for(lambda: all(_events(live, tag) == s for tag, s in wanted.items()), 30, what="every loss event")
    assert len(list(live.glob("events.out.tfevents.*"))) == 1

    p = daemon.cli("metrics", run_id, "--tensorboard", tmp_path / "export")
    assert p.returncode == 0, p.stderr
    exported = tmp_path / "export" / f"run-{run_id}-tb"
    assert str(exported) in p.stdout and f"tensorboard --logdir {tmp_path / 'export'}" in p.stdout
    for tag, samples in wanted.items():
        assert _events(exported, tag) == samples, tag
    # The stage's own rate and each rank's: tagged apart, rank 0's included.
    tags = set(EventAccumulator(str(exported)).Reload().Tags()["scalars"])
    assert {"selftest/tok_s", "selftest/tok_s/rank0", "selftest/tok_s/rank1", "selftest/samples"} <= tags

    again = daemon.cli("metrics", run_id, "--tensorboard", tmp_path / "export")
    assert again.returncode == 2 and "already holds TensorBoard events" in again.stderr


def test_a_folder_of_the_users_own_and_no_tracking(daemon, tmp_path):
    run_id, _ = _run(daemon, tmp_path, f'"{tmp_path / "boards"}"')
    folder = tmp_path / "boards" / f"run-{run_id}-tb"
    stored = _stored(daemon.home, run_id, "loss")
    wait_for(lambda: _events(folder, "selftest/loss") == stored[0], 30, what="rank 0's loss events")

    plain = daemon.submit(selftest_toml("untracked", ranks=1, options={"steps": 3}), name="plain.toml")
    run = daemon.wait_succeeded(plain)
    assert not (Path(run["output_dir"]) / "tensorboard").exists()
