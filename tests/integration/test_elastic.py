"""ft=elastic (and DeadPool's fallback when its spares run out) with real processes: a SIGKILL
with no spare left drops the dead rank's data-parallel replica; the job goes on narrower with the
same global batch, and regrows later. In place (the default, recovery/elastic.py) the survivors
keep their processes, which the tests check by PID; ``ft.elastic_mode=relaunch`` restarts every
process."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from deadpool.launch.job import run_job
from deadpool.launch.report import compare_final_states, final_ranks, load_final_rank
from tests.conftest import compose_train

BASE = ["model=tiny", "parallel=dp4", "num_steps=14", "log_every_steps=0",
        "ft.persist_interval_steps=0"]
quiet = lambda *a, **k: None  # noqa: E731


def _rows(run) -> list[dict]:
    """The job's metrics lines: one per step and rank."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _pids(run) -> dict[int, dict[int, set[int]]]:
    """slot -> generation -> the PIDs that logged a step for that slot in that generation."""
    out: dict[int, dict[int, set[int]]] = {}
    for r in _rows(run):
        out.setdefault(r["slot"], {}).setdefault(r["generation"], set()).add(r["pid"])
    return out


def _same_processes(run, slots, before: int, after: int) -> None:
    """Each of ``slots`` trained in generations ``before`` and ``after`` with one and the same
    process."""
    pids = _pids(run)
    for slot in slots:
        b, a = pids[slot].get(before), pids[slot].get(after)
        assert b and a and len(b | a) == 1, (slot, pids[slot])


def _first_step(run, generation: int) -> int:
    """The step the job resumed from in ``generation``: one before the first step logged in it."""
    return min(r["step"] for r in _rows(run) if r["generation"] == generation) - 1


def _final(run):
    return {f"rank{r}.pt": load_final_rank(run, r) for r in final_ranks(run)}


def test_elastic_refuses_spares(tmp_path):
    with pytest.raises(ValueError, match="num_spares=0"):
        run_job(compose_train(BASE + ["ft=elastic", "ft.num_spares=1"], tmp_path), log=quiet)
    with pytest.raises(ValueError, match="global_dp"):
        run_job(compose_train(BASE + ["parallel.global_dp=2"], tmp_path), log=quiet)


def _train(tmp_path, name: str, overrides: list[str], log=quiet):
    run = tmp_path / name
    s = run_job(compose_train(BASE + overrides, run), log=log)
    assert s["outcome"] == "completed", s["message"]
    return run, s


def _checkpointed_at(tmp_path, name: str, step: int, overrides: list[str]):
    """A failure-free job stopped at ``step`` with a disk checkpoint of it, written from the live
    state by the training thread (no snapshots); returns that checkpoint's directory."""
    run, _ = _train(tmp_path, name, ["faults=none", "ft.num_spares=0", "ft.snapshot=false",
                                     f"num_steps={step}", f"ft.persist_interval_steps={step}"]
                    + overrides)
    return run / "checkpoints" / f"step_{step}"


