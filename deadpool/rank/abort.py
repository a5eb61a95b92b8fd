"""Aborting a generation: how a survivor leaves whatever it waits on within one poll.

Survivors must never sit in a collective until its timeout. One watcher thread per generation
(``start_watcher``) reads the generation's abort key every ``poll_s`` (under a node agent the
node's shared-memory board, ``abort_probe``: no store request until the agent has seen the
pushed abort; else the store) and, once it is set, marks the generation aborted (a local flag: the training thread never asks the store
inside a step) and, on NCCL, aborts every device group of the generation in parallel, a thread
per group. A gloo rank under a node agent has no watcher: its waits already poll, and the board
read they then make themselves costs no more than the flag (a thread that woke 50 times a second
took ~0.005 cores per rank, 1 % of a 4-rank job's CPU on 2 cores). What cannot be polled (a group's rendezvous, point-to-point state transfer) runs in a
helper thread through ``run_abortable``; the calling thread polls the flag and abandons the helper
on abort (abandoned helpers are counted and bounded: ``abandoned_helpers``). Every wait is
bounded by elapsed time (``timeout_s``), never by parsing error text.

``Abortable`` holds these parts of the communicator (``deadpool.rank.comm.Communicator`` extends it:
the watcher, the abort flag, device-group aborts, ``run_abortable``, ``park``); it uses the
communicator's state (``groups``, ``store``, ``keys``, ``_abort_reason``, ...) and its
``report_error``.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref

from deadpool.errors import Aborted, CollectiveError, CoordinatorLost, PassThrough
from deadpool.store.auth import AuthError

# helper threads left running after an abort or a timeout (a rendezvous or NCCL init stuck on a
# dead peer); a process that has this many alive stops taking ranks (``Communicator.build``)
MAX_ABANDONED_HELPERS = 8
_abandoned: list[threading.Thread] = []


# The interpreter is exiting: the abort watchers stop (``_stop_watchers``). A daemon thread still
# inside the store client's C++ code when the interpreter finalizes is unwound there, and the
# process dies with "terminate called without an active exception" (seen at the end of a test
# session whose store server had gone, a watcher polling it). The workers leave with os._exit,
# which runs no atexit hook and finalizes nothing; this is for processes that exit normally.
_exiting = threading.Event()
_watchers: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


@atexit.register
def _stop_watchers(bound_s: float = 2.0) -> None:
    _exiting.set()
    deadline = time.monotonic() + bound_s
    for t in list(_watchers):
        t.join(max(0.0, deadline - time.monotonic()))


def abandoned_helpers() -> int:
    """How many abandoned helper threads of this process are still alive."""
    _abandoned[:] = [t for t in _abandoned if t.is_alive()]
    return len(_abandoned)


class Abortable:
    """The abort side of ``Communicator`` (see the module docstring)."""

    def start_watcher(self) -> threading.Thread:
        """Start the generation's abort watcher: it reads the abort key every ``poll_s`` and, once
        it is set or the generation is parked, marks the generation aborted and aborts its device
        groups. It holds the communicator weakly (a dropped communicator stops it)."""
        ref, parked, lost, poll = weakref.ref(self), self._parked, self.lost, self.poll_s

        def watch():  # holds no strong reference to the communicator between polls
            wait = poll
            while True:
                comm = ref()
                if comm is None or lost.is_set() or _exiting.is_set():
                    return
                if parked.is_set():
                    break
                try:
                    if comm._read_abort_key():
                        break
                    wait = poll
                except Exception:  # a store hiccup: the heartbeat thread decides what it means;
                    wait = min(1.0, 2 * wait)  # meanwhile ask less often
                del comm
                parked.wait(wait)
            comm.abort_device_groups()

        self._watcher = threading.Thread(target=watch, daemon=True,
                                         name=f"abort-watcher-g{self.topo.generation}")
        self._watcher.start()
        _watchers.add(self._watcher)
        return self._watcher

    def _on_device(self, name: str) -> bool:
        """A group of the device backend (replication and transfer groups are gloo)."""
        return self.backend == "nccl" and not name.startswith(("repl", "xfer"))

    def abort_device_groups(self) -> None:
        """Abort every NCCL group of the generation, in parallel (a thread per group: aborts take
        ~1 s each, and serial aborts of stuck communicators can deadlock) and wait for them.
        The generation is marked aborted first, so nothing completing from now on is trusted."""
        with self._lock:
            if self._abort_reason is None:
                self._abort_reason = "the generation was parked"
            todo = [(n, g) for n, g in self.groups.items()
                    if self._on_device(n) and n not in self._aborted_groups]
            self._aborted_groups.update(n for n, _ in todo)
            threads = [threading.Thread(target=self._abort_one, args=(n, g), daemon=True,
                                        name=f"abort-{n}-g{self.topo.generation}") for n, g in todo]
            self._aborting += threads
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout_s)

    def _abort_one(self, name: str, pg) -> None:
        t0 = time.monotonic()
        try:
            pg.abort()
        except Exception:  # already broken: nothing more to free
            pass
        self.abort_s[name] = time.monotonic() - t0

    # -- the abort flag -------------------------------------------------------------------
    def _read_abort_key(self, probe: bool = True) -> bool:
        """Read the abort key (a store request): True, and the generation marked aborted, once
        it holds a message sealed by this job. With ``abort_probe`` (and ``probe``) the store is
        asked only once the node's agent has seen the abort."""
        if self._abort_reason is not None:
            return True
        if probe and self.abort_probe is not None and not self.abort_probe(self.topo.generation):
            return False
        if not self.store.check([self.keys.abort]):
            return False
        try:
            reason = self.seal.unwrap(self.keys.abort, self.store.get(self.keys.abort))
        except AuthError:
            return False  # not written by this job: ignored
        with self._lock:
            if self._abort_reason is None:
                self._abort_reason = reason
        return True

    def aborted(self) -> bool:
        """True once the generation is aborted. With the watcher running this reads a local
        flag only, without it (gloo under a node agent) the board; raises ``CoordinatorLost``
        once the heartbeat has given the coordinator up."""
        if self._abort_reason is not None:
            return True
        if self.lost.is_set():
            raise CoordinatorLost("the coordinator stopped answering")
        return self._watcher is None and self._read_abort_key()

    def raise_if_aborted(self) -> None:
        if self.aborted():
            raise Aborted(self._abort_reason)

    def run_abortable(self, fn, what: str):
        """Run ``fn()`` in a helper thread and return its result, polling the abort flag.

        Raises ``Aborted`` if the generation is aborted first (the helper is abandoned: it may
        finish or fail later, and whatever it writes must be dropped by the caller),
        ``CollectiveError`` if ``fn`` raises or runs past ``timeout_s``. Other exceptions that
        must pass through (e.g. a corrupt transfer) are re-raised unchanged if they subclass
        ``PassThrough``.
        """
        box: dict = {}
        done = threading.Event()

        def run():
            try:
                box["value"] = fn()
            except BaseException as e:  # handed to the caller
                box["error"] = e
            done.set()

        helper = threading.Thread(target=run, name=f"{what}-g{self.topo.generation}", daemon=True)
        helper.start()
        t0 = time.monotonic()
        try:
            while not done.wait(self.poll_s):
                self.raise_if_aborted()
                if time.monotonic() - t0 > self.timeout_s:
                    msg = f"{what} did not finish within {self.timeout_s:.0f} s"
                    self.report_error(msg)
                    raise CollectiveError(msg)
        except BaseException:
            _abandoned.append(helper)
            raise
        err = box.get("error")
        if err is not None:
            if isinstance(err, PassThrough):
                raise err
            if isinstance(err, Aborted):
                raise err
            self.report_error(f"{what} failed: {err}")
            raise CollectiveError(f"{what} failed: {err}") from err
        return box.get("value")

    def park(self) -> None:
        """Called when the generation is over; returns at once. The generation is marked aborted
        and its watcher aborts the device groups (in parallel, off this thread). The caller must
        keep the parked object referenced (the worker does: ``Worker.parked``): its gloo groups
        may have ops in flight (see module doc) until ``release``."""
        with self._lock:
            if self._abort_reason is None:
                self._abort_reason = "the generation was parked"
        self._parked.set()
        if self._watcher is None:
            threading.Thread(target=self.abort_device_groups, daemon=True,
                             name=f"park-g{self.topo.generation}").start()
