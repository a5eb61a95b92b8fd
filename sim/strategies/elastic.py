"""Elastic baseline: drop the failed node's data-parallel replica, regrow when nodes return.

The failure unit is one data-parallel replica (``tp*pp`` GPUs, a *group*), the granularity of
torchft's replica groups and FT-HSDP (Oobleck re-forms pipelines from templates at a similar
grain). A failed node takes its group out of the job: the group's healthy nodes go idle in the
pool, the job reconfigures (shared detection + plan + rebuild) and continues at
``active_groups / num_groups`` of nominal throughput (the shortfall is badput "degraded"). When
the pool holds a group's worth of nodes (the idle survivors plus a repaired or rebooted node) a
group is re-formed, paying rebuild + state transfer from a live replica (``regrow: background``:
the transfer runs while the job trains at its current width, and only plan + rebuild +
warm-up pause it; ``blocking``: the whole of it pauses the job). Below
``min_width_frac`` of the groups the job stalls until it can regrow. No reserved spares: the
elastic job is charged only for its own nodes.

What a lost replica loses depends on where the optimizer state lives (``optimizer_state``):
- ``cluster``: the cluster's layout. With ZeRO-1 over all data-parallel ranks
  (``optimizer_sharded_over_dp``) the dropped replica held the only copy of its optimizer
  shard: the job rolls back to the newest durable disk checkpoint. ``shard_loss`` says how:
  ``in_place`` (survivors keep their processes, re-shard over the narrower width and read the
  checkpoint: plan + rebuild + storage load + warm-up, ``costs.inplace_reload_s``; counted as
  ``reloads``) or ``restart`` (a full requeue and relaunch, ``costs.restart_s``);
- ``replicated``: HSDP / torchft style, every replica holds the whole optimizer state: only the
  step in flight is lost. That needs ``(bytes_per_param_state - 2) * params / (tp*pp)`` more GPU
  memory per GPU than ZeRO-1, which is charged: when weights + optimizer + activations +
  reserved memory do not fit ``hbm_gb_per_gpu``, ``on_memory_overflow: shard`` shards the
  optimizer over the fewest replicas k (1, 2, 4, ...) that fit, and k replicas become one
  failure unit (an HSDP shard group: losing a node drops all k); ``refuse`` raises.
- ``replica``: the runtime's ``ft=elastic``: ZeRO-1 over all ranks, but the snapshot engine keeps
  every shard on a buddy as well, so the dropped shard is restored from there and only the step
  in flight is lost (the rollback of ``replicated``, without its memory cost).
A silent corruption reaches every replica through the gradient all-reduce: restore from the
newest disk checkpoint taken before it began.

How the width changes (``shrink``):
- ``in_place`` (torchft replica groups, FT-HSDP, the runtime's ``ft.elastic_mode=in_place``):
  survivors keep their processes; plan + rebuild (the runtime also crosses one local disk
  checkpoint to re-cut the state, ~0.1 s on its CPU runs: not modelled);
- ``relaunch`` (torchelastic, and the runtime's ``ft.elastic_mode=relaunch``): the consistent state is
  written to storage and every process relaunches at the new width and loads it (write +
  ``costs.relaunch_s`` at the new width + storage load), for a shrink and for a regrow.
Throughput at reduced width follows the calibration (``sim.costs.WidthScaling``).

What is rebuilt (``rebuild``): ``full`` (every communicator, the shared ``rebuild_*`` cost) or
``delta`` (only the changed members set up their connections: ``costs.rebuild_delta_s``, flat in
the job's size, TrainMover's delta-based group set-up). With ``uses_spares: true`` (the
``elastic_spares`` preset) the pool holds spares, so a dropped replica is re-formed at once from
its survivors and a spare, its state arriving from a live replica while the job trains narrower.

Analytic expectation (tests/sim/test_strategies.py): one permanent failure with repair
time D at full width G groups, replicated optimizer, costs about ``detect + reconfig + D/G``
of goodput seconds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from sim import costs
from sim.cluster import Fault, NodesAvailable
from sim.job import Job
from sim.strategies.checkpoint_restart import checkpoint_interval_s


@dataclasses.dataclass(frozen=True)
class ElasticParams:
    detect: costs.Detection
    shrink_s: float  # plan + rebuild at the new width (shrink=in_place)
    regrow_s: float  # rebuild + state transfer to the new group
    step_s: float
    min_groups: int
    shard_lost: bool  # a dropped replica takes the only copy of its optimizer shard
    disk: costs.DiskCosts
    disk_interval_s: float
    width: costs.WidthScaling = costs.WidthScaling()
    relaunch_s: tuple[float, ...] | None = None  # shrink=relaunch: cost by active groups after it
    reload_s: float | None = None  # shard_loss=in_place: survivors reload from storage (else disk.restart_s)
    regrow_transfer_s: float = 0.0  # regrow=background: state into the new replica while the job trains narrower
    group_replicas: int = 1  # replicas per failure unit (HSDP shard group sized to fit memory)


def replicas_per_shard_group(layout, on_overflow: str) -> int:
    """Fewest data-parallel replicas (a power of 2) whose combined memory holds one replicated
    optimizer state beside each GPU's weights, activations and reserved memory."""
    k = 1
    while k <= layout.dp:
        if layout.fits(layout.state_gb_per_gpu_sharded(k)):
            return k
        if on_overflow != "shard":
            break
        k *= 2
    raise ValueError(f"elastic with a replicated optimizer does not fit {layout.hbm_gb_per_gpu} GB per GPU: "
                     f"{layout.state_gb_per_gpu_sharded(1):.1f} GB of state + {layout.activation_gb_per_gpu} GB "
                     f"activations + {layout.reserved_gb_per_gpu} GB reserved (on_memory_overflow={on_overflow})")


