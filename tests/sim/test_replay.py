"""sim.replay: the simulator configured like a measured runtime run reproduces its goodput.

The shipped run directories (experiments/compare_strategies.py: dp=4, tiny model, every
strategy, failure-free / two kills / a burst of two, the failure schedules run three times; one
kill at dp=2 and dp=3) are calibrated with sim.calibrate and replayed. The target is 10 % on
each strategy's goodput: the mean over a schedule's repeats. One run on a shared 2-core host
sits further off (a relaunch that took a second longer, a slow phase of the host: single
elastic runs measured up to 16 % from the mean's replay), so a single run is allowed 20 %.
A held-out check fits the calibration without one repeat and replays that repeat.

These bounds were set after looking at the runs (the 20 % after a 16 % run): they are outcomes,
marked ``results`` (reported apart from the invariants by ``make test``), and a miss means the
simulator no longer reproduces the shipped measurements, not that the code is wrong.
"""

import json
import shutil
from pathlib import Path

import pytest

from sim import calibrate, replay

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "experiments/results/runtime/strategies"
DIRS = [d for d in calibrate.run_dirs([RUNS])
        if json.loads((d / "summary.json").read_text())["outcome"] == "completed"]
REPEATED = sorted({p for d in DIRS for p in d.parts if p.startswith("rep")})
MODE = {"deadpool": "sim_swaps", "sync_snapshot": "sim_swaps", "checkpoint_restart": "sim_restarts",
        "elastic": "sim_shrinks"}


def fitted(tmp_path: Path, dirs) -> dict:
    out = tmp_path / "calib.yaml"
    calibrate.main([str(d) for d in dirs] + ["--name", "replayed", "--out", str(out)])
    return replay.load_calibration(str(out))


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    return fitted(tmp_path_factory.mktemp("calib"), DIRS)


@pytest.fixture(scope="module")
def rows(calib):
    return [replay.replay(d, calib) for d in DIRS]


def test_the_shipped_runs_cover_every_strategy_schedule_and_repeats():
    groups = {replay.group_of(d) for d in DIRS}
    for sched in ("kills", "burst"):
        for strategy in MODE:
            assert str(RUNS / sched / strategy) in groups
    assert len(REPEATED) >= 2 and len(DIRS) > len(groups)


@pytest.mark.results
def test_each_strategys_mean_goodput_within_ten_percent(rows):
    for g in replay.by_group(rows):
        assert abs(g["rel_error"]) <= 0.10, g


@pytest.mark.results
@pytest.mark.parametrize("run_dir", DIRS, ids=lambda p: "/".join(p.relative_to(RUNS).parts))
def test_each_run_within_twenty_percent_on_the_recovery_path(run_dir, calib):
    row = replay.replay(run_dir, calib)
    assert abs(row["rel_error"]) <= 0.20, row
    if row["kills"]:
        assert row[MODE[row["strategy"]]] >= 1, row  # the simulator took the strategy's recovery path


@pytest.mark.results
@pytest.mark.parametrize("held_out", REPEATED)
def test_a_repeat_held_out_of_the_calibration_is_reproduced(held_out, tmp_path):
    test = [d for d in DIRS if held_out in d.parts]
    c = fitted(tmp_path, [d for d in DIRS if held_out not in d.parts])
    got = [replay.replay(d, c) for d in test]
    assert len(got) >= 4
    assert all(abs(r["rel_error"]) <= 0.20 for r in got), got


@pytest.mark.results
def test_the_calibration_measures_width_scaling_and_per_process_launch(calib):
    # both come from the runs: reduced-width generations and relaunches at 2, 3 and 4 ranks
    assert {f for f, _ in calib["width_step_time_ratio"]} == {0.5, 0.75}
    assert calib["width_scaling_exponent"] != 1.0
    assert calib["launch_per_node_s"] > 0 or calib["launch_per_log2_nodes_s"] > 0


def test_replay_finds_the_runs_below_a_directory_and_groups_repeats(tmp_path):
    got = replay.main([str(RUNS / "kills"), "--out", str(tmp_path / "r.csv")])  # shipped cpu_strategies
    assert {r["run"] for r in got} == {str(d) for d in DIRS if "kills" in d.relative_to(RUNS).parts}
    means = (tmp_path / "r_mean.csv").read_text().splitlines()
    assert len(means) == 1 + len({replay.group_of(r["run"]) for r in got}) < 1 + len(got)


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


def test_first_generation_step_time_is_taken_before_the_first_failure(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    rows = [dict(step=s, rank=r, generation=g, step_time_s=t, t=float(s))
            for g, steps, t in ((0, range(1, 6), 0.1), (1, range(5, 11), 0.3)) for s in steps for r in range(2)]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    (d / "job.json").write_text(json.dumps({"ft": {"strategy": "deadpool"}}))
    (d / "summary.json").write_text(json.dumps(dict(outcome="completed", steps=10, recoveries=[], model_params=10,
                                                    state_bytes_per_rank=100)))
    assert replay.load(d)["step_time_s"] == pytest.approx((4 * 0.1 + 5 * 0.3) / 9)
    assert replay.load(d, "first_generation")["step_time_s"] == pytest.approx(0.1)
    with pytest.raises(replay.ReplayError, match="step_time must be"):
        replay.load(d, "last")

