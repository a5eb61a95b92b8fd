"""Shared cost model: calibration values + layout -> the durations every strategy spends.

One place for every cost that more than one strategy pays, so that the same event costs the
same for everyone (``sim/conf/calibration/<name>.yaml`` holds the values and their sources):

- detection, by failure cause (``Detection``): crash, hang, silent data corruption. A crash
  is a process exit (``detect_crash_s + detect_crash_per_rank_s * N``) or, for the causes in
  ``node_causes``, the loss of the whole node (``detect_node_s + detect_node_per_rank_s * N``,
  default: the crash time), N = ``num_gpus`` (one rank per GPU);
- reconfiguration without a restart (``Reconfig``): ``plan_s + rebuild_s + transfer_s + warmup``
  with ``plan_s = plan_base_s + plan_per_rank_s * N`` (a file that gives only ``plan_s`` gives the
  base; the per-rank terms come from ``sim.calibrate_control_plane``),
  ``rebuild_s = rebuild_base_s + rebuild_per_log2_gpus_s * log2(num_gpus)`` and
  ``transfer_s = transfer_latency_s + state_bytes_per_node / (transfer_gbps_per_node * 1e9)``.
  DeadPool's hot swap, elastic shrink/regrow and a replica's replacement all pay it;
- the per-step snapshot engine (``Snapshots``): measured main-thread overhead plus what
  ``sim.network`` charges when replication does not fit, the effective interval and lag;
- job restart: ``requeue_s + launch_base_s + launch_per_log2_nodes_s * log2(num_nodes) +
  launch_per_node_s * num_nodes + load`` (the linear term: launch work that serialises over
  nodes, e.g. every process importing from one shared file system),
  where load comes from storage (``ckpt_latency_s + state_bytes_total / (storage_read_gbps*1e9)``)
  or from peers' host memory (the transfer above);
- disk checkpoints (``DiskCosts``): synchronous write ``ckpt_latency_s + state_bytes_total /
  (storage_write_gbps * 1e9)``; asynchronous: the stall is one snapshot's (the measured
  per-snapshot overhead, ``snapshot_overhead_frac * step``, plus any device-to-host copy beyond a
  step: the same engine DeadPool uses), durable one synchronous-write time later.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

from sim import host_copy, network, overhead
from sim.layout import Layout

CRASH, HANG, SDC = "crash", "hang", "sdc"


@dataclasses.dataclass(frozen=True)
class Detection:
    crash_s: float  # a process exit -> noticed
    hang_s: float
    sdc_s: float  # delay before a silent corruption is noticed (the fault is delivered then)
    hang_causes: frozenset[str]
    sdc_causes: frozenset[str]
    node_s: float | None = None  # a whole node lost (its agent with it) -> noticed; None: crash_s
    node_causes: frozenset[str] = frozenset()  # crash causes that take the node down

    def kind(self, cause: str) -> str:
        if cause in self.sdc_causes:
            return SDC
        return HANG if cause in self.hang_causes else CRASH

    def seconds(self, kind: str, cause: str = "") -> float:
        """Detection time booked after the fault is delivered. A corruption is delivered only
        when it is noticed; the delay before it is lost work, booked by the rollback. A crash
        whose ``cause`` takes the node down is noticed in ``node_s``."""
        if kind == CRASH and self.node_s is not None and cause in self.node_causes:
            return self.node_s
        return {CRASH: self.crash_s, HANG: self.hang_s, SDC: 0.0}[kind]


@dataclasses.dataclass(frozen=True)
class Reconfig:
    plan_s: float
    rebuild_s: float
    transfer_s: float
    warmup_s: float

    @property
    def swap_s(self) -> float:
        """Time from detection to training again (excluding detection and recomputation)."""
        return self.plan_s + self.rebuild_s + self.transfer_s + self.warmup_s


@dataclasses.dataclass(frozen=True)
class Snapshots:
    overhead_frac: float  # measured + network/copy backpressure, fraction of a step
    interval_w: float  # progress between snapshots (nominal seconds)
    lag_s: float  # a snapshot is on the buddy this long after it is taken
    generations: int  # snapshots a buddy keeps (rollback targets for a corruption)
    net: network.ReplicationPlan


@dataclasses.dataclass(frozen=True)
class DiskCosts:
    stall_s: float  # training blocked per checkpoint
    persist_lag_s: float  # checkpoint durable this long after the stall ends
    write_s: float  # one synchronous write (also used for on-demand checkpoints)
    restart_s: float  # requeue + relaunch + load from storage (+ warm-up)
    min_interval_s: float = 0.0  # shared storage: at most ckpt_storage_duty_max of its time on this job's writes
    keep_last: int = 0  # retention: the newest N durable checkpoints are kept (0: every one)
    keep_every_s: float = 0.0  # ... and the last one before every multiple of this much progress

    def checkpoints(self, interval_s: float):
        """The lazy schedule (``sim.schedule.Checkpoints``) at ``interval_s``, with this storage's
        minimum interval and retention."""
        from sim.schedule import Checkpoints

        return Checkpoints(max(interval_s, self.min_interval_s), self.stall_s, self.persist_lag_s,
                           keep_last=self.keep_last, keep_every_w=self.keep_every_s)


def detection(c: Mapping, layout: Layout) -> Detection:
    """Detection times at the layout's number of ranks (``num_gpus``); the per-rank terms
    (default 0) are the control plane's, fitted by ``sim.calibrate_control_plane``."""
    n = layout.num_gpus
    crash = float(c["detect_crash_s"]) + float(c.get("detect_crash_per_rank_s", 0.0) or 0.0) * n
    node = None
    if c.get("detect_node_s") is not None:
        node = float(c["detect_node_s"]) + float(c.get("detect_node_per_rank_s", 0.0) or 0.0) * n
    return Detection(crash_s=crash, hang_s=float(c["detect_hang_s"]),
                     sdc_s=float(c["detect_sdc_s"]), hang_causes=frozenset(c.get("hang_causes", ())),
                     sdc_causes=frozenset(c.get("sdc_causes", ())), node_s=node,
                     node_causes=frozenset(c.get("node_causes", ()) or ()))