def _equals_narrower_from(tmp_path, run, S: int, dp: int) -> None:
    """``run``'s final state equals a failure-free dp=4 job to step ``S`` followed by a fresh
    dp=``dp`` job with the global batch kept from that state (re-cut by the loader)."""
    at_S = _checkpointed_at(tmp_path, "ref_to_S", S, [])
    ref, _ = _train(tmp_path, "ref", [f"parallel.dp={dp}", "parallel.global_dp=4",
                                      "ft.num_spares=0", f"ft.resume_from={at_S}"])
    equal, why = compare_final_states(run, ref)
    assert equal, why


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", [pytest.param("in_place", marks=pytest.mark.core), "relaunch"])
def test_shrink_equals_training_at_the_reduced_width_from_the_same_step(tmp_path, mode):
    run, s = _train(tmp_path, "elastic", ["ft=elastic", "faults=kill_mid_step",
                                          "faults.events.0.step=6", f"ft.elastic_mode={mode}"])
    (rec,) = s["recoveries"]
    assert rec["outcome"] == "shrunk to dp=3" and rec["dropped_dp"] == [1]
    assert rec["elastic"] == mode
    assert rec["steps_recomputed"] <= 2 and rec["load_s"] >= 0  # one snapshot may still replicate
    assert sorted(_final(run)) == ["rank0.pt", "rank1.pt", "rank2.pt"]
    if mode == "in_place":  # ranks 0, 2, 3 went on as ranks 0, 1, 2 in their own processes
        assert "exec_s" not in rec and rec["checkpoint_s"] >= 0
        _same_processes(run, [0, 2, 3], 0, rec["generation"])
    else:  # every process was started anew
        pids = _pids(run)
        assert all(len(pids[slot][0] & pids[slot][rec["generation"]]) == 0 for slot in (0, 1, 2))
    # the reference, independent of the run under test: a failure-free dp=4 job to the shrink's
    # resume step S, then a fresh dp=3 job with the same global batch from that state (re-cut for
    # three ZeRO-1 shards by the loader)
    S = rec["resume_step"]
    at_S = _checkpointed_at(tmp_path, "ref_to_S", S, [])
    ref, _ = _train(tmp_path, "ref", ["parallel.dp=3", "parallel.global_dp=4", "ft.num_spares=0",
                                      f"ft.resume_from={at_S}"])
    equal, why = compare_final_states(run, ref)
    assert equal, why
    # the global batch and its mean are kept: the narrower job trains like the full-width one,
    # to rounding (sums in another order), and unlike a dp=3 job with a smaller global batch
    full, _ = _train(tmp_path, "full", ["faults=none"])
    small, _ = _train(tmp_path, "small", ["parallel.dp=3", f"ft.resume_from={at_S}"])
    for r in range(3):
        name = f"rank{r}.pt"
        p_el, p_full = _final(run)[name]["params"], _final(full)[name]["params"]
        p_small = _final(small)[name]["params"]
        n = min(p_el.numel(), p_full.numel(), p_small.numel())
        d_kept = (p_el[:n] - p_full[:n]).abs().max().item()
        d_other = (p_small[:n] - p_full[:n]).abs().max().item()
        assert d_kept < 1e-4 and d_kept * 50 < d_other, (name, d_kept, d_other)


