"""Stopping a job on a signal: walltime, preemption and Ctrl-C.

SIGTERM, SIGUSR1 or SIGINT to the coordinator's process (``python -m deadpool.train``), or to a
node agent (srun forwards a job's signals to its tasks), stops training at once and ends the job
with the newest step every rank can reach from memory written to disk, saying how to resume::

    the coordinator's process   ``Stopper.install`` (``train.run``): the first signal sets the
                                request and wakes the coordinator's loop; a second one (Ctrl-C
                                twice) stops hard: the job's local processes are SIGKILLed and
                                nothing more is written
    a node agent                ``install_agent``: a sealed ``job/stop_request`` to the
                                coordinator, then the agent lives on until its processes have
                                written and left (bounded); with the store unreachable its ranks
                                write what they hold themselves (the coordinator-loss path); a
                                second signal SIGKILLs its processes and ends it
    the coordinator's loop      ``recovery.preempt.due``: abort, collect, plan, write, stop, within
                                ``ft.stop_timeout_s`` of the request

The next run resumes with ``ft.resume_from=auto`` in the same run directory (the newest complete
checkpoint under ``ft.checkpoint_dir``: ``checkpoint.resolve_resume``), so ``sbatch --requeue``
works. Exit status of a stopped ``deadpool.train``: 128 + the signal's number.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

from deadpool.launch.procs import sigkill
from deadpool.recovery.detect import forged
from deadpool.store.protocol import Keys, coordinator_beat_s, wake_coordinator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
REQUEST_KEY = "job/stop_request"  # sealed: an agent's signal ({"signal", "node"})
REQUEST_HINT = "job/num_stop_requests"  # a wake-up hint (unsealed: it only says where to look)
POLL_S = 0.05  # the coordinator reads the agents' request hint at most this often
ASK_TIMEOUT_S = 5.0  # an agent's request unanswered this long: the coordinator is unreachable
LEAVE_GRACE_S = 3.0  # an agent whose processes are gone ends this long after, whatever it waits on


class HardStop(BaseException):
    """A second signal: the job ends now, its local processes SIGKILLed. A ``BaseException`` so
    that no ``except Exception`` on the way out of the coordinator's loop swallows it."""


def _say(text: str) -> None:
    """Print from a signal handler: a handler may interrupt a ``print`` of the same thread, and
    a reentrant write to the same buffered stream raises; a raw write to stderr does not."""
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass


def kill_local(launcher) -> None:
    """SIGKILL every process of the job this process started: the node agents (their children
    die with them, ``PR_SET_PDEATHSIG``) or the workers of the local launcher. Under srun there
    are none: the agents' ranks then take the coordinator-loss path."""
    if launcher is None:
        return
    for p in [*getattr(launcher, "agents", {}).values(), *getattr(launcher, "procs", {}).values()]:
        sigkill(p)


class Stopper:
    """A request to stop the job, from a signal to this process (``install``) or from a node
    agent's sealed request (``poll_agents``). ``job._launch`` sets ``launcher`` (what a hard stop
    kills), ``waker`` (the coordinator's ``WakeListener``: a request wakes its loop) and
    ``running`` (inside ``Coordinator.run``, which a hard stop unwinds)."""

    def __init__(self):
        self.why: str | None = None  # who asked: "SIGTERM", "SIGTERM to node 1's agent"
        self.signum: int | None = None
        self.t: float | None = None  # when the request arrived (time.time(), for records)
        self.t_mono: float | None = None  # the same on the monotonic clock (for deadlines)
        self.hard = False
        self.taken = False  # the coordinator's loop took it (``recovery.preempt.requested``)
        self.launcher = None
        self.waker = None
        self.running = False
        self._hint = 0
        self._polled = -1e9
        self._old: dict = {}

    def install(self) -> "Stopper":
        """Handle ``STOP_SIGNALS`` in this process (the main thread only: elsewhere nothing is
        installed and the signals keep their handlers)."""
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._old[s] = signal.signal(s, self._on_signal)
        return self

    def restore(self) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old = {}

    def request(self, why: str, signum: int | None) -> bool:
        """Ask for the stop; False if one was asked already."""
        if self.why is not None:
            return False
        self.why, self.signum = why, signum
        self.t, self.t_mono = time.time(), time.monotonic()
        if self.waker is not None:
            self.waker.woken.set()
        return True

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.request(name, signum):
            _say(f"[deadpool] {name}: stopping; the newest step in memory goes to disk "
                 f"(send {name} again to stop at once)")
            return
        self.hard = True
        kill_local(self.launcher)
        if self.running:
            self.running = False
            what = f"{name} twice" if self.why == name else f"{self.why}, then {name}"
            raise HardStop(f"{what}: stopped at once, every process of the job killed")

    def poll_agents(self, coord) -> None:
        """An agent's sealed request, once its hint moved: one counter read per loop turn, at
        most one per ``POLL_S`` (the start-up wait turns every 10 ms)."""
        now = time.monotonic()
        if now - self._polled < POLL_S:
            return
        self._polled = now
        n = coord.counter(REQUEST_HINT)
        if n == self._hint:
            return
        self._hint = n
        if not coord.store.check([REQUEST_KEY]):
            return
        text = coord.seal.open(REQUEST_KEY, coord.store.get(REQUEST_KEY))
        if text is None:
            forged(coord, "stop request")
            return
        req = json.loads(text)
        self.request(f"{req['signal']} to node {req['node']}'s agent",
                     int(getattr(signal, req["signal"], 0)) or None)


