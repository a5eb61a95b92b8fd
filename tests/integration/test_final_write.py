"""The end of a job with real processes (issue 37): a rank stopped or hung inside its final write
(fault phase ``final``) fails the job, naming that rank, within the bound on its writer's
progress - never a job reported completed without every rank's final state, never a wait
without end. (The final checkpoint's contents and a throttled writer that keeps progressing:
tests/deadpool/checkpoint/test_final_write.py and tests/deadpool/recovery/test_finish.py.)"""

from __future__ import annotations

import re
import time

import pytest

from deadpool.launch.job import run_job
from tests.conftest import compose_train

PROGRESS_S = 8.0  # ft.progress_timeout_s here: longer than any step of this job under load
BASE = ["model=tiny", "parallel=dp2", "num_steps=4", "ft.num_spares=0", "log_every_steps=0",
        f"ft.progress_timeout_s={PROGRESS_S}"]
quiet = lambda *a, **k: None  # noqa: E731


@pytest.mark.slow
@pytest.mark.parametrize("kind,says", [
    ("stop", "stopped beating while writing its final state"),  # SIGSTOP: its heartbeat stops
    ("hang", "made no progress writing their final state"),     # its heartbeat lives on
])
def test_a_rank_failing_in_its_final_write_fails_the_job_within_the_progress_bound(
        tmp_path, kind, says):
    ev = f"faults.events=[{{rank: 1, step: 3, phase: final, kind: {kind}}}]"
    summary = run_job(compose_train(BASE + [ev], tmp_path), log=quiet)
    ended = time.time()
    assert summary["outcome"] == "failed", summary
    assert says in summary["message"] and "1" in re.findall(r"\d+", summary["message"]), summary
    log = next(p.read_text() for p in (tmp_path / "logs").glob("slot*.log")
               if "at final of step 4" in p.read_text())
    fired = float(re.search(r"at final of step 4 \(rank 1.*t=([0-9.]+)\)", log).group(1))
    # from the fault to the job's end (teardown included): the progress bound and some slack
    assert ended - fired < PROGRESS_S + 10.0, ended - fired
    # rank 0's part of the final checkpoint is there; rank 1's is not, so it never counts
    step_dir = tmp_path / "final" / "step_4"
    assert (step_dir / "rank_0" / "header.json").exists()
    assert not (step_dir / "rank_1").exists() and summary["final_digest"] is None
