"""Per-step replication traffic as a shared resource: does the snapshot fit between steps?

The per-step snapshot engine (DeadPool, in-memory checkpoint/restart) copies each GPU's state to
host memory and sends the part no data-parallel peer holds to a buddy node. The copy and the
traffic share two resources with training:

- the host link: the device-to-host copy of one snapshot (``state_bytes_per_gpu /
  host_copy_gbps_per_gpu``) must finish before the next optimizer step changes the parameters;
  whatever it takes beyond one step blocks training (GPU check 1: on/off 1.34 when the 0.32 s
  copy outlasted forward+backward);
- the node's NIC: per step it carries the gradient traffic of data parallelism (reduce-scatter
  plus all-gather of bf16 values, ``2 * 2 B * params/(tp*pp) * (dp-1)/dp`` per GPU), the
  pipeline's activations and their gradients (``activation_bytes_per_node``, with the cluster's
  ``hidden_size``), the strategy's own disk checkpoint writes (averaged), and, off the critical
  path, the replication (``replicated_bytes_per_node``). Replication only uses the time the
  rest leaves idle: ``spare_s = step - grad_s - other_s`` per step.

When one snapshot's replication needs more than the spare NIC time of the configured interval,
``on_nic_overflow`` decides: ``backpressure`` (the runtime's behaviour: ``snapshot()`` waits for
a free slot, so each interval stretches to ``k*grad_s + repl_s`` and that is overhead), or
``widen`` (snapshot every ``k = ceil(repl_s / spare_s)`` steps: no overhead, a longer protection
lag, so more recomputation per failure). Tensor-parallel traffic across nodes and pipeline
The device-to-host copy's rate, the overlap window and the checksum come from ``sim.overhead``
(the parts of the snapshot overhead). Tensor-parallel traffic across nodes is not counted (TP is
assumed inside a node); that is optimistic when ``tp`` exceeds ``gpus_per_node``.

Analytic expectation (tests/sim/test_network.py): with repl_s <= spare_s nothing changes but the
lag, ``max(replicate_lag_steps * step, repl_s * step / spare_s, d2h_s)``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from sim import host_copy
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
    nic_util: float  # busy fraction of the NIC (gradients + other traffic + replication)
    other_s: float = 0.0  # NIC time of one step's pipeline activations and storage writes
    checksum_s: float = 0.0  # one rank hashing one snapshot
    nic_frac: float = 0.0  # overhead parts (fractions of a step): NIC backpressure,
    checksum_frac: float = 0.0  #   checksum backpressure,
    copy_over_frac: float = 0.0  #   device-to-host copy beyond the overlap window


def grad_bytes_per_node(layout: Layout) -> float:
    dp = layout.dp
    per_gpu = 2.0 * GRAD_BYTES * layout.model_params / (layout.tp * layout.pp) * (dp - 1) / dp
    return per_gpu * layout.gpus_per_node


def replicated_bytes_per_node(layout: Layout, mode: str, replicas: int = 1) -> float:
    """``unique``: what no data-parallel peer holds (the ZeRO-1 optimizer shard, or everything at
    dp = 1); ``full``: the whole per-GPU state; sent to each of ``replicas`` buddies."""
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
    return per_gpu * layout.gpus_per_node * replicas


def activation_bytes_per_node(layout: Layout) -> float:
    """Pipeline traffic of one step leaving a node: activations forward and their gradients
    backward across each stage boundary, ``2 * 2 B * hidden * tokens_per_replica`` per node that
    holds one stage of a replica (tensor parallelism inside the node); 0 without ``pp`` > 1 or a
    ``hidden_size``."""
    if layout.pp <= 1 or not layout.hidden_size:
        return 0.0
    tokens = layout.tokens_per_step / layout.dp
    per_stage = 2.0 * GRAD_BYTES * layout.hidden_size * tokens
    stages_per_node = max(1.0, layout.gpus_per_node / layout.tp)
    return per_stage * stages_per_node


def plan(layout: Layout, c: Mapping, persist_interval_s: float | None = None) -> ReplicationPlan:
    """``persist_interval_s``: the strategy's disk checkpoints (their writes leave through the same
    NIC: one node's state per interval, averaged over steps)."""
    step = layout.step_time_s
    nic = layout.nic_gbps_per_node * 1e9
    k0 = max(1, int(c["snapshot_interval_steps"]))
    grad_s = grad_bytes_per_node(layout) / nic
    other_s = activation_bytes_per_node(layout) / nic
    if persist_interval_s and math.isfinite(persist_interval_s):
        other_s += layout.state_bytes_per_node * step / persist_interval_s / nic
    busy_s = grad_s + other_s
    rep_bytes = replicated_bytes_per_node(layout, str(c.get("replicate", "unique")),
                                          int(c.get("replicas", 1)))
    repl_s = rep_bytes / nic
    d2h_s = host_copy.copy_s(layout, c, rep_bytes)
    chk_s = host_copy.checksum_s(layout, c)
    spare_s = max(step - busy_s, 0.0)
    mode = str(c.get("on_nic_overflow", "backpressure"))
    if mode not in ("backpressure", "widen"):
        raise ValueError(f"on_nic_overflow must be backpressure or widen, got {mode!r}")
    k, nic_extra = k0, 0.0
    if repl_s <= k0 * spare_s:
        lag = repl_s * step / spare_s if spare_s > 0 else 0.0
    elif mode == "widen" and spare_s > 0:
        k = math.ceil(repl_s / spare_s)
        lag = repl_s * step / spare_s
    else:  # each interval stretches until the NIC has carried the step's traffic and the replica
        interval_s = k0 * busy_s + repl_s
        # a step already longer than its compute (busy_s > step) is the preset's problem, not
        # the snapshot's: only the replication's share of the stretch is charged
        nic_extra = interval_s / (k0 * max(step, busy_s)) - 1.0
        lag = interval_s
    if mode == "widen" and chk_s > k * step:  # hashing must keep up with the snapshots
        k = math.ceil(chk_s / step)
    chk_extra = max(0.0, chk_s - k * step) / (k * step)  # backpressure: snapshot() waits for a slot
    copy_extra = max(0.0, d2h_s - host_copy.overlap_window_s(layout, c)) / (k * step)  # blocks the optimizer step
    extra = nic_extra + chk_extra + copy_extra
    lag = max(lag, d2h_s + chk_s, float(c["replicate_lag_steps"]) * step)
    util = min(1.0, (k * busy_s + repl_s) / (k * step * (1.0 + extra)))
    return ReplicationPlan(replicated_bytes_per_node=rep_bytes, grad_s=grad_s, repl_s=repl_s, d2h_s=d2h_s,
                           interval_steps=k, lag_s=lag, extra_overhead_frac=extra, nic_util=util,
                           other_s=other_s, checksum_s=chk_s, nic_frac=nic_extra, checksum_frac=chk_extra,
                           copy_over_frac=copy_extra)
