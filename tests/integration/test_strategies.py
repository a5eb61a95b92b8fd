"""Runtime strategies other than DeadPool's default, with real processes: ``ft=none`` (a failure
ends the job cleanly) and ``ft=sync_snapshot`` (snapshots on the critical path, same hot-swap)."""

from __future__ import annotations

import json

import pytest

from deadpool.launch.job import run_job
from deadpool.launch.report import compare_final_states
from tests.conftest import compose_train

BASE = ["model=tiny", "parallel=dp4", "num_steps=16", "log_every_steps=0",
        "ft.persist_interval_steps=0"]
quiet = lambda *a, **k: None  # noqa: E731


def test_none_takes_no_spares(tmp_path):
    with pytest.raises(ValueError, match="no spares"):
        run_job(compose_train(BASE + ["ft=none", "ft.num_spares=1"], tmp_path), log=quiet)
    assert not any(tmp_path.iterdir())  # refused before anything was written or started


@pytest.mark.slow
def test_none_ends_the_job_cleanly_on_a_kill(tmp_path):
    s = run_job(compose_train(BASE + ["ft=none", "faults=kill_mid_step", "faults.events.0.step=5"],
                              tmp_path), log=quiet)
    assert s["outcome"] == "unrecoverable"
    assert "ft.strategy=none" in s["message"]
    (rec,) = s["recoveries"]
    assert rec["failed_rank"] == 1 and rec["outcome"] == "unrecoverable"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) < 16 and not any(r["snapshot"] for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(900)  # several jobs
def test_sync_snapshot_pays_on_the_critical_path_and_hot_swaps_exactly(tmp_path):
    ref = tmp_path / "ref"
    s = run_job(compose_train(BASE + ["ft=sync_snapshot", "faults=none"], ref), log=quiet)
    assert s["outcome"] == "completed"
    rows = [json.loads(line) for line in (ref / "metrics.jsonl").read_text().splitlines()]
    snap = [r for r in rows if r["snapshot"] and r["step"] > 1]
    # the step waited for its own snapshot: replicated before the next one started
    assert all(r["protection_lag_steps"] == 0 for r in snap[len(snap) // 2:] if r["rank"] == 0)
    assert all(r["snapshot_interval"] == 1 for r in rows)
    deadpool = tmp_path / "deadpool"
    assert run_job(compose_train(BASE + ["faults=none"], deadpool), log=quiet)["outcome"] == "completed"
    assert compare_final_states(ref, deadpool)[0]  # the strategy changes timing, not training
    run = tmp_path / "kill"
    s2 = run_job(compose_train(BASE + ["ft=sync_snapshot", "faults=kill_mid_step",
                                       "faults.events.0.step=9"], run), log=quiet)
    assert s2["outcome"] == "completed", s2["message"]
    (rec,) = s2["recoveries"]
    assert rec["outcome"] == "hot-swapped" and rec["steps_recomputed"] <= 1
    equal, why = compare_final_states(run, ref)
    assert equal, why