def plan_s(layout: Layout, c: Mapping) -> float:
    """Detection -> the plan in every rank's hands (statuses collected, plan decided, written and
    read): ``plan_base_s + plan_per_rank_s * num_gpus``.
    A calibration must give ``plan_base_s`` or (older files) ``plan_s``, not both: an override
    of one would silently leave the other in force."""
    if "plan_base_s" in c and "plan_s" in c:
        raise ValueError("calibration gives both plan_s and plan_base_s; keep one "
                         "(plan_s is the older name of plan_base_s)")
    base = c["plan_base_s"] if "plan_base_s" in c else c["plan_s"]
    return float(base) + float(c.get("plan_per_rank_s", 0.0) or 0.0) * layout.num_gpus


def reconfig(layout: Layout, c: Mapping) -> Reconfig:
    return Reconfig(
        plan_s=plan_s(layout, c),
        rebuild_s=float(c["rebuild_base_s"]) + float(c["rebuild_per_log2_gpus_s"]) * math.log2(layout.num_gpus),
        transfer_s=transfer_s(layout, c),
        warmup_s=float(c["warmup_steps"]) * layout.step_time_s,
    )


def transfer_s(layout: Layout, c: Mapping) -> float:
    """One node's state into a replacement from peers' host memory."""
    return float(c["transfer_latency_s"]) + layout.state_bytes_per_node / (float(c["transfer_gbps_per_node"]) * 1e9)


def snapshots(layout: Layout, c: Mapping, persist_interval_s: float | None = None) -> Snapshots:
    """The shared snapshot engine: a measured total overhead (``snapshot_overhead_frac``) or one
    built from its parts (``sim.overhead``), plus what ``sim.network`` charges."""
    net = network.plan(layout, c, persist_interval_s)
    if overhead.from_parts(c):
        base = overhead.host_side_s(layout, c, net.d2h_s) / (net.interval_steps * layout.step_time_s)
    else:
        base = float(c["snapshot_overhead_frac"])
    return Snapshots(overhead_frac=base + net.extra_overhead_frac,
                     interval_w=net.interval_steps * layout.step_time_s, lag_s=net.lag_s,
                     generations=max(1, int(c.get("snapshot_memory_generations", 2))), net=net)


