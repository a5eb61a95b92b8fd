"""The training job as one SimPy process; strategies subclass it.

The job's life is: recover (if needed) -> compute until something happens -> ... A compute
segment is a single wait that only a failure (or a pool arrival the job asked for) ends, so
the event count grows with failures, not with training steps; progress and periodic
checkpoints inside a segment are computed in closed form when it ends (``sim.schedule``).

Progress ``W`` is kept work in nominal seconds (what a full-width, overhead-free job would
have done in that time). Throughput factors (``factors``: bucket -> fraction of nominal) turn
run time into progress; the lost fraction of each factor is booked to its badput bucket, so
the ledger always sums to the wall time.

Silent data corruption: the cluster calls ``corrupted(node)`` when a node starts corrupting
state (the job records its progress then, in ``poison``) and delivers the ``Fault`` only when
the corruption is noticed (``detect_sdc_s`` later). Every snapshot or checkpoint taken in
between is poisoned: a strategy must restore from state at progress ``<= poison[node]``.

Strategies must implement ``on_interrupt(cause)`` (called with the segment already closed;
set ``self.recovering`` to get ``recover()`` run) and ``recover()`` (a generator built from
``phase``, ``wait_for_pool`` and the group helpers). ``recover()`` may be interrupted at any
yield; it is then re-entered from the top and must be written so that re-entry redoes only
what is still pending.
"""

from __future__ import annotations

import math

import simpy

from sim import costs
from sim.cluster import Cluster, Corrupt, NodesAvailable
from sim.layout import Layout
from sim.ledger import Ledger
from sim.schedule import Checkpoints


