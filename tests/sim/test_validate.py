"""sim.validate: the published-fleet table (columns, values as published, inputs as documented)."""

import subprocess
import sys

import pandas as pd
import pytest

import sim.config
from sim import validate


def test_cli_writes_the_table_with_the_relied_on_columns(tmp_path):
    p = subprocess.run([sys.executable, "-m", "sim.validate", "--out", str(tmp_path), "--seeds", "1",
                        "--days-100k", "2"], cwd=sim.config.REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    df = pd.read_csv(tmp_path / "validation.csv")
    assert list(df.columns) == ["fleet", "metric", "published", "simulated", "error", "sample", "fitted", "source"]
    assert {"llama3_16k", "ft_hsdp_100k", "byterobust_9600", "infinitehbd_400"} <= set(df.fleet)
    # every row says in or out of sample and what was fitted on what; the error is simulated - published
    assert set(df["sample"]) == {"in", "out"} and df.fitted.str.len().min() > 10
    assert (df.error - (df.simulated - df.published)).abs().max() < 1e-3
    assert set(df[df.fleet == "llama3_16k"].set_index("metric")["sample"].items()) == {
        ("unexpected_interruptions", "in"), ("ettr", "out")}
    pub = df.set_index(["fleet", "metric"]).published
    assert pub[("llama3_16k", "ettr")] == 0.90 and pub[("llama3_16k", "unexpected_interruptions")] == 419
    assert pub[("ft_hsdp_100k", "ettr_synchronous")] == 0.44 and pub[("ft_hsdp_100k", "ettr_ft_hsdp")] == 0.80
    ettr = df[df.metric.str.startswith("ettr")]
    assert ((ettr.simulated > 0) & (ettr.simulated <= 1)).all()  # fractions, not percent
    assert df.source.str.len().min() > 20
    assert (tmp_path / "validation.md").read_text().count("\n") == len(df) + 2


def test_published_stalls_are_what_the_runs_are_given():
    """The 'published stalls as inputs' configurations: a synchronous restart of 10 min and an
    FT-HSDP reconfiguration of 3 min (nothing else on the stall)."""
    base = ["cluster.num_gpus=98304", "trace=llama3"]
    sync = validate.compose_cfg(base + validate.SYNC_STALL_10MIN)
    assert validate.sync_stall_min([], sync) == pytest.approx(10.0, rel=0.002)
    ft = validate.compose_cfg(base + validate.FT_STALL_3MIN)
    assert validate.ft_stall_min([], ft) == pytest.approx(3.0)
