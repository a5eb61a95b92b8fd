"""DeadPool: hot-swap a failed node with a spare, restore its state from its buddy's replica.

Steady state: every ``snapshot_interval_steps`` steps each node snapshots its state and
replicates it to its buddy, the next slot in a ring over nodes (``(i + 1) % n``, as the
runtime's ``RingOverNodes``) off the critical path; what blocks the main
thread is ``snapshot_overhead_frac`` (0 in the paper). Periodic asynchronous disk checkpoints
exist only for the fallback below.

Per unexpected failure: detection + plan + communicator rebuild + state transfer + warm-up,
plus recomputation of the progress since the newest replicated snapshot. Planned
maintenance is a drained swap (no detection, no recomputation).

Fallbacks, modelled explicitly:
- a node fails while a ring neighbour's state is still unrestored (the *replication window*:
  from the neighbour's failure until its replacement has the state, including any wait for a
  spare). Either the dead node held that neighbour's only copy (its ward) or the neighbour
  held the dead node's replica (its buddy) -> restart from the newest durable disk checkpoint;
- the pool is empty -> ``on_no_spare``: ``wait`` for a repaired node (stall), or ``shrink``
  (drop the failed node's data-parallel group, as the elastic strategy does, and regrow when
  enough nodes are back).

Analytic expectation (tests/sim/test_strategies.py): with ample spares and no buddy losses,
``goodput ~= 1/(1+snapshot_overhead_frac) - (failures * (detect + swap + recompute)
+ planned * swap) / T``.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from sim import costs
from sim.cluster import Fault, NodesAvailable
from sim.job import Job
from sim.schedule import Checkpoints


@dataclasses.dataclass(frozen=True)
class DeadPoolParams:
    hot: costs.HotSwapCosts
    disk: costs.DiskCosts
    disk_interval_s: float
    on_no_spare: str  # "wait" | "shrink"


class DeadPool(Job):
    def __init__(self, env, cluster, layout, ledger, p: DeadPoolParams):
        super().__init__(env, cluster, layout, ledger)
        if p.on_no_spare not in ("wait", "shrink"):
            raise ValueError(f"on_no_spare must be wait or shrink, got {p.on_no_spare!r}")
        self.p = p
        self.ckpt = Checkpoints(p.disk_interval_s, p.disk.stall_s, p.disk.persist_lag_s)
        if p.hot.snapshot_overhead_frac > 0:
            self.factors["snapshot"] = 1.0 / (1.0 + p.hot.snapshot_overhead_frac)
        self.pending: set[int] = set()  # slots whose state now lives only on the buddy
        self.fallback = False
        self.num_slots = layout.num_nodes

    @staticmethod
    def params_from_cfg(layout, scfg: Mapping, calib: Mapping, mtbf_s: float) -> DeadPoolParams:
        return DeadPoolParams(hot=costs.hotswap(layout, calib),
                              disk=costs.disk(layout, calib, scfg["disk_ckpt_mode"]),
                              disk_interval_s=float(scfg["disk_ckpt_interval_s"]),
                              on_no_spare=str(scfg["on_no_spare"]))

    def neighbours(self, slot: int) -> set[int]:
        """The buddy (holds this slot's replica) and the ward (whose replica this slot holds)."""
        n = self.num_slots
        return {(slot + 1) % n, (slot - 1) % n} - {slot}

    def on_interrupt(self, cause) -> None:
        self.recovering = True
        if isinstance(cause, NodesAvailable) or not isinstance(cause, Fault):
            return
        slot = cause.slot
        if not self.group_active[self.group_of(slot)]:
            return  # its group was already dropped (shrink); the node was idle
        self.vacant.add(slot)
        if cause.planned:
            return  # drained: its state was handed over before it left
        self.ckpt.cancel_inflight(self.env.now)
        if self.neighbours(slot) & self.pending and not self.fallback:
            self.fallback = True
            self.ledger.count("fallbacks")
            self.rollback_to(self.ckpt.rollback(self.env.now))
        elif not self.fallback:
            self.rollback_to(self.W - self.lost_since_snapshot(self.p.hot.snapshot_interval_w,
                                                               self.p.hot.replicate_lag_s))
        self.mem_floor = self.W
        self.pending.add(slot)
        self.detect_pending = True

    def recover(self):
        yield from self.detection(self.p.hot.detect_s)
        if self.fallback:
            yield from self.fill_vacant()
            yield from self.phase("restart", self.p.disk.restart_s)
            self.ledger.count("restarts")
            self.fallback = False
            self.pending.clear()
        elif self.vacant or self.pending:
            for slot in sorted(self.vacant):
                if slot not in self.vacant:
                    continue  # dropped with its group below
                if self.cluster.pool_size() == 0:
                    if self.p.on_no_spare == "shrink":
                        g = self.group_of(slot)
                        self.pending.difference_update(self.group_slots(g))
                        self.dissolve(g)
                        continue
                    yield from self.wait_for_pool(1)
                self.cluster.assign(slot, self.cluster.take())
                self.vacant.discard(slot)
                self.ledger.count("swaps")
            # An interrupt here redoes the whole rebuild + transfer with the new failure.
            yield from self.phase("reconfiguration", self.p.hot.swap_s)
            self.pending.clear()
        regrown = 0
        while self.can_regrow():
            self.regrow_one()
            regrown += 1
        if regrown:
            yield from self.phase("reconfiguration", self.p.hot.swap_s)
        self.background_need = self._npg if self.active_groups < len(self.group_active) else 0
        self.mem_floor = self.W
