"""A rank's progress: a heartbeat proves a process exists, progress proves it trains.

Each process runs a heartbeat thread (deadpool/rank/heartbeat.py) that writes ``hb/<slot>``
every ``heartbeat_interval_s``::

    "<beat> <progress> <step> <phase>"

``beat`` counts heartbeats and must increase (the value is sealed, see deadpool/store/auth.py, and a
replayed older beat is ignored); ``progress`` counts phase changes of the training thread (forward,
backward, all-reduce, optimizer, each recovery phase...), kept by ``Progress``. This module is the
rank's side: the counter, the phases (which wait on peers, which have nothing to do) and each
phase's progress bound. How the coordinator and the node agents judge the counters (soft and
hard timeouts, a hung thread, a stuck generation) is deadpool/control/liveness.py.
"""

from __future__ import annotations

import time

# waiting for other ranks: a stall here is caused elsewhere
PEER_WAIT = frozenset({"allreduce", "rebuild", "transfer", "snapshot_backpressure", "barrier",
                       "collective"})
# nothing to do: never a stall ("checkpoint", a write to disk, is watched: a writer hung on the
# file system must be found, not waited for)
IDLE = frozenset({"idle", "wait_plan", "wait_done", "start"})
# host parameters drawn per second in a stage's first build, at the slowest seen (a shared host
# drawing fp32 on one thread); the build phase's bound is set from it (``build_phase``)
BUILD_PARAMS_PER_S = 5e6


def bounded(phase: str, seconds: float) -> str:
    """A phase that carries its own progress bound (``name/<seconds>``), for one long operation
    whose length is known from its size: the watchdog allows the larger of it and its own."""
    return f"{phase}/{seconds:.0f}"


def build_phase(stage_params: int, progress_s: float) -> str:
    """The first build's phase: bounded by the stage's size, never counted a hang at 60 s (a
    1.4 B-parameter stage took 70 s to its first step and was once declared hung)."""
    return bounded("build", progress_s + stage_params / BUILD_PARAMS_PER_S)


def phase_bound(phase: str, default_s: float) -> float:
    """The progress bound of ``phase``: its own (``bounded``) when larger, else ``default_s``."""
    _, sep, own = phase.partition("/")
    try:
        return max(default_s, float(own)) if sep else default_s
    except ValueError:
        return default_s


class Progress:
    """The training thread's position, written by it and read by the heartbeat thread.

    ``set`` must be called at every phase boundary of the training thread; it is two attribute
    writes (no lock: the heartbeat reads a possibly one-beat-old but consistent-enough value).
    """

    def __init__(self):
        self.count = 0
        self.step = -1
        self.phase = "start"
        # called with each new step as the training thread enters it (the node board's step
        # word: a process killed mid-step is known to have died in that step, not the last beat's)
        self.on_step = None
        self.waited_s, self._t = 0.0, time.perf_counter()  # seconds in PEER_WAIT phases, total

    def set(self, step: int, phase: str) -> None:
        entered = step != self.step
        t = time.perf_counter()  # (a step's compute time excludes its waits on peers: straggler.py)
        if self.phase in PEER_WAIT:
            self.waited_s += t - self._t
        self._t = t
        self.step, self.phase = step, phase  # first: ``on_step`` and the beat see the new step
        self.count += 1
        if entered and self.on_step is not None:
            self.on_step(step)

    def waiting(self):
        """Context for a wait on peers inside a compute phase (a TP all-reduce in forward, a
        pipeline receive): reported as ``collective`` meanwhile, then the phase again."""
        return _Waiting(self)

    def encode(self) -> str:
        return f"{self.count} {self.step} {self.phase}"


class _Waiting:
    def __init__(self, progress: Progress):
        self.p = progress

    def __enter__(self):
        self.prev = self.p.phase
        self.p.set(self.p.step, "collective")

    def __exit__(self, *exc):
        self.p.set(self.p.step, self.prev)
