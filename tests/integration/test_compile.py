"""A hot swap under ``compile=true`` with real processes: rank 1 of dp2 (ZeRO-1: each rank's
optimizer shard differs) SIGKILLed mid-step, the warm spare (which compiled its blocks while
warm) takes it, and the final state equals a failure-free ``compile=true`` run of the same seed
bitwise. Survivors compile nothing after the swap, and the spare nothing after taking the rank.

CPU inductor compiles are slow (every process compiles; the on-disk FX graph cache helps the
later ones): the one multi-process compile test, few steps."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from deadpool.launch.job import run_job
from deadpool.launch.report import compare_final_states
from tests.conftest import compose_train

BASE = ["model=tiny", "parallel=dp2", "num_steps=6", "ft.num_spares=1", "log_every_steps=0",
        "compile=true",
        # compiling starves a 2-core machine for minutes: the spare compiles before it reports
        # warm, a rank's first step holds its compile, the agents may not run for seconds
        "ft.startup_timeout_s=900", "ft.progress_timeout_s=900", "ft.node_timeout_s=60",
        "ft.heartbeat_timeout_s=10"]
quiet = lambda *a, **k: None  # noqa: E731


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_hot_swap_with_compiled_blocks_is_bitwise_and_recompiles_nothing(tmp_path):
    ref = run_job(compose_train(BASE + ["faults=none"], tmp_path / "ref"), log=quiet)
    assert ref["outcome"] == "completed" and not ref["recoveries"]
    s = run_job(compose_train(BASE + ["faults=kill_mid_step", "faults.events.0.step=3"],
                              tmp_path / "run"), log=quiet)
    assert s["outcome"] == "completed", s["message"]
    (rec,) = s["recoveries"]
    assert rec["failed_rank"] == 1 and rec["outcome"] == "hot-swapped"
    equal, why = compare_final_states(tmp_path / "run", tmp_path / "ref")
    assert equal, why

    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    by_pid = defaultdict(list)
    for r in rows:
        by_pid[r["pid"]].append(r)
    first_gen = {pid for pid, rs in by_pid.items() if any(r["generation"] == 0 for r in rs)}
    spare = set(by_pid) - first_gen
    assert len(spare) == 1
    assert sum(1 for pid in first_gen if by_pid[pid][-1]["generation"] > 0) == 1  # the survivor
    for pid, rs in by_pid.items():
        before = [r["compiles"] for r in rs if r["generation"] == 0]
        after = [r["compiles"] for r in rs if r["generation"] > 0]
        if pid in first_gen:
            assert before[0] > 0  # the starting ranks compile in their first step
            if after:  # a survivor (the killed rank has no records after gen 0): nothing since
                assert set(after) == {before[-1]}, (pid, before, after)
        else:  # the spare compiled while warm, and nothing since it took rank 1
            assert set(after) == {0} and all(r["warm_compiles"] > 0 for r in rs), rs
