"""Which steps are snapshotted: every ``interval`` steps, widened when snapshots cost too much.

A snapshot's background work (copy, checksum, replication to the ``ft.replicas`` buddies) must
finish before the next one may reuse its buffers, and it competes with training for cores, memory bandwidth and
the network. Two measured limits widen the interval ``k`` over ``base, 2 base, 4 base, ...`` (at
most ``ft.max_snapshot_lag_steps``):

- **cycle** (back-pressure): ``k x step time >= margin x cycle``, the cycle being the time from a
  snapshot call until its copy and replication (to every buddy) are done. Otherwise the next snapshot would block
  the training thread waiting for a buffer. A cycle still running counts too, as a lower bound
  (its elapsed time): a copier far behind the steps finishes no cycle to measure.
- **cost** (``ft.snapshot_overhead_target``, e.g. 0.02): the slowdown of steps during which
  snapshot work runs ("active") against the steps around them during which none does ("quiet"),
  scaled to ``k``, must stay under the target. When no core is idle (a CPU box) snapshots are not
  free; on a GPU node whose host cores idle while the GPU computes, the cost measures ~0 and ``k``
  stays ``base``. With ``k = base`` there are no quiet steps, so the job skips ``probe`` (3)
  snapshots (a *probe*) to measure them; the protection lag then grows by ``probe``. Probes end
  just before a vote (below), early and then backing off, so a short job settles too: with the
  defaults (``every = 16``, ``probe_every = 64``) steps 13-15, 29-31, 61-63, then 3 steps before
  every multiple of ``probe_every``. The first ``warmup`` steps of a generation are not measured.

  Each active step is compared with the quiet steps at most ``reach`` (4) steps from it (their
  median), so a host whose speed drifts over seconds (a shared CPU box: ±10 % between runs a
  minute apart) does not read as cost; the cost is the median of these paired slowdowns times
  the share of active steps outside probes, i.e. what snapshots cost at the current interval. It
  needs ``min_quiet`` (4) quiet steps and as many pairs, so the vote of step 32 is the first that
  knows it (two probes), in force from step 40. The interval is chosen on the cost's upper
  bound, the median plus ``z`` (2) standard errors: a snapshot kept every step must be shown to
  be cheap. The two mistakes do not cost alike: a wider interval than needed costs a few more
  steps recomputed after a failure, a narrower one costs every step's speed. On a steady GPU
  node the bound is within a fraction of a percent of the median; on a noisy CPU host it widens
  the interval until more probes narrow the bound.

The cost is protection lag: after a failure up to ``k`` (during a probe, ``k`` + its length)
steps are recomputed. When even the widest interval cannot hide the cycle, the engine blocks
(counted in ``snapshot_blocked_s``): a bounded lag is worth more than the last percent of speed.

Every rank must snapshot the same steps (a step is protected once every rank replicated it), so
``k`` is agreed, not local: every ``every`` steps (decision step ``d``) each rank adds a vote for
its wanted ``k`` to a counter in the store (``interval/<d>/<k>``, in the generation's namespace),
and at step ``d + w`` (``w`` the widest interval, 8 by default) all ranks read the votes of ``d``
and take the largest wanted ``k`` from that step on: the vote of step 32 rules from step 40. The
read waits (abortably) until every rank has voted; in a coupled job ranks are never ``w`` steps
apart, so in practice it never waits. Per rank and decision this is ``2 + #levels`` store
operations, under one per step at the default ``every = 16``. Votes and decisions happen at
multiples of ``w``, which every ``k`` divides, so ``step % k == 0`` stays the rule; probes are a
function of the step too. A recovered generation restarts at ``base`` (its measurements kept).
"""

from __future__ import annotations

import statistics
from collections import deque