def request(store, seal, signal_name: str, node: int) -> None:
    """A node agent asks the coordinator to stop the job: the sealed request, then its hint and
    a wake-up (``protocol.wake_coordinator``)."""
    text = json.dumps({"signal": signal_name, "node": node})
    store.set(REQUEST_KEY, seal.wrap(REQUEST_KEY, text))
    store.add(REQUEST_HINT, 1)
    wake_coordinator(store)


def ask(open_store, seal, signal_name: str, node: int, timeout_s: float) -> bool:
    """Send the stop request and wait, within ``timeout_s``, for the coordinator's answer: its
    loop took a stop (``job/stop_taken``) or is alive after the request (its heartbeat advances,
    ``Observer._beat``, which beats only while the loop turns: a recovery in progress takes the
    request when it ends). A store that took the request is not enough: SIGSTOP reaches a
    multi-threaded process one thread at a time (the thread the kernel woke first stops the
    others), so on a loaded host the store's thread can still answer a request the stopped loop
    never reads. Blocks until the store answers: run it on a thread of its own
    (``install_agent``)."""
    deadline = time.monotonic() + timeout_s
    store = open_store(timeout_s=timeout_s)
    request(store, seal, signal_name, node)
    first = seal.count(store, Keys.COORD_HB)
    while time.monotonic() < deadline:
        if seal.flag(store, Keys.STOP_TAKEN) or seal.count(store, Keys.COORD_HB) > first:
            return True
        time.sleep(0.05)
    return False


def ask_timeout_s(ft) -> float:
    """How long an agent waits for the coordinator to answer its request: ``ASK_TIMEOUT_S``, or
    three of the coordinator's beats where they are slower (``protocol.coordinator_beat_s``)."""
    return max(ASK_TIMEOUT_S, 3 * coordinator_beat_s(ft))


def install_agent(node: int, open_store, seal, procs: dict, coordinator_lost,
                  ended: threading.Event, leave, timeout_s: float, ask_s: float) -> None:
    """A node agent's answer to ``STOP_SIGNALS`` (call from the main thread, after its children
    are forked). The first signal asks the coordinator to stop the job with a fresh store client
    (``ask``); if the coordinator does not answer within ``ask_s``, ``coordinator_lost()`` has
    the node's ranks write what they hold now. Either way the agent ends with its processes:
    those not gone ``timeout_s`` after the signal are SIGKILLed, and once all are gone the
    agent's main loop must end (``ended``) within ``LEAVE_GRACE_S``, else ``leave()`` ends the
    agent (its main thread is then inside a store call to an unreachable coordinator). A second
    signal SIGKILLs them at once and ends the agent (128 + its number).

    Signals are read from a wake-up pipe (``signal.set_wakeup_fd``) by a thread of their own, not
    acted on in a Python handler: Python runs handlers in the main thread between bytecodes, and
    the agent's main thread may sit in a store call for a minute when the coordinator's host is
    stopped or cut off, which is when the node must act without it."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    for s in STOP_SIGNALS:
        signal.signal(s, lambda signum, frame: None)  # caught, not fatal: acted on by ``watch``
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)

    def send(name: str, sent: threading.Event) -> None:
        try:
            if ask(open_store, seal, name, node, ask_s):
                sent.set()
        except Exception:
            pass

    def stop(name: str) -> None:
        # on a thread of its own, waited for with a bound: a store client connecting to a
        # stopped coordinator's port blocks past its own timeout (torch 2.13, libuv client)
        t0, sent = time.monotonic(), threading.Event()
        threading.Thread(target=send, args=(name, sent), daemon=True, name="stop-send").start()
        if sent.wait(ask_s):
            print(f"[agent {node}] {name}: asked the coordinator to write the newest step in "
                  "memory and stop the job", flush=True)
        else:
            print(f"[agent {node}] {name}: the coordinator does not answer within "
                  f"{ask_s:.0f} s; the node's ranks write what they hold", flush=True)
            coordinator_lost()
        while any(p.poll() is None for p in list(procs.values())):
            if time.monotonic() - t0 > timeout_s:
                print(f"[agent {node}] its processes did not leave within {timeout_s:.0f} s of "
                      f"{name}: killing them", flush=True)
                for p in list(procs.values()):
                    sigkill(p)
                break
            time.sleep(0.05)
        if not ended.wait(LEAVE_GRACE_S):
            print(f"[agent {node}] its processes are gone; leaving without the coordinator",
                  flush=True)
            leave()

    def watch() -> None:
        first = None
        while True:
            signum = os.read(r, 1)[0]
            if signum not in STOP_SIGNALS:
                continue
            name = signal.Signals(signum).name
            if first is None:
                first = name
                threading.Thread(target=stop, args=(name,), daemon=True,
                                 name="stop-request").start()
                continue
            for p in list(procs.values()):
                sigkill(p)
            print(f"[agent {node}] {name} again: its processes killed", flush=True)
            os._exit(128 + signum)

    threading.Thread(target=watch, daemon=True, name="stop-signals").start()
