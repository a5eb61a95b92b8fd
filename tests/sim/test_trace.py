"""Trace generator: determinism, rates, equilibrium start, cause split, repairs, maintenance."""

import math

import numpy as np
import pytest

from sim.trace import DAY_S, FAIL, HOUR_S, MAINTENANCE, TraceSpec, _intervals, generate, lognormal_sigma

LLAMA3 = TraceSpec(name="llama3", unexpected_per_1000_node_days=3.79, planned_per_1000_node_days=0.425)


def test_seeded_determinism():
    a = generate(LLAMA3, 500, 30 * DAY_S, seed=7)
    b = generate(LLAMA3, 500, 30 * DAY_S, seed=7)
    c = generate(LLAMA3, 500, 30 * DAY_S, seed=8)
    for f in ("time_s", "node", "event", "cause", "duration_s"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    assert len(a) != len(c) or not np.array_equal(a.time_s, c.time_s)
    assert np.all(np.diff(a.time_s) >= 0)


@pytest.mark.parametrize("dist", ["exponential", "weibull"])
def test_rate_matches_node_mttf(dist):
    spec = TraceSpec(name="x", unexpected_per_1000_node_days=3.79, tbf_distribution=dist, weibull_shape=0.6)
    counts = [generate(spec, 2048, 54 * DAY_S, seed=s).count(FAIL) for s in range(20)]
    assert np.mean(counts) == pytest.approx(2048 * 54 * 3.79 / 1000, rel=0.04)  # 419.1


def test_equilibrium_start_avoids_infant_mortality_overcount():
    """Starting every node at age 0 with k < 1 over-counts; the equilibrium start does not."""
    spec = TraceSpec(name="x", unexpected_per_1000_node_days=3.79, weibull_shape=0.5)
    rng = np.random.default_rng(0)
    n, horizon = 20000, 54 * DAY_S
    age0 = 0
    t = _intervals(spec, rng, n)
    while (t < horizon).any():
        age0 += int((t < horizon).sum())
        t = np.where(t < horizon, t + _intervals(spec, rng, n), t)
    eq = generate(spec, n, horizon, seed=0).count(FAIL)
    expected = n * 54 * 3.79 / 1000
    assert eq == pytest.approx(expected, rel=0.04)
    assert age0 > 1.5 * expected


def test_transient_share_and_repair_distribution():
    tr = generate(LLAMA3, 20000, 54 * DAY_S, seed=3)
    fail = tr.event == FAIL
    share = tr.transient[fail].mean()
    assert share == pytest.approx(95 / 419, abs=0.02)
    rep = tr.duration_s[fail & ~tr.transient] / HOUR_S
    assert np.median(rep) == pytest.approx(1.0, rel=0.1)
    assert rep.mean() == pytest.approx(3.0, rel=0.15)
    reboot = tr.duration_s[fail & tr.transient]
    assert np.median(reboot) == pytest.approx(300.0, rel=0.1)


def test_planned_maintenance_rate():
    counts = [generate(LLAMA3, 2048, 54 * DAY_S, seed=s).count(MAINTENANCE) for s in range(20)]
    assert np.mean(counts) == pytest.approx(47, rel=0.1)


def test_lognormal_sigma():
    assert lognormal_sigma(1.0, 3.0) == pytest.approx(math.sqrt(2 * math.log(3)))
    with pytest.raises(ValueError):
        lognormal_sigma(2.0, 1.0)


def test_many_failures_on_one_node_are_vectorised():
    spec = TraceSpec(name="x", unexpected_per_1000_node_days=1000 * 96, tbf_distribution="exponential")
    tr = generate(spec, 1, 1000 * DAY_S, seed=0)  # M = 15 min: ~96,000 failures
    assert len(tr) == pytest.approx(96000, rel=0.02)
