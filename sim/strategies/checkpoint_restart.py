"""Checkpoint/restart baseline: periodic disk checkpoints, every failure restarts the job.

On an unexpected failure the job loses the work since the newest durable checkpoint, spends
``detect_s`` noticing, takes a replacement node from the pool (waiting for a repair when the
pool is empty) and restarts (requeue + relaunch + load). Failures during detection or restart
start the restart over. Planned maintenance drains: an on-demand synchronous checkpoint, then
the same restart, with no lost work.

Analytic expectation (asserted in tests/sim/test_daly.py): with synchronous writes, Poisson
failures of rate 1/M, ``detect_s = 0`` and restart time R, the long-run goodput is
``tau / (M e^(R/M) (e^((tau+delta)/M) - 1))`` (Daly 2006), and the best interval is Daly's
``tau_opt``.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from sim import costs
from sim.cluster import Fault
from sim.job import Job
from sim.schedule import Checkpoints, daly_tau_opt


@dataclasses.dataclass(frozen=True)
class CheckpointRestartParams:
    detect_s: float
    interval_s: float  # compute (nominal seconds) between checkpoints
    disk: costs.DiskCosts


class CheckpointRestart(Job):
    def __init__(self, env, cluster, layout, ledger, p: CheckpointRestartParams):
        super().__init__(env, cluster, layout, ledger)
        self.p = p
        self.ckpt = Checkpoints(p.interval_s, p.disk.stall_s, p.disk.persist_lag_s)
        self.drain_pending = False

    @staticmethod
    def params_from_cfg(layout, scfg: Mapping, calib: Mapping, mtbf_s: float) -> CheckpointRestartParams:
        d = costs.disk(layout, calib, scfg["ckpt_mode"])
        interval = scfg.get("ckpt_interval_s")
        if interval is None:  # Daly-optimal for this scenario's job MTBF
            interval = daly_tau_opt(d.stall_s, mtbf_s)
        return CheckpointRestartParams(detect_s=float(scfg["detect_s"]), interval_s=float(interval), disk=d)

    def on_interrupt(self, cause) -> None:
        if not isinstance(cause, Fault):
            return
        self.vacant.add(cause.slot)
        if cause.planned:
            self.drain_pending = self.drain_pending or self.W > self.ckpt.durable
        else:
            self.rollback_to(self.ckpt.rollback(self.env.now))
            self.detect_pending = True
            self.drain_pending = False
        self.recovering = True

    def recover(self):
        yield from self.detection(self.p.detect_s)
        if self.drain_pending:
            yield from self.phase("ckpt_stall", self.p.disk.write_s)
            self.ckpt.mark_durable(self.W)
            self.drain_pending = False
        yield from self.fill_vacant()
        yield from self.phase("restart", self.p.disk.restart_s)
        self.ledger.count("restarts")
