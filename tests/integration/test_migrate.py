"""Planned swaps with real processes (recovery/migrate.py): a straggler and a drained node are
moved to warm spares at a step boundary, no step lost or recomputed, and the final state is
bitwise equal to a failure-free run of the same seed. The moved rank's state comes from its own
(retiring) process, which exits only after the spare's first step; a spare or a retiring process
killed (or a retiring process stopped) in the transfer falls back to the buddy's replica. Every rank's state is distinct (ZeRO-1
shards at dp > 1, and at dp2 x tp2 x pp2 each rank's (pp, tp) slice), so a state sent to the
wrong rank would show."""

from __future__ import annotations

import json
import os
import re
import statistics
import threading
import time
from pathlib import Path

import pytest

from deadpool.control import drain
from deadpool.launch.job import run_job
from deadpool.launch.report import compare_final_states
from deadpool.store import auth
from tests.conftest import compose_train

quiet = lambda *a, **k: None  # noqa: E731


def metrics(run_dir: Path) -> list[dict]:
    out = []
    for f in sorted((run_dir / "metrics").glob("slot*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def step_times(run_dir: Path) -> dict[int, float]:
    """step -> the job's time for it (the slowest rank's step_time_s, the newest record)."""
    out: dict[int, float] = {}
    for r in metrics(run_dir):
        out[r["step"]] = max(out.get(r["step"], 0.0), r["step_time_s"])
    return out


def retired_at(run_dir: Path, slot: int) -> tuple[str, float]:
    """The retired process's word on leaving (``recovery.pause.retire``): why, and when."""
    text = (run_dir / "logs" / f"slot{slot}.log").read_text()
    (m,) = re.findall(r"retired: generation \d+ (.*) \(t=([\d.]+)\)", text) or [None]
    assert m is not None, f"slot {slot} left without retiring:\n{text[-2000:]}"
    return m[0], float(m[1])


def first_step_at(run_dir: Path, slot: int) -> float:
    """When the process of ``slot`` finished its first step (its first metrics record)."""
    return min((r["step"], r["t"]) for r in metrics(run_dir) if r["slot"] == slot)[1]


@pytest.mark.slow
def test_a_slow_rank_is_migrated_without_losing_a_step(tmp_path):
    # (ft.node_timeout_s: no node is lost here; a loaded host once kept an agent silent 3 s)
    base = ["model=tiny", "parallel=dp4", "num_steps=45", "ft.num_spares=1", "log_every_steps=0",
            "ft.node_timeout_s=10"]
    lines: list[str] = []
    ref = run_job(compose_train(base + ["faults=none"], tmp_path / "ref"), log=lines.append)
    assert ref["outcome"] == "completed" and not ref["recoveries"]
    # no false positive in a failure-free run with detection on (ft.straggler.enabled=true)
    assert not [x for x in lines if "straggler" in x], lines
    ref_t = step_times(tmp_path / "ref")
    delay = round(0.5 * statistics.median(ref_t[s] for s in range(5, 41)), 3)  # 50 % of a step
    ev = f"faults.events=[{{rank: 1, step: 10, kind: slow, delay_s: {delay}}}]"
    s = run_job(compose_train(base + [ev], tmp_path / "run"), log=quiet)
    assert s["outcome"] == "completed", s["message"]
    (rec,) = s["recoveries"]
    assert rec["detected_by"] == "straggler" and rec["failed_rank"] == 1, rec
    assert rec["fault"] == "slow" and rec["steps_recomputed"] == 0 and rec["spare_slot"] == 4
    assert 10 < rec["resume_step"] < 45
    # its state came from its own process (the retiring slot), not its buddy's replica
    assert rec["sources"] == {"1": "retiring from slot 1"}, rec["sources"]
    equal, why = compare_final_states(tmp_path / "run", tmp_path / "ref")
    assert equal, why
    # rank 1's steps after the resume step ran on the spare, and the slow process is gone
    after = [r for r in metrics(tmp_path / "run") if r["rank"] == 1 and r["step"] > rec["resume_step"]]
    assert after and {r["slot"] for r in after} == {4}
    # the slow process left only after the spare trained its first step (issue 39)
    why, t_left = retired_at(tmp_path / "run", 1)
    assert why.startswith("running") and t_left > first_step_at(tmp_path / "run", 4), why
    # steps/s over the 10 steps after the migration against the same steps unslowed (a figure
    # for the log: wall-clock targets belong to a benchmark on a quiet machine)
    t = step_times(tmp_path / "run")
    S = rec["resume_step"]
    window = [k for k in range(S + 2, min(S + 12, 45) + 1) if k in t]
    ratio = statistics.median(ref_t[k] for k in window) / statistics.median(t[k] for k in window)
    slowed = statistics.median(ref_t[k] for k in range(12, S)) / statistics.median(
        t[k] for k in range(12, S))
    print(f"steps/s vs unslowed: {slowed:.2f} while slow, {ratio:.2f} over steps {window[0]}-"
          f"{window[-1]} after the migration (resumed at {S}; slow {delay * 1e3:.0f} ms/step)")
    # not asserted: on a host shared with other jobs the wall clock measured noise (0.88 while
    # slow, 0.85 after, one run); the figure belongs to a benchmark on a quiet machine

    # the spare dies in its transfer (before its first step): the retired process leaves on the
    # abort, and the rank comes from its buddy's replica to the second spare, no step lost
    kill = "{slot: 4, step: 0, kind: kill, phase: transfer}"
    ev2 = ev.replace("}]", f"}}, {kill}]")
    s2 = run_job(compose_train(base + ["ft.num_spares=2", ev2], tmp_path / "spare_dies"), log=quiet)
    assert s2["outcome"] == "completed", s2["message"]
    moved, rec2 = s2["recoveries"]
    assert moved["detected_by"] == "straggler" and moved["outcome"].startswith("interrupted"), moved
    assert rec2["failed_slot"] == 4 and rec2["spare_slot"] == 5 and rec2["steps_recomputed"] == 0
    assert rec2["resume_step"] == moved["resume_step"], (moved, rec2)
    why, t_left = retired_at(tmp_path / "spare_dies", 1)
    assert why.startswith("aborted") and t_left > rec2["t_kill"], (why, t_left, rec2)
    equal, why = compare_final_states(tmp_path / "spare_dies", tmp_path / "ref")
    assert equal, why

    # the retiring process dies while it sends: the spare's receive fails, and the next plan
    # keeps the spare on the rank with its buddy's replica (no rank lost, no spare used)
    # (its state in many chunks: a state sent whole in its first chunk would arrive)
    kill = "{slot: 1, step: 0, kind: kill, phase: transfer}"
    s3 = run_job(compose_train(base + ["ft.replication_chunk_mb=0.01",
                                       ev.replace("}]", f"}}, {kill}]")], tmp_path / "source_dies"),
                 log=quiet)
    assert s3["outcome"] == "completed", s3["message"]
    moved, rec3 = s3["recoveries"]
    assert moved["sources"] == {"1": "retiring from slot 1"}, moved
    assert moved["outcome"].startswith("interrupted") and rec3["failed_slot"] == [], rec3
    assert rec3["sources"]["1"].startswith("replica from rank 2"), rec3["sources"]
    assert rec3["steps_recomputed"] == 0 and rec3["resume_step"] == moved["resume_step"], rec3
    assert {r["slot"] for r in metrics(tmp_path / "source_dies")
            if r["rank"] == 1 and r["step"] > rec3["resume_step"]} == {4}
    equal, why = compare_final_states(tmp_path / "source_dies", tmp_path / "ref")
    assert equal, why

    # the retiring process stops while it sends (SIGSTOP after its first chunk, of many: no
    # exit, no broken connection, the spare left waiting in its receive): the coordinator
    # watches the retired slot until g+1 runs, fences it and aborts g+1 at once; the next plan
    # is a death's. (Before, the spare waited out its receive: the progress timeout, 60 s.)
    stop = "{slot: 1, step: 0, kind: stop, phase: transfer}"
    s4 = run_job(compose_train(base + ["ft.replication_chunk_mb=0.01",
                                       ev.replace("}]", f"}}, {stop}]")], tmp_path / "source_stops"),
                 log=quiet)
    assert s4["outcome"] == "completed", s4["message"]
    moved, rec4 = s4["recoveries"]
    assert moved["outcome"].startswith("interrupted"), moved
    assert rec4["detected_by"] == "retiring_lost" and rec4["failed_slot"] == [], rec4
    assert rec4["sources"]["1"].startswith("replica from rank 2"), rec4["sources"]
    assert rec4["steps_recomputed"] == 0 and rec4["resume_step"] == moved["resume_step"], rec4
    equal, why = compare_final_states(tmp_path / "source_stops", tmp_path / "ref")
    assert equal, why


def _wait_for_step(run_dir: Path, step: int, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(r["step"] >= step for r in metrics(run_dir) if r["rank"] == 0):
            return
        time.sleep(0.1)
    raise AssertionError(f"the job did not reach step {step}")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_draining_a_node_moves_its_ranks_and_its_processes_leave(tmp_path, monkeypatch):
    base = ["model=tiny", "parallel=dp2_tp2_pp2", "parallel.ranks_per_node=2", "num_steps=30",
            "ft.num_spares=2", "ft.replication_chunk_mb=0.5", "log_every_steps=0"]
    lines: list[str] = []
    ref = run_job(compose_train(base + ["faults=none"], tmp_path / "ref"), log=lines.append)
    assert ref["outcome"] == "completed" and not ref["recoveries"]
    # no false positive with pipeline stages of unequal work (first: embedding, last: head + loss)
    assert not [x for x in lines if "straggler" in x], lines
    secret = auth.new_secret()
    monkeypatch.setattr(auth, "new_secret", lambda: secret)  # the operator holds the job's secret
    monkeypatch.setenv("DEADPOOL_JOB_SECRET", secret)
    run_dir, out = tmp_path / "run", {}
    job = threading.Thread(target=lambda: out.update(run_job(compose_train(base, run_dir),
                                                             log=quiet)))
    job.start()
    try:
        _wait_for_step(run_dir, 6)
        pids = {r["pid"] for r in metrics(run_dir) if r["slot"] in (2, 3)}  # node 1's ranks
        assert drain.main([str(run_dir), "--node", "1", "--timeout-s", "60"]) == 0
        # no spare is left off node 0 for its two ranks: refused, the job goes on
        assert drain.main([str(run_dir), "--node", "0", "--timeout-s", "60"]) == 1
        deadline = time.monotonic() + 30
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        # gone while the job trains on (every process leaves at the job's end anyway)
        at = max(r["step"] for r in metrics(run_dir) if r["rank"] == 0)
        assert all(_gone(p) for p in pids) and at < 30 - 5, (pids, at)
    finally:
        job.join(300)
    s = out
    assert s["outcome"] == "completed", s["message"]
    (rec,) = s["recoveries"]
    assert rec["detected_by"] == "drain" and rec["failed_rank"] == [2, 3], rec
    assert rec["steps_recomputed"] == 0 and sorted(rec["spare_slot"]) == [8, 9]
    # each rank's state from its own (retiring) process, which left after the spares' first step
    assert rec["sources"] == {"2": "retiring from slot 2", "3": "retiring from slot 3"}, rec
    first = min(first_step_at(run_dir, 8), first_step_at(run_dir, 9))
    for slot in (2, 3):
        why, t_left = retired_at(run_dir, slot)
        assert why.startswith("running") and t_left > first, (slot, why)
    equal, why = compare_final_states(run_dir, tmp_path / "ref")
    assert equal, why
