"""Hot-swap with real processes: kill (SIGKILL), hang (SIGSTOP) or crash a rank, let a warm spare
take over, and require the final state to be bitwise equal to a failure-free run of the same seed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deadpool.launch.job import run_job
from deadpool.launch.report import compare_final_states
from tests.conftest import compose_train

BASE = ["model=tiny", "parallel=dp4", "num_steps=20", "ft.num_spares=1",
        "ft.replication_chunk_mb=0.5", "log_every_steps=0"]
quiet = lambda *a, **k: None  # noqa: E731


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    summary = run_job(compose_train(BASE + ["faults=none"], run_dir), log=quiet)
    assert summary["outcome"] == "completed" and not summary["recoveries"]
    return run_dir, summary


def slots_by_rank(run_dir: Path) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out.setdefault(r["rank"], set()).add(r["slot"])
    return out


def test_a_sigkilled_rank_is_hot_swapped_and_ends_bitwise_equal(tmp_path):
    """The shortest real-process recovery (not ``slow``): dp2, a SIGKILL in
    the gradient all-reduce, a warm spare restored from the buddy's replica and a peer."""
    small = ["model=tiny", "parallel=dp2", "num_steps=8", "ft.num_spares=1", "log_every_steps=0"]
    ref = run_job(compose_train(small + ["faults=none"], tmp_path / "ref"), log=quiet)
    assert ref["outcome"] == "completed" and not ref["recoveries"]
    s = run_job(compose_train(small + ["faults=kill_mid_step", "faults.events.0.step=4"],
                              tmp_path / "run"), log=quiet)
    assert s["outcome"] == "completed", s["message"]
    (rec,) = s["recoveries"]
    assert rec["failed_rank"] == 1 and rec["outcome"] == "hot-swapped"
    equal, why = compare_final_states(tmp_path / "run", tmp_path / "ref")
    assert equal, why


@pytest.mark.slow
@pytest.mark.parametrize("faults,rank,detected_by", [
    ("kill_mid_step", 1, "exit"),        # peers are inside the gradient all-reduce
    ("kill_step_start", 2, "exit"),      # at a step boundary
    ("kill_replication", 1, "exit"),     # mid-transfer of a snapshot: that replica must not count
    ("kill_rank0", 0, "exit"),           # rank 0 is nothing special (the store is not on it)
    ("kill_last", 3, "exit"),            # wrap-around buddy: rank 3's replica lives on rank 0
    ("stop_hang", 2, "heartbeat"),       # SIGSTOP: sockets stay open, only heartbeats tell
    ("exception", 1, "exception"),       # the training step raises
])
def test_warm_spare_replaces_failed_rank_and_state_matches_failure_free(
        reference, tmp_path, faults, rank, detected_by):
    # replicas only for the torn-replica case (a data-parallel peer would otherwise serve step 11)
    extra = ["ft.state_sources=[replica]"] if faults == "kill_replication" else []
    summary = run_job(compose_train(BASE + [f"faults={faults}"] + extra, tmp_path), log=quiet)
    assert summary["outcome"] == "completed", summary["message"]
    (rec,) = summary["recoveries"]
    assert rec["failed_rank"] == rank
    assert rec["detected_by"] == detected_by
    assert rec["spare_slot"] == 4 and rec["outcome"] == "hot-swapped"
    assert 0 <= rec["steps_recomputed"] <= 2
    if faults == "kill_replication":  # the torn replica of step 11 must not be used
        assert rec["resume_step"] < 11
    for k in ("detect_s", "plan_s", "rebuild_s", "transfer_s", "rollback_s", "first_step_s",
              "kill_to_training_s", "kill_to_first_step_s"):
        assert rec[k] is not None and rec[k] >= 0, k
    # survivors kept their processes; only the dead rank's slot changed
    slots = slots_by_rank(tmp_path)
    assert slots[rank] == {rank, 4}
    assert all(slots[r] == {r} for r in range(4) if r != rank)
    equal, why = compare_final_states(tmp_path, reference[0])
    assert equal, why
    assert summary["final_digest"] == reference[1]["final_digest"]


