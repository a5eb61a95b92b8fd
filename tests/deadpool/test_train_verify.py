"""``verify_against_failure_free=true`` (deadpool/train.py), without processes: after a completed
run the entry point re-runs the same config with no faults in a directory of its own, compares
the final states and digests, prints the verdict and exits by it. The real-process halves:
tests/integration/test_hotswap.py's verify test (a recovered run, from the command line: EQUAL,
exit 0) and tests/integration/test_3d.py's swapped-routes test (the comparison tells a recovery
that swapped two ranks' states from a right one)."""

from __future__ import annotations

from pathlib import Path

import pytest

import deadpool.train as train
from tests.conftest import compose_train


@pytest.mark.parametrize("equal,same_digest,code,verdict", [
    (True, True, 0, "EQUAL"),
    (False, True, 1, "DIFFERENT"),   # a state differs (e.g. two ranks' routes swapped)
    (True, False, 1, "DIFFERENT"),   # the states compare equal but the digests do not
])
def test_the_failure_free_rerun_decides_the_exit_status(tmp_path, monkeypatch, capsys, equal,
                                                        same_digest, code, verdict):
    cfg = compose_train(["model=tiny", "parallel=dp2", "faults=kill_mid_step",
                         "verify_against_failure_free=true"], tmp_path)
    jobs, compared = [], []

    def fake_run_job(c, log=None, stop=None):
        jobs.append(c)
        digest = "abc" if len(jobs) == 1 or same_digest else "abd"
        return {"outcome": "completed", "final_digest": digest}

    def fake_compare(a, b):
        compared.append((str(a), str(b)))
        return equal, "why"

    monkeypatch.setattr(train, "run_job", fake_run_job)
    monkeypatch.setattr(train, "compare_final_states", fake_compare)
    monkeypatch.setattr(train, "print_report", lambda summary: None)
    assert train.run(cfg) == code
    run, ref = jobs
    assert run["faults"]["events"] and ref["faults"]["events"] == []
    assert Path(ref["run_dir"]) == tmp_path / "reference_failure_free"
    assert Path(ref["ft"]["checkpoint_dir"]) == tmp_path / "reference_failure_free" / "checkpoints"
    assert {k: v for k, v in ref.items() if k not in ("faults", "run_dir", "ft")} == \
        {k: v for k, v in run.items() if k not in ("faults", "run_dir", "ft")}
    assert compared == [(str(tmp_path), str(tmp_path / "reference_failure_free"))]
    assert f"failure-free run of the same seed: {verdict}" in capsys.readouterr().out


def test_no_rerun_after_a_failed_run(tmp_path, monkeypatch):
    cfg = compose_train(["model=tiny", "parallel=dp2", "verify_against_failure_free=true"], tmp_path)
    jobs = []
    monkeypatch.setattr(train, "run_job", lambda c, **k: jobs.append(c) or
                        {"outcome": "unrecoverable", "final_digest": None})
    monkeypatch.setattr(train, "print_report", lambda summary: None)
    assert train.run(cfg) == 1 and len(jobs) == 1
