"""The simulated cluster: node roles, the spare pool, repairs, and trace replay.

Nodes ``0 .. num_active-1`` start as the job's slots (slot i holds node i); when the job
reserves spares, nodes ``num_active .. num_active+num_spares-1`` start in the pool. Other
trace nodes are outside this job's allocation and their events are ignored.

Replay rules (the same for every strategy, so the trace is common random numbers):
- An event on an active node vacates its slot, sends the node away for ``duration_s`` and
  interrupts the job with a ``Fault``. ``fail``/``remove`` count as ``failures``,
  ``maintenance`` as ``planned_maintenance``: only events that hit the job are counted.
- An event on a pool node removes it from the pool (``spare_failures``).
- An event on a node that is already away is dropped (``masked``): a node that is down
  cannot fail again.
- A node coming back (repair, reboot, maintenance done, ``add``) joins the pool; the job
  is told through ``listener`` and decides whether it wants it.
- Silent data corruption (a ``fail`` whose cause ``detection.kind`` calls ``sdc``) on an active
  node: the node stays in its slot and the job is told at once (``job.corrupted(node)``, which
  only records the progress); ``detect_sdc_s`` later the node is taken out as a failure with
  ``kind="sdc"``. If it left the job meanwhile (failed otherwise, drained, released) the
  corruption is dropped with it (counted ``masked``): a simplification, rare at the rates used.
"""

from __future__ import annotations

import dataclasses

import simpy

from sim.costs import CRASH, HANG, SDC, Detection
from sim.ledger import Ledger
from sim.trace import ADD, FAIL, MAINTENANCE, REMOVE, Trace

ABSENT, ACTIVE, POOL, DOWN = 0, 1, 2, 3


@dataclasses.dataclass(slots=True)
class Fault:
    """Interrupt cause: the node in ``slot`` went away at the current time."""

    node: int
    slot: int
    transient: bool
    planned: bool
    kind: str = CRASH  # crash | hang | sdc (sim.costs.Detection.kind of the cause)
    cause: str = ""


@dataclasses.dataclass(slots=True)
class Corrupt:
    """Interrupt cause: the node started corrupting state (nothing is noticed yet)."""

    node: int


class NodesAvailable:
    """Interrupt cause: the pool now holds as many nodes as the job said it wants."""


class Cluster:
    """Node bookkeeping plus the trace-replay process. Must be built before the job reads it;
    ``listener`` and ``job_proc`` are wired by the job."""

    def __init__(self, env: simpy.Environment, trace: Trace, num_active: int, num_spares: int,
                 ledger: Ledger, detection: Detection | None = None):
        reserved = num_active + num_spares
        if trace.num_nodes < num_active:
            raise ValueError(f"trace has {trace.num_nodes} nodes, the job needs {num_active} active")
        self.env, self.trace, self.ledger = env, trace, ledger
        down = set() if trace.initially_down is None else {int(n) for n in trace.initially_down}
        up = [n for n in range(trace.num_nodes) if n not in down]
        if len(up) < num_active:
            raise ValueError(f"only {len(up)} nodes are present at t=0, the job needs {num_active}")
        self.role = [ABSENT] * trace.num_nodes
        self.slot_of = [-1] * trace.num_nodes
        self.node_of = up[:num_active]
        for s, n in enumerate(self.node_of):
            self.role[n], self.slot_of[n] = ACTIVE, s
        self.pool: dict[int, None] = {}  # insertion-ordered set; FIFO hand-out
        for n in up[num_active:reserved]:
            self.role[n] = POOL
            self.pool[n] = None
        for n in down:
            self.role[n] = DOWN  # joins the pool at its ``add`` event
        self.listener = None  # callable(): the pool gained a node
        self.job_proc: simpy.Process | None = None
        self.job = None  # the Job (for corruption notices)
        self.detection = detection
        self.process = env.process(self.run())

    # -- pool -------------------------------------------------------------------------------
    def pool_size(self) -> int:
        return len(self.pool)

    def take(self) -> int:
        """Pops a pool node. Must only be called when ``pool_size() > 0``."""
        node = next(iter(self.pool))
        del self.pool[node]
        return node

    def assign(self, slot: int, node: int) -> None:
        self.node_of[slot] = node
        self.role[node], self.slot_of[node] = ACTIVE, slot

    def release(self, slot: int) -> None:
        """A healthy node leaves its slot (shrink) and joins the pool."""
        node = self.node_of[slot]
        if node >= 0:
            self.node_of[slot] = -1
            self.slot_of[node] = -1
            self._to_pool(node)

    def _to_pool(self, node: int) -> None:
        self.role[node] = POOL
        self.pool[node] = None
        if self.listener is not None:
            self.listener()

    def _come_back(self, event) -> None:
        node = event.value
        if self.role[node] == DOWN:
            self._to_pool(node)

    # -- replay -----------------------------------------------------------------------------
    def run(self):
        tr, env, led = self.trace, self.env, self.ledger
        keep = [i for i, n in enumerate(tr.node.tolist()) if self.role[n] != ABSENT]
        times, nodes = tr.time_s.tolist(), tr.node.tolist()
        events, durs = tr.event.tolist(), tr.duration_s.tolist()
        transient = tr.transient.tolist()
        det = self.detection
        kinds = [det.kind(c) if det else CRASH for c in tr.causes]
        causes = tr.cause.tolist()
        for i in keep:
            t = times[i]
            if t > env.now:
                yield env.timeout(t - env.now)
            node, ev = nodes[i], events[i]
            role = self.role[node]
            if ev == ADD:
                if role == DOWN:
                    self._to_pool(node)
                continue
            if role == DOWN:
                led.count("masked")
                continue
            kind = kinds[causes[i]] if ev == FAIL else CRASH
            if kind == SDC and role == ACTIVE:
                self.job.corrupted(node)
                env.timeout(det.sdc_s, value=i).callbacks.append(self._sdc_noticed)
                continue
            self._hit(i, node, ev, durs[i], bool(transient[i]), kind)

    def _sdc_noticed(self, event) -> None:
        i = event.value
        node = int(self.trace.node[i])
        if self.role[node] != ACTIVE:
            self.job.poison.pop(node, None)
            self.ledger.count("masked")
            return
        self._hit(i, node, FAIL, float(self.trace.duration_s[i]), False, SDC)

    def _hit(self, i: int, node: int, ev: int, dur: float, transient: bool, kind: str) -> None:
        """Event ``i`` takes ``node`` away (it is up: active or in the pool)."""
        role = self.role[node]
        self.role[node] = DOWN
        if role == POOL:
            del self.pool[node]
            self.ledger.count("spare_failures")
        else:
            slot = self.slot_of[node]
            self.node_of[slot], self.slot_of[node] = -1, -1
        if ev != REMOVE:
            if dur > 0:
                self.env.timeout(dur, value=node).callbacks.append(self._come_back)
            else:  # back at once (e.g. Daly's model): skip the extra event
                self._to_pool(node)
        if role == POOL:
            return
        planned = ev == MAINTENANCE
        self.ledger.count("planned_maintenance" if planned else "failures")
        if not planned and not self.pool:
            self.ledger.count("empty_pool")  # the job finds no spare for this failure
        if not planned and kind != CRASH:
            self.ledger.count("hangs" if kind == HANG else "corruptions")
        cause = self.trace.causes[int(self.trace.cause[i])] if len(self.trace.causes) else ""
        self.job_proc.interrupt(Fault(node, slot, transient and ev == FAIL, planned, kind, cause))
