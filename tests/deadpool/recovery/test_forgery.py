"""A client with store access but without the job's secret tries every forgery it can, and the
coordinator (and a worker's heartbeat) acts only on what the job sealed (deadpool/store/auth.py).

The forger writes into the job's namespace directly: ``list_keys()`` shows it to any client that
reaches the port, so the namespace is no defence. Each test also shows the sealed message being
acted on, so it fails if the check were skipped."""

from __future__ import annotations

import json
import threading
import time

import torch.distributed as dist

from deadpool.rank.heartbeat import Heartbeat
from deadpool.rank.watchdog import Progress
from deadpool.rank.worker import Worker
from deadpool.recovery import detect, disk, plan, timeline
from deadpool.store import auth, reports
from deadpool.store.protocol import Keys, Plan, RankStatus, RankTimings, Seal, Source
from tests.deadpool.recovery.helpers import coordinator

SECRET = auth.new_secret()
OTHER = auth.new_secret()  # the forger's own key: what it seals with is not the job's
JOB = Seal(SECRET)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def sealed(store, key: str, text: str) -> None:
    reports.post(store, JOB, key, text)


def forged(store, key: str, text: str) -> None:  # (listed in the index, as a writer does)
    reports.post(store, Seal(OTHER), key, text)


def beat(store, slot: int, n: int, seal=JOB, step: int = 5, phase: str = "forward", prog: int = 0):
    key = Keys.heartbeat(slot)
    store.set(key, seal.wrap(key, f"{n} {prog} {step} {phase}"))


def job_coordinator(tmp_path, overrides=(), logs=None):
    coord = coordinator(tmp_path, overrides, logs=logs, secret=SECRET)
    coord.live.clock = Clock()
    return coord


def test_a_fake_or_replayed_heartbeat_does_not_keep_a_dead_rank_alive(tmp_path):
    logs: list[str] = []
    coord = job_coordinator(tmp_path, logs=logs)
    store, clock = coord.store, coord.live.clock
    for n in range(1, 6):
        for s in range(5):
            beat(store, s, n)
        coord.read_heartbeats(force=True)
        clock.t += 0.05
    old = store.get(Keys.heartbeat(2))  # rank 2's last real beat (5); then its process dies
    beat(store, 2, 3)
    replay_of_3 = store.get(Keys.heartbeat(2))
    for n in range(6, 400):  # 20 s of beats from everyone else, and forgeries for slot 2
        for s in (0, 1, 3, 4):
            beat(store, s, n)
        if n % 3 == 0:
            store.set(Keys.heartbeat(2), f"{n} {n} 5 forward")           # unsealed
        elif n % 3 == 1:
            beat(store, 2, n, seal=Seal(OTHER))                           # sealed, wrong secret
        else:
            store.set(Keys.heartbeat(2), replay_of_3 if n % 2 else old)   # replays of real beats
        coord.read_heartbeats(force=True)
        clock.t += 0.05
    assert detect.failures(coord)[0] == {2: "heartbeat"}
    assert any("slot 2: heartbeat without the job's secret" in line for line in logs)
    beat(store, 2, 400)  # the job's own beat (a live process) is taken at once
    coord.read_heartbeats(force=True)
    assert coord.live.beat_age(2) == 0.0


def test_a_forged_or_copied_status_is_not_taken_and_the_dead_rank_is_replaced(tmp_path):
    logs: list[str] = []
    coord = job_coordinator(tmp_path, ["ft.status_timeout_s=5"], logs=logs)
    keys, store = Keys(0), coord.store
    for s in range(5):
        beat(store, s, 1)
    coord.read_heartbeats(force=True)
    coord.launcher.exited[1] = -9  # rank 1 died; the forger claims it is live at step 9
    forged(store, keys.status(1), RankStatus(1, 1, 9, [9], {}).to_json())
    forged(store, keys.status(3), RankStatus(3, 3, 9, [9], {}).to_json())  # the real one: later
    for r in (0, 2):  # rank 2 holds rank 1's replica
        sealed(store, keys.status(r), RankStatus(r, r, 7, [6, 7], {1: [6, 7]} if r == 2 else {}
                                                 ).to_json())

    def rank3_reports():
        time.sleep(0.2)
        store.set(keys.status(1), store.get(keys.status(0)))  # a real status copied to rank 1
        sealed(store, keys.status(3), RankStatus(3, 3, 7, [6, 7], {}).to_json())
    t = threading.Thread(target=rank3_reports)
    t.start()
    failed: dict[int, str] = {}
    statuses = detect.collect_statuses(coord, failed, keys)
    t.join()
    assert failed == {1: "exit"} and sorted(statuses) == [0, 2, 3]
    assert statuses[3].live_step == 7  # the real report, not the forged step 9
    d = plan.decide(coord, statuses)
    assert d.resume_step == 7 and d.sources[1].kind == "replica" and d.sources[1].holder == 2
    assert any("status for rank 1 without the job's secret" in line for line in logs)


