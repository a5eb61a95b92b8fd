"""Smoke runs of the command-line entry points in a temporary directory."""

import os
import subprocess
import sys

import pandas as pd
import pytest

import sim.config

ROOT = sim.config.REPO_ROOT


def sim_run(tmp_path, *overrides, multirun=False):
    cmd = [sys.executable, "-m", "sim.run", *overrides]
    if multirun:
        cmd.insert(3, "-m")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_sim_run_writes_summary_and_prints_ettr(tmp_path):
    out = tmp_path / "run"
    p = sim_run(tmp_path, "trace=llama3", "cluster.num_gpus=1024", "duration_days=3", "seeds=2",
                f"hydra.run.dir={out}")
    assert p.returncode == 0, p.stderr
    df = pd.read_csv(out / "summary.csv")
    assert {"strategy", "seed", "goodput", "fleet_goodput", "failures", "planned_maintenance"} <= set(df.columns)
    assert sorted(df.strategy.unique()) == sorted(["deadpool", "inmem_restart", "checkpoint_restart", "injob_restart", "trainmover", "elastic", "elastic_hsdp", "elastic_spares"])
    assert len(df) == 2 * 8  # 2 seeds x the 8 headline strategies
    agg = pd.read_csv(out / "aggregate.csv")
    assert {"goodput_mean", "goodput_ci95_lo", "goodput_ci95_hi"} <= set(agg.columns)
    assert "ETTR" in p.stdout and "deadpool" in p.stdout
    assert "seed 2/2" in p.stderr  # progress


@pytest.mark.slow
def test_strategies_restricts_the_set_and_traces_are_saved(tmp_path):
    out = tmp_path / "run"
    p = sim_run(tmp_path, "strategies=[deadpool,elastic]", "cluster.num_gpus=1024", "duration_days=2",
                "seeds=1", "save_traces=true", f"hydra.run.dir={out}")
    assert p.returncode == 0, p.stderr
    assert list(pd.read_csv(out / "summary.csv").strategy) == ["deadpool", "elastic"]
    saved = out / "trace_seed0.csv"
    assert saved.exists()
    # the saved trace replays through trace=csv
    p2 = sim_run(tmp_path, "trace=csv", f"trace.path={saved}", "cluster.num_gpus=1024", "duration_days=2",
                 "seeds=1", f"hydra.run.dir={tmp_path / 'replay'}")
    assert p2.returncode == 0, p2.stderr
    a = pd.read_csv(out / "summary.csv").set_index("strategy")
    b = pd.read_csv(tmp_path / "replay" / "summary.csv").set_index("strategy")
    assert a.loc["deadpool", "goodput"] == pytest.approx(b.loc["deadpool", "goodput"])


@pytest.mark.slow
def test_unknown_strategy_is_a_clear_error(tmp_path):
    p = sim_run(tmp_path, "strategies=[deadpool,nope]", "seeds=1", "duration_days=1",
                f"hydra.run.dir={tmp_path / 'x'}")
    assert p.returncode != 0 and "nope" in p.stderr


@pytest.mark.slow
def test_multirun_with_joblib_and_collect(tmp_path):
    sweep = tmp_path / "mr"
    p = sim_run(tmp_path, "hydra/launcher=sim_joblib", "cluster.num_gpus=1024,2048", "duration_days=2",
                "seeds=1", f"hydra.sweep.dir={sweep}", multirun=True)
    assert p.returncode == 0, p.stderr
    from sim.collect import collect
    df, agg = collect([str(sweep)], tmp_path / "collected")
    assert sorted(df.num_gpus.unique()) == [1024, 2048]
    assert len(agg) == 2 * 8  # 2 sizes x the 8 headline strategies


def test_a_negative_gpu_count_is_a_clear_config_error(tmp_path):
    p = sim_run(tmp_path, "cluster.num_gpus=-5", f"hydra.run.dir={tmp_path / 'run'}")
    assert p.returncode == 2
    assert "cluster.num_gpus=-5 must be >= 1" in p.stderr and "Traceback" not in p.stderr
