"""Recovery that survives what happens during recovery, with real processes.

Each scenario kills, stops, hangs or corrupts a process at a chosen phase (of training, or of a
recovery already under way) and requires the job to finish bitwise equal (``torch.equal`` on
every tensor of every rank) to a failure-free run of the same seed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deadpool.launch.job import run_job
from deadpool.launch.launcher import job_processes
from deadpool.launch.report import compare_final_states, load_final_rank
from tests.conftest import FORKED, compose_train

# dp4 with ZeRO-1 (the default) and replicas of the unique region only: every rank's optimizer
# shard is its own, so a state sent to the wrong rank ends unequal to the failure-free run (with
# ZeRO off and whole-state replicas all four states were identical and a wrong route passed).
# Two replicas per rank (r+1, r+2 on this one node): a second failure during a recovery may take
# the first holder of the shard being restored.
BASE = ["model=tiny", "parallel=dp4", "ft.replicas=2", "num_steps=20",
        "ft.replication_chunk_mb=0.5", "log_every_steps=0", "ft.progress_timeout_s=3",
        "ft.status_timeout_s=4"]  # progress 3 s: 30x a step here
quiet = lambda *a, **k: None  # noqa: E731
REPO = Path(__file__).resolve().parents[2]


def events(*evs: str) -> str:
    return "faults.events=[" + ",".join("{" + e + "}" for e in evs) + "]"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    summary = run_job(compose_train(BASE + ["faults=none", "ft.num_spares=0"], run_dir), log=quiet)
    assert summary["outcome"] == "completed" and not summary["recoveries"]
    return run_dir


def run_and_compare(tmp_path, reference, overrides):
    summary = run_job(compose_train(BASE + overrides, tmp_path), log=quiet)
    assert summary["outcome"] == "completed", summary["message"]
    equal, why = compare_final_states(tmp_path, reference)
    assert equal, why
    return summary


def ranks_of(rec) -> list[int]:
    r = rec["failed_rank"]
    return r if isinstance(r, list) else [r]


@pytest.mark.slow
@pytest.mark.parametrize("second", [
    # (recovery phases carry the resume step, 11 or 12 as the snapshots fall: "from step 5 on")
    "slot:4,step:5,phase:transfer,kind:kill",     # the receiving spare dies mid-transfer
    "rank:0,step:5,phase:transfer,kind:kill",     # the sending holder (rank 1's peer) dies
    "rank:3,step:5,phase:rebuild,kind:kill",      # a survivor dies inside the group rebuild
    "rank:2,step:0,phase:status,kind:kill",       # a survivor dies before reporting its state
    "slot:4,step:0,phase:rollback,kind:stop",     # the new rank hangs (SIGSTOP) after restoring
], ids=["spare-in-transfer", "holder-in-transfer", "survivor-in-rebuild", "survivor-in-status",
        "spare-stopped"])
def test_a_failure_during_a_recovery_is_recovered_too(reference, tmp_path, second):
    s = run_and_compare(tmp_path, reference, [
        "ft.num_spares=2", events("rank:1,step:12,phase:mid_step,kind:kill", second)])
    # two processes were lost (in one recovery or in a recovery and the one that interrupted it)
    lost = [(r, slot) for rec in s["recoveries"] for r, slot in
            zip(ranks_of(rec), rec["failed_slot"] if isinstance(rec["failed_slot"], list)
                else [rec["failed_slot"]])]
    assert len(set(lost)) == 2 and lost[0] == (1, 1)
    # every recovery lost a rank (a regroup with none lost has no cause in this schedule), and
    # the last one hot-swapped it
    assert all(ranks_of(r) for r in s["recoveries"]), [
        (r["detected_by"], r["outcome"]) for r in s["recoveries"]]
    assert s["recoveries"][-1]["outcome"] == "hot-swapped"


@pytest.mark.slow
def test_every_rank_holds_distinct_state(reference):
    """What makes a wrong route fail: no two ranks' final states are equal (ZeRO-1 shards)."""
    import torch

    states = [load_final_rank(reference, r) for r in range(4)]
    for a in range(4):
        for b in range(a + 1, 4):
            assert any(not torch.equal(states[a][k], states[b][k]) for k in states[a]), (a, b)


@pytest.mark.slow
def test_a_kill_at_step_zero_takes_its_parameters_from_a_data_parallel_peer(reference, tmp_path):
    s = run_and_compare(tmp_path, reference, [
        "ft.num_spares=1", events("rank:1,step:0,phase:step_start,kind:kill")])
    (rec,) = s["recoveries"]
    # its shard from a replica of step 0 when one was made, else drawn from the seed
    assert rec["resume_step"] == 0 and (
        rec["sources"]["1"] == "init from rank 1" or
        re.fullmatch(r"replica from rank [23] \+ parameters from rank [023]",
                     rec["sources"]["1"])), rec["sources"]


