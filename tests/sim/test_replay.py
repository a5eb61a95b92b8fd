"""sim.replay: the simulator configured like a measured runtime run reproduces its goodput.

The shipped run directories (experiments/compare_strategies.py: dp=4, tiny model, every
strategy, failure-free / two kills / a burst of two) are calibrated with sim.calibrate and
replayed. The target is 10 %; the test allows 15 % per run and asks for 10 % on the median.
Two shipped runs sit between 10 and 15 % (kills/checkpoint_restart: its two relaunches took 6.3
and 6.8 s where the fit over every relaunch says 6.0 s, and a goodput of 0.44 turns that into
13 %; kills/elastic: the dp=3 generation ran 9 % slower than full width, as one of three ranks
computes two of the four batches, which the simulator's power law in width does not model).
"""

import statistics

import json
import shutil
from pathlib import Path

import pytest

from sim import calibrate, replay

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "experiments/results/runtime/strategies"
STRATEGIES = ("deadpool", "sync_snapshot", "checkpoint_restart", "elastic")
REPLAYED = ([RUNS / "free/none"] + [RUNS / s / k for s in ("free", "kills", "burst") for k in STRATEGIES])
CALIBRATED = ([RUNS / s / k for s in ("kills", "burst") for k in ("deadpool", "checkpoint_restart", "elastic")]
              + [RUNS / f"scale/dp{w}" / k for w in (2, 3) for k in ("deadpool", "checkpoint_restart")])


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    out = tmp_path_factory.mktemp("calib") / "replayed.yaml"
    calibrate.main([str(d) for d in CALIBRATED] + ["--name", "replayed", "--out", str(out)])
    return replay.load_calibration(str(out))


@pytest.mark.parametrize("run_dir", REPLAYED, ids=lambda p: "/".join(p.parts[-2:]))
def test_replay_reproduces_the_measured_goodput(run_dir, calib):
    row = replay.replay(run_dir, calib)
    assert abs(row["rel_error"]) <= 0.15, row
    if "kills" in str(run_dir) or "burst" in str(run_dir):
        assert row["kills"] >= 1
        mode = {"deadpool": "sim_swaps", "sync_snapshot": "sim_swaps", "checkpoint_restart": "sim_restarts",
                "elastic": "sim_shrinks"}[row["strategy"]]
        assert row[mode] >= 1, row  # the simulator took the strategy's recovery path


def test_median_error_within_ten_percent(calib):
    errs = [abs(replay.replay(d, calib)["rel_error"]) for d in REPLAYED]
    assert statistics.median(errs) <= 0.10, errs


def test_the_calibration_measures_width_scaling_and_per_process_launch(calib):
    # both come from the runs: reduced-width generations and relaunches at 2, 3 and 4 ranks
    assert calib["width_scaling_exponent"] != 1.0
    assert calib["launch_per_node_s"] > 0 or calib["launch_per_log2_nodes_s"] > 0


def edited_run(tmp_path, source: str, **summary) -> Path:
    """A copy of a shipped run directory with some summary.json fields changed."""
    d = tmp_path / source.replace("/", "_")
    shutil.copytree(RUNS / source, d)
    s = json.loads((d / "summary.json").read_text())
    (d / "summary.json").write_text(json.dumps({**s, **summary}))
    return d


def test_a_failure_with_ft_none_is_refused(tmp_path, calib):
    with pytest.raises(replay.ReplayError, match="ft=none ends"):
        replay.replay(edited_run(tmp_path, "kills/deadpool", strategy="none"), calib)


def test_an_unfinished_run_is_refused(tmp_path, calib):
    with pytest.raises(replay.ReplayError, match="did not complete"):
        replay.replay(edited_run(tmp_path, "free/none", outcome="unrecoverable"), calib)


def test_kills_land_on_distinct_nodes_at_measured_times(calib):
    run = replay.load(RUNS / "kills/elastic")
    _, scfg, c, layout, trace = replay.configure(run, calib)
    assert len(set(trace.node.tolist())) == len(trace) == 2
    assert trace.time_s.tolist() == sorted(t for t, _ in run["kills"])
    assert scfg["shrink"] == "relaunch" and c["snapshot_overhead_frac"] == 0.0
    assert layout.num_gpus == run["dp"] == 4
