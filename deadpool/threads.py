"""Thread helpers shared by the snapshot engine, the communicator and the checkpoint writer.

- ``lower_thread_priority``: background work (snapshot copies, replication, disk writes) runs at
  a lower CPU priority than the training thread.
- ``run_in_thread``: run a function on a fresh thread (e.g. at that lower priority) and wait.
- ``wait_until``: the one store-polling loop (a condition, a check between polls, a deadline).
"""

from __future__ import annotations

import os
import threading
import time


def lower_thread_priority(nice: int) -> None:
    """Lower the calling thread's CPU priority (Linux: nice applies per thread).

    Snapshot copies, checksums and replication traffic then take the CPU time training leaves
    idle (all-reduce waits, Python overhead) instead of competing with it; threads this thread
    creates (e.g. gloo's I/O threads for the replication group) inherit the lower priority.
    """
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except OSError:
        pass


def run_in_thread(fn, nice: int = 0, name: str = "deadpool-helper") -> None:
    """Run ``fn()`` on a new thread at CPU priority ``nice`` and wait for it; its exception is
    re-raised here. Threads ``fn`` creates inherit the priority."""
    err: list[BaseException] = []

    def run():
        lower_thread_priority(nice)
        try:
            fn()
        except BaseException as e:  # re-raised in the caller
            err.append(e)

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    if err:
        raise err[0]


def wait_until(cond, *, every_s: float, between=None, timeout_s: float | None = None) -> bool:
    """Poll ``cond()`` every ``every_s`` seconds until it holds (True) or ``timeout_s`` passes
    (False). ``between()`` runs after each false poll: an abort check that raises, or a tick
    that tells a watchdog this loop is alive."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not cond():
        if between is not None:
            between()
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True
