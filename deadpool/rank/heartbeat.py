"""A process's heartbeat thread: proof of life for the coordinator, fences, coordinator loss.

Writes ``hb/<slot>`` (beat count + the training thread's progress, see watchdog.py, sealed with
the job's secret) every interval, SIGKILLs its own process when the coordinator fenced it, and
watches the coordinator's own heartbeat (``coord/hb``, sealed, a count that must increase).
"""

from __future__ import annotations

import os
import signal
import threading
import time

from deadpool.rank.watchdog import Progress
from deadpool.store import auth
from deadpool.store.protocol import Keys, Seal


class Heartbeat(threading.Thread):
    """Writes ``hb/<slot>`` (beat count + the training thread's progress, see watchdog.py) every
    interval, honours fences, and watches the coordinator's own heartbeat.

    Store errors never stop it: it reconnects on the next beat. If the coordinator's heartbeat
    has not advanced (or the store has been unreachable) for ``coordinator_timeout_s`` on this
    process's own clock, it sets ``coordinator_lost``; the training thread then saves what it
    holds and exits (see ``Worker.save_and_exit``).
    """

    def __init__(self, open_store, slot: int, interval_s: float, coordinator_timeout_s: float,
                 progress: Progress, seal: Seal):
        super().__init__(name="heartbeat", daemon=True)
        self.open_store = open_store
        self.slot = slot
        self.key = Keys.heartbeat(slot)
        self.interval_s = interval_s
        self.coordinator_timeout_s = coordinator_timeout_s
        self.progress = progress
        self.seal = seal
        self.coordinator_lost = threading.Event()
        self.stopped = threading.Event()  # stop(): a process going on without beating (tests)
        self.seen_coordinator = False
        self.store = self._first_store()
        self.beat()  # the coordinator reads every process's heartbeat from the start

    def _first_store(self):
        """The first connection, tried again until ``coordinator_timeout_s``: each try is bounded
        like a reconnect (``open_store``: 2 s in a worker), and a coordinator's store that many
        processes connect to at once, on loaded cores, took longer than that to answer one (a
        worker then crashed at its start). Not answering for ``coordinator_timeout_s`` is what
        counts as the coordinator lost later on too."""
        deadline = time.monotonic() + self.coordinator_timeout_s
        while True:
            try:
                return self.open_store()
            except Exception:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def beat(self, n: int = 0) -> None:
        # sealed: a process without the job's secret cannot keep a dead slot alive; the count
        # only increases, so a replayed older beat is refused (liveness.Liveness)
        self.store.set(self.key, self.seal.wrap(self.key, f"{n} {self.progress.encode()}"))

    def run(self):
        fence = Keys.fence(self.slot)
        n, last_coord, t_coord = 0, -1, time.monotonic()
        seen = False  # the coordinator's key exists (then it always does: one round trip, not two)
        while not self.stopped.is_set():
            n += 1
            try:
                if self.store is None:
                    self.store = self.open_store()
                self.beat(n)
                # a process the coordinator declared dead must not come back (e.g. after SIGCONT);
                # checked every 4th beat: store round trips share the cores with training
                if n % 4 == 1 and self.store.check([fence]) and self._sealed(fence):
                    os.kill(os.getpid(), signal.SIGKILL)
                coord = self.seal.count(self.store, Keys.COORD_HB, exists=seen)
                seen = seen or coord >= 0
                if coord > last_coord:  # an older (replayed) beat is no news
                    last_coord, t_coord = coord, time.monotonic()
                    self.seen_coordinator = True
            except Exception:  # a store hiccup, or the coordinator is gone: retry next beat
                self.store = None
            if time.monotonic() - t_coord > self.coordinator_timeout_s:
                self.coordinator_lost.set()
            self.stopped.wait(self.interval_s)

    def stop(self) -> None:
        self.stopped.set()
        self.join()

    def _sealed(self, key: str) -> bool:
        try:
            self.seal.unwrap(key, self.store.get(key))
            return True
        except auth.AuthError:
            return False