class Elastic(Job):
    def __init__(self, env, cluster, layout, ledger, p: ElasticParams):
        if p.group_replicas > 1:
            layout = dataclasses.replace(layout, replicas_per_group=p.group_replicas)
        super().__init__(env, cluster, layout, ledger, p.detect)
        self.p = p
        self.ckpt = p.disk.checkpoints(p.disk_interval_s)
        self.width = p.width
        self.factors["degraded"] = 1.0
        self.shrink_pending = False
        self.restore_pending = False

    @staticmethod
    def params_from_cfg(layout, scfg: Mapping, calib: Mapping, mtbf_s: float) -> ElasticParams:
        rc = costs.reconfig(layout, calib)
        where = str(scfg.get("optimizer_state", "cluster"))
        if where not in ("cluster", "replicated", "replica"):
            raise ValueError(f"optimizer_state must be cluster, replicated or replica, got {where!r}")
        shrink = str(scfg.get("shrink", "in_place"))
        if shrink not in ("in_place", "relaunch"):
            raise ValueError(f"shrink must be in_place or relaunch, got {shrink!r}")
        regrow = str(scfg.get("regrow", "blocking"))
        if regrow not in ("background", "blocking"):
            raise ValueError(f"regrow must be background or blocking, got {regrow!r}")
        shard_loss = str(scfg.get("shard_loss", "restart"))
        if shard_loss not in ("in_place", "restart"):
            raise ValueError(f"shard_loss must be in_place or restart, got {shard_loss!r}")
        k = 1
        if where == "replicated":
            k = replicas_per_shard_group(layout, str(scfg.get("on_memory_overflow", "shard")))
            layout = dataclasses.replace(layout, replicas_per_group=k)
        d = costs.disk(layout, calib, scfg["disk_ckpt_mode"], costs.requeues(scfg))
        relaunch = None
        if shrink == "relaunch":
            npg = layout.nodes_per_group
            relaunch = tuple(d.write_s + costs.relaunch_s(layout, calib, g * npg) + costs.storage_load_s(layout, calib)
                             + costs.restart_warmup_s(layout, calib) for g in range(layout.num_groups + 1))
        rebuild = str(scfg.get("rebuild", "full"))
        if rebuild not in ("full", "delta"):
            raise ValueError(f"rebuild must be full or delta, got {rebuild!r}")
        if rebuild == "delta":  # only the changed members set up their connections (TrainMover-style)
            rc = dataclasses.replace(rc, rebuild_s=costs.rebuild_delta_s(calib))
        reload_s = None
        if shard_loss == "in_place" and shrink == "in_place":
            reload_s = rc.plan_s + rc.rebuild_s + costs.storage_load_s(layout, calib) + rc.warmup_s
        return ElasticParams(
            detect=costs.detection(calib, layout),
            shrink_s=rc.plan_s + rc.rebuild_s,
            regrow_s=rc.swap_s,
            step_s=layout.step_time_s,
            min_groups=max(1, math.ceil(float(scfg["min_width_frac"]) * layout.num_groups)),
            shard_lost=where == "cluster" and layout.optimizer_sharded_over_dp and layout.dp > 1,
            disk=d,
            disk_interval_s=checkpoint_interval_s({"ckpt_interval_s": scfg.get("disk_ckpt_interval_s")}, d, mtbf_s),
            width=costs.width_scaling(calib),
            relaunch_s=relaunch,
            reload_s=reload_s,
            regrow_transfer_s=rc.transfer_s if regrow == "background" and shrink == "in_place" else 0.0,
            group_replicas=k,
        )

    def on_interrupt(self, cause) -> None:
        self.recovering = True
        if isinstance(cause, NodesAvailable) or not isinstance(cause, Fault):
            return
        g = self.group_of(cause.slot)
        if not self.group_active[g]:
            return
        if not cause.planned:
            self.ckpt.cancel_inflight(self.env.now)
            if cause.kind == costs.SDC:
                limit = self.poison.pop(cause.node, self.W)
                self.rollback_to(self.ckpt.rollback_before(self.env.now, limit))
                self.restore_pending = True
            elif self.p.shard_lost:
                self.rollback_to(self.ckpt.rollback(self.env.now))
                self.restore_pending = True
            elif not self.restore_pending:
                self.rollback_to(self.W - self.lost_since_snapshot(self.p.step_s * self.rate, 0.0))
            self.note_failure(cause)
        # planned maintenance drains: the leaving replica hands its shard over first
        self.dissolve(g)
        self.shrink_pending = True

    def recover(self):
        yield from self.detection()
        if self.restore_pending:
            if self.p.reload_s is None:
                yield from self.phase("restart", self.p.disk.restart_s)
                self.ledger.count("restarts")
            else:  # survivors stay; re-shard and read the checkpoint in place
                yield from self.phase("restart", self.p.reload_s)
                self.ledger.count("reloads")
            self.restore_pending = self.shrink_pending = False
        if self.shrink_pending:
            cost = self.p.shrink_s if self.p.relaunch_s is None else self.p.relaunch_s[self.active_groups]
            yield from self.phase("reconfiguration", cost)
            self.shrink_pending = False
        grew, background = 0, False
        if self.p.regrow_transfer_s > 0 and self.can_regrow() and self.active_groups >= self.p.min_groups:
            # the new replicas receive state from live ones while the job trains at its width
            yield from self.compute_for(self.p.regrow_transfer_s)
            background = True
        while self.can_regrow() or self.active_groups < self.p.min_groups:
            if not self.can_regrow():
                yield from self.wait_for_pool(self._npg)
                background = False  # below the minimum width nothing trains: the transfer blocks
            self.regrow_one()
            grew += 1
        if grew:
            if self.p.relaunch_s is not None:
                cost = self.p.relaunch_s[self.active_groups]
            else:
                cost = self.p.regrow_s - (self.p.regrow_transfer_s if background else 0.0)
            yield from self.phase("reconfiguration", cost)
        self.background_need = self._npg if self.active_groups < len(self.group_active) else 0
        self.mem_floor = self.W
