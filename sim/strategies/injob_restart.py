"""In-job restart onto warm standby nodes (NVIDIA Resiliency Extension, ``ft_launcher`` with hot
spares: its recommended path since v0.6).

Every failure restarts every process, but inside the job's allocation: ``ft_launcher`` on each
node respawns its workers, a warm standby node (already in the allocation, its launcher up)
takes the failed node's place, and the job resumes from NVRx *local checkpoints*: asynchronous
saves into host memory (the same snapshot engine as everyone's: one snapshot's stall per save)
replicated to a peer node, durable one node-state transfer later. The restart is
``costs.local_checkpoints``: relaunch without requeue (process start, imports, NCCL init, the
shared ``launch_*`` costs) + the replacement's state from its peer + warm-up. The save interval
is Daly's optimum for that stall and the job's MTBF (``ckpt_interval_s`` overrides it).

Differences from its neighbours: ``inmem_restart`` snapshots every step and restores the last
one (more overhead, less lost work); checkpoint/restart saves to shared storage (a minimum
interval, slower loads). Its best case is assumed: a failure never takes a node and the peer
holding its local checkpoint together (no fallback to storage is modelled).

Analytic expectation (tests/sim/test_baselines.py): one crash at progress w with saves every
tau costs ``detect + (w mod tau, or one interval more while the newest save is still being
replicated) + relaunch + transfer + warm-up``.
"""

from __future__ import annotations

from typing import Mapping

from sim import costs
from sim.strategies.checkpoint_restart import CheckpointRestart, CheckpointRestartParams, checkpoint_interval_s


class InJobRestart(CheckpointRestart):
    @staticmethod
    def params_from_cfg(layout, scfg: Mapping, calib: Mapping, mtbf_s: float) -> CheckpointRestartParams:
        d = costs.local_checkpoints(layout, calib)
        return CheckpointRestartParams(detect=costs.detection(calib, layout),
                                       interval_s=checkpoint_interval_s(scfg, d, mtbf_s), disk=d)