class Job:
    """Base job: segment and phase accounting, waiting for pool nodes, DP-group shrink/regrow."""

    def __init__(self, env: simpy.Environment, cluster: Cluster, layout: Layout, ledger: Ledger,
                 detection: costs.Detection):
        self.env, self.cluster, self.layout, self.ledger = env, cluster, layout, ledger
        self.W = 0.0  # kept progress, nominal seconds
        self.ckpt: Checkpoints | None = None
        self.factors: dict[str, float] = {}  # bucket -> throughput factor, applied in order
        self.recovering = False
        self.background_need = 0  # pool size at which a computing job wants to be interrupted
        self.mem_floor = 0.0  # progress of the state restored by the last recovery
        self.vacant: set[int] = set()  # slots that lost their node and need one
        self.detect_pending = False  # an unexpected failure has not been detected yet
        self.detect_s = 0.0  # detection time of the pending failures (by cause, sim.costs)
        self.detection_costs = detection
        self.poison: dict[int, float] = {}  # corrupting node -> progress when it began
        npg = layout.nodes_per_group
        self.group_active = [True] * layout.num_groups
        self.active_groups = layout.num_groups
        self._npg = npg
        # throughput at a reduced data-parallel width, global batch kept (sim.costs.WidthScaling)
        self.width = costs.WidthScaling()
        self._seg_t0: float | None = None
        self.progress_log: list[tuple[float, float]] | None = None  # (time, W) points when set to a list
        self._phase: tuple[str, float] | None = None
        self._wake: simpy.Event | None = None
        self._need = 0
        self._grow_sent = False
        self._stalled = False
        cluster.listener = self._pool_changed
        self.proc = env.process(self.run())
        cluster.job_proc = self.proc
        cluster.job = self

    # -- strategy interface -----------------------------------------------------------------
    def on_interrupt(self, cause) -> None:
        raise NotImplementedError

    def recover(self):
        raise NotImplementedError
        yield  # pragma: no cover

    # -- main loop --------------------------------------------------------------------------
    def run(self):
        while True:
            try:
                if self.recovering:
                    yield from self.recover()
                    self.recovering = False
                self._seg_t0 = self.env.now
                self._log()
                yield self.env.event()  # compute until interrupted or the window closes
            except simpy.Interrupt as irq:
                self._seg_close()
                if isinstance(irq.cause, Corrupt):
                    self.poison.setdefault(irq.cause.node, self.W)
                    continue
                if isinstance(irq.cause, NodesAvailable):
                    self._grow_sent = False
                self.on_interrupt(irq.cause)

    def corrupted(self, node: int) -> None:
        """Node ``node`` starts corrupting state now. While computing, the segment is closed (one
        interrupt) to learn the progress; otherwise progress is standing still."""
        if self._seg_t0 is not None and self.env.active_process is not self.proc:
            self.proc.interrupt(Corrupt(node))
        else:
            self.poison.setdefault(node, self.W)

    def note_failure(self, cause) -> None:
        """An unexpected failure: its detection time (by cause, the same for every strategy) is
        still to be spent. A second failure before the first is detected restarts the wait with
        the longer of the two."""
        s = self.detection_costs.seconds(cause.kind, cause.cause)
        self.detect_s = max(self.detect_s, s) if self.detect_pending else s
        self.detect_pending = True

    @property
    def rate(self) -> float:
        r = 1.0
        for f in self.factors.values():
            r *= f
        return r

    def _seg_close(self) -> None:
        if self._seg_t0 is None:
            return
        dt = self.env.now - self._seg_t0
        r = self.rate
        if self.ckpt is not None:
            w1, stall = self.ckpt.advance(self._seg_t0, self.W, dt, r)
        else:
            w1, stall = self.W + r * dt, 0.0
        self.ledger.add("ckpt_stall", stall)
        rem = dt - stall
        for bucket, f in self.factors.items():
            self.ledger.add(bucket, rem * (1.0 - f))
            rem *= f
        self.W = w1
        self._seg_t0 = None
        self._log()

    def _log(self) -> None:
        """Record (time, progress) for a timeline (``progress_log``): at every segment's start and
        end and after every rollback; progress is linear in between while computing."""
        if self.progress_log is not None:
            self.progress_log.append((self.env.now, self.W))

    def finalize(self) -> None:
        """Close the books at the end of the window (the process is left suspended)."""
        self._seg_close()
        if self._phase is not None:
            bucket, t0 = self._phase
            self.ledger.add(bucket, self.env.now - t0)
            self._phase = None

    # -- helpers for recover() --------------------------------------------------------------
    def detection(self):
        """Spend the detection time of the pending unexpected failures, once (badput: detection)."""
        if self.detect_pending:
            yield from self.phase("detection", self.detect_s)
            self.detect_pending = False

    def phase(self, bucket: str, seconds: float):
        """Spend ``seconds`` in badput ``bucket``; an interrupt books the elapsed part."""
        if seconds <= 0:
            return
        t0 = self.env.now
        self._phase = (bucket, t0)
        try:
            yield self.env.timeout(seconds)
        except simpy.Interrupt:
            self.ledger.add(bucket, self.env.now - t0)
            self._phase = None
            raise
        self.ledger.add(bucket, seconds)
        self._phase = None

    def compute_for(self, seconds: float):
        """Train at the current rate for ``seconds`` inside ``recover()`` (while something runs in
        the background, e.g. a replacement's state transfer). An interrupt closes the segment in
        ``run`` and re-enters ``recover()``, which must then redo what is still pending."""
        if seconds <= 0:
            return
        self.background_need = 0  # no pool interrupts meanwhile
        self._seg_t0 = self.env.now
        yield self.env.timeout(seconds)
        self._seg_close()

    def wait_for_pool(self, n: int):
        """Block until the pool holds at least ``n`` nodes (badput: wait_spare)."""
        if self.cluster.pool_size() >= n:
            self._stalled = False
            return
        if not self._stalled:  # a failure that interrupts the wait does not start a new stall
            self.ledger.count("stalls")
            self._stalled = True
        t0 = self.env.now
        self._phase = ("wait_spare", t0)
        try:
            while self.cluster.pool_size() < n:
                self._need = n
                self._wake = self.env.event()
                yield self._wake
                self._wake = None
        except simpy.Interrupt:
            self._wake = None
            self.ledger.add("wait_spare", self.env.now - t0)
            self._phase = None
            raise
        self.ledger.add("wait_spare", self.env.now - t0)
        self._phase = None
        self._stalled = False

    def fill_vacant(self):
        """Give every vacant slot a pool node, waiting when the pool is empty."""
        for slot in sorted(self.vacant):
            yield from self.wait_for_pool(1)
            self.cluster.assign(slot, self.cluster.take())
            self.vacant.discard(slot)

    def rollback_to(self, w: float) -> None:
        """Discard progress above ``w`` (booked as lost work). A node still corrupting state
        corrupts it again from ``w`` on."""
        if w < self.W:
            self.ledger.add("lost", self.W - w)
            self.W = w
            self._log()
            for n, pw in self.poison.items():
                self.poison[n] = min(pw, w)

    def memory_marks(self, interval_w: float, lag_s: float, generations: int = 1) -> list[float]:
        """Progress of the in-memory snapshots a buddy holds now, newest first: taken every
        ``interval_w`` of progress, usable ``lag_s`` after they are taken (at the current rate,
        so a lag of several intervals reaches several snapshots back), at most ``generations``
        of them, never below ``mem_floor`` (the state the last recovery restored, which every
        survivor and the buddy hold)."""
        usable = self.W - lag_s * self.rate
        m = math.floor((usable + 1e-9) / interval_w) * interval_w
        marks = []
        while len(marks) < generations and m > self.mem_floor + 1e-9:
            marks.append(m)
            m -= interval_w
        if len(marks) < generations or not marks:
            marks.append(min(self.mem_floor, self.W))
        return marks

    def lost_since_snapshot(self, interval_w: float, lag_s: float) -> float:
        """Progress since the newest replicated in-memory snapshot (see ``memory_marks``)."""
        return max(self.W - self.memory_marks(interval_w, lag_s)[0], 0.0)

    # -- data-parallel groups (shrink / regrow) ---------------------------------------------
    def group_of(self, slot: int) -> int:
        return slot // self._npg

    def group_slots(self, g: int) -> range:
        return range(g * self._npg, (g + 1) * self._npg)

    def dissolve(self, g: int) -> None:
        """Drop DP group ``g``: its healthy nodes join the pool, throughput shrinks."""
        self.group_active[g] = False
        self.active_groups -= 1
        for s in self.group_slots(g):
            self.vacant.discard(s)
            self.cluster.release(s)
        self.ledger.count("shrinks")
        self._set_width()

    def regrow_one(self) -> None:
        """Re-form the first dropped group from pool nodes. Must have ``pool >= nodes_per_group``."""
        g = self.group_active.index(False)
        for s in self.group_slots(g):
            self.cluster.assign(s, self.cluster.take())
        self.group_active[g] = True
        self.active_groups += 1
        self.ledger.count("regrows")
        self._set_width()

    def can_regrow(self) -> bool:
        return self.active_groups < len(self.group_active) and self.cluster.pool_size() >= self._npg

    def _set_width(self) -> None:
        self.factors["degraded"] = self.width.speed(self.active_groups / len(self.group_active))

    # -- pool notifications -----------------------------------------------------------------
    def _pool_changed(self) -> None:
        if self.env.active_process is self.proc:
            return  # the job itself released nodes; it re-checks the pool before computing
        n = self.cluster.pool_size()
        if self._wake is not None:
            if n >= self._need and not self._wake.triggered:
                self._wake.succeed()
        elif (self._seg_t0 is not None and self.background_need and n >= self.background_need
              and not self._grow_sent):
            self._grow_sent = True
            self.proc.interrupt(NodesAvailable())
