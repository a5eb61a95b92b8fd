"""Replication baseline (Bamboo-style redundant computation).

Every node's work is also computed by its buddy (slot ``i ^ 1``), in pipeline bubbles, which
costs ``redundant_compute_frac`` of throughput always (badput "redundant") and optionally
``redundant_gpu_frac`` extra GPUs (charged in fleet goodput; 0 for in-bubble redundancy,
1 for full dual replicas). When one copy is lost the buddy takes over at once: detection +
``failover_s``, no rollback, and the job runs at ``failover_throughput_frac`` (badput
"degraded") until a pool node replaces the failed one (rebuild + transfer). With an empty
pool it keeps running degraded until a node comes back. If the buddy fails before the
replacement is in, both copies are gone: restart from the newest durable disk checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from sim import costs
from sim.cluster import Fault, NodesAvailable
from sim.job import Job
from sim.schedule import Checkpoints


@dataclasses.dataclass(frozen=True)
class ReplicationParams:
    detect_s: float
    failover_s: float
    replace_s: float
    redundant_compute_frac: float
    failover_throughput_frac: float
    disk: costs.DiskCosts
    disk_interval_s: float


class Replication(Job):
    def __init__(self, env, cluster, layout, ledger, p: ReplicationParams):
        super().__init__(env, cluster, layout, ledger)
        self.p = p
        self.ckpt = Checkpoints(p.disk_interval_s, p.disk.stall_s, p.disk.persist_lag_s)
        self.factors["redundant"] = 1.0 / (1.0 + p.redundant_compute_frac)
        self.factors["degraded"] = 1.0
        self.num_slots = layout.num_nodes
        self.failover_pending = False
        self.fallback = False

    @staticmethod
    def params_from_cfg(layout, scfg: Mapping, calib: Mapping, mtbf_s: float) -> ReplicationParams:
        hot = costs.hotswap(layout, calib)
        return ReplicationParams(
            detect_s=float(scfg["detect_s"]),
            failover_s=float(scfg["failover_s"]),
            replace_s=hot.swap_s,
            redundant_compute_frac=float(scfg["redundant_compute_frac"]),
            failover_throughput_frac=float(scfg["failover_throughput_frac"]),
            disk=costs.disk(layout, calib, scfg["disk_ckpt_mode"]),
            disk_interval_s=float(scfg["disk_ckpt_interval_s"]),
        )

    def buddy(self, slot: int) -> int:
        b = slot ^ 1
        return b if b < self.num_slots else slot - 1

    def on_interrupt(self, cause) -> None:
        self.recovering = True
        if isinstance(cause, NodesAvailable) or not isinstance(cause, Fault):
            return
        slot = cause.slot
        buddy_missing = self.buddy(slot) in self.vacant
        self.vacant.add(slot)
        if cause.planned:
            self.failover_pending = True
            return
        self.ckpt.cancel_inflight(self.env.now)
        if buddy_missing and not self.fallback:
            self.fallback = True
            self.ledger.count("fallbacks")
            self.rollback_to(self.ckpt.rollback(self.env.now))
        elif not self.fallback:
            self.ledger.count("absorbed")
            self.failover_pending = True
        self.detect_pending = True

    def recover(self):
        yield from self.detection(self.p.detect_s)
        if self.fallback:
            yield from self.fill_vacant()
            yield from self.phase("restart", self.p.disk.restart_s)
            self.ledger.count("restarts")
            self.fallback = self.failover_pending = False
        if self.failover_pending:
            yield from self.phase("reconfiguration", self.p.failover_s)
            self.failover_pending = False
        self.factors["degraded"] = self.p.failover_throughput_frac if self.vacant else 1.0
        if self.vacant and self.cluster.pool_size():
            for slot in sorted(self.vacant):
                if not self.cluster.pool_size():
                    break
                self.cluster.assign(slot, self.cluster.take())
                self.vacant.discard(slot)
                self.ledger.count("swaps")
            yield from self.phase("reconfiguration", self.p.replace_s)
        self.factors["degraded"] = self.p.failover_throughput_frac if self.vacant else 1.0
        self.background_need = 1 if self.vacant else 0
