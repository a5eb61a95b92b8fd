"""The end of a job (issue 37): the wait for the final states follows the writers' progress, not a
fixed bound, and the final digest comes from the ranks' own digests."""

from __future__ import annotations

import threading
import time

from deadpool.checkpoint.final import FinalWait, final_digest

OLD_FIXED_BOUND_S = 0.6  # stands for the old fixed 120 s, scaled to the test


def _throttled_writer(progress: dict, done: set, rank: int, chunks: int, every_s: float,
                      stop_after: int | None = None) -> threading.Thread:
    """Writes ``chunks`` chunks, one every ``every_s`` (a slow disk), publishing the bytes
    written; ``stop_after``: hangs (no more progress, no record) after that many chunks."""
    def run():
        for i in range(chunks):
            if stop_after is not None and i >= stop_after:
                return
            time.sleep(every_s)
            progress[rank] = (i + 1) * 4096
        done.add(rank)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait(w: FinalWait, progress, done, limit_s=10.0) -> str:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        w.update(set(done), dict(progress))
        if w.finished:
            return "completed"
        if w.stalled():
            return f"stalled {w.stalled()}"
        time.sleep(0.01)
    return "timeout"


def test_a_slow_disk_is_no_failure_while_the_writers_make_progress():
    progress, done = {}, set()
    # rank 1 writes for ~1.2 s, twice the old fixed bound, at one chunk every 0.1 s
    for r, n in ((0, 2), (1, 12)):
        _throttled_writer(progress, done, r, n, 0.1)
    w = FinalWait(range(2), stall_s=0.5)
    t0 = time.monotonic()
    assert _wait(w, progress, done) == "completed"
    assert time.monotonic() - t0 > OLD_FIXED_BOUND_S  # a fixed bound would have failed it


def test_a_writer_that_stops_making_progress_is_named():
    progress, done = {}, set()
    _throttled_writer(progress, done, 0, 3, 0.05)
    _throttled_writer(progress, done, 1, 20, 0.05, stop_after=4)  # hangs in its write
    w = FinalWait(range(2), stall_s=0.4)
    assert _wait(w, progress, done) == "stalled [1]"


def test_the_final_digest_is_the_ranks_digests_in_rank_order():
    finals = {1: {"digest": "b"}, 0: {"digest": "a"}}
    assert final_digest(finals, 2) == final_digest({0: {"digest": "a"}, 1: {"digest": "b"}}, 2)
    assert final_digest(finals, 2) != final_digest({0: {"digest": "b"}, 1: {"digest": "a"}}, 2)
    assert final_digest({0: {"digest": "a"}}, 2) is None
