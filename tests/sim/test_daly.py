"""Validation against Daly (2006): checkpoint/restart under Poisson failures.

Daly's three published test points: T_s = 500 h, R = 10 min, delta = 5 min and M = 24 h,
6 h, 15 min. The simulated long-run goodput must equal T_s / E[T_wall] with
E[T_wall] = M e^(R/M) (e^((tau+delta)/M) - 1) T_s / tau within 1%. The windows are long
enough (~60k-400k failures) that the Monte-Carlo error is ~0.1-0.3%. They are checked through
the scenario config ``trace=daly_poisson`` (M = 24 h with no other override; the other two
with the overrides its header documents) and once through ``python -m sim.run``.
"""

import os
import subprocess
import sys

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import sim.config
from sim import simulate

from sim.layout import Layout
from sim.schedule import daly_expected_wall_s, daly_tau_opt
from sim.simulate import run_one
from sim.trace import DAY_S, TraceSpec, generate

H, MIN = 3600.0, 60.0
DELTA, R, WORK = 5 * MIN, 10 * MIN, 500 * H
LAYOUT = Layout(num_gpus=1, gpus_per_node=1, tp=1, pp=1, num_spares=0, model_params=1.0,
                bytes_per_param_state=1.0, optimizer_sharded_over_dp=False, step_time_s=1.0)
# restart = requeue + load(latency) = R; sync write = latency = delta
CALIB = dict(ckpt_latency_s=DELTA, storage_write_gbps=1e30, storage_read_gbps=1e30, requeue_s=R - DELTA,
             launch_base_s=0.0, launch_per_log2_nodes_s=0.0, host_copy_gbps_per_gpu=1.0,
             detect_crash_s=0.0, detect_hang_s=0.0, detect_sdc_s=0.0, snapshot_overhead_frac=0.0)


def poisson_trace(m_s: float, horizon_s: float, seed: int = 0):
    spec = TraceSpec(name="daly", unexpected_per_1000_node_days=1000 * DAY_S / m_s,
                     tbf_distribution="exponential", transient_downtime_median_s=0.0,
                     cause_mix={"x": 1}, transient_causes=("x",))
    return generate(spec, 1, horizon_s, seed)


def simulated_goodput(m_s: float, tau_s: float, horizon_s: float, trace=None) -> float:
    trace = trace if trace is not None else poisson_trace(m_s, horizon_s)
    scfg = dict(kind="checkpoint_restart", ckpt_mode="sync", ckpt_interval_s=tau_s)
    r = run_one("checkpoint_restart", scfg, CALIB, LAYOUT, trace, horizon_s, m_s)
    assert abs(r["accounting_error_s"]) < 1e-6 * horizon_s
    return r["goodput"]


def daly_goodput(m_s: float) -> float:
    tau = daly_tau_opt(DELTA, m_s)
    return WORK / daly_expected_wall_s(WORK, tau, DELTA, R, m_s)


POINTS = [(24 * H, []),  # trace=daly_poisson alone
          (6 * H, ["trace.unexpected_per_1000_node_days=4000", "duration_days=15000"]),
          (15 * MIN, ["trace.unexpected_per_1000_node_days=96000", "duration_days=4200"])]


@pytest.mark.slow
@pytest.mark.parametrize("m_s, overrides", POINTS)
def test_daly_points_through_the_scenario_config(m_s, overrides):
    with initialize_config_dir(version_base="1.3", config_dir=str(sim.config.CONF_DIR)):
        cfg = OmegaConf.to_container(compose("sim", overrides=["trace=daly_poisson", *overrides]), resolve=True)
    (row,) = simulate.run_scenario(cfg, progress=False)
    assert row["job_mtbf_h"] * H == pytest.approx(m_s)
    assert abs(row["accounting_error_s"]) < 1e-6 * cfg["duration_days"] * 86400
    assert row["goodput"] == pytest.approx(daly_goodput(m_s), rel=0.01)


@pytest.mark.slow
def test_daly_point_through_the_command_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(sim.config.REPO_ROOT))
    p = subprocess.run([sys.executable, "-m", "sim.run", "trace=daly_poisson", f"hydra.run.dir={tmp_path}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    got = pd.read_csv(tmp_path / "summary.csv").goodput.item()
    assert got == pytest.approx(daly_goodput(24 * H), rel=0.01)


@pytest.mark.slow
def test_best_simulated_interval_is_near_daly_optimum():
    m_s = 6 * H
    tau_opt = daly_tau_opt(DELTA, m_s)
    horizon = 40_000 * m_s
    trace = poisson_trace(m_s, horizon, seed=3)  # common random numbers across intervals
    grid = [0.4, 0.7, 1.0, 1.4, 2.5]
    goodputs = [simulated_goodput(m_s, f * tau_opt, horizon, trace) for f in grid]
    best = grid[max(range(len(grid)), key=goodputs.__getitem__)]
    assert best in (0.7, 1.0, 1.4)
    assert max(goodputs) - goodputs[grid.index(1.0)] < 0.003
