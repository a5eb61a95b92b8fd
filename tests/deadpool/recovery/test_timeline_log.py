"""Recovery records written as they happen (issue 37): each record the coordinator completes is
appended to ``run_dir/recoveries.jsonl`` (and, with ``logging.tensorboard``, to the TensorBoard
directory) at once, so a coordinator that crashes afterwards leaves them on disk; the end of the
job does not write them to TensorBoard twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from deadpool.rank import tensorboard_log
from deadpool.recovery import timeline
from deadpool.store.protocol import RecoveryRecord
from tests.deadpool.recovery.helpers import coordinator


def lines(run_dir) -> list[dict]:
    path = run_dir / "recoveries.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def scalars(run_dir, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        return []
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_a_record_is_on_disk_as_soon_as_the_coordinator_completes_it(tmp_path):
    coord = coordinator(tmp_path, ["logging.tensorboard=true"])
    coord.pending = RecoveryRecord(1, failed_rank=2, fault="kill", detected_by="exit",
                                   resume_step=6, steps_recomputed=1, detect_s=0.04)
    timeline.finish_pending(coord, interrupted=True)  # closed (here: another failure came first)
    assert [(r["generation"], r["outcome"]) for r in lines(tmp_path)] == \
        [(1, timeline.INTERRUPTED)]
    assert scalars(tmp_path, "recovery/detect_s") == [(6, pytest.approx(0.04))]
    # a fallback's record (appended by recovery.fallbacks) the same way
    coord.recoveries.append(RecoveryRecord(2, failed_rank=1, fallback="disk", resume_step=4,
                                           detect_s=0.07, outcome="restarted from disk"))
    assert [r["generation"] for r in lines(tmp_path)] == [1, 2]
    assert scalars(tmp_path, "recovery/detect_s")[-1] == (4, pytest.approx(0.07))


def test_the_end_of_the_job_does_not_write_the_logged_records_to_tensorboard_again(tmp_path):
    coord = coordinator(tmp_path, ["logging.tensorboard=true"])
    rec = RecoveryRecord(1, failed_rank=0, resume_step=3, detect_s=0.02, outcome="hot-swapped")
    coord.recoveries.append(rec)
    late = RecoveryRecord(2, failed_rank=1, resume_step=5, detect_s=0.03, outcome="hot-swapped")
    tensorboard_log.write_recoveries(coord.cfg, {"recoveries": [rec.to_dict(), late.to_dict()]})
    assert scalars(tmp_path, "recovery/detect_s") == [(3, pytest.approx(0.02)),
                                                     (5, pytest.approx(0.03))]


def test_a_coordinator_killed_after_a_recovery_leaves_its_record(tmp_path):
    """A real process: the coordinator completes a record, then is SIGKILLed (no end of job,
    no summary): the record and its TensorBoard entry are on disk."""
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from pathlib import Path
        from deadpool.store.protocol import RecoveryRecord
        from deadpool.recovery import timeline
        from tests.deadpool.recovery.helpers import coordinator
        coord = coordinator(Path({str(tmp_path)!r}), ["logging.tensorboard=true"])
        coord.pending = RecoveryRecord(1, failed_rank=3, fault="kill", resume_step=8,
                                       detect_s=0.05)
        timeline.finish_pending(coord, interrupted=True)
        print("recorded", flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "recorded"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert [(r["generation"], r["failed_rank"]) for r in lines(tmp_path)] == [(1, 3)]
    assert not (tmp_path / "summary.json").exists()
    assert scalars(tmp_path, "recovery/detect_s") == [(8, pytest.approx(0.05))]
