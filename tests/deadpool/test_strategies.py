"""The runtime strategies' pure parts (deadpool/rank/strategies.py)."""

import math

import pytest

from deadpool.rank.strategies import young_daly_steps


def test_young_interval_in_steps():
    # tau = sqrt(2 * delta * M): 0.5 s checkpoints, M = 100 s -> 10 s, i.e. 10 one-second steps
    assert young_daly_steps(0.5, 100.0, 1.0) == 10
    assert young_daly_steps(0.5, 100.0, 0.25) == 40
    # Daly's test point (delta = 5 min, M = 24 h): Young's first order gives 120 min (Daly's
    # higher-order optimum is 117 min); in one-minute steps
    assert young_daly_steps(300.0, 24 * 3600.0, 60.0) == 120


def test_young_interval_grows_as_the_square_root_of_cost_and_mtbf():
    base = young_daly_steps(0.01, 400.0, 0.01)
    assert young_daly_steps(0.04, 400.0, 0.01) == 2 * base
    assert young_daly_steps(0.01, 1600.0, 0.01) == 2 * base
    assert base == round(math.sqrt(2 * 0.01 * 400.0) / 0.01)


@pytest.mark.parametrize("cost,mtbf,step", [(1e-3, 1e-3, 10.0), (0.0, 3600.0, 1.0), (1.0, 0.0, 1.0)])
def test_young_interval_is_at_least_one_step(cost, mtbf, step):
    assert young_daly_steps(cost, mtbf, step) == 1
