"""ft=checkpoint_restart with real processes: periodic DCP checkpoints (async and synchronous,
fixed and Young/Daly interval); a SIGKILL tears the job down and relaunches every process from
the newest complete checkpoint, which resumes bitwise."""

from __future__ import annotations

import json

import pytest

from deadpool.launch.job import run_job
from deadpool.launch.report import compare_final_states
from deadpool.rank.strategies import young_daly_steps
from tests.conftest import compose_train

BASE = ["model=tiny", "parallel=dp4", "num_steps=16", "log_every_steps=0"]
quiet = lambda *a, **k: None  # noqa: E731


def test_checkpoint_restart_refuses_bad_knobs(tmp_path):
    for bad, msg in ((["ft.num_spares=1"], "no spares"), (["ft.snapshot=true"], "snapshots"),
                     (["ft.persist_interval_steps=0"], "persist_interval_steps"),
                     (["ft.persist_interval_steps=auto"], "mtbf_s")):
        with pytest.raises(ValueError, match=msg):
            run_job(compose_train(BASE + ["ft=checkpoint_restart"] + bad, tmp_path), log=quiet)
    with pytest.raises(ValueError, match="auto"):
        run_job(compose_train(BASE + ["ft.persist_interval_steps=auto"], tmp_path), log=quiet)
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("async_", [True, False], ids=["async_save", "sync_save"])
def test_a_kill_relaunches_everything_from_the_checkpoint_bitwise(tmp_path, failure_free, async_):
    ref, _ = failure_free(BASE + ["ft=none"])  # one run for both cases (tests/conftest.py)
    run = tmp_path / "cr"
    s = run_job(compose_train(BASE + ["ft=checkpoint_restart", "ft.persist_interval_steps=4",
                                      f"ft.persist_async={str(async_).lower()}",
                                      "faults=kill_mid_step", "faults.events.0.step=10"], run),
                log=quiet)
    assert s["outcome"] == "completed", s["message"]
    (rec,) = s["recoveries"]
    assert rec["outcome"] == "relaunched from checkpoint"
    # the newest complete checkpoint at the kill: step 8's (a synchronous write is done before
    # step 9 starts; an asynchronous one may still be writing under load, then step 4's)
    assert rec["failed_at_step"] == 10
    assert rec["resume_step"] == 8 if not async_ else rec["resume_step"] in (4, 8)
    assert rec["steps_recomputed"] == 10 - rec["resume_step"]
    for k in ("detect_s", "teardown_s", "start_s", "exec_s", "imports_s", "build_s", "load_s",
              "first_step_s", "kill_to_first_step_s"):
        assert rec[k] is not None and rec[k] >= 0, k
    assert rec["kill_to_first_step_s"] >= rec["start_s"] + rec["load_s"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # steps 9 and 10 were computed twice: once before the kill, once after the relaunch
    assert {r["generation"] for r in rows if r["step"] == 9 and r["rank"] == 0} == {0, 2}
    assert all(r["checkpoint_s"] is not None for r in rows if r["step"] % 4 == 0)
    equal, why = compare_final_states(run, ref)
    assert equal, why


@pytest.mark.slow
def test_young_daly_interval_is_measured_and_agreed(tmp_path):
    # checkpoints of the tiny model take milliseconds (d), steps ~0.1 s: with an MTBF M of 5 s,
    # tau = sqrt(2 d M) is a few steps, so the agreed interval recurs several times in 30 steps;
    # with an MTBF of 0.01 s it is below a step (every step)
    for mtbf, steps in ((5, 30), (0.01, 16)):
        run = tmp_path / f"m{mtbf}"
        s = run_job(compose_train(BASE + ["ft=checkpoint_restart", "ft.persist_interval_steps=auto",
                                          f"ft.mtbf_s={mtbf}", "ft.persist_async=false",
                                          f"num_steps={steps}"], run), log=quiet)
        assert s["outcome"] == "completed", s["message"]
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        ckpt = sorted({r["step"] for r in rows if r["checkpoint_s"] is not None})
        for r in range(4):  # every rank checkpointed the same steps
            assert sorted(x["step"] for x in rows if x["rank"] == r and x["checkpoint_s"]
                          is not None) == ckpt
        assert ckpt[0] == 2  # the measured probe
        later = ckpt[1:]
        assert len(later) >= 2, f"the agreed interval did not recur within {steps} steps: {ckpt}"
        k = later[1] - later[0]
        # one agreed interval k: every multiple of k after the probe, and nothing else
        assert later == list(range(k * (2 // k + 1), steps + 1, k)), (ckpt, k)
        # each rank proposed Young/Daly's interval for what it measured at the probe, with this
        # MTBF, and every rank adopted the widest proposal
        props = [x["checkpoint_interval_proposal"] for x in rows
                 if x["step"] == 2 and x["checkpoint_interval_proposal"] is not None]
        assert len(props) == 4
        for p in props:
            assert p["proposed"] == young_daly_steps(p["cost_s"], mtbf, p["step_s"]), p
        assert k == max(p["proposed"] for p in props), (k, props)
        if mtbf < 1:
            assert k == 1