class SnapshotSchedule:
    def __init__(self, base: int, max_lag: int, every: int = 16, margin: float = 1.25,
                 adaptive: bool = True, overhead_target: float | None = None,
                 probe_every: int = 64, probe: int = 3, window: int = 16, min_quiet: int = 4,
                 warmup: int = 2, reach: int = 4, history: int = 64, z: float = 2.0):
        if base < 1:
            raise ValueError("ft.snapshot_interval_steps must be >= 1")
        self.levels = [base]
        while adaptive and self.levels[-1] * 2 <= max_lag:
            self.levels.append(self.levels[-1] * 2)
        self.adaptive = adaptive and len(self.levels) > 1
        if self.adaptive and every % self.levels[-1]:
            raise ValueError(f"ft.snapshot_adapt_every_steps={every} must be a multiple of the "
                             f"widest snapshot interval {self.levels[-1]}")
        if overhead_target is not None and not 0 < overhead_target < 1:
            raise ValueError("ft.snapshot_overhead_target must be in (0, 1) or null")
        if self.adaptive and overhead_target and probe_every <= probe + 1:
            raise ValueError("ft.snapshot_probe_every_steps must exceed the probe length")
        self.base, self.every, self.margin = base, every, margin
        self.target = overhead_target if self.adaptive else None
        self.probe_every, self.probe, self.min_quiet = probe_every, probe, min_quiet
        # probes end at the first vote that leaves warm-up and enough active steps before it,
        # then back off (doubling) to one every probe_every steps
        end = every
        while end < warmup + min_quiet + probe:
            end *= 2
        self._early_ends = []
        while end < probe_every:
            self._early_ends.append(end)
            end *= 2
        self.warmup, self.reach, self.z = warmup, reach, z
        self._seen = 0  # steps observed in this generation (the first `warmup` are not measured)
        self._observed = 0  # steps observed in all
        self.interval = base
        self._steps: deque = deque(maxlen=window)
        self._share: deque = deque(maxlen=window)  # active or not, steps outside probes
        self._cycles: deque = deque(maxlen=window)
        self._pending: float = 0.0  # elapsed time of the oldest unfinished cycle (a lower bound)
        # (observation, time, active) of the last `history` measured steps: the paired cost's input
        self._hist: deque = deque(maxlen=history)
        self._rounds = None  # the generation's agreements (deadpool.store.rounds): votes and decisions
        self._voted: set[int] = set()

    def start(self, rounds) -> None:
        """A new generation: back to ``base``, history kept (it describes this rank's hardware)."""
        self._rounds = rounds
        self.interval = self.base
        self._voted = set()
        self._seen = 0

    def probing(self, step: int) -> bool:
        """Snapshots skipped at ``step`` to measure quiet steps (only while ``k`` is ``base``)."""
        if self.target is None or self.interval != self.base:
            return False
        if any(end - self.probe <= step < end for end in self._early_ends):
            return True
        return step % self.probe_every >= self.probe_every - self.probe

    def due(self, step: int) -> bool:
        return step % self.interval == 0 and not self.probing(step)

    def observe(self, step_s: float, active: bool, cycle_s: float | None,
                step: int | None = None, pending_s: float | None = None) -> None:
        """One training step's time, whether snapshot work ran during it, and the cycle time of
        the snapshot that finished during it (if one did). ``step``: the step just completed
        (its quietness is the probe's doing when the snapshot of ``step - 1`` was skipped);
        None: counted as outside probes. ``pending_s``: how long the oldest unfinished snapshot
        has been running (a lower bound on its cycle; None: none is). The first ``warmup``
        steps of a generation (lazy allocations, a recovery's first step) are not measured."""
        self._seen += 1
        self._observed += 1  # over generations: a recovery's repeated step numbers stay apart
        if self._seen <= self.warmup:
            return
        self._pending = pending_s or 0.0
        self._steps.append(step_s)
        self._hist.append((self._observed, step_s, active))
        if step is None or not self.probing(step - 1):
            self._share.append(active)
        if cycle_s:
            self._cycles.append(cycle_s)

    def _paired(self) -> list[float]:
        """Each active step's slowdown against the median of the quiet steps within ``reach``."""
        quiet = [(i, t) for i, t, active in self._hist if not active]
        out = []
        for i, t, active in self._hist:
            near = [q for j, q in quiet if abs(j - i) <= self.reach] if active else None
            if near:
                base = statistics.median(near)
                out.append((t - base) / base)
        return out

    def _cost(self) -> tuple[float, float] | None:
        """(median, upper bound) of the measured slowdown at the current interval; None: too
        few quiet steps or pairs."""
        n_quiet = sum(1 for _, _, active in self._hist if not active)
        pairs = self._paired()
        if n_quiet < self.min_quiet or len(pairs) < self.min_quiet:
            return None
        mid = statistics.median(pairs)
        # standard error of a median from the median absolute deviation (robust to one slow step)
        mad = statistics.median(abs(p - mid) for p in pairs)
        se = 1.2533 * 1.4826 * mad / len(pairs) ** 0.5
        # the share of steps with snapshot work at this interval (probes would lower it)
        share = sum(self._share) / len(self._share) if self._share else 1.0
        return max(0.0, mid * share), max(0.0, (mid + self.z * se) * share)

    def overhead(self) -> float | None:
        """Measured slowdown of training by snapshots at the current interval (None: unknown)."""
        cost = self._cost()
        return None if cost is None else cost[0]

    def overhead_bound(self) -> float | None:
        """Its upper bound (median + ``z`` standard errors), on which the interval is chosen."""
        cost = self._cost()
        return None if cost is None else cost[1]

    def wanted(self) -> int:
        """The smallest level that both covers this rank's snapshot cycle and keeps its measured
        cost (its upper bound) under the target, narrowing only with a 2x margin and by one level
        per vote, so the choice does not flap: at a wide interval the cost rests on few active
        steps, and one low reading must not send the job back to the narrowest interval at once
        (seen: 8 -> 1 in an 80-step job after a probe). Widening jumps as far as needed."""
        if not self._steps:
            return self.base
        step = statistics.median(self._steps)
        cycle = max(statistics.median(self._cycles) if self._cycles else 0.0, self._pending)
        need = self.margin * cycle / step if cycle else 1
        cost = self.overhead_bound() if self.target is not None else None
        for k in self.levels:
            if k < need or k < self.interval // 2:
                continue
            if cost is not None:
                o = cost * self.interval / k  # per-snapshot cost spread over k steps
                if o > (self.target if k >= self.interval else self.target / 2):
                    continue
            return k
        return self.levels[-1]

    def end_of_step(self, step: int, abort_check) -> None:
        """After step ``step`` (the snapshot decision for it already made): vote, and adopt the
        decision of the previous vote. Must be called by every rank at every step."""
        lag = self.levels[-1]
        if not self.adaptive or self._rounds is None or step % lag:
            return
        prev = step - lag
        if prev in self._voted:
            self.interval = self._decide(prev, abort_check)
        if step % self.every:
            return
        self._rounds.vote(step, self.wanted())
        self._voted.add(step)

    def _decide(self, step: int, abort_check) -> int:
        return self._rounds.decision(step, list(self.levels), abort_check)