@pytest.mark.slow
def test_a_kill_inside_the_very_first_group_build_starts_the_job_over_from_step_zero(reference, tmp_path):
    # found by experiments/fault_campaign.py: nobody has restored anything yet, but every process
    # starting the job holds each rank's step-0 state
    s = run_and_compare(tmp_path, reference, [
        "ft.num_spares=1", events("rank:1,step:0,phase:rebuild,kind:kill")])
    assert s["recoveries"][-1]["resume_step"] == 0
    assert s["recoveries"][-1]["outcome"] == "hot-swapped"


@pytest.mark.slow
def test_a_hung_training_thread_with_a_live_heartbeat_is_fenced_and_swapped(reference, tmp_path):
    s = run_and_compare(tmp_path, reference, [
        "ft.num_spares=1", events("rank:2,step:12,phase:backward,kind:hang")])
    (rec,) = s["recoveries"]
    assert rec["failed_rank"] == 2 and rec["detected_by"] == "progress"
    assert rec["outcome"] == "hot-swapped"


@pytest.mark.slow
def test_a_rank_hung_inside_a_collective_is_found_by_its_silence_and_swapped(reference, tmp_path):
    # every rank waits in the all-reduce; rank 2's training thread will never come back
    s = run_and_compare(tmp_path, reference, [
        "ft.num_spares=1", events("rank:2,step:12,phase:allreduce,kind:hang")])
    lost = [r for rec in s["recoveries"] for r in ranks_of(rec)]
    assert lost == [2]
    assert s["recoveries"][-1]["outcome"] == "hot-swapped"


@pytest.mark.slow
def test_a_corrupted_replica_is_detected_and_another_source_used(reference, tmp_path):
    # replicas only; rank 2 (rank 1's first buddy) has its newest replica of rank 1 corrupted
    # just before it reports. The spare must detect it and resume from another source: the
    # second buddy's copy, the older replica if the survivors still hold that step, else the
    # newest disk checkpoint
    for attempt in range(2):  # which copy the plan takes depends on timing: the corrupt one
        # must be taken (and refused) at least once in two runs
        s = run_and_compare(tmp_path / f"try{attempt}", reference, [
            "ft.num_spares=1", "ft.state_sources=[replica]", "ft.persist_interval_steps=2",
            events("rank:1,step:13,phase:step_start,kind:kill", "rank:2,step:0,phase:status,kind:corrupt")])
        bad = [b for rec in s["recoveries"] for b in rec.get("bad_sources", [])]
        if bad:
            break
    assert bad, [(r["detected_by"], r.get("fault"), r["outcome"]) for r in s["recoveries"]]
    assert len(bad) == 1 and bad[0]["holder"] == 2 and bad[0]["owner"] == 1
    first, last = s["recoveries"][0], s["recoveries"][-1]
    assert first["sources"]["1"].startswith("replica from rank 2 + parameters from rank ")
    # the second buddy's copy, an older one of the first buddy's, or the disk
    assert last["sources"]["1"].startswith(("replica from rank 3", "replica from rank 2",
                                            "disk from rank 1")), last["sources"]
    if last["sources"]["1"].startswith("replica from rank 2"):  # older than the corrupt copy
        assert last["resume_step"] < bad[0]["step"]


@pytest.mark.slow
@pytest.mark.core
def test_coordinator_death_workers_save_and_exit_and_the_resume_is_bitwise_equal(reference, tmp_path):
    run_dir = tmp_path / "lost"
    cmd = [sys.executable, "-m", "deadpool.train", *FORKED, *BASE, "num_steps=20", "ft.num_spares=1",
           "ft.coordinator_timeout_s=2", "log_every_steps=1", f"hydra.run.dir={run_dir}"]
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in p.stdout:  # kill the coordinator (the launcher process) mid-training
        m = re.search(r"step +(\d+)/", line)
        if m and int(m.group(1)) >= 10:  # progress lines may be coalesced: any step from 10 on
            p.send_signal(signal.SIGKILL)
            break
    p.wait()
    deadline = time.time() + 30
    while job_processes(run_dir) and time.time() < deadline:
        time.sleep(0.2)
    assert not job_processes(run_dir), "workers outlived their coordinator"
    logs = "".join(f.read_text() for f in (run_dir / "logs").glob("slot*.log"))
    assert "coordinator stopped answering" in logs and "ft.resume_from=" in logs
    from deadpool import checkpoint
    step_dir = checkpoint.latest_step_dir(run_dir / "checkpoints")
    assert int(step_dir.name.split("_")[1]) >= 8
    resumed = tmp_path / "resumed"
    s = run_job(compose_train(BASE + ["faults=none", "ft.num_spares=0",
                                      f"ft.resume_from={run_dir / 'checkpoints'}"], resumed), log=quiet)
    assert s["outcome"] == "completed"
    equal, why = compare_final_states(resumed, reference)
    assert equal, why


