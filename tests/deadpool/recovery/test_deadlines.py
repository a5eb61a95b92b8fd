"""Recovery deadlines against a wall-clock step (an NTP correction during a recovery): the
coordinator's waits run on ``time.monotonic()``, so a jump of ``time.time()`` neither declares
silent ranks failed early (a step forward) nor keeps the coordinator waiting (a step back)."""

from __future__ import annotations

import threading
import time

import pytest

from deadpool.recovery import detect
from deadpool.store import reports
from deadpool.store.protocol import Keys, RankStatus
from tests.deadpool.recovery.helpers import coordinator

HOUR_S = 3600.0


def beat(coord, slot: int, n: int):
    coord.store.set(Keys.heartbeat(slot), f"{n} 0 5 forward")


def report_status(coord, keys: Keys, r: int) -> None:
    reports.post(coord.store, coord.seal, keys.status(r), RankStatus(r, r, 7, [6, 7], {}).to_json())


@pytest.fixture
def ntp_step(monkeypatch):
    """``step(s)``: from the next call on, ``time.time()`` reads ``s`` seconds off (once a
    process started by the call before took its reading). The patched clock refuses to be read
    more than 10 s (real time) after the step: a wait on it that did not end has no deadline."""
    real_time, t0 = time.time, time.monotonic()
    offset = {"s": 0.0, "calls": 0}

    def stepped() -> float:
        assert time.monotonic() - t0 < 10, "still waiting 10 s after the wall clock stepped"
        offset["calls"] += 1
        return real_time() + (offset["s"] if offset["calls"] > 1 else 0.0)

    def step(seconds: float) -> None:
        offset["s"] = seconds
        monkeypatch.setattr(time, "time", stepped)
    return step


def test_a_clock_step_forward_does_not_declare_answering_ranks_failed(tmp_path, ntp_step):
    """Ranks 1 and 3 answer the abort 0.3 s late (beating all along), well within
    ``status_timeout_s``; an hour's step forward of the wall clock must not make them
    ``no_status`` (and SIGKILLed)."""
    coord = coordinator(tmp_path, ["ft.status_timeout_s=5"])
    keys = Keys(0)
    for s in range(5):
        beat(coord, s, 1)
    for r in (0, 2):
        report_status(coord, keys, r)

    def late():
        time.sleep(0.3)
        for r in (1, 3):
            beat(coord, r, 2)
            report_status(coord, keys, r)
    answer = threading.Thread(target=late)
    ntp_step(HOUR_S)
    answer.start()
    failed: dict[int, str] = {}
    statuses = detect.collect_statuses(coord, failed, keys)
    answer.join()
    assert failed == {} and sorted(statuses) == [0, 1, 2, 3]
    assert coord.launcher.killed == []


@pytest.mark.parametrize("step_s", [HOUR_S, -HOUR_S], ids=["forward", "back"])
def test_naming_the_culprit_waits_its_own_time_whatever_the_wall_clock_does(tmp_path, ntp_step,
                                                                             step_s):
    """Only a collective broke; rank 2's process exits 0.2 s later. Naming the culprit waits up
    to 1.5 heartbeat timeouts for it: a step forward must not cut that short (rank 2 unnamed), a
    step back must not stretch it (every rank beats: with no culprit the wait ends on time)."""
    coord = coordinator(tmp_path, ["ft.heartbeat_timeout_s=1.0"])
    stop = threading.Event()

    def beats():
        n = 1
        while not stop.is_set():
            for s in range(5):
                beat(coord, s, n)
            n += 1
            time.sleep(0.05)
    beating = threading.Thread(target=beats)
    beating.start()
    try:
        if step_s > 0:  # rank 2 dies
            threading.Timer(0.2, lambda: coord.launcher.exited.__setitem__(2, -9)).start()
        ntp_step(step_s)
        t0 = time.monotonic()
        named = detect.name_culprit(coord, poll_s=0.01)
        took = time.monotonic() - t0
    finally:
        stop.set()
        beating.join()
    if step_s > 0:
        assert named == {2: "exit"}
    else:
        assert named == {} and took < 1.5 * 1.0 + 1.0, took


def test_start_up_waits_its_own_time_after_a_clock_step_forward(tmp_path, ntp_step):
    """Every process joins 0.3 s after the coordinator starts waiting (``ft.startup_timeout_s``
    5 s); an hour's step forward of the wall clock must not fail the start-up."""
    coord = coordinator(tmp_path, ["ft.startup_timeout_s=5"])
    slots = sorted(set(coord.members.ranks.values()) | set(coord.members.spares))

    def join():
        time.sleep(0.3)
        for s in slots:
            beat(coord, s, 1)
            coord.store.set(Keys.spare_ready(s), coord.seal.wrap(Keys.spare_ready(s), "1.0"))
    joining = threading.Thread(target=join)
    ntp_step(HOUR_S)
    joining.start()
    coord.wait_warm()
    joining.join()
    assert coord.store.check([Keys.plan(0)])


def test_the_final_wait_waits_its_own_time_after_a_clock_step_forward(tmp_path, ntp_step):
    """Every rank writes its final state 0.3 s after the job is done (the wait allows 120 s);
    an hour's step forward of the wall clock must not call them missing."""
    coord = coordinator(tmp_path)

    def write():
        time.sleep(0.3)
        for r in range(4):
            coord.store.set(Keys.final(r), coord.seal.wrap(Keys.final(r), '{"digest": "d"}'))
    writing = threading.Thread(target=write)
    ntp_step(HOUR_S)
    writing.start()
    coord._collect_finals()
    writing.join()
    assert sorted(coord.finals) == [0, 1, 2, 3]
