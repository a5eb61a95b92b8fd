"""The coordinator's recovery decisions (deadpool/recovery: detect, plan, fallbacks, timeline)
on an in-memory store with a scripted launcher: no processes."""

from __future__ import annotations

import json
import re

import pytest

from deadpool.recovery import detect, disk, fallbacks, plan, timeline
from deadpool.store import reports
from deadpool.store.protocol import Keys, RankStatus, RankTimings, Source
from deadpool.store.wire import fetch_plan
from tests.deadpool.recovery.helpers import coordinator


def post(coord, key: str, text: str) -> None:
    """A report as its writer sends it (``reports.post``: the coordinator reads posted ones)."""
    reports.post(coord.store, coord.seal, key, text)


def beat(coord, slot: int, n: int, progress: int = 0, step: int = 5, phase: str = "forward"):
    coord.store.set(Keys.heartbeat(slot), f"{n} {progress} {step} {phase}")


def test_an_exited_process_is_failed_by_exit_and_a_crash_report_makes_it_an_exception(tmp_path):
    coord = coordinator(tmp_path)
    for s in range(5):
        beat(coord, s, 1)
    assert detect.failures(coord) is None
    coord.launcher.exited[2] = -9
    failed, _ = detect.failures(coord)
    assert failed == {2: "exit"}
    post(coord, Keys.crash(2), "RuntimeError: boom")
    failed, _ = detect.failures(coord)
    assert failed == {2: "exception"}


def test_a_reported_collective_error_with_no_culprit_aborts_without_naming_anyone(tmp_path):
    logs = []
    coord = coordinator(tmp_path, logs=logs)
    for s in range(5):
        beat(coord, s, 1)
    post(coord, Keys(0).error(1), "connection closed by peer")
    coord.store.add(Keys(0).num_errors, 1)
    assert detect.failures(coord)[0] == {}
    assert any("rank 1 reports: connection closed" in line for line in logs)


def test_a_lost_spare_leaves_the_pool(tmp_path):
    coord = coordinator(tmp_path)
    assert coord.members.spares == [4]
    coord.launcher.exited[4] = 1
    detect.check_spares(coord)
    assert coord.members.spares == [] and coord.launcher.killed == [4]


def test_abort_and_fence_sets_the_sealed_abort_once_and_kills_the_failed(tmp_path):
    coord = coordinator(tmp_path)
    detect.abort_and_fence(coord, {1: "exit"})
    detect.abort_and_fence(coord, {}, reason="second")
    assert coord.seal.unwrap(Keys(0).abort, coord.store.get(Keys(0).abort)) == "ranks [1] failed"
    assert coord.launcher.killed == [1]


def test_statuses_are_collected_and_a_silent_stopped_rank_is_declared_failed(tmp_path):
    coord = coordinator(tmp_path, ["ft.status_timeout_s=5"])
    keys = Keys(0)
    for r in (0, 2):
        post(coord, keys.status(r), RankStatus(r, r, 7, [6, 7], {}).to_json())
    coord.launcher.stopped.add(3)
    for s in range(5):
        beat(coord, s, 1)
    coord.live.soft_s = 0.0  # rank 3 stopped beating: past the soft timeout at once
    failed = {1: "exit"}
    statuses = detect.collect_statuses(coord, failed, keys)
    assert sorted(statuses) == [0, 2] and failed == {1: "exit", 3: "heartbeat"}
    assert 3 in coord.launcher.killed
    # how each was found, for the message of a recovery that cannot go on
    assert re.fullmatch(r"rank 1 \(exit\), rank 3 \(heartbeat: beat \d+\.\d s old, phase forward "
                        r"unchanged for \d+\.\d s\)", detect.described(coord, failed)), \
        detect.described(coord, failed)