def snapshot_stall_s(layout: Layout, c: Mapping) -> float:
    """Training time one snapshot (no replication) costs: its measured share of a step, or its
    issue and contention parts (``sim.overhead``), plus a device-to-host copy that outlasts the
    forward+backward it overlaps with."""
    d2h = host_copy.copy_s(layout, c)
    over = max(0.0, d2h - host_copy.overlap_window_s(layout, c))
    if overhead.from_parts(c):
        return overhead.host_side_s(layout, c, d2h) + over
    return float(c["snapshot_overhead_frac"]) * layout.step_time_s + over


def relaunch_s(layout: Layout, c: Mapping, num_nodes: int | None = None, requeue: bool = True) -> float:
    """Requeue and relaunch every process (NCCL init included), before any state is loaded;
    ``num_nodes`` (default: the layout's) is the width the job relaunches at. ``requeue=False``:
    the job restarts inside its allocation (it holds spares: nothing to ask the scheduler for)."""
    n = layout.num_nodes if num_nodes is None else num_nodes
    return ((float(c["requeue_s"]) if requeue else 0.0) + float(c["launch_base_s"])
            + float(c["launch_per_log2_nodes_s"]) * math.log2(max(n, 1))
            + float(c.get("launch_per_node_s", 0.0)) * n)


@dataclasses.dataclass(frozen=True)
class WidthScaling:
    """Throughput at a reduced data-parallel width, global batch kept, as a fraction of full.

    ``table`` (calibration ``width_step_time_ratio``: ``[[w/W, step time at w / at W], ...]``,
    measured by ``sim.calibrate`` on reduced-width runs) is interpolated linearly between its
    points and full width (1, 1); below its narrowest point the power law continues from there.
    Without a table: ``(w/W)**exponent`` (``width_scaling_exponent``; 1 = linear, every rank on
    its own GPU; measured below 0 where fewer ranks share a host's cores)."""

    exponent: float = 1.0
    table: tuple[tuple[float, float], ...] = ()

    def speed(self, frac: float) -> float:
        if frac >= 1.0:
            return 1.0
        pts = sorted(p for p in self.table if 0.0 < p[0] < 1.0)
        if not pts:
            return frac ** self.exponent
        f0, r0 = pts[0]
        if frac < f0:
            return (frac / f0) ** self.exponent / r0
        xs, ys = [f for f, _ in pts] + [1.0], [r for _, r in pts] + [1.0]
        return 1.0 / float(np.interp(frac, xs, ys))


def width_scaling(c: Mapping) -> WidthScaling:
    return WidthScaling(exponent=float(c.get("width_scaling_exponent", 1.0)),
                        table=tuple((float(f), float(r)) for f, r in (c.get("width_step_time_ratio") or ())))


def storage_gbps(c: Mapping, key: str) -> float:
    """This job's share of the storage's aggregate bandwidth (``storage_share_frac``: the rest
    serves data loading and other jobs)."""
    return float(c[key]) * float(c.get("storage_share_frac", 1.0))


def storage_load_s(layout: Layout, c: Mapping) -> float:
    """Every node's state back from storage (``ckpt_load``): ``one_copy`` reads one copy and
    ignores who needs it; ``broadcast`` reads one copy and sends the replicated weights to the
    other data-parallel replicas over the NIC (the cheapest way); ``direct`` has every node read
    its own state (weights once per replica)."""
    mode = str(c.get("ckpt_load", "one_copy"))
    read = storage_gbps(c, "storage_read_gbps") * 1e9
    if mode == "one_copy":
        return float(c["ckpt_latency_s"]) + layout.state_bytes_total / read
    if mode == "broadcast":
        weights_per_node = 2.0 * layout.model_params / (layout.tp * layout.pp) * layout.gpus_per_node
        bcast = weights_per_node / (layout.nic_gbps_per_node * 1e9) if layout.dp > 1 else 0.0
        return float(c["ckpt_latency_s"]) + layout.state_bytes_total / read + bcast
    if mode == "direct":
        return float(c["ckpt_latency_s"]) + layout.state_bytes_per_node * layout.num_nodes / read
    raise ValueError(f"ckpt_load must be one_copy, broadcast or direct, got {mode!r}")


def restart_warmup_s(layout: Layout, c: Mapping) -> float:
    """Slow first steps after a relaunch (``restart_warmup_steps``; the same warm-up a hot swap
    pays when it equals ``warmup_steps``)."""
    return float(c.get("restart_warmup_steps", 0.0)) * layout.step_time_s


