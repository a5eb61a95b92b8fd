"""TrainMover-like baseline (OSDI '26, arXiv 2412.12636): standby machines warmed in a sandbox,
only the changed communicator members set up; no per-step snapshots (zero memory overhead).

On a failure a standby (a pool node) that already ran its communication-free sandboxed warm-up
replaces the failed node; the communicator groups are patched by a delta-based two-phase set-up
in which only the joiner builds connections (``costs.rebuild_delta_s``: flat in the job's size,
the paper's ~20 s downtime at 1,024 GPUs is its order). The joiner's state comes from the
data-parallel peers that hold the same shard (one node-state transfer). What a failure loses
depends on where the optimizer lives (``layout.optimizer_sharded_over_dp``): replicated across
data-parallel peers, only the step in flight; sharded (ZeRO-1) over them, the failed node held
the only copy of its shard, so every rank rolls back, in place, to the newest durable disk
checkpoint (survivors stay: plan + delta rebuild + storage load). Disk checkpoints are
asynchronous at Daly's interval (the same engine and stall as checkpoint/restart). Planned
maintenance is a live migration: the standby warms up while the leaver still trains, then the
delta set-up alone pauses the job. A corruption restores a disk checkpoint from before it began.
An empty pool waits for a repaired node.

Analytic expectation (tests/sim/test_baselines.py): with replicated optimizer state, one crash
costs ``detect + step/2 + plan + rebuild_delta + transfer + warm-up``.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from sim import costs
from sim.cluster import Fault, NodesAvailable
from sim.job import Job
from sim.strategies.checkpoint_restart import checkpoint_interval_s


@dataclasses.dataclass(frozen=True)
class TrainMoverParams:
    detect: costs.Detection
    join_s: float  # plan + delta rebuild + the joiner's state from peers + warm-up
    migrate_s: float  # planned: plan + delta rebuild (the state moved while training)
    reload_s: float  # in place: plan + delta rebuild + storage load + warm-up
    step_s: float
    shard_lost: bool
    disk: costs.DiskCosts
    disk_interval_s: float


class TrainMover(Job):
    def __init__(self, env, cluster, layout, ledger, p: TrainMoverParams):
        super().__init__(env, cluster, layout, ledger, p.detect)
        self.p = p
        self.ckpt = p.disk.checkpoints(p.disk_interval_s)
        self.reload_pending = False
        self.planned_only = True

    @staticmethod
    def params_from_cfg(layout, scfg: Mapping, calib: Mapping, mtbf_s: float) -> TrainMoverParams:
        rc = costs.reconfig(layout, calib)
        delta = rc.plan_s + costs.rebuild_delta_s(calib)
        d = costs.disk(layout, calib, scfg["disk_ckpt_mode"], costs.requeues(scfg))
        return TrainMoverParams(
            detect=costs.detection(calib, layout),
            join_s=delta + rc.transfer_s + rc.warmup_s,
            migrate_s=delta,
            reload_s=delta + costs.storage_load_s(layout, calib) + rc.warmup_s,
            step_s=layout.step_time_s,
            shard_lost=layout.optimizer_sharded_over_dp and layout.dp > 1,
            disk=d,
            disk_interval_s=checkpoint_interval_s({"ckpt_interval_s": scfg.get("disk_ckpt_interval_s")}, d, mtbf_s),
        )

    def on_interrupt(self, cause) -> None:
        self.recovering = True
        if isinstance(cause, NodesAvailable) or not isinstance(cause, Fault):
            return
        self.vacant.add(cause.slot)
        if cause.planned:
            return
        self.planned_only = False
        self.ckpt.cancel_inflight(self.env.now)
        if cause.kind == costs.SDC:
            self.rollback_to(self.ckpt.rollback_before(self.env.now, self.poison.pop(cause.node, self.W)))
            self.reload_pending = True
        elif self.p.shard_lost:
            self.rollback_to(self.ckpt.rollback(self.env.now))
            self.reload_pending = True
        elif not self.reload_pending:
            self.rollback_to(self.W - self.lost_since_snapshot(self.p.step_s * self.rate, 0.0))
        self.note_failure(cause)

    def recover(self):
        yield from self.detection()
        swapped = False
        for slot in sorted(self.vacant):
            yield from self.wait_for_pool(1)
            self.cluster.assign(slot, self.cluster.take())
            self.vacant.discard(slot)
            self.ledger.count("swaps")
            swapped = True
        if self.reload_pending:
            yield from self.phase("restart", self.p.reload_s)
            self.ledger.count("reloads")
        elif swapped:
            yield from self.phase("reconfiguration", self.p.migrate_s if self.planned_only else self.p.join_s)
        self.reload_pending = False
        self.planned_only = True
        self.mem_floor = self.W
