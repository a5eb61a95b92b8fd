"""Back-pressure with real processes: replication capped so a snapshot's cycle outlasts a step. The
job must widen the snapshot interval (every rank the same), keep training unblocked, record the
protection lag, and a rank killed while the interval is wide must still be rebuilt bitwise."""

from __future__ import annotations

import json

import pytest

from deadpool.launch.job import run_job
from deadpool.launch.report import compare_final_states
from tests.conftest import compose_train

BASE = ["model=tiny", "parallel=dp4", "num_steps=24", "ft.num_spares=1", "log_every_steps=0",
        "ft.persist_interval_steps=0", "ft.snapshot_adapt_every_steps=8",
        "ft.snapshot_overhead_target=null",
        "ft.replication_max_mb_per_s=2"]  # ~1.6 MB per rank: ~0.75 s per snapshot, ~7 steps
quiet = lambda *a, **k: None  # noqa: E731


@pytest.mark.slow
def test_slow_replication_widens_the_interval_and_recovery_stays_exact(tmp_path):
    ref = tmp_path / "ref"
    s = run_job(compose_train(BASE + ["faults=none"], ref), log=quiet)
    assert s["outcome"] == "completed"
    rows = [json.loads(line) for line in (ref / "metrics.jsonl").read_text().splitlines()]
    by_step: dict[int, set] = {}
    for r in rows:
        by_step.setdefault(r["step"], set()).add(r["snapshot_interval"])
    assert all(len(v) == 1 for v in by_step.values()), "ranks disagree on the interval"
    widest = max(max(v) for v in by_step.values())
    assert widest > 1
    assert all(r["step"] % r["snapshot_interval"] == 0 for r in rows if r["snapshot"])
    assert max(r["protection_lag_steps"] for r in rows if r["protection_lag_steps"] is not None) > 1

    kill_step = 20
    assert max(by_step[kill_step]) > 1  # the kill below lands while the interval is wide
    run = tmp_path / "kill"
    kill = ["faults=kill_mid_step", f"faults.events.0.step={kill_step}"]
    s2 = run_job(compose_train(BASE + kill, run), log=quiet)
    assert s2["outcome"] == "completed", s2["message"]
    (rec,) = s2["recoveries"]
    assert rec["outcome"] == "hot-swapped"
    equal, why = compare_final_states(run, ref)
    assert equal, why
