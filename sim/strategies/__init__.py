"""Strategies: one interface (a ``sim.job.Job`` subclass with ``params_from_cfg``), one trace.

Every strategy is built by ``build(kind, env, cluster, layout, ledger, scfg, calib, mtbf_s)``
and replays the same trace. Every cost that more than one of them pays comes from the shared
calibration through ``sim.costs``; ``scfg`` (the strategy's YAML) holds only its own knobs.
``uses_spares(scfg)`` says whether it holds the reserved spare pool (and is charged for it in
fleet goodput).

| kind | where the copy lives | on a failure |
|---|---|---|
| ``deadpool`` | buddy's host memory, every step | hot swap a spare in |
| ``inmem_restart`` | buddy's host memory, every step (Gemini-like) | restart the job |
| ``checkpoint_restart`` | storage, Daly interval (async) | restart the job |
| ``replication`` | a redundant computation on the pair node | fail over, replace |
| ``elastic`` | other data-parallel replicas (+ storage) | drop a replica, regrow |
| ``injob_restart`` | NVRx local checkpoints (host memory + a peer) | restart every process in the allocation |
| ``trainmover`` | data-parallel peers (+ storage for a ZeRO-1 shard) | sandbox-warmed standby joins (delta set-up) |

Every strategy that holds spares restarts inside its allocation (no requeue) unless its YAML says
``restart_in_allocation: false`` (``sim.costs.requeues``).
"""

from __future__ import annotations

from typing import Mapping

from sim.strategies.checkpoint_restart import CheckpointRestart
from sim.strategies.deadpool import DeadPool
from sim.strategies.elastic import Elastic
from sim.strategies.injob_restart import InJobRestart
from sim.strategies.inmem_restart import InMemoryRestart
from sim.strategies.replication import Replication
from sim.strategies.trainmover import TrainMover

REGISTRY = {
    "deadpool": DeadPool,
    "inmem_restart": InMemoryRestart,
    "checkpoint_restart": CheckpointRestart,
    "replication": Replication,
    "elastic": Elastic,
    "injob_restart": InJobRestart,
    "trainmover": TrainMover,
}


def build(kind: str, env, cluster, layout, ledger, scfg: Mapping, calib: Mapping, mtbf_s: float):
    if kind not in REGISTRY:
        raise ValueError(f"unknown strategy kind {kind!r}; known: {', '.join(REGISTRY)}")
    cls = REGISTRY[kind]
    return cls(env, cluster, layout, ledger, cls.params_from_cfg(layout, scfg, calib, mtbf_s))


def uses_spares(scfg: Mapping) -> bool:
    return bool(scfg.get("uses_spares", True))


def redundant_gpus(kind: str, scfg: Mapping, num_gpus: int) -> float:
    """Extra GPUs a strategy occupies beyond the active job (charged in fleet goodput)."""
    return float(scfg.get("redundant_gpu_frac", 0.0)) * num_gpus if kind == "replication" else 0.0