def test_forged_bad_source_crash_and_fault_reports_are_ignored(tmp_path):
    coord = job_coordinator(tmp_path)
    keys, store = Keys(0), coord.store
    forged(store, keys.bad_source(2), json.dumps({"holder": 0, "owner": 1, "step": 9}))
    assert detect.collect_bad_sources(coord, keys) == [] and coord.bad == set()
    assert not detect._bad_reported(coord)
    sealed(store, keys.bad_source(3), json.dumps({"holder": 2, "owner": 1, "step": 9}))
    assert detect.collect_bad_sources(coord, keys) == [{"holder": 2, "owner": 1, "step": 9}]
    assert coord.bad == {(2, 1, 9)} and detect._bad_reported(coord)
    # a forged crash report does not turn an exit into an exception
    for s in range(5):
        beat(store, s, 1)
    coord.launcher.exited[2] = -9
    forged(store, Keys.crash(2), "RuntimeError: forged")
    assert detect.failures(coord)[0] == {2: "exit"}
    sealed(store, Keys.crash(2), "RuntimeError: boom")
    assert detect.failures(coord)[0] == {2: "exception"}
    # a forged fault record does not date a failure
    forged(store, Keys.fault(1), json.dumps({"t": 1e12, "kind": "kill"}))
    sealed(store, Keys.fault(3), json.dumps({"t": 101.0, "kind": "stop"}))
    assert detect.collect_faults(coord, {1}) == {3: {"t": 101.0, "kind": "stop"}}


def test_a_bumped_error_counter_without_a_sealed_report_aborts_nothing(tmp_path):
    logs: list[str] = []
    coord = job_coordinator(tmp_path, logs=logs)
    keys, store = Keys(0), coord.store
    for s in range(5):
        beat(store, s, 1)
    store.add(keys.num_errors, 5)
    forged(store, keys.error(1), "forged collective error")
    sealed(store, Keys.crash(2), "x")  # a crash report of a live process names nobody alone
    assert detect.failures(coord) is None
    assert any("error counter of generation 0 bumped with no report" in line for line in logs)
    sealed(store, keys.error(1), "connection closed by peer")  # the real report, then the hint
    store.add(keys.num_errors, 1)
    found = detect.failures(coord)
    assert found is not None and found[0] == {2: "exception"}  # now the sealed crash counts


def test_a_bumped_finish_counter_does_not_end_the_job(tmp_path):
    logs: list[str] = []
    coord = job_coordinator(tmp_path, logs=logs)
    keys, store = Keys(0), coord.store
    store.add(keys.finished_count, 4)           # the forger's bump: "every rank finished"
    forged(store, keys.finished(0), "1")
    assert not coord._all_finished()
    for r in range(4):                          # the real ranks finish, each report then the hint
        assert not coord._all_finished()
        sealed(store, keys.finished(r), "1")
        store.add(keys.finished_count, 1)
    assert coord._all_finished()
    assert any("finish counter of generation 0 ahead of the reports" in line for line in logs)


def test_a_forged_final_state_is_not_taken(tmp_path):
    coord = job_coordinator(tmp_path)
    store = coord.store
    for r in range(1, 4):
        sealed(store, Keys.final(r), json.dumps({"digest": f"real{r}", "step": 20}))
    forged(store, Keys.final(0), json.dumps({"digest": "forged", "step": 20}))

    def rank0_writes():
        time.sleep(0.2)
        sealed(store, Keys.final(0), json.dumps({"digest": "real0", "step": 20}))
    t = threading.Thread(target=rank0_writes)
    t.start()
    coord._collect_finals()
    t.join()
    assert {r: f["digest"] for r, f in coord.finals.items()} == {r: f"real{r}" for r in range(4)}


def test_a_bumped_checkpoint_counter_does_not_mark_the_checkpoint_written(tmp_path):
    coord = job_coordinator(tmp_path, ["ft.snapshot=false"])
    store = coord.store
    decision = plan.RecoveryDecision(6, {}, 0)
    keys = Keys(1)
    store.add(keys.checkpointed_count(), 4)  # forged: "every rank wrote its state"
    written = {}

    def ranks_write():
        time.sleep(0.3)
        written["t"] = time.time()
        for r in range(4):
            sealed(store, keys.checkpointed(r), "1")
            store.add(keys.checkpointed_count(), 1)
    t = threading.Thread(target=ranks_write)
    t.start()
    disk.write_state(coord, 1, "checkpoint_and_stop", decision, "test")
    t.join()
    assert time.time() >= written["t"]  # it returned only after the real reports