def test_an_exit_is_described_with_its_status(tmp_path):
    coord = coordinator(tmp_path)
    for s in range(5):
        beat(coord, s, 1)
    coord.launcher.exited.update({2: -11, 3: 1})  # a crash in C (no report), an exit
    failed, _ = detect.failures(coord)
    assert failed == {2: "exit", 3: "exit"}
    assert detect.described(coord, failed) == ("rank 2 (exit: killed by SIGSEGV), "
                                               "rank 3 (exit: exit code 1)")


def test_a_corrupt_copy_reported_by_a_receiver_is_never_chosen_again(tmp_path):
    coord = coordinator(tmp_path)
    post(coord, Keys(0).bad_source(1), json.dumps({"holder": 2, "owner": 1, "step": 9}))
    found = detect.collect_bad_sources(coord, Keys(0))
    assert found == [{"holder": 2, "owner": 1, "step": 9}] and coord.bad == {(2, 1, 9)}


def test_the_dead_ranks_injected_fault_dates_the_failure_once(tmp_path):
    coord = coordinator(tmp_path)
    post(coord, Keys.fault(1), json.dumps({"t": 100.0, "kind": "kill"}))
    post(coord, Keys.fault(3), json.dumps({"t": 101.0, "kind": "stop"}))
    assert list(detect.collect_faults(coord, {1})) == [1]  # the dead rank's own, first
    # rank 1's is attributed now; a survivor's newer fault explains the next recovery, once
    assert list(detect.collect_faults(coord, {1})) == [3]
    assert detect.collect_faults(coord, {1}) == {}


def test_decide_takes_the_replica_and_a_peers_parameters_under_zero(tmp_path):
    coord = coordinator(tmp_path)  # dp4, ZeRO-1, ft.replicate=unique: buddies on the ring
    st = {r: RankStatus(r, r, 8, [7, 8], {r - 1: [7, 8]} if r else {3: [7, 8]}) for r in (0, 2, 3)}
    d = plan.decide(coord, st)
    assert d.resume_step == 8
    assert d.sources[1].kind == "replica" and d.sources[1].holder == 2
    assert d.sources[1].shared_from in (0, 2, 3)


def test_spares_go_to_the_ranks_without_a_process_while_they_last(tmp_path):
    coord = coordinator(tmp_path, ["ft.num_spares=1"])
    del coord.members.ranks[1], coord.members.ranks[3]
    assignments, need, used = plan.assign_spares(coord)
    assert need == [1, 3] and used == [4] and assignments[1] == 4 and 3 not in assignments
    assert coord.members.spares == []


def test_swap_routes_fault_crosses_two_sources():
    srcs = {1: Source("replica", 2), 3: Source("replica", 0)}
    plan.swap_routes({"swap_routes": [1, 3]}, srcs)
    assert srcs == {1: Source("replica", 0, owner=3), 3: Source("replica", 2, owner=1)}
    plan.swap_routes({}, srcs)  # no fault configured: unchanged
    assert srcs[1].owner == 3


def test_groups_survivors_left_cleanly_are_kept_on_gloo_only(tmp_path):
    coord = coordinator(tmp_path)
    clean = {r: RankStatus(r, r, 5, [5], {}, {"dp/pp0-tp0": [3, 3]}) for r in (0, 1, 2, 3)}
    assert plan.groups_to_keep(coord, clean, [], 1) == ["dp/pp0-tp0"]
    assert plan.groups_to_keep(coord, clean, [2], 1) == []  # a member is replaced
    coord_all = coordinator(tmp_path, ["ft.rebuild=all"])
    assert plan.groups_to_keep(coord_all, clean, [], 1) == []


def test_too_many_recoveries_without_progress_write_and_stop(tmp_path):
    coord = coordinator(tmp_path, ["ft.max_recoveries_without_progress=1"])
    d = plan.RecoveryDecision(4, {r: Source("disk", r, dir="x") for r in range(4)}, 0)
    rec = timeline.open_record(coord, {1: "exit"}, {}, d, 1.0, [])
    assert not fallbacks.stalled(coord, d, rec, 1.0)
    assert fallbacks.stalled(coord, d, rec, 1.0)  # the second in a row: a disk source -> stop
    assert coord.outcome == "unrecoverable" and "without a completed step" in coord.message
    p, _ = fetch_plan(coord.store, coord.seal, 1, None)
    assert p.action == "stop"


