"""DeadPool across hosts: jobs on the test bed (experiments/testbed: each host a network namespace
with its own address and interface, the coordinator in the root namespace on the bridge, one node
agent per host started as srun would start it). Two ranks per host and a spare host; each job
ends bitwise equal (``torch.equal`` per tensor, per rank) to a failure-free single-host run of the
same seed and layout.

    dp4 on hosts 0-1, spare host 2:   failure-free with host 1's link capped at 30 Mbit/s (each
                                      host's connections on its own address, its processes
                                      given its interface), a rank killed,
                                      every process of host 1 killed, host 1's link down at a
                                      step
                                      SIGTERM to the coordinator, then a resume
    dp2 x tp2 x pp2 on hosts 0-3,     every process of host 1 killed: its TP pair lands whole on
    spare host 4:                     the spare host

Needs root and iproute2 (CI runs as root); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from deadpool import checkpoint
from deadpool.launch.job import run_job
from deadpool.launch.report import compare_final_states
from experiments.testbed import netns
from experiments.testbed.cluster import ClusterJob
from tests.conftest import compose_train

WHY = netns.available()
pytestmark = [pytest.mark.slow, pytest.mark.testbed, pytest.mark.timeout(600),
              pytest.mark.skipif(WHY is not None, reason=f"no test bed: {WHY}")]

STEPS = 30
COMMON = ["model=tiny", f"num_steps={STEPS}", "seed=2718", "log_every_steps=5"]
DP4 = ["parallel.dp=4", "ft.num_spares=2"]
# 4 micro-batches, not auto's 8: a fifth less CPU, the same 1F1B phases (tests/conftest.py)
D3 = ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.microbatches=4", "ft.num_spares=2"]
NODE_TIMEOUT_S = 3.0  # ft.node_timeout_s's default


def reference(tmp_path_factory, layout: list[str]) -> Path:
    run_dir = tmp_path_factory.mktemp("reference")
    cfg = compose_train(COMMON + layout + ["parallel.ranks_per_node=2"], run_dir)  # (forked)
    assert run_job(cfg, log=lambda *a, **k: None)["outcome"] == "completed"
    return run_dir


@pytest.fixture(scope="module")
def ref_dp4(tmp_path_factory):
    return reference(tmp_path_factory, DP4)


@pytest.fixture(scope="module")
def ref_3d(tmp_path_factory):
    return reference(tmp_path_factory, D3)


def cluster(bed, tmp_path, layout, extra=(), fork=True) -> ClusterJob:
    """A job on ``bed``; its agents fork their processes unless ``fork`` is false (then each is
    a new interpreter, as by default under srun: slower to start, its environment readable)."""
    return ClusterJob(bed, tmp_path / "run", COMMON + layout + list(extra) +
                      [f"launcher.fork_workers={str(fork).lower()}"], ranks_per_node=2)


def finish(job: ClusterJob, ref: Path) -> dict:
    summary = job.wait(timeout_s=240)
    assert summary["outcome"] == "completed", (summary.get("message"), job.log()[-3000:])
    equal, why = compare_final_states(job.run_dir, ref)
    assert equal, why
    return summary


def first_step_after(job: ClusterJob, generation: int) -> float:
    """The wall-clock stamp of the first step any rank finished in ``generation`` or later."""
    stamps = [r["t"] for f in (job.run_dir / "metrics").glob("slot*.jsonl")
              for r in map(json.loads, f.read_text().splitlines())
              if r.get("generation", 0) >= generation]
    return min(stamps)


def listed(x) -> list:
    """A record's rank or slot field: one value, or a list of them."""
    return sorted(x) if isinstance(x, list) else [x]