class JoinerKiller:
    """A thread that SIGKILLs the process of ``slot`` of the job in ``run`` as soon as it exists
    (a regrow's joiner, still building its model: in its warm-up), once. The tests' processes
    are forks of their node agent (tests/conftest.py): its command line (naming the job file)
    and its own process name ``dp-slot<slot>`` (``launch.procs.fork_worker``) tell it."""

    def __init__(self, run, slot: int):
        self.job, self.name = str(run / "job.json").encode(), f"dp-slot{slot}"
        self.killed: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set() and self.killed is None:
            for p in Path("/proc").iterdir():
                try:
                    if not p.name.isdigit() or (p / "comm").read_text().strip() != self.name:
                        continue
                    cmd = (p / "cmdline").read_bytes()
                except OSError:
                    continue
                if self.job in cmd:
                    os.kill(int(p.name), signal.SIGKILL)
                    self.killed = int(p.name)
                    return
            self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_spares_three_failures_shrink_then_regrow_in_place(tmp_path):
    # two spares, three kills: the first two are hot-swapped, the third finds no spare and the
    # job shrinks in place to dp=3 (survivors keep their processes); a replacement is asked for
    # at once, warms up while the narrower job trains, and the job regrows in place to dp=4.
    # The first replacement (slot 6) is SIGKILLed while it warms up: a second (slot 7) is started
    # in its place and the regrow goes on with it (issue 36 items 11 and 14: a joiner dying in
    # warm-up; old code gave the regrow up for good and the job ended at dp=3)
    events = ("faults.events=[{rank: 1, step: 3, phase: mid_step, kind: kill},"
              "{rank: 2, step: 6, phase: mid_step, kind: kill},"
              "{rank: 3, step: 9, phase: mid_step, kind: kill}]")
    steps = 200  # long enough for two replacements to warm up one after the other
    logs: list[str] = []
    killer = JoinerKiller(tmp_path / "dp", slot=6)
    try:
        run, s = _train(tmp_path, "dp", [events, "ft.num_spares=2", "ft.elastic_regrow_after_s=0",
                                         f"num_steps={steps}"], log=logs.append)
    finally:
        killer.stop()
    assert killer.killed, "slot 6's process was never seen"
    assert any("slot(s) [6] exited during start-up; started slot(s) [7]" in line
               for line in logs), [line for line in logs if "regrow" in line]
    recs = s["recoveries"]
    assert [r["outcome"] for r in recs] == ["hot-swapped", "hot-swapped", "shrunk to dp=3",
                                            "regrown to dp=4"], recs
    shrink, grow = recs[2], recs[3]
    assert shrink["elastic"] == grow["elastic"] == "in_place"
    assert shrink["dropped_dp"] == [3] and shrink["steps_recomputed"] <= 2
    # the shrink: ranks 0, 1, 2 (slots 0, 4, 5 after the hot swaps) train on in their processes
    _same_processes(run, [0, 4, 5], recs[1]["generation"], shrink["generation"])
    # the regrow: the same three processes, plus one started for it (a slot never used before)
    _same_processes(run, [0, 4, 5], shrink["generation"], grow["generation"])
    pids = _pids(run)
    new = [slot for slot in pids if slot > 5]  # slot 6 died before training a step
    assert new == [7] and set(pids[7]) == {grow["generation"]}, pids
    assert sorted(_final(run)) == [f"rank{r}.pt" for r in range(4)]
    rows = _rows(run)
    assert max(r["step"] for r in rows) == steps
    S, R = shrink["resume_step"], grow["resume_step"]
    # the joiner warmed up while the job trained at dp=3: the shrink's generation (its three
    # ranks, no fourth) resumed from S and trained every step of (S, R], and the regrow's
    # generation resumed from R
    narrow = [r for r in rows if r["generation"] == shrink["generation"]]
    assert {r["rank"] for r in narrow} == {0, 1, 2}, sorted({r["rank"] for r in narrow})
    trained = {(r["step"], r["rank"]) for r in narrow}
    untrained = [(t, r) for t in range(S + 1, R + 1) for r in range(3) if (t, r) not in trained]
    assert R - S >= 1 and not untrained, (S, R, untrained)
    assert _first_step(run, shrink["generation"]) == S
    assert _first_step(run, grow["generation"]) == R
    # ... and trained throughout the wait, not in a burst before the joiner was asked for or
    # after it was warm: from the shrink's detection to the regrow's decision (taken once the
    # joiner announced itself warm: ft.elastic_regrow_after_s=0) the dp=3 steps span most of
    # the time (measured on 2 cores: 9.7 s of 10.3 s, 47 steps)
    span = max(r["t"] for r in narrow) - min(r["t"] for r in narrow)
    wait = grow["t_detect"] - shrink["t_detect"]
    assert span > 0.5 * wait, (span, wait, R - S)
    # the reference, built without the run under test: failure-free at dp=4 to the shrink's step
    # S (the hot swaps before it change nothing), dp=3 with the global batch kept from S to the
    # regrow's step R, then dp=4 again from R to the end; every tensor of every rank must match
    at_S = _checkpointed_at(tmp_path, "ref_to_S", S, [])
    at_R = _checkpointed_at(tmp_path, "ref_S_to_R", R, ["parallel.dp=3", "parallel.global_dp=4",
                                                         f"ft.resume_from={at_S}"])
    ref, _ = _train(tmp_path, "ref", ["faults=none", "ft.num_spares=0", f"num_steps={steps}",
                                      f"ft.resume_from={at_R}"])
    equal, why = compare_final_states(run, ref)
    assert equal, why


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_relaunch_mode_falls_back_to_elastic_then_regrows(tmp_path):
    # ft.elastic_mode=relaunch, kept for comparison: one spare, two kills; the second shrinks by
    # relaunching every process at dp=3, and the regrow relaunches them at dp=4
    events = ("faults.events=[{rank: 1, step: 3, phase: mid_step, kind: kill},"
              "{rank: 2, step: 6, phase: mid_step, kind: kill}]")
    run, s = _train(tmp_path, "dp", [events, "ft.elastic_regrow_after_s=0.5", "num_steps=16",
                                     "ft.elastic_mode=relaunch"])
    outcomes = [r["outcome"] for r in s["recoveries"]]
    assert outcomes == ["hot-swapped", "shrunk to dp=3", "regrown to dp=4"], outcomes
    assert sorted(_final(run)) == [f"rank{r}.pt" for r in range(4)]
    S, R = s["recoveries"][1]["resume_step"], s["recoveries"][2]["resume_step"]
    at_S = _checkpointed_at(tmp_path, "ref_to_S", S, [])
    at_R = _checkpointed_at(tmp_path, "ref_S_to_R", R, ["parallel.dp=3", "parallel.global_dp=4",
                                                         f"ft.resume_from={at_S}"])
    ref, _ = _train(tmp_path, "ref", ["faults=none", "ft.num_spares=0", "num_steps=16",
                                      f"ft.resume_from={at_R}"])
    equal, why = compare_final_states(run, ref)
    assert equal, why
    # that reference crosses the same checkpoint format and re-cut loader (rank_state,
    # parallel.data.reshard) as the relaunches, so an error there would appear in both and
    # cancel. The independent one never touches a checkpoint: the same 16 steps failure-free at
    # dp=4, which the narrower segment (global batch kept) matches to rounding (measured: at
    # most 3.5e-7 of a tensor's largest magnitude; every step counter equal)
    full, _ = _train(tmp_path, "full", ["faults=none", "num_steps=16"])
    _within_rounding(run, full)