def test_forged_timings_and_protection_do_not_complete_a_record(tmp_path):
    coord = job_coordinator(tmp_path)  # ranks replicate: the record waits for protection
    d = plan.RecoveryDecision(6, {}, 1)
    rec = timeline.open_record(coord, {1: "exit"}, {}, d, 10.0, [])
    rec.update(t_plan=10.5, spare_slot=4)
    coord.pending, coord.members.generation = rec, 1
    keys, store = Keys(1), coord.store
    t = RankTimings(plan_seen=10.6, rebuilt=11.0, transferred=11.5, rolled_back=11.6, ready=11.7)
    for r in range(4):
        forged(store, keys.timing(r), t.to_json())
        forged(store, keys.first_step(r), "12.0")
    store.add(keys.protected_count, 4)
    timeline.finish_pending(coord)
    assert coord.pending is rec
    for r in range(4):
        sealed(store, keys.timing(r), t.to_json())
        sealed(store, keys.first_step(r), "12.0")
        forged(store, keys.protected(r), "12.5")
    timeline.finish_pending(coord)
    assert coord.pending is rec  # the protection hint has no sealed reports behind it
    for r in range(4):
        sealed(store, keys.protected(r), "12.5")
    timeline.finish_pending(coord)
    assert coord.pending is None and rec.kill_to_protected_s == 12.5 - 10.0


def test_forged_job_stop_does_not_end_a_spare_waiting_for_its_plan():
    store = dist.HashStore()
    w = Worker.__new__(Worker)  # only what wait_plan uses
    w.store, w.seal, w.first_gen = store, JOB, 0
    w.link, w.plan_held, w._group_keys = None, None, []  # no node agent: the store is polled
    w.lost = threading.Event()
    w.ft = {"startup_timeout_s": 30}
    w.trainer = type("T", (), {"rank": 0})()
    forged(store, Keys.JOB_STOP, "1")
    forged(store, Keys.JOB_DONE, "1")
    assert not JOB.flag(store, Keys.JOB_STOP) and not JOB.flag(store, Keys.JOB_DONE)

    def coordinator_plans():
        time.sleep(0.3)
        p = Plan(0, "train", {0: 0}, 0, {0: Source("live", 0)})
        sealed(store, Keys.plan(0), p.to_json())
    t = threading.Thread(target=coordinator_plans)
    t.start()
    got = w.wait_plan(0)
    t.join()
    assert got is not None and got.assignments == {0: 0}
    sealed(store, Keys.JOB_STOP, "1")
    assert w.wait_plan(1) is None  # the job's own stop is obeyed
    assert JOB.flag(store, Keys.JOB_STOP)


def test_a_forged_or_replayed_coordinator_heartbeat_does_not_hide_its_loss():
    store = dist.HashStore()
    hb = Heartbeat(lambda: store, 0, 0.01, 0.5, Progress(), JOB)
    hb.start()
    n = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.5:  # the coordinator beats: not lost
        n += 1
        sealed(store, Keys.COORD_HB, str(n))
        time.sleep(0.02)
    assert hb.seen_coordinator and not hb.coordinator_lost.is_set()
    replay = store.get(Keys.COORD_HB)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.5 and not hb.coordinator_lost.is_set():
        n += 1  # the coordinator stopped: the forger writes on, unsealed, foreign and replayed
        store.set(Keys.COORD_HB, str(n) if n % 3 == 0 else
                  auth.seal(OTHER, str(n), context=Keys.COORD_HB) if n % 3 == 1 else replay)
        time.sleep(0.01)
    assert hb.coordinator_lost.is_set()
    assert JOB.unwrap(Keys.heartbeat(0), store.get(Keys.heartbeat(0))).split()[0].isdigit()
    hb.stop()


def test_a_forged_join_announcement_is_not_counted_as_a_warm_process(tmp_path):
    logs: list[str] = []
    coord = job_coordinator(tmp_path, logs=logs)
    store = coord.store
    for s in range(5):
        beat(store, s, 1)
    for s in range(4):
        sealed(store, Keys.spare_ready(s), "1.0")
    forged(store, Keys.spare_ready(4), "1.0")  # the spare's slot, claimed by the forger
    joined = {}

    def spare_joins():
        time.sleep(0.3)
        joined["t"] = time.time()
        sealed(store, Keys.spare_ready(4), "2.0")
    t = threading.Thread(target=spare_joins)
    t.start()
    coord.wait_warm()
    t.join()
    assert time.time() >= joined["t"] and store.check([Keys.plan(0)])
    assert any("slot 4: join announcement without the job's secret refused" in line for line in logs)
