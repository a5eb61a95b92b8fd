"""Cost model: turn calibration values and the layout into per-event durations.

Every duration a strategy spends comes from here, so the formulas are in one place:

- hot-swap (DeadPool): ``detect_s + plan_s + rebuild_s + transfer_s + warmup``, with
  ``rebuild_s = rebuild_base_s + rebuild_per_log2_gpus_s * log2(num_gpus)`` and
  ``transfer_s = transfer_latency_s + state_bytes_per_node / (transfer_gbps_per_node * 1e9)``;
  plus recomputation of the steps since the newest replicated snapshot.
- job restart (checkpoint/restart, and every strategy's fallback):
  ``requeue_s + launch_base_s + launch_per_log2_nodes_s * log2(num_nodes) + load``, with
  ``load = ckpt_latency_s + state_bytes_total / (storage_read_gbps * 1e9)``.
- disk checkpoint: synchronous write ``ckpt_latency_s + state_bytes_total / (storage_write_gbps
  * 1e9)``; asynchronous: the stall is the device-to-host copy of one GPU's state
  (``state_bytes_per_gpu / (host_copy_gbps_per_gpu * 1e9)``) and the write finishes in the
  background one synchronous-write time later.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from sim.layout import Layout


@dataclasses.dataclass(frozen=True)
class HotSwapCosts:
    detect_s: float
    plan_s: float
    rebuild_s: float
    transfer_s: float
    warmup_s: float
    snapshot_overhead_frac: float
    snapshot_interval_w: float  # progress between in-memory snapshots (nominal seconds)
    replicate_lag_s: float  # a snapshot is usable on the buddy this long after it is taken

    @property
    def swap_s(self) -> float:
        """Time from detection to training again (excluding detection and recomputation)."""
        return self.plan_s + self.rebuild_s + self.transfer_s + self.warmup_s


@dataclasses.dataclass(frozen=True)
class DiskCosts:
    stall_s: float  # training blocked per checkpoint
    persist_lag_s: float  # checkpoint durable this long after the stall ends
    write_s: float  # one synchronous write (also used for on-demand checkpoints)
    restart_s: float  # requeue + relaunch + load


def hotswap(layout: Layout, c: Mapping) -> HotSwapCosts:
    step = layout.step_time_s
    return HotSwapCosts(
        detect_s=float(c["detect_s"]),
        plan_s=float(c["plan_s"]),
        rebuild_s=float(c["rebuild_base_s"]) + float(c["rebuild_per_log2_gpus_s"]) * math.log2(layout.num_gpus),
        transfer_s=float(c["transfer_latency_s"]) + layout.state_bytes_per_node / (float(c["transfer_gbps_per_node"]) * 1e9),
        warmup_s=float(c["warmup_steps"]) * step,
        snapshot_overhead_frac=float(c["snapshot_overhead_frac"]),
        snapshot_interval_w=max(1, int(c["snapshot_interval_steps"])) * step,
        replicate_lag_s=float(c["replicate_lag_steps"]) * step,
    )


def restart_s(layout: Layout, c: Mapping) -> float:
    load = float(c["ckpt_latency_s"]) + layout.state_bytes_total / (float(c["storage_read_gbps"]) * 1e9)
    return (float(c["requeue_s"]) + float(c["launch_base_s"])
            + float(c["launch_per_log2_nodes_s"]) * math.log2(max(layout.num_nodes, 1)) + load)


def disk(layout: Layout, c: Mapping, mode: str) -> DiskCosts:
    """Disk checkpoint costs; ``mode`` is ``sync`` or ``async``."""
    write = float(c["ckpt_latency_s"]) + layout.state_bytes_total / (float(c["storage_write_gbps"]) * 1e9)
    if mode == "sync":
        stall, lag = write, 0.0
    elif mode == "async":
        stall, lag = layout.state_bytes_per_gpu / (float(c["host_copy_gbps_per_gpu"]) * 1e9), write
    else:
        raise ValueError(f"checkpoint mode must be sync or async, got {mode!r}")
    return DiskCosts(stall_s=stall, persist_lag_s=lag, write_s=write, restart_s=restart_s(layout, c))
