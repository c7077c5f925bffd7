"""state/tbevents.py: the event files read back by TensorBoard's own loader (which checks every record's CRC), and the tag and step each sample gets."""

from __future__ import annotations

from tensorboard.backend.event_processing import event_file_loader as efl

from eyas.state import tbevents


def _load(path) -> list:
    return list(efl.LegacyEventFileLoader(str(path)).Load())


def test_tensorboard_reads_every_event_back(tmp_path):
    f = tbevents.EventFile(tmp_path / "run-1-x", now=1000.0)
    f.write([(1000.5, 3, [("train/loss", 1.5)]), (1001.25, 2**40, [("train/loss", -2.0), ("train/acc_0", 0.25)])])
    f.close()
    assert f.path.name.startswith("events.out.tfevents.0000001000.") and f.events == 2
    first, *events = _load(f.path)
    assert first.file_version == "brain.Event:2" and first.wall_time == 1000.0
    got = [(e.wall_time, e.step, [(v.tag, v.simple_value) for v in e.summary.value]) for e in events]
    assert got == [(1000.5, 3, [("train/loss", 1.5)]), (1001.25, 2**40, [("train/loss", -2.0), ("train/acc_0", 0.25)])]


def test_a_damaged_record_is_refused_so_the_checksums_are_checked(tmp_path):
    f = tbevents.EventFile(tmp_path, now=1000.0)
    f.write([(1000.0 + k, k, [("a/b", float(k))]) for k in range(5)])
    f.close()
    data = bytearray(f.path.read_bytes())
    data[-10] ^= 0xFF  # inside the last record's event
    f.path.write_bytes(bytes(data))
    assert len(_load(f.path)) == 5  # the version record and the first four


def test_crc32c_is_castagnolis():
    assert tbevents.crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C


def test_two_files_of_one_second_get_two_names(tmp_path):
    a, b = tbevents.EventFile(tmp_path, now=5.0), tbevents.EventFile(tmp_path, now=5.0)
    assert a.path != b.path and len(list(tmp_path.iterdir())) == 2


def test_files_get_the_mode_asked_for(tmp_path):
    f = tbevents.EventFile(tmp_path, mode=0o640)
    assert f.path.stat().st_mode & 0o777 == 0o640


def _row(t, name, value, rank=0, stage="train", attempt=1):
    return {"time": t, "stage": stage, "attempt": attempt, "rank": rank, "name": name, "value": value}


def test_steps_follow_the_training_step_then_the_sample_count():
    clock = tbevents.StepClock()
    events = clock.events(
        [
            _row(10.0, "tok_s", 50.0, rank=None),  # before any progress: step 0
            _row(11.0, "step", 7.0),
            _row(11.0, "loss", 2.5),
            _row(11.0, "samples", 64.0),
            _row(11.5, "gpu_mem_bytes", 1e9, rank=1),  # the daemon's: the attempt's latest step
            _row(11.2, "samples", 60.0, rank=1),  # a rank without figures: still the training step
        ]
    )
    assert events == [
        (10.0, 0, [("train/tok_s", 50.0)]),
        (11.0, 7, [("train/step", 7.0), ("train/loss", 2.5), ("train/samples", 64.0)]),
        (11.2, 7, [("train/samples/rank1", 60.0)]),
        (11.5, 7, [("train/gpu_mem_bytes/rank1", 1e9)]),
    ]
    # A stage without training steps counts samples; the clock carries over batches.
    clock.events([_row(20.0, "samples", 3.0, stage="selftest"), _row(20.0, "loss", 0.33, stage="selftest")])
    later = clock.events(
        [_row(21.0, "cpu_percent", 99.0, stage="selftest"), _row(21.0, "tok_s", 5.0, rank=None, stage="selftest")]
    )
    # (The stage's own rows come first within one time.)
    assert later == [(21.0, 3, [("selftest/tok_s", 5.0)]), (21.0, 3, [("selftest/cpu_percent/rank0", 99.0)])]
    # A new attempt starts its own count (a retry resumes where its work stands).
    assert clock.events([_row(30.0, "loss", 1.0, attempt=2)]) == [(30.0, 0, [("train/loss", 1.0)])]


def test_run_folders_and_tags():
    assert tbevents.run_folder("/tb", 3, "my run/x").as_posix() == "/tb/run-3-my-run-x"
    assert tbevents.run_folder("/tb", 3, None).as_posix() == "/tb/run-3"
    assert tbevents.tag("train", "loss", 0) == "train/loss"
    assert tbevents.tag("train", "loss", 2) == "train/loss/rank2"
    assert tbevents.tag("train", "tok_s", 0) == "train/tok_s/rank0"  # rank 0's rate is not the stage's
    assert tbevents.tag("train", "tok_s", None) == "train/tok_s"
