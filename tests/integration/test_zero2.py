"""ZeRO-2 end to end (real processes): the same training as ZeRO-1, and hot-swap at 3D bitwise.

dp2 runs one micro-batch per rank per step: ZeRO-2's per-bucket sums are ZeRO-1's, so the final
states are bitwise equal. dp2 x tp2 x pp2 runs 4 micro-batches (1F1B): ZeRO-2 reduces each
micro-batch over dp and sums the micro-batches in fp32 afterwards, ZeRO-1 the other way round,
so the two agree to fp32 rounding grown over 10 AdamW steps (tolerance below), not bitwise.
A killed rank under ZeRO-2 must still end bitwise equal to ZeRO-2's own failure-free run.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from deadpool.launch.job import run_job
from deadpool.launch.report import compare_final_states, load_final_rank
from tests.conftest import compose_train

quiet = lambda *a, **k: None  # noqa: E731
TINY = ["model=tiny", "num_steps=10", "log_every_steps=0", "faults=none"]


def final_states(run_dir, n):
    return [load_final_rank(run_dir, r) for r in range(n)]


def run(tmp_path_factory, name, overrides):
    run_dir = tmp_path_factory.mktemp(name)
    summary = run_job(compose_train(TINY + overrides, run_dir), log=quiet)
    assert summary["outcome"] == "completed", summary["message"]
    return run_dir


@pytest.fixture(scope="module")
def runs_3d(tmp_path_factory):
    base = ["parallel=dp2_tp2_pp2", "ft.replication_chunk_mb=0.5"]
    return {z: run(tmp_path_factory, f"zero{z}_3d", base + [f"parallel.zero={z}"]) for z in (1, 2)}


@pytest.mark.slow
def test_dp2_zero2_is_bitwise_zero1(tmp_path_factory):
    one, two = (run(tmp_path_factory, f"zero{z}_dp2", ["parallel=dp2", f"parallel.zero={z}"])
                for z in (1, 2))
    equal, why = compare_final_states(two, one)
    assert equal, why


@pytest.mark.slow
def test_3d_zero2_matches_zero1_to_rounding(runs_3d):
    """Tolerance: the per-step gradients differ by fp32 summation order (~1e-7 relative). AdamW
    divides by sqrt(v): where a gradient is near zero that rounding moves the update by up to
    about lr per step (measured: 1.2e-5 on one element of 133k after 10 steps), so the bound is
    an absolute 1e-4 (a thirtieth of one step at lr 3e-3) plus 1e-4 relative."""
    one, two = final_states(runs_3d[1], 8), final_states(runs_3d[2], 8)
    differ = 0
    for a, b in zip(one, two):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-4)
            differ += not torch.equal(a[k], b[k])
    assert differ  # the summation order does change bits: ZeRO-2 really ran


@pytest.mark.slow
@pytest.mark.parametrize("rank,phase", [(4, "backward"), (5, "allreduce")])
def test_3d_zero2_hot_swap_is_bitwise_the_failure_free_run(runs_3d, tmp_path, rank, phase):
    """Killed while its gradient buckets are being reduced from backward's hooks (the last
    stage, dp 0) or in the final reduce: the spare takes over and the job ends bitwise equal."""
    ev = f"faults.events=[{{rank: {rank}, step: 5, phase: {phase}, kind: kill}}]"
    summary = run_job(compose_train(["model=tiny", "num_steps=10", "log_every_steps=0",
                                     "parallel=dp2_tp2_pp2", "parallel.zero=2",
                                     "ft.num_spares=1", "ft.replication_chunk_mb=0.5", ev],
                                    tmp_path), log=quiet)
    assert summary["outcome"] == "completed", summary["message"]
    (rec,) = summary["recoveries"]
    assert rec["failed_rank"] == rank and rec["outcome"] == "hot-swapped"
    equal, why = compare_final_states(tmp_path, runs_3d[2])
    assert equal, why


@pytest.mark.slow
def test_zero2_verify_against_failure_free_says_equal(tmp_path):
    p = subprocess.run([sys.executable, "-m", "deadpool.train", "model=tiny",
                        "parallel=dp2_tp2_pp2", "parallel.zero=2", "num_steps=8",
                        "log_every_steps=0", "ft.num_spares=1", "verify_against_failure_free=true",
                        "launcher.fork_workers=true",  # (a new interpreter each: test_hotswap's)
                        "faults.events=[{rank: 2, step: 4, phase: backward, kind: kill}]",
                        f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=400)
    assert p.returncode == 0 and "failure-free run of the same seed: EQUAL" in p.stdout, p.stdout


@pytest.mark.slow
def test_an_unknown_zero_stage_is_refused_before_any_process_starts(tmp_path):
    p = subprocess.run([sys.executable, "-m", "deadpool.train", "parallel.zero=3",
                        f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "parallel.zero must be" in p.stderr, p.stderr
