"""Stragglers: a rank whose own compute is slower than its peers', found at the coordinator.

A synchronous job runs at the pace of its slowest rank, so a throttled GPU or a host with a
noisy neighbour slows every rank; the others only show it as time spent waiting. Each rank
therefore measures its **own compute time** per step: the step's wall time minus the time its
training thread spent waiting on peers (``watchdog.Progress.waited_s``: the phases in
``PEER_WAIT``, a TP all-reduce or a pipeline receive inside a compute phase included). A slow rank
keeps its compute time; its peers lose theirs to waiting on it. On a CPU device the training
thread's own CPU time is taken instead (``time.thread_time``, plus a ``slow`` fault's sleep):
wall time counts the time a process waits for a core, which on an oversubscribed host (the tests'
2 cores for 5 processes) looked like a straggler. Partial: on CUDA the host's wall time less its
waits is a rank's compute only where the host waits for the device (its syncs), not yet per
kernel (CUDA events would be).

How it travels (no store request of its own)::

    rank         ComputeClock: after every step, one board word (``pack_compute``): the step and
                 the *smallest* compute time of its last ``ft.straggler.steps`` steps
    node agent   copies its ranks' words into its sealed node record (``agent.node``, ``cmp``),
                 written every ``ft.agent_interval_s`` anyway
    coordinator  ``liveness.NodeLiveness.compute`` -> ``StragglerDetector.observe`` (O(ranks) of
                 arithmetic per record read, O(nodes) store reads, as before)

The rule (``StragglerDetector``): rank r is slow in a record when the smallest compute time of
its last ``steps`` steps exceeds the median of the same figure over its **peers in the same
pipeline stage position** by more than ``threshold`` (a fraction) and by at least
``min_excess_s``; it is a straggler when it was slow in every record read over ``steps`` more
steps (two disjoint windows). The window minimum makes it "slower on every one of the steps":
one slow step (jitter, a snapshot copy, a garbage collection) cannot flag a rank, and the second
window keeps a run of unlucky steps (a core shared with another process) from doing it. Comparing within a stage
position keeps a pipeline's first and last stages (embedding, head and loss) from being
compared with the middle ones. Samples are ignored until ``skip_steps`` steps after the job's
start and after every recovery or migration plus the window (the first steps of a generation
build caches and warm up; a spare's first step is slow by nature).

What the coordinator does with one (``recovery.migrate``): migrates it to a free warm spare, else
logs it once.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

_US_BITS = 32
PAUSED = (1 << _US_BITS) - 1  # the low bits of a word whose rank holds at a migration's pause


def pack_compute(step: int, compute_s: float) -> int:
    """(step, compute time) in one positive 64-bit board word (0 means "none yet")."""
    us = min(int(compute_s * 1e6), PAUSED - 1)
    return (max(step, 0) << _US_BITS) | max(us, 1)


def pack_paused(step: int) -> int:
    return (max(step, 0) << _US_BITS) | PAUSED


def unpack_compute(word: int) -> tuple[int, float | None]:
    """(step, compute seconds), or (step, None) for a rank holding at a pause."""
    us = word & PAUSED
    return word >> _US_BITS, None if us == PAUSED else us / 1e6


def settings(ft: dict) -> dict:
    """``ft.straggler`` with its defaults (conf/ft/default.yaml documents them)."""
    d = {"enabled": True, "threshold": 0.3, "steps": 5, "skip_steps": 10, "min_excess_s": 0.005,
         "action": "migrate"}
    d.update(ft.get("straggler") or {})
    return d


class ComputeClock:
    """Rank side: ``begin`` at the top of a step, ``end`` after it; ``end`` returns the step's
    compute time (into the metrics: ``last_s``) and publishes the window's minimum on the node's
    board (under a node agent; without one nothing is published)."""

    def __init__(self, progress, steps: int = 5, cpu: bool = False):
        self.progress, self.cpu = progress, cpu
        self.window: deque[float] = deque(maxlen=max(1, int(steps)))
        self._t0 = self._w0 = 0.0
        self.last_s: float | None = None
        self.generation, self.link = -1, None

    @classmethod
    def of(cls, cfg: dict, progress) -> "ComputeClock":
        """A rank's clock as the job's config asks (``ft.straggler.steps``, the device)."""
        return cls(progress, settings(cfg["ft"])["steps"], cpu=cfg["device"] == "cpu")

    def begin(self, comm, delay_s: float = 0.0) -> None:
        """``delay_s``: a ``slow`` fault's sleep (faults.py), counted as this step's compute."""
        if comm.topo.generation != self.generation:  # a new generation: its first steps are
            self.generation, self.link = comm.topo.generation, getattr(comm, "link", None)
            self.window.clear()  # not compared with the old ones
        self._t0, self._w0 = time.perf_counter(), self.progress.waited_s
        self._c0, self._delay = time.thread_time(), delay_s
        if delay_s:
            time.sleep(delay_s)

    def end(self, step: int) -> float:
        if self.cpu:  # the thread's own CPU time, waits excluded by nature, plus a slow fault
            compute = time.thread_time() - self._c0 + self._delay
        else:
            dt = time.perf_counter() - self._t0
            compute = max(0.0, dt - (self.progress.waited_s - self._w0))
        self.last_s = compute
        self.window.append(compute)
        if self.link is not None and len(self.window) == self.window.maxlen:
            self.link.board.set_compute(self.link.index, pack_compute(step, min(self.window)))
        return compute


class StragglerDetector:
    """Coordinator side, pure: ``observe`` the ranks' newest words, get the stragglers."""

    def __init__(self, threshold: float = 0.3, steps: int = 5, skip_steps: int = 10,
                 min_excess_s: float = 0.005):
        self.threshold, self.steps = float(threshold), int(steps)
        self.skip_steps, self.min_excess_s = int(skip_steps), float(min_excess_s)
        self.quiet_until = self.skip_steps + self.steps  # no sample of an earlier step counts
        self.reported: set[int] = set()  # ranks already named (reported once)
        self.since: dict[int, int] = {}  # rank -> the first step of its current slow windows

    def restarted(self, step: int) -> None:
        """A recovery or migration resumed at ``step``: its first steps are not compared."""
        self.quiet_until = max(self.quiet_until, step + self.skip_steps + self.steps)
        self.reported.clear()
        self.since.clear()

    def observe(self, words: dict[int, int], position: dict[int, int]) -> list[int]:
        """``words``: rank -> its board word; ``position``: rank -> its pipeline stage. Returns
        the ranks newly found slow (each once until the next ``restarted``)."""
        by_pos: dict[int, dict[int, float]] = {}
        for r, w in words.items():
            step, c = unpack_compute(w)
            if c is not None and w > 0 and step >= self.quiet_until:
                by_pos.setdefault(position[r], {})[r] = c
        found = []
        for group in by_pos.values():
            for r, c in sorted(group.items()):
                peers = [v for q, v in group.items() if q != r]
                if not peers or r in self.reported:
                    continue
                med = statistics.median(peers)
                step = unpack_compute(words[r])[0]
                if not (c > med * (1 + self.threshold) and c - med >= self.min_excess_s):
                    self.since.pop(r, None)
                elif step - self.since.setdefault(r, step) >= self.steps:
                    found.append(r)  # two disjoint windows, every sample between them slow
        self.reported.update(found)
        return found
