"""Gray failures in the simulator (sim/gray.py): the simulated losses against the docstring's
analytic expectation, and the policies compared on the same events."""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml

from sim import gray

CFG = yaml.safe_load((gray.ROOT / "experiments" / "sim" / "gray.yaml").read_text())


def test_union_counts_overlapping_intervals_once():
    assert gray.union_length(np.array([0.0, 5.0, 20.0]), np.array([10.0, 10.0, 1.0])) == 16.0
    assert gray.union_length(np.array([]), np.array([])) == 0.0


def test_detect_only_stragglers_lose_the_analytic_expectation_at_a_low_rate():
    c, rate = dict(CFG), 0.5  # ~55 events, overlaps rare
    lost = [gray.straggler_lost(np.random.default_rng(s), c, rate, "detect") for s in range(400)]
    n = rate * c["num_nodes"] * c["days"] / 1000
    each = (1 - 1 / c["slowdown"]) * c["straggler_median_s"] * math.exp(c["straggler_sigma"] ** 2 / 2)
    assert np.mean(lost) == pytest.approx(n * each, rel=0.05)


def test_migration_never_loses_more_than_detection_on_the_same_events():
    for rate in CFG["straggler_rates"]:
        for s in range(4):
            det = gray.straggler_lost(np.random.default_rng(s), CFG, rate, "detect")
            mig = gray.straggler_lost(np.random.default_rng(s), CFG, rate, "migrate")
            assert mig < det


def test_silent_corruption_losses_follow_the_formulas():
    c = dict(CFG, detect_sdc_s=100.0, ckpt_interval_s=0.0, restart_s=50.0)
    rng = np.random.default_rng(0)
    n = np.random.default_rng(0).poisson(1.0 * c["num_nodes"] * c["days"] / 1000)
    assert gray.sdc_lost(rng, c, 1.0, "detect") == pytest.approx(n * 150.0)
    k, step, swap = c["snapshot_interval_steps"], c["step_s"], c["swap_s"]
    got = gray.sdc_lost(np.random.default_rng(0), dict(c, dp=2), 1.0, "checksum")
    assert got == pytest.approx(n * ((2 * k + 1) * step + 2 * swap))
