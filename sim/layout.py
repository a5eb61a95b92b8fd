"""Cluster and job layout: GPUs, nodes, parallel degrees, iteration time and state size.

The failure domain is a node. Data-parallel replicas are the unit an elastic job can drop:
a replica spans ``tp * pp`` GPUs, i.e. ``nodes_per_group = max(1, tp*pp / gpus_per_node)``
nodes (a *group*); losing any node of a group takes the whole group out of an elastic job.

Iteration time comes from the model when ``step_time_s`` is null:
``step_time_s = 6 * model_params * tokens_per_step / (num_gpus * peak_tflops_per_gpu * 1e12 * mfu)``
(Llama 3 405B, 16M tokens, 16,384 H100 at 40% MFU: 6 * 405e9 * 16.8e6 / (16384 * 989e12 * 0.4)
= 6.3 s).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class Layout:
    num_gpus: int  # active GPUs of the job
    gpus_per_node: int
    tp: int
    pp: int
    num_spares: int  # reserved hot-spare nodes (charged to strategies that use them)
    model_params: float
    bytes_per_param_state: float  # bytes of weights + optimizer state per parameter
    optimizer_sharded_over_dp: bool  # ZeRO-1: optimizer state split over DP ranks
    step_time_s: float
    nic_gbps_per_node: float = 400.0  # GB/s of network bandwidth per node (all its NICs)
    nodes_per_rack: int = 1  # nodes behind one rack switch: a correlated failure domain
    tokens_per_step: float = 0.0  # global batch in tokens (pipeline activation traffic)
    hidden_size: int = 0  # model width (pipeline activation traffic; 0: not counted)
    hbm_gb_per_gpu: float | None = None  # GPU memory (memory feasibility checks; None: not checked)
    activation_gb_per_gpu: float = 0.0  # activations held at the peak of a step, per GPU
    reserved_gb_per_gpu: float = 0.0  # CUDA context, NCCL buffers, allocator slack
    replicas_per_group: int = 1  # data-parallel replicas per failure unit (an HSDP shard group)
    host_mem_gb_per_node: float | None = None  # host memory (snapshot feasibility; None: not checked)

    @property
    def num_nodes(self) -> int:
        return self.num_gpus // self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.num_gpus // (self.tp * self.pp)

    @property
    def nodes_per_group(self) -> int:
        return max(1, (self.tp * self.pp * self.replicas_per_group) // self.gpus_per_node)

    @property
    def num_groups(self) -> int:
        return self.num_nodes // self.nodes_per_group

    @property
    def state_bytes_total(self) -> float:
        """One copy of weights + optimizer state: what a disk checkpoint writes."""
        return self.model_params * self.bytes_per_param_state

    @property
    def state_bytes_per_gpu(self) -> float:
        """What one GPU must get back after a swap (its model shard and optimizer shard)."""
        shard = self.model_params / (self.tp * self.pp)
        if self.optimizer_sharded_over_dp:
            return shard * (2.0 + (self.bytes_per_param_state - 2.0) / self.dp)
        return shard * self.bytes_per_param_state

    def state_gb_per_gpu_sharded(self, shard_over: int) -> float:
        """GPU memory of weights + optimizer state per GPU when the optimizer (and gradients) are
        sharded over ``shard_over`` data-parallel ranks and the bf16 weights are replicated."""
        shard = self.model_params / (self.tp * self.pp)
        return shard * (2.0 + (self.bytes_per_param_state - 2.0) / max(1, shard_over)) / 1e9

    def fits(self, state_gb: float) -> bool:
        """Whether ``state_gb`` of model state plus activations and reserved memory fit one GPU."""
        if self.hbm_gb_per_gpu is None:
            return True
        return state_gb + self.activation_gb_per_gpu + self.reserved_gb_per_gpu <= self.hbm_gb_per_gpu

    @property
    def state_bytes_per_node(self) -> float:
        return self.state_bytes_per_gpu * self.gpus_per_node

    @classmethod
    def from_cfg(cls, c: Mapping) -> "Layout":
        num_gpus, gpn, tp, pp = int(c["num_gpus"]), int(c["gpus_per_node"]), int(c["tp"]), int(c["pp"])
        for key, v in (("num_gpus", num_gpus), ("gpus_per_node", gpn), ("tp", tp), ("pp", pp)):
            if v < 1:
                raise ValueError(f"cluster.{key}={v} must be >= 1")
        if num_gpus % gpn:
            raise ValueError(f"cluster.num_gpus={num_gpus} must be a multiple of gpus_per_node={gpn}")
        if num_gpus % (tp * pp):
            raise ValueError(f"cluster.num_gpus={num_gpus} must be a multiple of tp*pp={tp * pp}")
        nodes = num_gpus // gpn
        spares = c.get("num_spares")
        if spares is None:
            spares = math.ceil(float(c["spare_fraction"]) * nodes)
        step = c.get("step_time_s")
        if step is None:
            step = (6.0 * float(c["model_params"]) * float(c["tokens_per_step"])
                    / (num_gpus * float(c["peak_tflops_per_gpu"]) * 1e12 * float(c["mfu"])))
        return cls(num_gpus=num_gpus, gpus_per_node=gpn, tp=tp, pp=pp, num_spares=int(spares),
                   model_params=float(c["model_params"]),
                   bytes_per_param_state=float(c["bytes_per_param_state"]),
                   optimizer_sharded_over_dp=bool(c.get("optimizer_sharded_over_dp", True)),
                   step_time_s=float(step), nic_gbps_per_node=float(c.get("nic_gbps_per_node", 400.0)),
                   nodes_per_rack=int(c.get("nodes_per_rack", 1)),
                   tokens_per_step=float(c.get("tokens_per_step") or 0.0),
                   hidden_size=int(c.get("hidden_size") or 0),
                   hbm_gb_per_gpu=None if c.get("hbm_gb_per_gpu") is None else float(c["hbm_gb_per_gpu"]),
                   activation_gb_per_gpu=float(c.get("activation_gb_per_gpu") or 0.0),
                   reserved_gb_per_gpu=float(c.get("reserved_gb_per_gpu") or 0.0),
                   host_mem_gb_per_node=None if c.get("host_mem_gb_per_node") is None else float(c["host_mem_gb_per_node"]))