@pytest.mark.slow
def test_no_spare_left_writes_a_dcp_checkpoint_that_resumes_to_the_same_state(reference, tmp_path):
    stopped = tmp_path / "stopped"
    summary = run_job(compose_train(BASE + ["faults=kill_mid_step", "ft.num_spares=0",
                                            "ft.on_no_spare=checkpoint_and_stop",
                                            "ft.persist_interval_steps=5"], stopped), log=quiet)
    assert summary["outcome"] == "checkpoint_and_stop"
    assert "no warm spare" in summary["message"]
    S = summary["recoveries"][0]["resume_step"]
    ckpt = stopped / "checkpoints"
    assert (ckpt / f"step_{S}" / "meta.json").exists()
    assert sorted(p.name for p in (ckpt / f"step_{S}").glob("rank_*")) == [f"rank_{r}" for r in range(4)]
    from deadpool import checkpoint
    assert checkpoint.is_complete(ckpt / "step_10")  # periodic persistence before the failure
    assert checkpoint.latest_step_dir(ckpt).name == f"step_{S}"
    resumed = tmp_path / "resumed"
    summary2 = run_job(compose_train(BASE + ["faults=none", f"ft.resume_from={ckpt}"], resumed),
                       log=quiet)
    assert summary2["outcome"] == "completed"
    equal, why = compare_final_states(resumed, reference[0])
    assert equal, why


@pytest.mark.slow
def test_no_spare_left_with_on_no_spare_checkpoint_restart_relaunches_to_the_same_state(
        reference, tmp_path):
    s = run_job(compose_train(BASE + ["faults=kill_mid_step", "ft.num_spares=0",
                                      "ft.on_no_spare=checkpoint_restart"], tmp_path), log=quiet)
    assert s["outcome"] == "completed", s["message"]
    (rec,) = s["recoveries"]
    assert rec["outcome"] == "relaunched from checkpoint" and rec["load_s"] >= 0
    equal, why = compare_final_states(tmp_path, reference[0])
    assert equal, why


@pytest.mark.slow
def test_first_free_spare_policy_hot_swaps_exactly(reference, tmp_path):
    # same_node_first is the default (every other test runs it); the other policy end to end
    s = run_job(compose_train(BASE + ["faults=kill_mid_step", "ft.spare_policy=first_free"],
                              tmp_path), log=quiet)
    (rec,) = s["recoveries"]
    assert rec["outcome"] == "hot-swapped" and rec["spare_slot"] == 4
    equal, why = compare_final_states(tmp_path, reference[0])
    assert equal, why


@pytest.mark.slow
def test_verify_against_failure_free_says_equal_and_exits_0(tmp_path):
    """From the command line, each process a new interpreter (the default): a recovered 3D run
    and its failure-free rerun compare EQUAL. The DIFFERENT verdict and its exit status 1 are
    tests/deadpool/test_train_verify.py's (no processes); that the comparison tells a
    recovery with two ranks' routes swapped is test_3d's swapped-routes test (real processes)."""
    ok = subprocess.run([sys.executable, "-m", "deadpool.train", "model=tiny", "parallel=dp2_tp2_pp2",
                         "num_steps=8", "log_every_steps=0", "ft.num_spares=2",
                         "verify_against_failure_free=true", "faults=kill_3d_two_ranks_swapped",
                         "faults.swap_routes=null", "faults.events.0.step=4", "faults.events.1.step=4",
                         f"hydra.run.dir={tmp_path / 'ok'}"],
                        capture_output=True, text=True, timeout=280)
    assert ok.returncode == 0 and "failure-free run of the same seed: EQUAL" in ok.stdout, ok.stdout


