"""Replication baseline (Bamboo-style redundant computation).

Every node's work is also computed by its buddy (its pair in ``buddy_placement``: the
neighbouring slot, or one rack over), in pipeline bubbles, which
costs ``redundant_compute_frac`` of throughput always (badput "redundant") and optionally
``redundant_gpu_frac`` extra GPUs (charged in fleet goodput; 0 for in-bubble redundancy,
1 for full dual replicas). When one copy is lost the buddy takes over at once: detection +
``failover_s``, no rollback, and the job runs at ``failover_throughput_frac`` (badput
"degraded") until a pool node replaces the failed one. ``replace: background`` (the default)
transfers the state into the replacement while the job keeps running degraded and pauses only
to join it (plan + rebuild + warm-up); ``blocking`` pauses for the whole swap. With an empty
pool it keeps running degraded until a node comes back.

Memory: a buddy must hold its pair's state to take over without a rollback, so each GPU holds
two nodes' model state beside its activations; when that does not fit ``hbm_gb_per_gpu`` the
strategy refuses (``ValueError``). Its redundancy (``redundant_compute_frac``) has no published
measurement for this layout, so replication is left out of the headline strategy list and
sampled over its whole range in the ranking study (experiments/sim/ranking.py). If the buddy fails before the
replacement is in, both copies are gone: restart from the newest durable disk checkpoint.
A silent corruption spreads to the pair through the computation they share (and to everyone
through the gradient all-reduce): it also restarts from a disk checkpoint taken before it began.
Detection, the replacement's rebuild + transfer, restarts and checkpoint costs are the shared
ones (``sim.costs``); the redundancy overhead, failover time and degraded throughput are this
strategy's own (its YAML, with the published measurements they come from).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from sim import costs, placement
from sim.cluster import Fault, NodesAvailable
from sim.job import Job


@dataclasses.dataclass(frozen=True)
class ReplicationParams:
    detect: costs.Detection
    failover_s: float
    replace_s: float
    redundant_compute_frac: float
    failover_throughput_frac: float
    disk: costs.DiskCosts
    disk_interval_s: float
    buddy_placement: str
    replace: str = "blocking"  # background | blocking
    transfer_s: float = 0.0  # background part of the replacement (state transfer)


class Replication(Job):
    def __init__(self, env, cluster, layout, ledger, p: ReplicationParams):
        super().__init__(env, cluster, layout, ledger, p.detect)
        self.p = p
        self.ckpt = p.disk.checkpoints(p.disk_interval_s)
        self.factors["redundant"] = 1.0 / (1.0 + p.redundant_compute_frac)
        self.factors["degraded"] = 1.0
        self.pairs = placement.pairs(p.buddy_placement, layout.num_nodes, layout.nodes_per_rack)
        self.failover_pending = False
        self.fallback = False
        self.joining: set[int] = set()  # slots given a pool node whose state is still arriving

    @staticmethod
    def params_from_cfg(layout, scfg: Mapping, calib: Mapping, mtbf_s: float) -> ReplicationParams:
        replace = str(scfg.get("replace", "blocking"))
        if replace not in ("background", "blocking"):
            raise ValueError(f"replace must be background or blocking, got {replace!r}")
        pair_state_gb = 2.0 * layout.state_bytes_per_gpu / 1e9
        if not layout.fits(pair_state_gb):
            raise ValueError(f"replication does not fit {layout.hbm_gb_per_gpu} GB per GPU: {pair_state_gb:.1f} GB of own "
                             f"and pair state + {layout.activation_gb_per_gpu} GB activations + "
                             f"{layout.reserved_gb_per_gpu} GB reserved")
        rc = costs.reconfig(layout, calib)
        background = rc.transfer_s if replace == "background" else 0.0
        return ReplicationParams(
            detect=costs.detection(calib, layout),
            failover_s=float(scfg["failover_s"]),
            replace_s=rc.swap_s - background,
            replace=replace,
            transfer_s=background,
            redundant_compute_frac=float(scfg["redundant_compute_frac"]),
            failover_throughput_frac=float(scfg["failover_throughput_frac"]),
            disk=costs.disk(layout, calib, scfg["disk_ckpt_mode"], costs.requeues(scfg)),
            disk_interval_s=float(scfg["disk_ckpt_interval_s"]),
            buddy_placement=str(calib.get("buddy_placement", "adjacent")),
        )

    def buddy(self, slot: int) -> int:
        return self.pairs.buddy(slot)

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
        sdc = cause.kind == costs.SDC
        if (buddy_missing or sdc) and not self.fallback:
            self.fallback = True
            self.ledger.count("fallbacks")
        if sdc:
            self.rollback_to(self.ckpt.rollback_before(self.env.now, self.poison.pop(cause.node, self.W)))
        elif buddy_missing:
            self.rollback_to(self.ckpt.rollback(self.env.now))
        elif not self.fallback:
            self.ledger.count("absorbed")
            self.failover_pending = True
        self.note_failure(cause)

    def recover(self):
        yield from self.detection()
        if self.fallback:
            yield from self.fill_vacant()
            yield from self.phase("restart", self.p.disk.restart_s)
            self.ledger.count("restarts")
            self.fallback = self.failover_pending = False
            self.joining.clear()
        if self.failover_pending:
            yield from self.phase("reconfiguration", self.p.failover_s)
            self.failover_pending = False
        self.factors["degraded"] = self.p.failover_throughput_frac if self.vacant or self.joining else 1.0
        if self.vacant and self.cluster.pool_size():
            for slot in sorted(self.vacant):
                if not self.cluster.pool_size():
                    break
                self.cluster.assign(slot, self.cluster.take())
                self.vacant.discard(slot)
                self.joining.add(slot)
                self.ledger.count("swaps")
        if self.joining:
            # background: the state arrives while the buddies carry the work (an interrupt redoes it)
            yield from self.compute_for(self.p.transfer_s)
            yield from self.phase("reconfiguration", self.p.replace_s)
            self.joining.clear()
        self.factors["degraded"] = self.p.failover_throughput_frac if self.vacant else 1.0
        self.background_need = 1 if self.vacant else 0