def _within_rounding(run, ref, rtol: float = 1e-5) -> None:
    """Every tensor of every rank's final state in ``run`` is within rounding of ``ref``'s: the
    same layout, the step counters equal, the largest difference of each tensor at most ``rtol``
    of that tensor's largest magnitude in ``ref``."""
    a, b = _final(run), _final(ref)
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for name in a:
        assert a[name].keys() == b[name].keys(), (name, a[name].keys(), b[name].keys())
        for k, t in a[name].items():
            u = b[name][k]
            assert t.shape == u.shape and t.dtype == u.dtype, (name, k, t.shape, u.shape)
            if k == "step" or not t.is_floating_point():
                assert torch.equal(t, u), (name, k, t, u)
                continue
            d = (t.double() - u.double()).abs().max().item()
            scale = u.double().abs().max().item()
            assert d <= rtol * scale, (name, k, f"max abs diff {d:.3e} of max |ref| {scale:.3e}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_failure_inside_the_in_place_shrink_shrinks_again_from_its_checkpoint(tmp_path):
    # no spare: rank 1 killed at step 6 shrinks dp4 -> dp3 in place; the process that becomes
    # rank 1 of dp3 is killed inside that regroup's group rebuild, before anyone loaded the state:
    # no copy is left in memory, so the job shrinks again, to dp2, from the checkpoint the first
    # shrink wrote (re-cut from dp4 to dp2), with the two processes left
    events = ("faults.events=[{rank: 1, step: 6, phase: mid_step, kind: kill},"
              "{rank: 1, step: 1, phase: rebuild, kind: kill}]")
    run, s = _train(tmp_path, "elastic", ["ft=elastic", events])
    first, second = s["recoveries"]
    assert first["outcome"] == "interrupted by another failure", first
    assert second["outcome"] == "shrunk to dp=2" and second["elastic"] == "in_place", second
    assert second["checkpoint_s"] == 0  # read back, not written again
    assert second["resume_step"] == first["resume_step"]
    assert sorted(_final(run)) == ["rank0.pt", "rank1.pt"]
    _same_processes(run, [0, 3], 0, second["generation"])
    _equals_narrower_from(tmp_path, run, second["resume_step"], 2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_in_place_shrink_in_3d_keeps_the_dropped_replicas_processes_as_spares(tmp_path):
    # dp2 x tp2 x pp2, no spare: rank 2 (dp 1, tp 0, stage 0) killed; its whole data-parallel
    # replica is dropped: ranks 0, 1, 4, 5 go on as ranks 0-3 of dp1 x tp2 x pp2 in their own
    # processes, and the replica's three live processes (slots 3, 6, 7) stay as warm spares. A
    # later kill of rank 1 is hot-swapped by one of them
    base = ["model=tiny", "parallel=dp2_tp2_pp2", "num_steps=14", "log_every_steps=0",
            "ft.persist_interval_steps=0"]
    events = ("faults.events=[{rank: 2, step: 5, phase: mid_step, kind: kill},"
              "{rank: 1, step: 10, phase: mid_step, kind: kill}]")
    run = tmp_path / "elastic"
    s = run_job(compose_train(base + ["ft=elastic", events], run), log=quiet)
    assert s["outcome"] == "completed", s["message"]
    shrink, swap = s["recoveries"]
    assert shrink["outcome"] == "shrunk to dp=1" and shrink["dropped_dp"] == [1], shrink
    assert swap["outcome"] == "hot-swapped" and swap["spare_slot"] in (3, 6, 7), swap
    _same_processes(run, [0, 4, 5], 0, shrink["generation"])
    assert sorted(_final(run)) == [f"rank{r}.pt" for r in range(4)]
    S = shrink["resume_step"]
    at_S = _checkpointed_at(tmp_path, "ref_to_S", S, ["parallel=dp2_tp2_pp2"])
    ref = tmp_path / "ref"
    r = run_job(compose_train(base + ["parallel.dp=1", "parallel.global_dp=2", "ft.num_spares=0",
                                      "faults=none", f"ft.resume_from={at_S}"], ref), log=quiet)
    assert r["outcome"] == "completed", r["message"]
    equal, why = compare_final_states(run, ref)
    assert equal, why


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_writer_killed_while_the_shrink_writes_its_checkpoint_is_planned_around(tmp_path):
    # no spare: rank 1 killed at step 6; while the survivors write the in-place regroup's
    # checkpoint, rank 3 (which holds no copy anyone needs) is killed before writing its part.
    # The coordinator plans again from what the survivors reported, without rank 3's replica
    # too: dp4 -> dp2, ranks 0 and 2 in their own processes, from the step of rank 3's newest
    # replica (the step of the failure, or one before while its snapshot was still in flight)
    events = ("faults.events=[{rank: 1, step: 6, phase: mid_step, kind: kill},"
              "{rank: 3, step: 1, phase: checkpoint, kind: kill}]")
    run, s = _train(tmp_path, "elastic", ["ft=elastic", events])
    (rec,) = s["recoveries"]
    assert rec["outcome"] == "shrunk to dp=2" and rec["failed_rank"] == [1, 3], rec
    assert rec["dropped_dp"] == [1, 3] and rec["elastic"] == "in_place"
    assert sorted(_final(run)) == ["rank0.pt", "rank1.pt"]
    _same_processes(run, [0, 2], 0, rec["generation"])
    assert _first_step(run, rec["generation"]) == rec["resume_step"] in (5, 6), rec
    _equals_narrower_from(tmp_path, run, rec["resume_step"], 2)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["stop", "hang"])
def test_a_writer_stopped_or_hung_while_the_shrink_writes_is_planned_around(tmp_path, kind):
    # as above, but rank 3 does not die: it is SIGSTOPped (heartbeat silent, process still there)
    # or its training thread hangs in its part of the write (heartbeat alive: only the progress
    # watchdog sees it, so the checkpoint phase must be watched). Either way it must count as a
    # lost writer within its bound (old code: only an exited writer did; the coordinator waited
    # 300 s, then wrote meta.json for the incomplete step and planned from it), be fenced, and the
    # job go on at dp2 from what the survivors hold
    events = ("faults.events=[{rank: 1, step: 6, phase: mid_step, kind: kill},"
              f"{{rank: 3, step: 1, phase: checkpoint, kind: {kind}}}]")
    run, s = _train(tmp_path, "elastic", ["ft=elastic", events, "ft.progress_timeout_s=8"])
    (rec,) = s["recoveries"]
    assert rec["outcome"] == "shrunk to dp=2" and rec["failed_rank"] == [1, 3], rec
    assert rec["dropped_dp"] == [1, 3] and rec["elastic"] == "in_place"
    assert rec["checkpoint_s"] < 60, rec  # found within its bound, not after 300 s
    assert sorted(_final(run)) == ["rank0.pt", "rank1.pt"]
    _same_processes(run, [0, 2], 0, rec["generation"])
    assert _first_step(run, rec["generation"]) == rec["resume_step"] in (5, 6), rec
    if kind == "stop":
        _equals_narrower_from(tmp_path, run, rec["resume_step"], 2)