@pytest.mark.slow
def test_bad_config_is_rejected_before_any_process_starts(tmp_path):
    p = subprocess.run([sys.executable, "-m", "deadpool.train", "parallel.tp=3",
                        f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "ranks_per_node" in p.stderr
    assert not (tmp_path / "logs").exists()


TWO_KILLS = "faults.events=[{rank:%d,step:12,phase:mid_step,kind:kill},{rank:%d,step:12,phase:mid_step,kind:kill}]"


@pytest.mark.slow
def test_two_simultaneous_failures_on_different_buddy_pairs_take_two_spares(reference, tmp_path):
    # ranks 0 and 2: each one's replica lives on a survivor (1 and 3)
    summary = run_job(compose_train(BASE + ["ft.num_spares=2", TWO_KILLS % (0, 2)], tmp_path), log=quiet)
    assert summary["outcome"] == "completed", summary["message"]
    assert ranks_lost(summary) == {0, 2}
    equal, why = compare_final_states(tmp_path, reference[0])
    assert equal, why


@pytest.mark.slow
def test_a_rank_and_its_buddy_lost_together_stops_with_a_clear_message(tmp_path):
    # rank 2 holds rank 1's replica: rank 1 dies mid-step, and rank 2 dies while the recovery
    # moves rank 1's optimizer shard off it (after its first chunk). No copy of that ZeRO-1 shard
    # is left in memory (rank 1's data-parallel peers hold only its parameters) and there is no
    # disk checkpoint: the job must stop and say so, whatever the timing of the two deaths.
    ev = ("faults.events=[{rank:1,step:12,phase:mid_step,kind:kill},"
          "{rank:2,step:0,phase:transfer,kind:kill}]")
    summary = run_job(compose_train(BASE + ["ft.num_spares=2", "ft.persist_interval_steps=0", ev],
                                    tmp_path), log=quiet)
    assert summary["outcome"] == "unrecoverable", summary["recoveries"]
    assert "no consistent copy of rank(s) [1]" in summary["message"]
    first = summary["recoveries"][0]
    assert first["failed_rank"] == 1 and first["sources"]["1"].startswith("replica from rank 2")
    assert 2 in ranks_lost(summary)


def ranks_lost(summary: dict) -> set[int]:
    return {r for rec in summary["recoveries"] for r in
            (rec["failed_rank"] if isinstance(rec["failed_rank"], list) else [rec["failed_rank"]])}


@pytest.mark.slow
def test_a_failing_replication_thread_is_reported_and_the_job_regroups(reference, tmp_path):
    # found by experiments/soak_runtime.py: an error inside the replication thread used to stall
    # every rank on snapshot backpressure; now it is reported and the generation is rebuilt
    ev = "faults.events=[{rank:1,step:9,phase:replication,kind:exception}]"
    summary = run_job(compose_train(BASE + [ev], tmp_path), log=quiet)
    assert summary["outcome"] == "completed", summary["message"]
    (rec,) = summary["recoveries"]
    assert rec["detected_by"] == "collective_error"
    assert rec["outcome"] == "regrouped (no rank lost)"
    equal, why = compare_final_states(tmp_path, reference[0])
    assert equal, why


@pytest.mark.parametrize("override,msg", [
    ("lr=abc", "lr must be a number, got 'abc'"),
    ("ft.resume_from=/nonexistent/ckpt", "ft.resume_from=/nonexistent/ckpt: no such directory"),
])
def test_bad_values_found_as_a_new_user_are_refused_before_any_process_starts(tmp_path, override, msg):
    p = subprocess.run([sys.executable, "-m", "deadpool.train", override,
                        f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert msg in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow
def test_a_single_rank_job_snapshots_locally_and_trains_to_the_end(tmp_path):
    # one rank (one GPU's job): its only buddy would be itself, so nothing is replicated and the
    # local snapshots count as protected; this used to stall in snapshot back-pressure at step 3
    s = run_job(compose_train(["model=tiny", "parallel.dp=1", "ft.num_spares=0", "num_steps=8",
                               "log_every_steps=0"], tmp_path), log=quiet)
    assert s["outcome"] == "completed", s["message"]
    assert not s["recoveries"]