def hosts_of(summary: dict, ranks_per_node: int = 2) -> set[int]:
    """The hosts the last recovery's spares were on."""
    return {s // ranks_per_node for s in listed(summary["recoveries"][-1]["spare_slot"])}


def tcp_local_addresses(bed, i: int) -> set[str]:
    """Local IPv4 addresses of the established TCP connections inside host ``i``."""
    out = set()
    for line in bed.run(i, ["cat", "/proc/net/tcp"]).stdout.splitlines()[1:]:
        local, _, state = line.split()[1:4]
        if state == "01":  # ESTABLISHED
            hexaddr = local.split(":")[0]
            out.add(".".join(str(int(hexaddr[k:k + 2], 16)) for k in (6, 4, 2, 0)))
    return out


def is_rank(pid: int) -> bool:
    """A worker or spare process (forked by its agent: named ``dp-slot<n>``; or exec'd)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().startswith("dp-slot") or \
            b"deadpool.rank.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def child_env(pid: int) -> dict:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)


def test_each_host_s_processes_talk_over_its_own_interface_and_a_slow_link_is_no_failure(
        tmp_path, ref_dp4):
    with netns.TestBed(3) as bed, cluster(bed, tmp_path, DP4).start() as job:
        job.wait_step(STEPS - 10)
        # host 1's link capped at 30 Mbit/s for the last 10 steps: each gradient all-reduce
        # crosses it (~1.5 s a step for the tiny model's 6 MB), and nothing is a failure
        bed.rate_limit(1, 30)
        for i in range(3):
            assert [p for p in bed.pids(i) if is_rank(p)], f"host {i} runs no rank"
            # every connection inside the host is on its own address: gloo's between ranks (on
            # this host and others), the agent's to the store; none on loopback
            addrs = tcp_local_addresses(bed, i)
            assert addrs == {bed.hosts[i].addr}, addrs
        summary = finish(job, ref_dp4)
    assert summary["recoveries"] == []


def test_an_agent_gives_its_processes_the_interface_that_reaches_the_store(tmp_path):
    """(Read from a new interpreter's environment: a forked child's is not in /proc.)"""
    with netns.TestBed(2) as bed, cluster(bed, tmp_path, ["parallel.dp=2", "ft.num_spares=0"],
                                          fork=False).start() as job:
        job.wait_step(1)
        for i in range(2):
            for pid in [p for p in bed.pids(i) if is_rank(p)]:
                env = child_env(pid)
                assert env["GLOO_SOCKET_IFNAME"] == netns.HOST_IF, env.get("GLOO_SOCKET_IFNAME")
                assert env["NCCL_SOCKET_IFNAME"] == netns.HOST_IF
        assert job.wait(timeout_s=120)["outcome"] == "completed"


@pytest.mark.core
def test_a_rank_killed(tmp_path, ref_dp4):
    kill = ["faults.events=[{rank: 2, step: 10, phase: mid_step, kind: kill}]"]
    with netns.TestBed(3) as bed, cluster(bed, tmp_path, DP4, kill).start() as job:
        summary = finish(job, ref_dp4)
    (rec,) = summary["recoveries"]
    assert listed(rec["failed_rank"]) == [2] and hosts_of(summary) == {2}


def test_every_process_of_a_host_killed(tmp_path, ref_dp4):
    with netns.TestBed(3) as bed, cluster(bed, tmp_path, DP4).start() as job:
        job.wait_step(10)
        t_kill = time.time()
        assert bed.kill_host(1)
        summary = finish(job, ref_dp4)
        kill_to_step = first_step_after(job, 1) - t_kill
    (rec,) = summary["recoveries"]
    assert listed(rec["failed_rank"]) == [2, 3] and hosts_of(summary) == {2}
    assert rec["detected_by"] == "exit"  # its agent's connection ended: no silent-record wait
    print(f"host killed -> first step: {kill_to_step:.2f} s")
    (job.run_dir / "kill_to_first_step_s").write_text(f"{kill_to_step:.3f}\n")


def test_a_host_cut_off_fences_itself_and_the_job_goes_on_without_it(tmp_path, ref_dp4):
    with netns.TestBed(3) as bed, cluster(bed, tmp_path, DP4).start() as job:
        job.wait_step(10)
        t_down, m_down = time.time(), time.monotonic()
        bed.link_down(1)
        while bed.pids(1):  # no process of the cut-off host within the node timeout + 2 s
            assert time.monotonic() - m_down < NODE_TIMEOUT_S + 2.0, bed.pids(1)
            time.sleep(0.05)
        gone_s = time.monotonic() - m_down
        job.wait_step(STEPS // 2 + 5)
        bed.link_up(1)  # nothing of it comes back
        summary = finish(job, ref_dp4)
        assert bed.pids(1) == []
        down_to_step = first_step_after(job, 1) - t_down
    (rec,) = summary["recoveries"]
    assert listed(rec["failed_rank"]) == [2, 3] and hosts_of(summary) == {2}
    assert "cut off" in (job.run_dir / "agent1.out").read_text()
    # it wrote nothing the job reads: no checkpoint at all in this job, nothing of its slots
    ckpt = job.run_dir / "checkpoints"
    assert not ckpt.exists() or not any(ckpt.iterdir()), list(ckpt.iterdir())
    assert down_to_step <= NODE_TIMEOUT_S + 0.5 + 1.0, down_to_step  # (+1 s: a loaded 2-core CI)
    print(f"link down -> first step: {down_to_step:.2f} s; host's processes gone after "
          f"{gone_s:.2f} s")


def test_3d_a_host_killed_moves_its_tensor_parallel_pair_whole_to_the_spare_host(tmp_path, ref_3d):
    with netns.TestBed(5) as bed, cluster(bed, tmp_path, D3).start() as job:
        job.wait_step(10)
        assert bed.kill_host(1)
        summary = finish(job, ref_3d)
    (rec,) = summary["recoveries"]
    assert len(listed(rec["failed_rank"])) == 2 and hosts_of(summary) == {4}


def test_sigterm_to_the_coordinator_writes_the_newest_step_and_the_job_resumes_from_it(
        tmp_path, ref_dp4):
    """Walltime or preemption as Slurm delivers it (the batch shell forwards the signal to the
    coordinator): the job ends with its state on disk and no process on any host, and a
    resubmission with ft.resume_from=auto in the same run directory completes it."""
    with netns.TestBed(3) as bed:
        with cluster(bed, tmp_path, DP4).start() as job:
            job.wait_step(10)
            t0 = time.monotonic()
            job.coord.send_signal(signal.SIGTERM)
            summary = job.wait(timeout_s=60)
            ended_s = time.monotonic() - t0
            left = {i: bed.pids(i) for i in range(3)}
        assert summary["outcome"] == "preempted", summary.get("message")
        assert "ft.resume_from" in summary["message"]
        assert not any(left.values()), left
        assert checkpoint.latest_complete_step(job.run_dir / "checkpoints") >= 10
        with cluster(bed, tmp_path, DP4, ["ft.resume_from=auto"]).start() as resumed:
            finish(resumed, ref_dp4)
    print(f"SIGTERM -> job ended with its state on disk: {ended_s:.2f} s")
