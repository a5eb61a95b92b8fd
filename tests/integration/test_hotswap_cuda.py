"""Hot-swap with CUDA state: 4 ranks + 1 spare on one GPU, gloo over CUDA tensors, a SIGKILL
mid-step, the spare restored from the buddy's replica alone (``ft.replicate=full``); the final state must be bitwise equal to
a failure-free run (deterministic algorithms on). Skipped without a GPU."""

from __future__ import annotations

import pytest

from deadpool.launch.job import run_job
from deadpool.launch.report import compare_final_states
from tests.conftest import compose_train

BASE = ["model=tiny", "parallel=dp4", "num_steps=16", "ft.num_spares=1", "device=cuda",
        "backend=gloo", "deterministic=true", "ft.state_sources=[replica]", "ft.replicate=full",
        "log_every_steps=0"]  # replicate=full: the whole state (ZeRO-1 shard and parameters) from the replica
quiet = lambda *a, **k: None  # noqa: E731


@pytest.mark.gpu
@pytest.mark.slow
def test_spare_restores_cuda_state_from_replica_and_matches_failure_free(tmp_path):
    ref = run_job(compose_train(BASE + ["faults=none"], tmp_path / "ref"), log=quiet)
    assert ref["outcome"] == "completed", ref["message"]
    summary = run_job(compose_train(BASE + ["faults=kill_mid_step"], tmp_path / "swap"), log=quiet)
    assert summary["outcome"] == "completed", summary["message"]
    (rec,) = summary["recoveries"]
    assert rec["failed_rank"] == 1 and rec["outcome"] == "hot-swapped"
    assert rec["sources"] == {"1": "replica from rank 2"}
    equal, why = compare_final_states(tmp_path / "swap", tmp_path / "ref")
    assert equal, why
    assert summary["final_digest"] == ref["final_digest"]
