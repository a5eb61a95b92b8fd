"""Pushed control events: the coordinator appends, every node agent follows in order.

The coordinator writes ``ev/<i>`` (sealed JSON, i = 0, 1, 2, ...) for each decision the nodes
must act on at once::

    {"kind": "abort", "g": g}          generation g failed: ranks leave their waits (with
                                       "slots": [...], also the fence of those slots)
    {"kind": "plan", "g": g}           plan g is written (``plan/<g>``)
    {"kind": "fence", "slots": [...]}  SIGKILL these processes: declared dead, never to return
    {"kind": "done"} / {"kind": "stop"}

An agent waits for the next event with a blocking ``get`` on its own connection (the store
answers when the key is set: one request per event, no polling, no store work while nothing
happens), acts, and waits for the next. A wait that times out (nothing happened for
``wait_s``) is retried on a fresh connection: after a timeout the old one may still receive the
late answer.

The other direction is a wake-up only: whoever bumps a hint the coordinator's loop must act on at
once (an agent after a local process exited, a rank after a broken collective) then sets
``coord/wake``; the coordinator's ``WakeListener`` is blocked on that key, so its loop sleeps
until woken or until its next timed duty (reading the node records every half agent interval)
instead of turning every 10 ms.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

from deadpool.store.protocol import Keys, Seal, wake_coordinator


def event_key(i: int) -> str:
    return f"ev/{i}"


class EventLog:
    """Coordinator side: append events (thread-safe; the store client must be too)."""

    def __init__(self, store, seal: Seal):
        self.store, self.seal = store, seal
        self.n = 0
        self._lock = threading.Lock()

    def push(self, kind: str, **data) -> int:
        with self._lock:
            i = self.n
            key = event_key(i)
            self.store.set(key, self.seal.wrap(key, json.dumps(dict(data, kind=kind))))
            self.n += 1
            return i


class EventFollower:
    """Agent side: ``next()`` blocks until event ``i`` exists and returns it (a dict), in order.

    ``open_store()`` makes a fresh store client. A forged event (not sealed by the job) is
    reported with ``on_forged(i)`` and read again until the coordinator's overwrites it."""

    def __init__(self, open_store, seal: Seal, wait_s: float = 30.0, on_forged=None):
        self.open_store, self.seal, self.wait_s = open_store, seal, wait_s
        self.on_forged = on_forged
        self.i = 0
        self.store = None

    def next(self, stop: threading.Event | None = None) -> dict | None:
        """The next event; None if ``stop`` was set meanwhile. Raises the store's error when the
        store is gone (the coordinator died): the caller decides."""
        while stop is None or not stop.is_set():
            key = event_key(self.i)
            if self.store is None:
                self._fresh()
            try:
                raw = self.store.get(key)  # blocks until the key is set: one request per event
            except Exception:
                self.store = None  # a timed-out client may still get the late reply: drop it
                if not self._exists(key):
                    continue
                raw = self.store.get(key)
            text = self.seal.open(key, raw)
            if text is None:  # written by a process without the secret: the real event will
                if self.on_forged is not None:  # overwrite it, so read the same key again
                    self.on_forged(self.i)
                time.sleep(0.01)
                continue
            self.i += 1
            return json.loads(text)
        return None

    def _fresh(self):
        self.store = self.open_store()
        self.store.set_timeout(timedelta(seconds=self.wait_s))  # a blocking get waits this long
        return self.store

    def _exists(self, key: str) -> bool:
        """After a failed wait: is the store there at all (raises if not) and the key set?"""
        return self._fresh().check([key])


class WakeListener:
    """Coordinator side of ``coord/wake``: a thread on its own store connection blocks on the key
    (a blocking ``get``: the store answers when it is set), deletes it and sets an event the loop
    waits on with a timeout (``wait``).

    No wake-up is lost: a writer bumps its hint before setting the key, and the thread deletes
    the key before it sets the event, the loop clears the event before reading the hints; so a
    hint bumped after that read leaves the key set (or the event set) for the next wait, and a
    wake-up seen twice costs one spare turn of the loop. ``open_store()`` makes a fresh client:
    a blocking get holds its connection, so it cannot share the loop's. Its timeout is long (a
    timed-out get logs a warning and needs a fresh connection): the loop's own timeout does the
    periodic work. ``stop`` wakes the thread by setting the key itself and joins it, so no thread
    is left inside the store client when the interpreter exits."""

    def __init__(self, open_store, wait_s: float = 86400.0):
        self.open_store, self.wait_s = open_store, wait_s
        self.woken = threading.Event()
        self.wakeups = 0  # wake-ups seen (tests; the loop's turns are its timeouts plus these)
        self._stop = threading.Event()
        self._store = None
        self._thread = threading.Thread(target=self._listen, name="coordinator-wake", daemon=True)

    def start(self) -> "WakeListener":
        self._store = self.open_store()  # connect before the caller goes on: no wake-up is
        self._store.set_timeout(timedelta(seconds=self.wait_s))  # missed while it connects
        self._thread.start()
        return self

    def wait(self, timeout: float) -> bool:
        """Block until a wake-up or ``timeout`` seconds; True if woken. Clears the wake-up."""
        woken = self.woken.wait(timeout)
        self.woken.clear()
        return woken

    def stop(self, store) -> None:
        """Stop the thread (``store``: any client of the job's store, to set the key with)."""
        self._stop.set()
        if self._thread.is_alive():
            try:
                wake_coordinator(store)
            except Exception:  # the store is gone: so is the thread's connection
                pass
            self._thread.join(timeout=2.0)

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                if self._store is None:
                    self._store = self.open_store()
                    self._store.set_timeout(timedelta(seconds=self.wait_s))
                self._store.get(Keys.COORD_WAKE)
                self._store.delete_key(Keys.COORD_WAKE)
                self.wakeups += 1
            except Exception:  # timed out, or the store went away: a fresh connection, once the
                self._store = None  # loop had a turn (the late answer may still come on the old)
                self._stop.wait(0.1)
            self.woken.set()
