"""The end of a job (issue 37): the coordinator waits for each rank's final record while the
rank's writer makes progress (its heartbeat's progress counter moves), not for a fixed time; a
writer that stops progressing, or whose process stops, is named in ``JobFailed``.

The ranks are threads beating into the coordinator's in-memory store ("<beat> <progress> <step>
<phase>", what ``rank/heartbeat.py`` writes); ``ft.progress_timeout_s`` is scaled down to 0.4 s, the
stand-in for both the old fixed 120 s and the progress watchdog's bound."""

from __future__ import annotations

import threading
import time

import pytest

from deadpool.errors import JobFailed
from deadpool.store.protocol import Keys
from tests.deadpool.recovery.helpers import coordinator

STALL_S = 0.4


class Rank(threading.Thread):
    """A rank writing its final state: beats every 20 ms; its progress counter moves every
    ``every_s`` while writing (a throttled disk) for ``write_s``, then it posts its record.
    ``hang_after_s``: its writer stops progressing then (the beat lives on: a write stuck on the
    file system); ``stop_after_s``: the whole process stops then (SIGSTOP: no beat either)."""

    def __init__(self, coord, r: int, write_s: float, every_s: float = 0.05,
                 hang_after_s: float | None = None, stop_after_s: float | None = None):
        super().__init__(daemon=True)
        self.coord, self.r, self.write_s, self.every_s = coord, r, write_s, every_s
        self.hang_after_s, self.stop_after_s = hang_after_s, stop_after_s
        self.quit = threading.Event()

    def run(self):
        t0, beat, prog, last_prog = time.monotonic(), 0, 0, 0.0
        slot = self.coord.members.ranks[self.r]
        while not self.quit.is_set():
            now = time.monotonic() - t0
            if self.stop_after_s is not None and now > self.stop_after_s:
                self.coord.launcher.stopped.add(slot)
                return
            hung = self.hang_after_s is not None and now > self.hang_after_s
            if not hung and now - last_prog >= self.every_s:
                prog, last_prog = prog + 1, now
            beat += 1
            self.coord.store.set(Keys.heartbeat(slot), f"{beat} {prog} 5 final")
            if now >= self.write_s and not hung:
                self.coord.store.set(Keys.final(self.r), '{"digest": "d%d"}' % self.r)
                return
            time.sleep(0.02)


def run_ranks(coord, ranks) -> tuple[float, str | None]:
    for t in ranks:
        t.start()
    t0 = time.monotonic()
    try:
        coord._collect_finals()
        err = None
    except JobFailed as e:
        err = str(e)
    finally:
        for t in ranks:
            t.quit.set()
            t.join()
    return time.monotonic() - t0, err


@pytest.fixture
def coord(tmp_path):
    return coordinator(tmp_path, [f"ft.progress_timeout_s={STALL_S}", "ft.heartbeat_timeout_s=0.3",
                                  "ft.heartbeat_hard_timeout_s=5"])


def test_a_throttled_writer_is_waited_for_while_it_progresses(coord):
    """Rank 2 writes for 1.6 s (four times the stand-in bound), progressing every 50 ms."""
    took, err = run_ranks(coord, [Rank(coord, r, 1.6 if r == 2 else 0.1) for r in range(4)])
    assert err is None, err
    assert sorted(coord.finals) == [0, 1, 2, 3] and took > 4 * STALL_S


def test_a_writer_that_stops_progressing_is_named_without_waiting_long(coord):
    """Rank 1's write hangs after 0.2 s (its heartbeat lives on): named within a few bounds,
    not after a fixed 120 s."""
    ranks = [Rank(coord, r, 3.0 if r == 1 else 0.1, hang_after_s=0.2 if r == 1 else None)
             for r in range(4)]
    took, err = run_ranks(coord, ranks)
    assert err is not None and "[1]" in err and "progress" in err, err
    assert took < 0.2 + 4 * STALL_S, took


def test_a_stopped_writer_is_named(coord):
    """Rank 3's process is stopped (SIGSTOP: no beat, the launcher sees it stopped) mid-write."""
    ranks = [Rank(coord, r, 3.0 if r == 3 else 0.1, stop_after_s=0.2 if r == 3 else None)
             for r in range(4)]
    took, err = run_ranks(coord, ranks)
    assert err is not None and "rank 3" in err, err
    assert took < 0.2 + 4 * STALL_S, took


def test_a_writer_that_exits_without_its_record_fails_the_job_at_once(coord):
    coord.launcher.exited[2] = 1
    took, err = run_ranks(coord, [Rank(coord, r, 0.1) for r in (0, 1, 3)])
    assert err is not None and "rank 2 failed while writing its final state" in err
    assert took < STALL_S
