"""The session's failure-free runs (tests/conftest.py ``failure_free``): one run per resolved
config, shared by every module that asks for it; a config that differs anywhere gets its own;
and the tiny pipelined jobs' pinned micro-batches."""

from __future__ import annotations

import deadpool.launch.job
from tests import conftest
from tests.conftest import compose_train


def test_one_run_per_resolved_config_and_any_difference_its_own(failure_free, monkeypatch):
    runs = []

    def fake_run_job(cfg, log=None):
        runs.append(cfg)
        return {"outcome": "completed", "recoveries": [], "final_digest": len(runs)}

    monkeypatch.setattr(deadpool.launch.job, "run_job", fake_run_job)
    monkeypatch.setattr(conftest, "_FAILURE_FREE", {})
    base = ["model=tiny", "parallel=dp2_tp2_pp2", "num_steps=8"]
    a_dir, a = failure_free(base)
    # the same config spelled otherwise (a default named, another order): the same run
    assert failure_free(["precision=fp32", *reversed(base)]) == (a_dir, a)
    assert len(runs) == 1 and runs[0]["faults"]["events"] in ([], None)
    assert str(runs[0]["run_dir"]) == str(a_dir)
    # one field apart (a step, a spare, the micro-batches): a run of its own, in its own directory
    for other in (["num_steps=10"], ["ft.num_spares=2"], ["parallel.microbatches=8"]):
        d, s = failure_free(base + other)
        assert d != a_dir and s["final_digest"] == len(runs)
    assert len(runs) == 4


def test_a_tiny_pipelined_job_runs_the_pinned_micro_batches_unless_told(tmp_path):
    tiny_3d = ["model=tiny", "parallel=dp2_tp2_pp2"]
    assert compose_train(tiny_3d, tmp_path)["parallel"]["microbatches"] == conftest.TEST_MICROBATCHES
    assert compose_train(tiny_3d + ["parallel.microbatches=auto"], tmp_path)["parallel"]["microbatches"] == "auto"
    assert compose_train(["model=tiny", "parallel=dp4"], tmp_path)["parallel"]["microbatches"] == "auto"