def restart_s(layout: Layout, c: Mapping, requeue: bool = True) -> float:
    """Job restart from a disk checkpoint (``requeue=False``: inside the allocation)."""
    return relaunch_s(layout, c, requeue=requeue) + storage_load_s(layout, c) + restart_warmup_s(layout, c)


def memory_restart_s(layout: Layout, c: Mapping, requeue: bool = True) -> float:
    """Job restart from in-memory checkpoints: survivors load their own host copy, the replacement
    node gets its state from its buddy (one transfer); ``requeue=False``: inside the allocation."""
    return relaunch_s(layout, c, requeue=requeue) + transfer_s(layout, c) + restart_warmup_s(layout, c)


def requeues(scfg: Mapping) -> bool:
    """Whether a strategy's job restart goes through the scheduler (requeue + relaunch). A job
    that holds spares restarts inside its allocation (``restart_in_allocation``, default true):
    the baseline at its best; one without spares must ask for nodes again."""
    return not (bool(scfg.get("uses_spares", True)) and bool(scfg.get("restart_in_allocation", True)))


def rebuild_delta_s(c: Mapping) -> float:
    """Communicator set-up when only the changed members join (TrainMover's delta-based group
    set-up; elastic with ``rebuild: delta``): ``rebuild_delta_s``, flat in the job's size. A
    calibration without it gives the full rebuild's base."""
    return float(c.get("rebuild_delta_s", c["rebuild_base_s"]))


def inplace_reload_s(layout: Layout, c: Mapping) -> float:
    """Survivors stay in place and reload a durable checkpoint (a lost ZeRO-1 shard): plan +
    rebuild at the new width + storage load + warm-up, no requeue or relaunch."""
    rc = reconfig(layout, c)
    return rc.plan_s + rc.rebuild_s + storage_load_s(layout, c) + rc.warmup_s


def disk(layout: Layout, c: Mapping, mode: str, requeue: bool = True) -> DiskCosts:
    """Disk checkpoint costs; ``mode`` is ``sync`` or ``async``; ``requeue``: whether a restart
    goes through the scheduler (False: inside the allocation)."""
    write = float(c["ckpt_latency_s"]) + layout.state_bytes_total / (storage_gbps(c, "storage_write_gbps") * 1e9)
    duty = c.get("ckpt_storage_duty_max")
    min_interval = max(float(c.get("ckpt_min_interval_s", 0.0)), write / float(duty) if duty else 0.0)
    retention = dict(min_interval_s=min_interval, keep_last=int(c.get("ckpt_keep_last", 0) or 0),
                     keep_every_s=float(c.get("ckpt_keep_every_h", 0.0) or 0.0) * 3600.0)
    if mode == "sync":
        stall, lag = write, 0.0
    elif mode == "async":
        stall, lag = snapshot_stall_s(layout, c), write
    else:
        raise ValueError(f"checkpoint mode must be sync or async, got {mode!r}")
    return DiskCosts(stall_s=stall, persist_lag_s=lag, write_s=write, restart_s=restart_s(layout, c, requeue),
                     **retention)


def local_checkpoints(layout: Layout, c: Mapping) -> DiskCosts:
    """NVRx-style local checkpoints: an asynchronous save into host memory (the same snapshot
    engine: one snapshot's stall), replicated to a peer node (durable one node-state transfer
    later), and an in-job restart inside the allocation that loads it (relaunch without requeue
    + the replacement's state from its peer + warm-up). No shared storage: no minimum interval."""
    t = transfer_s(layout, c)
    return DiskCosts(stall_s=snapshot_stall_s(layout, c), persist_lag_s=t, write_s=t,
                     restart_s=memory_restart_s(layout, c, requeue=False))


def disk_from_snapshots(layout: Layout, c: Mapping, mode: str, requeue: bool = True) -> DiskCosts:
    """Disk checkpoints of a job that already takes a snapshot every step (DeadPool, in-memory
    restart): an asynchronous save is written from the newest snapshot off the training thread,
    so it adds no stall beyond the per-step overhead already charged (the runtime's persist)."""
    d = disk(layout, c, mode, requeue)
    return dataclasses.replace(d, stall_s=0.0) if mode == "async" else d
