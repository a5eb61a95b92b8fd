"""A node agent's stop request counts as answered only when the coordinator's loop answers
(``launch.stop.ask``), not when its store takes the bytes: SIGSTOP reaches a multi-threaded
coordinator one thread at a time, so its store's thread may take a request its stopped loop never
reads (the unreachable-coordinator preemption test then waited out ``coordinator_timeout_s``)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from deadpool.launch import stop
from deadpool.store.protocol import Keys, Seal

SEAL = Seal("s3cret")


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10), use_libuv=True)
    yield master


def opener(master):
    return lambda timeout_s: dist.TCPStore("127.0.0.1", master.port, is_master=False,
                                           timeout=timedelta(seconds=timeout_s), use_libuv=True)


def beat(master, n):
    master.set(Keys.COORD_HB, SEAL.wrap(Keys.COORD_HB, str(n)))


def test_a_store_that_takes_the_request_while_the_loop_is_silent_is_no_answer(store):
    beat(store, 7)  # it beat before, then its loop stopped: the store's thread still answers
    t0 = time.monotonic()
    assert not stop.ask(opener(store), SEAL, "SIGTERM", 1, timeout_s=1.0)
    assert 1.0 <= time.monotonic() - t0 < 3.0
    assert store.check([stop.REQUEST_KEY])  # the request itself did go through


def test_a_beat_after_the_request_is_the_answer(store):
    beat(store, 7)
    t = threading.Timer(0.3, beat, args=(store, 8))
    t.start()
    t0 = time.monotonic()
    assert stop.ask(opener(store), SEAL, "SIGTERM", 1, timeout_s=5.0)
    assert time.monotonic() - t0 < 2.0
    t.join()


def test_a_stop_the_loop_took_is_the_answer_once_it_beats_no_more(store):
    # (the coordinator stops beating once it stops the job: the flag answers instead)
    store.set(Keys.STOP_TAKEN, SEAL.wrap(Keys.STOP_TAKEN, "1"))
    assert stop.ask(opener(store), SEAL, "SIGTERM", 1, timeout_s=5.0)


def test_forged_answers_are_none(store):
    store.set(Keys.STOP_TAKEN, "1")  # not sealed by the job
    beat(store, 7)
    threading.Timer(0.2, store.set, args=(Keys.COORD_HB, "99")).start()  # nor this beat
    assert not stop.ask(opener(store), SEAL, "SIGTERM", 1, timeout_s=1.0)


def test_the_wait_covers_three_of_the_coordinators_beats():
    ft = {"heartbeat_interval_s": 0.05, "coordinator_timeout_s": 10.0}
    assert stop.ask_timeout_s(ft) == stop.ASK_TIMEOUT_S
    assert stop.ask_timeout_s({**ft, "coordinator_timeout_s": 200.0}) == 30.0