@pytest.mark.slow
def test_a_process_with_a_wrong_secret_cannot_take_a_rank_and_the_job_goes_on(reference, tmp_path):
    """Two strangers: a worker started with a wrong secret claims the spare's slot, and a client
    that reaches the store and finds the job's namespace (``list_keys``) forges every control
    key it can: job/stop and job/done, a finished count, an error count, a final state, a
    bad-source report, the dead rank's status and, once it is killed, its heartbeat; under node
    agents also a node's record, its statuses and the next pushed events (fences, a stop). The job
    must hot-swap exactly once and end bitwise equal to the failure-free run."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from deadpool.store import auth
    # an intruder starts as soon as job.json exists, claiming the spare's slot
    intruder: dict = {}
    done = threading.Event()

    def intrude():
        job, deadline = tmp_path / "job.json", time.time() + 120
        while not job.exists():
            if time.time() > deadline:
                return  # no job started: the main thread's assertions say why
            time.sleep(0.05)
        env = dict(os.environ, **{auth.SECRET_ENV: auth.new_secret()})
        env.pop(auth.SECRET_FILE_ENV, None)
        cfg = json.loads(job.read_text())
        cfg["ft"]["startup_timeout_s"] = 8
        (tmp_path / "intruder.json").write_text(json.dumps(cfg))
        intruder["p"] = subprocess.run(
            [sys.executable, "-m", "deadpool.rank.worker", "--job", str(tmp_path / "intruder.json"),
             "--slot", "4"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)

    def forge():
        job, deadline = tmp_path / "job.json", time.time() + 120
        while not job.exists() and time.time() < deadline:
            time.sleep(0.05)
        try:
            cfg = json.loads(job.read_text())
            raw = dist.TCPStore(cfg["_store"]["host"], int(cfg["_store"]["port"]),
                                is_master=False, timeout=timedelta(seconds=5), use_libuv=True)
            ns = None
            while ns is None and not done.is_set():  # the job's namespace, from its plan key
                ns = next((k.rsplit("/", 2)[0] for k in raw.list_keys()
                           if k.endswith("/plan/0")), None)
                time.sleep(0.02)
            if ns is None:
                return
            other = auth.new_secret()
            for key, value in (("job/stop", "1"), ("job/done", "1"), ("final/0", '{"digest": 0}'),
                               ("g0/bad_source/2", '{"holder": 0, "owner": 1, "step": 3}'),
                               ("g0/status/1", '{"rank": 1, "slot": 1, "live_step": 99, '
                                               '"local_steps": [99], "replicas": {}}')):
                raw.set(f"{ns}/{key}", auth.seal(other, value, context=key))
            key = "g0/status/node/0"  # node agents: node 0's statuses, rank 1 live at step 99
            raw.set(f"{ns}/{key}", auth.seal(other, json.dumps(
                ['{"rank": 1, "slot": 1, "live_step": 99, "local_steps": [99], "replicas": {}}']),
                context=key))
            raw.add(f"{ns}/g0/num_finished", 4)
            raw.add(f"{ns}/g0/num_errors", 1)
            # node agents: a record claiming slot 0 exited, and the next pushed events (fence
            # every rank, stop) written ahead of the coordinator, which overwrites them
            raw.set(f"{ns}/node/0", auth.seal(other, '99 0 12 0 0 {"exit":{"0":-9}}',
                                              context="node/0"))
            for i in range(1, 5):
                raw.set(f"{ns}/ev/{i}", auth.seal(other, '{"kind":"fence","slots":[0,1,2,3]}'
                                                  if i % 2 else '{"kind":"stop"}', context=f"ev/{i}"))
            intruder["forged"] = True
            n = 10 ** 6
            while not done.is_set():  # once rank 1 is killed, beat for it
                if raw.check([f"{ns}/fault/1"]):
                    n += 1
                    raw.set(f"{ns}/hb/1", f"{n} {n} 12 forward")
                time.sleep(0.02)
        except Exception:  # the job ended and its store with it
            return

    threads = [threading.Thread(target=f, daemon=True) for f in (intrude, forge)]
    for t in threads:
        t.start()
    try:
        s = run_and_compare(tmp_path, reference, [
            "ft.num_spares=1", events("rank:1,step:12,phase:mid_step,kind:kill")])
    finally:
        done.set()
    for t in threads:
        t.join(timeout=180)
    assert "p" in intruder, "the intruder never ran"
    assert intruder.get("forged"), "the forger never found the job's namespace"
    (rec,) = s["recoveries"]
    assert rec["spare_slot"] == 4 and rec["outcome"] == "hot-swapped"
    assert rec["failed_rank"] == 1 and rec["detected_by"] == "exit"
    # the real slot-4 process took the rank; the intruder never saw a plan and said why
    assert intruder["p"].returncode != 0
    assert "job secret" in intruder["p"].stdout + intruder["p"].stderr