"""experiments/sim/ranking.py: the Latin hypercube and its summaries (no ranking is asserted)."""

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

import sim.config

HERE = sim.config.REPO_ROOT / "experiments" / "sim"
sys.path.insert(0, str(HERE))
import ranking  # noqa: E402


def test_latin_hypercube_hits_every_stratum_once_per_parameter():
    spec = [{"low": 2.0, "high": 6.0}, {"low": 1.0, "high": 100.0, "log": True}]
    n = 16
    v = ranking.draw(spec, n, seed=3)
    assert v.shape == (n, 2)
    lin = np.floor((v[:, 0] - 2.0) / 4.0 * n)
    log = np.floor(np.log(v[:, 1]) / np.log(100.0) * n)
    assert sorted(lin) == list(range(n)) and sorted(log) == list(range(n))
    assert not np.array_equal(v, ranking.draw(spec, n, seed=4))


def test_scaled_parameters_multiply_their_defaults():
    spec = [{"keys": ["a.x", "a.y"], "scale": True}, {"keys": ["b"]}]
    ov = ranking.overrides_for(spec, np.array([2.0, 0.5]), {"a.x": 10.0, "a.y": 3.0})
    assert ov == ["a.x=20", "a.y=6", "b=0.5"]


def test_categorical_assumptions_take_each_choice_equally_often():
    """Buddy placement is sampled as a choice: the hypercube's strata split evenly between the
    choices, and the override names the choice (not its index)."""
    spec = [{"keys": ["calibration.buddy_placement"], "choices": ["adjacent", "cross_rack"]}, {"low": 0.0, "high": 1.0}]
    v = ranking.draw(spec, 16, seed=0)
    assert sorted(v[:, 0]) == [0.0] * 8 + [1.0] * 8
    assert ranking.overrides_for(spec[:1], np.array([1.0]), {}) == ["calibration.buddy_placement=cross_rack"]


def test_the_study_samples_what_can_flip_the_ranking_against_the_strongest_baselines():
    import yaml

    spec = yaml.safe_load((HERE / "ranking.yaml").read_text())
    by = {k: p for p in spec["parameters"] for k in p["keys"]}
    assert by["calibration.snapshot_overhead_frac"]["low"] <= 0.0043 and by["calibration.snapshot_overhead_frac"]["high"] >= 0.03
    assert set(by["calibration.buddy_placement"]["choices"]) == {"adjacent", "cross_rack"}
    base = " ".join(spec["base"])
    for s in ("injob_restart", "trainmover", "elastic_spares", "checkpoint_restart", "inmem_restart"):
        assert s in base


@pytest.mark.parametrize("k, n", [(0, 10), (10, 10), (3, 10)])
def test_wilson_interval_holds_p(k, n):
    lo, hi = ranking.wilson(k, n)
    assert 0.0 <= lo <= k / n <= hi <= 1.0


def test_study_writes_its_summaries(tmp_path):
    """Two samples of a short window: every file is written and P(first) sums to 1 per scale and metric."""
    p = subprocess.run([sys.executable, str(HERE / "ranking.py"), "--samples", "2", "--days", "1", "--out", str(tmp_path)],
                       cwd=HERE, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    pf = pd.read_csv(tmp_path / "p_first.csv")
    assert set(pf.num_gpus) == {16384, 131072} and set(pf.metric) == {"goodput", "fleet_goodput"}
    assert np.allclose(pf.groupby(["num_gpus", "metric"]).p_first.sum(), 1.0)
    s = pd.read_csv(tmp_path / "samples.csv")
    assert len(s) == 2 * 2 * 9  # samples x scales x strategies (ranking.yaml base)
    assert s.groupby("strategy").feasible.any().all()  # a strategy may refuse a sample (memory), not all
    assert {"q05", "median", "q95", "p_positive"} <= set(pd.read_csv(tmp_path / "margin.csv").columns)
    assert len(pd.read_csv(tmp_path / "drivers.csv")) > 10
