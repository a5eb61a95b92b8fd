"""Spare sizing (sim.spares) against its closed form and against the simulator."""

import math

import numpy as np
import pytest

from sim import spares
from sim.layout import Layout
from sim.simulate import run_one
from sim.trace import DAY_S, HOUR_S, TraceSpec, generate


def poisson_tail(s: int, a: float) -> float:
    """P(N >= s), N ~ Poisson(a), summed by hand."""
    return 1.0 - sum(math.exp(-a) * a ** k / math.factorial(k) for k in range(s))


@pytest.mark.parametrize("load", [0.3, 2.0, 7.7, 33.0])
@pytest.mark.parametrize("target", [0.01, 0.001])
def test_spares_needed_is_the_smallest_count_meeting_the_target(load, target):
    s = spares.spares_needed(load, target)
    assert poisson_tail(s, load) <= target < poisson_tail(s - 1, load)
    assert spares.stall_probability(s, load) == pytest.approx(poisson_tail(s, load), rel=1e-9, abs=1e-15)


def test_offered_load_is_rate_times_mean_time_away():
    spec = TraceSpec(name="x", unexpected_per_1000_node_days=10.0, cause_mix={"hw": 1}, transient_causes=(),
                     repair_median_h=1.0, repair_mean_h=3.0, rma_frac=0.5, rma_median_h=24.0, rma_mean_h=48.0)
    # 1000 nodes x 0.01 per day = 10 per day, each away (3 + 48) / 2 h = 25.5 h -> 10.625 nodes
    assert spares.offered_load(spec, 1000) == pytest.approx(10.0 / 24.0 * 25.5)


@pytest.mark.slow
def test_stall_share_in_the_simulator_matches_the_closed_form(strategy_cfgs, calib):
    """DeadPool, exponential failures, no transients: the share of failures that find the pool
    empty is P(N >= S) for S spares, within sampling error."""
    spec = TraceSpec(name="x", unexpected_per_1000_node_days=40.0, tbf_distribution="exponential",
                     cause_mix={"hw": 1}, transient_causes=(), repair_median_h=2.0, repair_mean_h=3.0)
    nodes, s = 1024, 6
    load = spares.offered_load(spec, nodes + s)  # 1030 x 0.04 / day x 3 h = 5.15
    lay = Layout(num_gpus=8 * nodes, gpus_per_node=8, tp=8, pp=1, num_spares=s, model_params=1.0,
                 bytes_per_param_state=16, optimizer_sharded_over_dp=False, step_time_s=1.0)
    horizon = 200 * DAY_S
    stalls = failures = 0
    for seed in range(4):
        tr = generate(spec, nodes + s, horizon, seed)
        r = run_one("deadpool", strategy_cfgs("deadpool"), calib, lay, tr, horizon, HOUR_S)
        stalls += r["empty_pool"]
        failures += r["failures"]
    p = spares.stall_probability(s, load)
    assert failures > 30_000
    sd = math.sqrt(p * (1 - p) / failures)
    assert stalls / failures == pytest.approx(p, abs=4 * sd)
    assert spares.spares_needed(load, 0.01) > s
