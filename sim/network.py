"""Per-step replication traffic as a shared resource: does the snapshot fit between steps?

The per-step snapshot engine (DeadPool, in-memory checkpoint/restart) copies each GPU's state to
host memory and sends the part no data-parallel peer holds to a buddy node. The copy and the
traffic share two resources with training:

- the host link: the device-to-host copy of one snapshot (``state_bytes_per_gpu /
  host_copy_gbps_per_gpu``) must finish before the next optimizer step changes the parameters;
  whatever it takes beyond one step blocks training (GPU check 1: on/off 1.34 when the 0.32 s
  copy outlasted forward+backward);
- the node's NIC: per step it carries the gradient traffic of data parallelism (reduce-scatter
  plus all-gather of bf16 values, ``2 * 2 B * params/(tp*pp) * (dp-1)/dp`` per GPU) and, off the
  critical path, the replication (``replicated_bytes_per_node``). Replication only uses the time
  the gradients leave idle: ``spare_s = step - grad_s`` per step.

When one snapshot's replication needs more than the spare NIC time of the configured interval,
``on_nic_overflow`` decides: ``backpressure`` (the runtime's behaviour: ``snapshot()`` waits for
a free slot, so each interval stretches to ``k*grad_s + repl_s`` and that is overhead), or
``widen`` (snapshot every ``k = ceil(repl_s / spare_s)`` steps: no overhead, a longer protection
lag, so more recomputation per failure). Tensor-parallel traffic across nodes and pipeline
activations are not counted (TP is assumed inside a node); that is optimistic when ``tp`` exceeds
``gpus_per_node``.

Analytic expectation (tests/sim/test_network.py): with repl_s <= spare_s nothing changes but the
lag, ``max(replicate_lag_steps * step, repl_s * step / spare_s, d2h_s)``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from sim.layout import Layout

GRAD_BYTES = 2.0  # bf16 gradients / parameters on the wire


@dataclasses.dataclass(frozen=True)
class ReplicationPlan:
    replicated_bytes_per_node: float  # sent to the buddy per snapshot
    grad_s: float  # NIC time of one step's gradient traffic
    repl_s: float  # NIC time of one snapshot's replication
    d2h_s: float  # device-to-host copy of one snapshot (per GPU, in parallel)
    interval_steps: int  # effective snapshot interval
    lag_s: float  # a snapshot is usable on the buddy this long after it is taken
    extra_overhead_frac: float  # slowdown beyond the measured snapshot overhead
    nic_util: float  # busy fraction of the NIC (gradients + replication)


def grad_bytes_per_node(layout: Layout) -> float:
    dp = layout.dp
    per_gpu = 2.0 * GRAD_BYTES * layout.model_params / (layout.tp * layout.pp) * (dp - 1) / dp
    return per_gpu * layout.gpus_per_node


def replicated_bytes_per_node(layout: Layout, mode: str) -> float:
    """``unique``: what no data-parallel peer holds (the ZeRO-1 optimizer shard, or everything at
    dp = 1); ``full``: the whole per-GPU state."""
    shard = layout.model_params / (layout.tp * layout.pp)
    if mode == "full":
        per_gpu = layout.state_bytes_per_gpu
    elif mode == "unique":
        if layout.dp == 1:
            per_gpu = layout.state_bytes_per_gpu
        elif layout.optimizer_sharded_over_dp:
            per_gpu = shard * (layout.bytes_per_param_state - GRAD_BYTES) / layout.dp
        else:
            per_gpu = 0.0
    else:
        raise ValueError(f"replicate must be unique or full, got {mode!r}")
    return per_gpu * layout.gpus_per_node


def plan(layout: Layout, c: Mapping) -> ReplicationPlan:
    step = layout.step_time_s
    nic = layout.nic_gbps_per_node * 1e9
    k0 = max(1, int(c["snapshot_interval_steps"]))
    grad_s = grad_bytes_per_node(layout) / nic
    rep_bytes = replicated_bytes_per_node(layout, str(c.get("replicate", "unique")))
    repl_s = rep_bytes / nic
    d2h_s = layout.state_bytes_per_gpu / (float(c["host_copy_gbps_per_gpu"]) * 1e9)
    spare_s = max(step - grad_s, 0.0)
    mode = str(c.get("on_nic_overflow", "backpressure"))
    if mode not in ("backpressure", "widen"):
        raise ValueError(f"on_nic_overflow must be backpressure or widen, got {mode!r}")
    k, extra = k0, 0.0
    if repl_s <= k0 * spare_s:
        lag = repl_s * step / spare_s if spare_s > 0 else 0.0
    elif mode == "widen" and spare_s > 0:
        k = math.ceil(repl_s / spare_s)
        lag = repl_s * step / spare_s
    else:  # each interval stretches until the NIC has carried gradients and the replica
        interval_s = k0 * grad_s + repl_s
        # a step already longer than its compute (grad_s > step) is the preset's problem, not
        # the snapshot's: only the replication's share of the stretch is charged
        extra = interval_s / (k0 * max(step, grad_s)) - 1.0
        lag = interval_s
    extra += max(0.0, d2h_s - step) / (k * step)  # copy outlasting a step blocks the optimizer step
    lag = max(lag, d2h_s, float(c["replicate_lag_steps"]) * step)
    util = min(1.0, (k * grad_s + repl_s) / (k * step * (1.0 + extra)))
    return ReplicationPlan(replicated_bytes_per_node=rep_bytes, grad_s=grad_s, repl_s=repl_s, d2h_s=d2h_s,
                           interval_steps=k, lag_s=lag, extra_overhead_frac=extra, nic_util=util)
