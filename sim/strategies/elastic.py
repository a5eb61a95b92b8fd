"""Elastic baseline: shrink the data-parallel width on a failure, regrow when nodes return.

A failed node takes its whole data-parallel group (``tp*pp`` GPUs) out of the job: the
group's healthy nodes go idle in the pool, the job reconfigures (``detect_s`` + rebuild +
``reshard_s``) and continues at ``active_groups / num_groups`` of nominal throughput (the
shortfall is badput "degraded"). Only the partial iteration in flight is lost (the other
replicas hold the full state). When the pool holds a group's worth of nodes (the idle
survivors plus a repaired or rebooted node) a group is re-formed, paying rebuild + state
transfer. Below ``min_width_frac`` of the groups the job stalls until it can regrow.
No reserved spares by default: the elastic job is charged only for its own nodes.

Analytic expectation (tests/sim/test_strategies.py): one permanent failure with repair
time D at full width G groups costs about ``detect + reconfig + D/G`` of goodput seconds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from sim import costs
from sim.cluster import Fault, NodesAvailable
from sim.job import Job


@dataclasses.dataclass(frozen=True)
class ElasticParams:
    detect_s: float
    shrink_s: float  # rebuild at the new width + re-shard data/optimizer
    regrow_s: float  # rebuild + state transfer to the new group
    step_s: float
    min_groups: int


class Elastic(Job):
    def __init__(self, env, cluster, layout, ledger, p: ElasticParams):
        super().__init__(env, cluster, layout, ledger)
        self.p = p
        self.factors["degraded"] = 1.0
        self.shrink_pending = False

    @staticmethod
    def params_from_cfg(layout, scfg: Mapping, calib: Mapping, mtbf_s: float) -> ElasticParams:
        hot = costs.hotswap(layout, calib)
        return ElasticParams(
            detect_s=float(scfg["detect_s"]),
            shrink_s=hot.plan_s + hot.rebuild_s + float(scfg["reshard_s"]),
            regrow_s=hot.swap_s,
            step_s=layout.step_time_s,
            min_groups=max(1, math.ceil(float(scfg["min_width_frac"]) * layout.num_groups)),
        )

    def on_interrupt(self, cause) -> None:
        self.recovering = True
        if isinstance(cause, NodesAvailable) or not isinstance(cause, Fault):
            return
        g = self.group_of(cause.slot)
        if not self.group_active[g]:
            return
        if not cause.planned:
            step_w = self.p.step_s * self.rate
            self.rollback_to(self.W - self.lost_since_snapshot(step_w, 0.0))
            self.detect_pending = True
        self.dissolve(g)
        self.shrink_pending = True

    def recover(self):
        yield from self.detection(self.p.detect_s)
        if self.shrink_pending:
            yield from self.phase("reconfiguration", self.p.shrink_s)
            self.shrink_pending = False
        grew = 0
        while self.can_regrow() or self.active_groups < self.p.min_groups:
            if not self.can_regrow():
                yield from self.wait_for_pool(self._npg)
            self.regrow_one()
            grew += 1
        if grew:
            yield from self.phase("reconfiguration", self.p.regrow_s)
        self.background_need = self._npg if self.active_groups < len(self.group_active) else 0
        self.mem_floor = self.W
