"""Periodic checkpoints evaluated lazily, so a compute segment stays one SimPy timeout.

A job that checkpoints every ``interval_w`` seconds of progress does not need an event per
checkpoint: given when a compute segment started, its progress and its rate, the checkpoints
it took and which of them became durable follow in closed form. The pattern after a
segment starts at progress ``w0`` is: compute until the next mark, stall ``stall_s`` (the
write for a synchronous checkpoint, the host snapshot for an asynchronous one), compute
``interval_w`` of progress, stall, ... A checkpoint taken when its stall ends becomes
durable ``persist_lag_s`` later (0 for synchronous writes). A failure during a stall loses
that checkpoint; a failure during a persist cancels it (the failed node held part of it).

With synchronous writes and Poisson failures this is exactly Daly's model (2006): a segment
of ``tau + delta`` must complete uninterrupted, and ``E[T_wall]`` is his closed form.
"""

from __future__ import annotations

import math


class Checkpoints:
    """Lazy periodic checkpoint schedule in progress units (nominal compute seconds)."""

    def __init__(self, interval_w: float, stall_s: float, persist_lag_s: float = 0.0, keep_last: int = 0,
                 keep_every_w: float = 0.0):
        if interval_w <= 0:
            raise ValueError(f"checkpoint interval must be > 0, got {interval_w}")
        self.interval = interval_w
        self.stall = stall_s
        self.lag = persist_lag_s
        # retention (storage does not keep every checkpoint): the newest ``keep_last`` durable ones,
        # and the last one before every multiple of ``keep_every_w`` of progress (0: keep all)
        self.keep_last = int(keep_last)
        self.keep_every = float(keep_every_w)
        self.next_mark = interval_w  # progress at which the next checkpoint is taken
        self.durable = 0.0  # progress of the newest durable checkpoint
        self.inflight: list[tuple[float, float]] = []  # (mark, time it becomes durable)
        self.taken = 0
        # every durable checkpoint, as runs (first mark, spacing, count): storage keeps old
        # checkpoints, and a corruption noticed late needs one from before it began
        self.history: list[tuple[float, float, int]] = [(0.0, 0.0, 1)]

    def _record(self, first: float, count: int, spacing: float = 0.0) -> None:
        if count > 0:
            self.history.append((first, spacing, count))

    def settle(self, now: float) -> None:
        """Persists that finished by ``now`` become durable."""
        if self.inflight:
            keep = []
            for mark, t in self.inflight:
                if t <= now:
                    self.durable = max(self.durable, mark)
                    self._record(mark, 1)
                else:
                    keep.append((mark, t))
            self.inflight = keep

    def advance(self, t0: float, w0: float, dt: float, rate: float) -> tuple[float, float]:
        """Run ``dt`` wall seconds from (t0, w0) at ``rate`` progress per run-second.

        Returns (progress at t0 + dt, seconds of the segment spent stalled).
        """
        self.settle(t0)
        if math.isinf(self.interval) or rate <= 0:
            return w0 + rate * dt, 0.0
        a = (self.next_mark - w0) / rate  # run time before the first stall
        if dt < a:
            return w0 + rate * dt, 0.0
        run_per = self.interval / rate
        cyc = self.stall + run_per
        n = math.floor((dt - a) / cyc)
        rem = (dt - a) - n * cyc
        if rem >= self.stall:  # n+1 stalls completed, computing after the last one
            m = n + 1
            w1 = self.next_mark + n * self.interval + rate * (rem - self.stall)
            stalled = m * self.stall
        else:  # inside stall number n+1: that checkpoint is not taken
            m = n
            w1 = self.next_mark + n * self.interval
            stalled = n * self.stall + rem
        now = t0 + dt
        if m > 0:
            first_done = t0 + a + self.stall  # checkpoint 0 taken (stall ended) at this time
            i_dur = min(m - 1, math.floor((now - self.lag - first_done) / cyc))
            if i_dur >= 0:
                self.durable = max(self.durable, self.next_mark + i_dur * self.interval)
                for mark, _ in self.inflight:  # older than checkpoint 0 of this segment
                    self._record(mark, 1)
                self.inflight = []
                self._record(self.next_mark, i_dur + 1, self.interval)
            for i in range(max(i_dur + 1, 0), m):
                self.inflight.append((self.next_mark + i * self.interval, first_done + i * cyc + self.lag))
            self.next_mark += m * self.interval
            self.taken += m
        return w1, stalled

    def cancel_inflight(self, now: float) -> None:
        """A failure: persists finished by ``now`` count, those still being written are lost."""
        self.settle(now)
        self.inflight = []

    def rollback(self, now: float) -> float:
        """A failure: in-flight persists are cancelled; returns the progress to restart from."""
        return self.rollback_before(now, math.inf)

    def rollback_before(self, now: float, limit_w: float) -> float:
        """Restart from the newest durable checkpoint at progress ``<= limit_w`` (a corruption
        that began at ``limit_w`` poisoned every later one) that retention kept; newer checkpoints
        are discarded. ``history`` is in progress order (a rollback truncates it), so this pops
        from its end."""
        self.cancel_inflight(now)
        if self.keep_last > 0 and math.isfinite(limit_w) and self._newer_than(limit_w) >= self.keep_last:
            # not among the newest kept: the last checkpoint before a retention boundary
            limit_w = math.floor(limit_w / self.keep_every + 1e-9) * self.keep_every if self.keep_every > 0 else 0.0
        h = self.history
        while len(h) > 1 and h[-1][0] > limit_w + 1e-9:
            h.pop()
        first, spacing, count = h[-1]
        if spacing > 0 and math.isfinite(limit_w):
            count = min(count, math.floor((limit_w - first) / spacing + 1e-9) + 1)
        h[-1] = (first, spacing, count)
        best = first + (count - 1) * spacing if h[-1][0] <= limit_w + 1e-9 else 0.0
        self.durable = best
        self.next_mark = best + self.interval
        return best

    def _newer_than(self, limit_w: float) -> int:
        """Durable checkpoints at progress above the newest one at or below ``limit_w``."""
        n = 0
        for first, spacing, count in self.history:
            if first > limit_w + 1e-9:
                n += count
            elif spacing > 0:  # marks first + i * spacing above limit_w, i < count
                n += max(0, count - 1 - math.floor((limit_w - first) / spacing + 1e-9))
        return n

    def mark_durable(self, w: float) -> None:
        """An on-demand checkpoint at progress ``w`` completed (e.g. before planned maintenance)."""
        self.durable = max(self.durable, w)
        for mark, _ in self.inflight:
            if mark <= w:
                self._record(mark, 1)
        self.inflight = []
        self._record(w, 1)
        self.next_mark = w + self.interval


def daly_tau_opt(delta_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimum compute time between checkpoints."""
    if delta_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = delta_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * delta_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta_s


def young_tau_opt(delta_s: float, mtbf_s: float) -> float:
    """Young's (1974) first-order optimum sqrt(2 delta M)."""
    return math.sqrt(2.0 * delta_s * mtbf_s)


def daly_expected_wall_s(work_s: float, tau_s: float, delta_s: float, restart_s: float, mtbf_s: float) -> float:
    """Daly's expected wall time: M e^(R/M) (e^((tau+delta)/M) - 1) T_s / tau."""
    m = mtbf_s
    return m * math.exp(restart_s / m) * math.expm1((tau_s + delta_s) / m) * work_s / tau_s
