"""sim/report.py: per-strategy means and 95 % Student-t confidence intervals over seeds."""

import math

import pandas as pd
import pytest

from sim import report


def test_mean_sd_and_student_t_interval_over_seeds():
    df = pd.DataFrame({"strategy": ["a"] * 4 + ["b"],
                       "goodput": [0.90, 0.92, 0.94, 0.96, 0.5],
                       "failures": [1, 2, 3, 4, 7]})
    agg = report.aggregate(df).set_index("strategy")
    a = agg.loc["a"]
    assert a["n_seeds"] == 4
    assert a["goodput_mean"] == pytest.approx(0.93)
    sd = math.sqrt(sum((x - 0.93) ** 2 for x in (0.90, 0.92, 0.94, 0.96)) / 3)
    assert a["goodput_sd"] == pytest.approx(sd)
    half = 3.182446305284263 * sd / 2  # t_{0.975, 3 d.o.f.} from tables, sqrt(4) = 2
    assert a["goodput_ci95_lo"] == pytest.approx(0.93 - half)
    assert a["goodput_ci95_hi"] == pytest.approx(0.93 + half)
    assert a["failures_mean"] == pytest.approx(2.5)
    b = agg.loc["b"]  # one seed: no spread, a zero-width interval rather than NaN
    assert b["n_seeds"] == 1 and b["goodput_sd"] == 0.0
    assert b["goodput_ci95_lo"] == b["goodput_ci95_hi"] == 0.5
