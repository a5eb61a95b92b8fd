"""A worker's heartbeat (``rank.heartbeat.Heartbeat``, no node agent) connects to the
coordinator's store when the worker starts. Each try is bounded like a reconnect (2 s), and a
store that many processes reach at once on loaded cores has taken longer than that: the first
connection is tried again until ``coordinator_timeout_s`` rather than crashing the worker."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from deadpool.rank.heartbeat import Heartbeat
from deadpool.rank.watchdog import Progress
from deadpool.store import auth
from deadpool.store.protocol import Keys, Seal

JOB = Seal(auth.new_secret())


class SlowStore:
    """``open_store`` whose first ``fails`` tries time out, as a loaded store's connect does."""

    def __init__(self, fails: int):
        self.fails, self.tries, self.store = fails, 0, dist.HashStore()

    def __call__(self):
        self.tries += 1
        if self.tries <= self.fails:
            raise dist.DistNetworkError("The client socket has timed out after 2000ms")
        return self.store


def test_a_first_connection_that_times_out_is_tried_again():
    opener = SlowStore(fails=2)
    hb = Heartbeat(opener, 3, 0.05, 5.0, Progress(), JOB)
    assert opener.tries == 3
    assert JOB.unwrap(Keys.heartbeat(3), opener.store.get(Keys.heartbeat(3))).split()[0] == "0"


def test_a_store_that_never_answers_fails_the_start_after_the_coordinator_timeout():
    opener = SlowStore(fails=10**6)
    t0 = time.monotonic()
    with pytest.raises(dist.DistNetworkError):
        Heartbeat(opener, 3, 0.05, 0.3, Progress(), JOB)
    assert 0.3 <= time.monotonic() - t0 < 5.0 and opener.tries > 1