def test_no_copy_in_memory_and_no_disk_checkpoint_stops_naming_the_lost_ranks(tmp_path):
    coord = coordinator(tmp_path)
    d = plan.RecoveryDecision(None, {}, 0, "no consistent copy of rank(s) [1] survives in memory",
                              [1])
    rec = timeline.open_record(coord, {1: "exit"}, {}, d, 1.0, [])
    assert disk.from_disk(coord, d, rec) is None
    assert coord.outcome == "unrecoverable"
    assert "rank(s) [1]" in coord.message and "no complete disk checkpoint" in coord.message
    assert coord.recoveries[-1].outcome == "unrecoverable"


def test_no_spare_with_a_disk_source_stops_unless_the_job_shrinks_in_place(tmp_path):
    # a relaunch needs the processes' memory (the state goes to disk from it): stop
    coord = coordinator(tmp_path, ["ft.num_spares=0", "ft.elastic_mode=relaunch"])
    d = plan.RecoveryDecision(4, {r: Source("disk", r, dir="x") for r in range(4)}, 0, "lost")
    rec = timeline.open_record(coord, {1: "exit"}, {}, d, 1.0, [])
    fallbacks.no_spare(coord, 1, d, rec, {1}, 1.0)
    assert coord.outcome == "unrecoverable" and "no warm spare left" in coord.message
    # in place the survivors read the complete checkpoint at the narrower width: nothing written
    coord = coordinator(tmp_path / "in_place", ["ft.num_spares=0"])
    rec = timeline.open_record(coord, {1: "exit"}, {}, d, 1.0, [])
    del coord.members.ranks[1]
    fallbacks.no_spare(coord, 1, d, rec, {1}, 1.0)
    assert coord.outcome == "running" and coord.dims.dp == 3 and coord.gen == 1
    p = coord._last_plan
    assert p.generation == 1 and p.action == "train" and p.layout["dp"] == 3
    assert p.assignments == {0: 0, 1: 2, 2: 3}
    assert {s.kind for s in p.sources.values()} == {"disk"} and p.sources[1].dir == "x"
    assert rec.checkpoint_s == 0 and rec.elastic == "in_place" and coord.pending is rec


def test_the_record_is_completed_from_every_ranks_timings(tmp_path):
    coord = coordinator(tmp_path, ["ft.snapshot=false"])
    d = plan.RecoveryDecision(6, {}, 1)
    rec = timeline.open_record(coord, {1: "exit"}, {1: {"t": 9.0, "kind": "kill"}}, d, 10.0, [])
    assert rec.detect_s == pytest.approx(1.0) and rec.fault == "kill" and rec.failed_rank == 1
    rec.update(t_plan=10.5, spare_slot=4)
    coord.pending = rec
    coord.members.generation = 1
    keys = Keys(1)
    for r in range(4):
        t = RankTimings(plan_seen=10.6, rebuilt=11.0 + r / 10, transferred=11.5, rolled_back=11.6,
                        ready=11.7, bytes_received=100 if r == 1 else 0)
        post(coord, keys.timing(r), t.to_json())
    timeline.finish_pending(coord)
    assert coord.pending is rec  # first steps not reported yet
    for r in range(4):
        post(coord, keys.first_step(r), repr(12.0 + r / 100))
    timeline.finish_pending(coord)
    assert coord.pending is None and coord.recoveries == [rec]
    assert rec.outcome == "hot-swapped" and rec.bytes_transferred == 100
    assert rec.rebuild_s == pytest.approx(11.3 - 10.5)
    assert rec.transfer_s == pytest.approx(0.5)  # the slowest rank: 11.5 - 11.0
    assert rec.kill_to_first_step_s == pytest.approx(12.03 - 9.0)
    assert "rollback_s" in rec.to_dict() and "load_s" not in rec.to_dict()


