"""DeadPool: hot-swap a failed node with a spare, restore its state from its buddy's replica.

Steady state: every snapshot interval (``sim.network``: one step unless replication does not
fit) each node snapshots its state and replicates it to its buddy (``buddy_placement``: the next
slot, as the runtime's ``ring_over_nodes``, or one rack over; with the calibration key
``replicas`` = k, the runtime's ``ft.replicas``, also to the k-1 slots after it, k times the
bytes) off the critical path; what it costs training is ``Snapshots.overhead_frac`` (measured, plus network/copy backpressure). Periodic
asynchronous disk checkpoints exist only for the fallbacks below.

Per unexpected failure: detection (by cause, shared) + plan + communicator rebuild + state
transfer + warm-up (``Reconfig.swap_s``, shared), plus recomputation of the progress since the
newest replicated snapshot (``Job.memory_marks``: a lag of several intervals reaches several
snapshots back). Planned maintenance is a drained swap (no detection, no recomputation).

Fallbacks, modelled explicitly:
- a node fails while a ring neighbour's state is still unrestored (the *replication window*:
  from the neighbour's failure until its replacement has the state, including any wait for a
  spare). Either the dead node held that neighbour's only copy (its ward) or the neighbour
  held the dead node's replica (its buddy) -> restart from the newest durable disk checkpoint
  (with k replicas: once some dead node's state and all k of its copies are gone,
  ``placement.Ring.lost``);
- a silent corruption noticed late: every snapshot since it began is poisoned. If the buddy
  still keeps a clean one (``snapshot_memory_generations``) the swap restores it, else restart
  from the newest disk checkpoint taken before the corruption began;
- the pool is empty -> ``on_no_spare``: ``wait`` for a repaired node (stall), or ``shrink``
  (drop the failed node's data-parallel group, as the elastic strategy does, and regrow when
  enough nodes are back).

``resume()`` is the only hot-swap-specific step; ``InMemoryRestart`` replaces it by a job restart
to separate "where the copy lives" from "hot swap vs restart".

Analytic expectation (tests/sim/test_strategies.py): with ample spares and no buddy losses,
``goodput ~= 1/(1+overhead) - (failures * (detect + swap + recompute) + planned * swap) / T``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from sim import costs, placement
from sim.cluster import Fault, NodesAvailable
from sim.job import Job


@dataclasses.dataclass(frozen=True)
class DeadPoolParams:
    detect: costs.Detection
    reconfig: costs.Reconfig
    snap: costs.Snapshots
    disk: costs.DiskCosts
    disk_interval_s: float
    on_no_spare: str  # "wait" | "shrink"
    buddy_placement: str
    replicas: int  # copies of each node's state, on its buddy and the next (calibration ``replicas``)
    memory_restart_s: float  # job restart from host-memory copies (InMemoryRestart)
    width: costs.WidthScaling = costs.WidthScaling()  # throughput at reduced width after a shrink


def host_gb_per_node(layout, calib: Mapping) -> float:
    """Host memory the snapshot engine holds on a node: ``snapshot_host_copies`` x each GPU's state
    for its local slots, plus the receive buffers of the wards' replicas (``replicate``'s bytes,
    from each of its ``replicas`` wards)."""
    from sim import network

    local = float(calib.get("snapshot_host_copies", 0.0)) * layout.state_bytes_per_node
    received = float(calib.get("snapshot_receive_copies", 0.0)) * network.replicated_bytes_per_node(
        layout, str(calib.get("replicate", "unique")), int(calib.get("replicas", 1)))
    return (local + received) / 1e9


def check_host_memory(layout, calib: Mapping) -> None:
    """Refuse a layout whose snapshots do not fit ``host_mem_gb_per_node`` (when the cluster gives it)."""
    cap = layout.host_mem_gb_per_node
    need = host_gb_per_node(layout, calib)
    if cap is not None and need > cap:
        raise ValueError(f"snapshots need {need:.0f} GB of host memory per node, the node has {cap:.0f} GB")


class DeadPool(Job):
    def __init__(self, env, cluster, layout, ledger, p: DeadPoolParams):
        super().__init__(env, cluster, layout, ledger, p.detect)
        if p.on_no_spare not in ("wait", "shrink"):
            raise ValueError(f"on_no_spare must be wait or shrink, got {p.on_no_spare!r}")
        self.p = p
        self.width = p.width
        self.ckpt = p.disk.checkpoints(p.disk_interval_s)
        if p.snap.overhead_frac > 0:
            self.factors["snapshot"] = 1.0 / (1.0 + p.snap.overhead_frac)
        self.pending: set[int] = set()  # slots whose state now lives only on the buddy
        self.fallback = False
        self.buddies = placement.ring(p.buddy_placement, layout.num_nodes, layout.nodes_per_rack,
                                      p.replicas)

    @staticmethod
    def params_from_cfg(layout, scfg: Mapping, calib: Mapping, mtbf_s: float) -> DeadPoolParams:
        check_host_memory(layout, calib)
        return DeadPoolParams(detect=costs.detection(calib, layout), reconfig=costs.reconfig(layout, calib),
                              snap=costs.snapshots(layout, calib, float(scfg["disk_ckpt_interval_s"])),
                              disk=costs.disk_from_snapshots(layout, calib, scfg["disk_ckpt_mode"], costs.requeues(scfg)),
                              disk_interval_s=float(scfg["disk_ckpt_interval_s"]),
                              on_no_spare=str(scfg.get("on_no_spare", "wait")),
                              buddy_placement=str(calib.get("buddy_placement", "adjacent")),
                              replicas=int(calib.get("replicas", 1)),
                              memory_restart_s=costs.memory_restart_s(layout, calib, costs.requeues(scfg)),
                              width=costs.width_scaling(calib))

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
        self.note_failure(cause)
        if cause.kind == costs.SDC:
            self._restore_clean(self.poison.pop(cause.node, self.W))
        elif self.buddies.lost(slot, self.pending):
            self._to_disk(math.inf)
        elif not self.fallback:
            self.rollback_to(self.memory_marks(self.p.snap.interval_w, self.p.snap.lag_s)[0])
        self.mem_floor = self.W
        self.pending.add(slot)

    def _restore_clean(self, limit_w: float) -> None:
        """Restore the newest state from before progress ``limit_w``: memory if a kept snapshot
        is that old, else disk."""
        s = self.p.snap
        clean = [m for m in self.memory_marks(s.interval_w, s.lag_s, s.generations) if m <= limit_w + 1e-9]
        if clean and not self.fallback:
            self.rollback_to(clean[0])
        else:
            self._to_disk(limit_w)

    def _to_disk(self, limit_w: float) -> None:
        if not self.fallback:
            self.fallback = True
            self.ledger.count("fallbacks")
        self.rollback_to(self.ckpt.rollback_before(self.env.now, limit_w))

    def resume(self):
        """Training again after the vacant slots got nodes: rebuild + transfer + warm-up."""
        yield from self.phase("reconfiguration", self.p.reconfig.swap_s)

    def recover(self):
        yield from self.detection()
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
            yield from self.resume()
            self.pending.clear()
        regrown = 0
        while self.can_regrow():
            self.regrow_one()
            regrown += 1
        if regrown:
            yield from self.phase("reconfiguration", self.p.reconfig.swap_s)
        self.background_need = self._npg if self.active_groups < len(self.group_active) else 0
        self.mem_floor = self.W
