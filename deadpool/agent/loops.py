"""The node agent's loops that must outlive any one failure (``agent.__main__`` runs them).

``EventApplier`` applies each pushed event (``agent.events``) to the ``NodeAgent``. An event
must never end the events thread: a node that stops applying events while its record stays fresh
is deaf (a spare there stalls a recovery, its fences are never carried out, and the coordinator
picks it again). So a failing event is retried with a fresh store client, for up to
``give_up_s`` (and ``MIN_TRIES`` tries)::

    event i --apply--> ok ------------------------------------------------> event i+1
               |
               +-- error (store gone, plan unreadable, /dev/shm full) --> log, fresh client,
                   retry the same event ... past give_up_s: NodeAgent.go_deaf (no record,
                   no board beat) and ``on_deaf`` (the agent kills its processes and leaves)

so the node is either following the coordinator or lost to it, never in between. (A plan whose
delta was overwritten or collected is no failure: ``deadpool.store.wire.fetch_plan`` reads the full
form, or jumps to the newest plan.)

``store_reader`` is the thread of the agent's periodic store reads (the coordinator's
heartbeat, the job's step): its own client, so a read that hangs holds up nothing else.
"""

from __future__ import annotations

import time
from datetime import timedelta

RETRY_PAUSE_S = 0.2
MIN_TRIES = 3  # however long one try took (a read that timed out), a few before giving up


class EventApplier:
    def __init__(self, agent, open_store, give_up_s: float, log=print, on_deaf=None,
                 clock=time.monotonic, pause=time.sleep):
        self.agent, self.open_store, self.give_up_s = agent, open_store, give_up_s
        self.log, self.on_deaf = log, on_deaf
        self.clock, self.pause = clock, pause
        self.store = None  # this thread's client for plan fetches (opened when first needed)

    def __call__(self, event: dict) -> bool:
        """Apply ``event``; True once applied, False if the agent gave up (it is deaf now)."""
        t0, tries = self.clock(), 0
        while True:
            try:
                if event["kind"] == "plan" and self.store is None:
                    self.store = self.open_store()
                fetched = self.agent.fetch(event, self.store)
                self.agent.apply(event, fetched)
                if tries:
                    self.log(f"[agent {self.agent.node}] event {event} applied after "
                             f"{tries} failed attempt(s)")
                return True
            except Exception as e:  # any failure: retried, never the end of the thread
                tries += 1
                self.store = None  # a timed-out or broken client: a fresh one next time
                why = f"{type(e).__name__}: {e}"
                if self.clock() - t0 >= self.give_up_s and tries >= MIN_TRIES:
                    self.agent.go_deaf(f"cannot apply event {event}: {why}")
                    self.log(f"[agent {self.agent.node}] cannot apply event {event} for "
                             f"{self.give_up_s:.1f} s ({why}): the node stops its record and "
                             "leaves the job")
                    if self.on_deaf is not None:
                        self.on_deaf(why)
                    return False
                if tries == 1:
                    self.log(f"[agent {self.agent.node}] event {event} failed ({why}); retrying")
                self.pause(RETRY_PAUSE_S)


def store_reader(agent, open_store, stop, timeout_s: float) -> None:
    """Until ``stop``: ``agent.poll_store`` on a client of its own whose reads time out after
    ``timeout_s`` (a failed read drops the client; the agent judges the coordinator's silence
    on its own clock meanwhile, ``NodeAgent.judge_coordinator``)."""
    store = None
    while not stop.is_set():
        try:
            if store is None:
                store = open_store(timeout_s=timeout_s)
                store.set_timeout(timedelta(seconds=timeout_s))
            agent.poll_store(store)
        except ValueError:  # the board was closed: the agent is ending
            return
        except Exception:
            store = None
        stop.wait(agent.coord_every_s / 2)