@pytest.mark.parametrize("backend", ["hash", "tcp"])
def test_keys_of_finished_generations_are_deleted_and_the_key_count_stays_flat(tmp_path, backend):
    from deadpool.store import auth
    store = None
    if backend == "tcp":  # the real store, through the job's namespace
        store = auth.namespaced(auth.serve_store("127.0.0.1", 0, timeout_s=10), auth.new_secret())
    coord = coordinator(tmp_path, ["ft.snapshot=false"], store=store)
    store = coord.store
    store.set(Keys.plan(0), "plan")
    counts = []
    for g in range(1, 8):
        old = Keys(g - 1)  # what generation g-1 left: reports, rendezvous keys, per-step counters
        for r in range(4):
            for key in (old.status(r), old.error(r), old.timing(r), old.first_step(r),
                        old.finished(r), f"g{g - 1}/dp/pp0-tp0/{r}"):
                store.set(key, "x")
        for step in range(10):
            store.add(old.repl_done(step), 4)
        store.add(old.num_errors, 1)
        store.set(Keys.plan(g), "plan")
        store.set(Keys.plan_full(g), "plan")
        d = plan.RecoveryDecision(6, {}, 1)  # the recovery into g completes
        rec = timeline.open_record(coord, {1: "exit"}, {}, d, 10.0, [])
        rec.update(t_plan=10.5, spare_slot=4)
        coord.pending, coord.members.generation = rec, g
        for r in range(4):
            post(coord, Keys(g).timing(r), RankTimings(10.6, 11.0, 11.5, 11.6, 11.7).to_json())
            post(coord, Keys(g).first_step(r), "12.0")
        timeline.finish_pending(coord)
        assert coord.pending is None
        while coord._garbage:
            coord.collect_garbage(budget=16)
        counts.append(store.num_keys())
        left = set(store.list_keys())
        assert not any(k.startswith(f"g{g - 1}/") for k in left)
        assert Keys.plan(g) in left and Keys.plan(g - 1) in left and Keys.plan(g - 2) not in left
        assert Keys.plan_full(g) in left and Keys.plan_full(g - 2) not in left
        assert Keys(g).timing(0) in left  # the running generation's keys stay
    assert counts[1:] == [counts[1]] * (len(counts) - 1), counts


def test_each_recovery_goes_out_as_a_delta_against_the_plan_every_reader_holds(tmp_path):
    """Two recoveries in a row: each plan is a delta that a reader holding the plan before it
    decodes to the coordinator's membership (the coordinator must not change a plan it wrote,
    else the next delta names a base no reader holds and every reader reads the full form)."""
    from deadpool.store.protocol import Plan
    from deadpool.store.wire import decode_plan

    coord = coordinator(tmp_path, ["ft.num_spares=2", "ft.status_timeout_s=5"])
    ranks = dict(coord.members.ranks)
    coord.write_plan(Plan(0, "train", ranks, 0, {r: Source("live", r) for r in ranks}))
    held, _ = fetch_plan(coord.store, coord.seal, 0, None)
    for g, dead in ((0, 1), (1, 2)):
        for s in range(6):
            beat(coord, s, g + 1)
        for r, slot in coord.members.ranks.items():  # survivors: live at step 8, each holding
            if r != dead:                             # its ring predecessor's replica
                post(coord, Keys(g).status(r), RankStatus(r, slot, 8, [7, 8],
                                                  {(r - 1) % 4: [7, 8]}).to_json())
        coord.launcher.exited[coord.members.ranks[dead]] = -9
        coord.recover({dead: "exit"}, 10.0 + g)
        text = coord.store.get(Keys.plan(g + 1)).decode()
        assert json.loads(text)["form"] == "delta"
        held = decode_plan(text, held, coord._group_keys)  # no BaseMismatch
        assert held.assignments == coord.members.ranks and held.generation == g + 1
    assert held.assignments == {0: 0, 1: 4, 2: 5, 3: 3}
