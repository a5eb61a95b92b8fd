"""Shared fixtures for the simulator tests: small layouts, exact calibrations, handmade traces."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

import sim.config
from sim.layout import Layout
from sim.trace import EVENT_NAMES, Trace


@pytest.fixture
def layout():
    """8 nodes x 8 GPUs; tp*pp = 16 -> groups of 2 nodes, 4 groups; 2 spares; 10 s steps."""
    def make(num_spares: int = 2, **kw) -> Layout:
        args = dict(num_gpus=64, gpus_per_node=8, tp=8, pp=2, num_spares=num_spares, model_params=1.0,
                    bytes_per_param_state=16.0, optimizer_sharded_over_dp=False, step_time_s=10.0)
        args.update(kw)
        return Layout(**args)
    return make


@pytest.fixture
def calib():
    """Round numbers so expected answers can be written down: detection 5 s (crash and hang),
    swap = 0 + 20 + 5 + 0 = 25 s, restart = 100 + 10 = 110 s, synchronous write = 10 s (state
    bytes are negligible), no snapshot overhead, corruption noticed after 600 s."""
    c = yaml.safe_load((sim.config.SIM_CONF_DIR / "calibration" / "default.yaml").read_text())
    c.update(detect_crash_s=5.0, detect_hang_s=5.0, detect_sdc_s=600.0, plan_s=0.0, rebuild_base_s=20.0, rebuild_per_log2_gpus_s=0.0,
             transfer_latency_s=5.0, transfer_gbps_per_node=1e12, warmup_steps=0.0,
             snapshot_overhead_frac=0.0, snapshot_interval_steps=1, replicate_lag_steps=0.0,
             requeue_s=100.0, launch_base_s=0.0, launch_per_log2_nodes_s=0.0, ckpt_latency_s=10.0,
             storage_write_gbps=1e12, storage_read_gbps=1e12, host_copy_gbps_per_gpu=1e12)
    return c


@pytest.fixture
def strategy_cfgs():
    """A strategy's YAML as a dict. The hand-computed answers of the older tests count a restart as
    requeue + relaunch (110 s), so ``restart_in_allocation`` is false unless ``in_allocation=True``
    (the YAML default: tests/sim/test_baselines.py checks restarts inside the allocation)."""
    def load(name: str, in_allocation: bool = False) -> dict:
        out = _load(name)
        if "restart_in_allocation" in out:
            out["restart_in_allocation"] = in_allocation
        return out

    def _load(name: str) -> dict:
        d = yaml.safe_load((sim.config.SIM_CONF_DIR / "strategy" / f"{name}.yaml").read_text())
        out: dict = {}
        for base in d.pop("defaults", []):
            if base != "_self_":
                out.update(_load(base))
        out.update(d)
        return out
    return load


@pytest.fixture
def handmade():
    """Trace from rows (time_s, node, event name, transient, duration_s)."""
    def make(rows, num_nodes: int, horizon_s: float) -> Trace:
        causes = ("transient", "permanent", "planned", "preemption")
        return Trace(
            time_s=np.array([r[0] for r in rows], dtype=float),
            node=np.array([r[1] for r in rows], dtype=np.int64),
            event=np.array([EVENT_NAMES.index(r[2]) for r in rows], dtype=np.int8),
            cause=np.array([0 if r[3] else (2 if r[2] == "maintenance" else 1) for r in rows], dtype=np.int16),
            duration_s=np.array([r[4] for r in rows], dtype=float),
            causes=causes, transient_causes=frozenset({"transient"}),
            num_nodes=num_nodes, horizon_s=horizon_s)
    return make
