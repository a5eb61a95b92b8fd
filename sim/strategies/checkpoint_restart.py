"""Checkpoint/restart baseline: periodic disk checkpoints, every failure restarts the job.

On an unexpected failure the job loses the work since the newest durable checkpoint (since the
newest one taken before a silent corruption began, when that is what failed), spends the shared
detection time for the cause, takes a replacement node from the pool (waiting for a repair
when the pool is empty) and restarts: relaunch + load, inside its allocation when it holds
spares (``restart_in_allocation``, the default: no requeue), else requeue + relaunch + load. Failures during detection or
restart start the restart over. Planned maintenance drains: an on-demand synchronous
checkpoint, then the same restart, with no lost work.

Asynchronous checkpoints (the default) stall training for one snapshot (the same engine and
measured cost as DeadPool's per-step snapshot: ``costs.snapshot_stall_s``) and become durable
one synchronous-write time later; the interval is Daly's optimum for that stall, but at least
one write time (storage holds one checkpoint in flight).

Analytic expectation (asserted in tests/sim/test_daly.py): with synchronous writes, Poisson
failures of rate 1/M, no detection time and restart time R, the long-run goodput is
``tau / (M e^(R/M) (e^((tau+delta)/M) - 1))`` (Daly 2006), and the best interval is Daly's
``tau_opt``.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from sim import costs
from sim.cluster import Fault
from sim.job import Job
from sim.schedule import daly_tau_opt


@dataclasses.dataclass(frozen=True)
class CheckpointRestartParams:
    detect: costs.Detection
    interval_s: float  # compute (nominal seconds) between checkpoints
    disk: costs.DiskCosts


def checkpoint_interval_s(scfg: Mapping, d: costs.DiskCosts, mtbf_s: float) -> float:
    """``ckpt_interval_s`` when given, else Daly-optimal for the stall (and >= one write when
    asynchronous)."""
    interval = scfg.get("ckpt_interval_s")
    if interval is None:
        interval = max(daly_tau_opt(d.stall_s, mtbf_s), d.persist_lag_s)
    return float(interval)


class CheckpointRestart(Job):
    def __init__(self, env, cluster, layout, ledger, p: CheckpointRestartParams):
        super().__init__(env, cluster, layout, ledger, p.detect)
        self.p = p
        self.ckpt = p.disk.checkpoints(p.interval_s)
        self.drain_pending = False

    @staticmethod
    def params_from_cfg(layout, scfg: Mapping, calib: Mapping, mtbf_s: float) -> CheckpointRestartParams:
        d = costs.disk(layout, calib, scfg["ckpt_mode"], costs.requeues(scfg))
        return CheckpointRestartParams(detect=costs.detection(calib, layout),
                                       interval_s=checkpoint_interval_s(scfg, d, mtbf_s), disk=d)

    def on_interrupt(self, cause) -> None:
        if not isinstance(cause, Fault):
            return
        self.vacant.add(cause.slot)
        if cause.planned:
            self.drain_pending = self.drain_pending or self.W > self.ckpt.durable
        else:
            limit = self.poison.pop(cause.node, self.W) if cause.kind == costs.SDC else float("inf")
            self.rollback_to(self.ckpt.rollback_before(self.env.now, limit))
            self.note_failure(cause)
            self.drain_pending = False
        self.recovering = True

    def recover(self):
        yield from self.detection()
        if self.drain_pending:
            yield from self.phase("ckpt_stall", self.p.disk.write_s)
            self.ckpt.mark_durable(self.W)
            self.drain_pending = False
        yield from self.fill_vacant()
        yield from self.phase("restart", self.p.disk.restart_s)
        self.ledger.count("restarts")
