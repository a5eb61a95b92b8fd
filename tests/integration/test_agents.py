"""Node agents with real processes: a node's agent killed from outside (its processes die with
it), a rank and its agent dying together, and a node lost during a recovery. Every case must end
bitwise equal to a failure-free run of the same seed; survivors keep their processes."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from deadpool.launch.job import run_job
from deadpool.launch.launcher import job_processes
from deadpool.launch.report import compare_final_states
from tests.conftest import compose_train

pytestmark = pytest.mark.slow

# dp4 on nodes of 2 slots: node 0 = ranks 0, 1; node 1 = ranks 2, 3; spares on nodes 2 (and 3)
# each process a new interpreter (launcher.fork_workers=false, the default; the other modules
# fork) where a test finds processes by command line; the others fork (FORK: ~3 s of CPU saved
# per process, the final state the same)
BASE = ["model=tiny", "parallel=dp4", "parallel.ranks_per_node=2", "num_steps=20",
        "launcher.agents=true", "launcher.fork_workers=false", "ft.replication_chunk_mb=0.5",
        "log_every_steps=0"]
FORK = ["launcher.fork_workers=true"]
quiet = lambda *a, **k: None  # noqa: E731


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    summary = run_job(compose_train(BASE + FORK + ["faults=none", "ft.num_spares=2"], run_dir),
                      log=quiet)
    assert summary["outcome"] == "completed" and not summary["recoveries"]
    return run_dir


def lost(summary) -> set[int]:
    return {r for rec in summary["recoveries"] for r in
            (rec["failed_rank"] if isinstance(rec["failed_rank"], list) else [rec["failed_rank"]])}


def slot_pids(run_dir: Path) -> dict[int, int]:
    """slot -> pid of this job's worker processes now running."""
    out = {}
    for pid in job_processes(run_dir):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"deadpool.rank.worker" in argv:
            out[int(argv[argv.index(b"--slot") + 1])] = pid
    return out


def agent_pid(run_dir: Path, node: int) -> int | None:
    for pid in job_processes(run_dir):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if Path(f"/proc/{pid}/comm").read_text().strip() == f"dp-agent{node}":
                return pid  # forked by the zygote (launcher.fork_agents): its name tells
        except OSError:
            continue
        if b"deadpool.agent" in argv and argv[argv.index(b"--node") + 1] == str(node).encode():
            return pid
    return None


def final_slots(run_dir: Path) -> dict[int, int]:
    """rank -> the slot of its newest training step (metrics.jsonl)."""
    newest: dict[int, tuple[int, int]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        newest[m["rank"]] = max(newest.get(m["rank"], (-1, -1)), (m["step"], m["slot"]))
    return {r: slot for r, (_, slot) in newest.items()}


def on_one_spare_node(run_dir: Path, ranks) -> bool:
    """``ranks`` finished on one node of spares, together (ft.spare_policy=same_node_first:
    nodes of 2 slots, slot // 2, as ``topology.node_slots`` lays them out)."""
    slots = final_slots(run_dir)
    return len({slots[r] // 2 for r in ranks}) == 1 and all(slots[r] >= 4 for r in ranks)


def newest_step(run_dir: Path) -> int:
    steps = [-1]
    for f in (run_dir / "metrics").glob("slot*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                steps.append(json.loads(line)["step"])
            except (ValueError, KeyError):
                pass
    return max(steps)


@pytest.mark.core
def test_a_killed_node_agent_loses_its_node_and_spares_take_both_ranks(reference, tmp_path):
    result, pids = {}, {}
    job = threading.Thread(target=lambda: result.update(
        run_job(compose_train(BASE + ["faults=none", "ft.num_spares=2"], tmp_path), log=quiet)))
    job.start()
    deadline = time.time() + 240
    while newest_step(tmp_path) < 6 and time.time() < deadline and job.is_alive():
        time.sleep(0.1)
    pids.update(slot_pids(tmp_path))
    victim = agent_pid(tmp_path, 1)
    assert victim is not None, "node 1's agent not found"
    os.kill(victim, signal.SIGKILL)
    job.join(300)
    assert not job.is_alive()
    assert result["outcome"] == "completed", result.get("message")
    (rec,) = result["recoveries"]
    assert set(rec["failed_rank"]) == {2, 3} and rec["outcome"] == "hot-swapped"
    assert {0, 1, 2, 3} <= set(pids)  # every rank was running when the agent was killed
    assert on_one_spare_node(tmp_path, [2, 3]), final_slots(tmp_path)
    equal, why = compare_final_states(tmp_path, reference)
    assert equal, why
    assert job_processes(tmp_path) == []


def run_watching(overrides, run_dir, before: int, after: int):
    """Run the job on a thread; the workers' pids (slot -> pid) once a step >= ``before`` is
    written and again once one >= ``after`` is (None where the job ended first)."""
    result, seen = {}, {}
    job = threading.Thread(target=lambda: result.update(
        run_job(compose_train(overrides, run_dir), log=quiet)))
    job.start()
    for name, step in (("before", before), ("after", after)):
        deadline = time.time() + 240
        while newest_step(run_dir) < step and time.time() < deadline and job.is_alive():
            time.sleep(0.05)
        seen[name] = slot_pids(run_dir) if job.is_alive() else None
    job.join(300)
    assert not job.is_alive()
    return result, seen


def test_a_rank_and_its_agent_dying_together_are_one_node_loss(reference, tmp_path):
    """One recovery, naming both of the node's ranks; the other node's processes (slots 2, 3)
    are the same processes before and after it."""
    ev = "faults.events=[{rank:0,step:8,phase:mid_step,kind:kill_node}]"
    summary, pids = run_watching(BASE + ["ft.num_spares=2", ev], tmp_path, before=4, after=12)
    assert summary["outcome"] == "completed", summary["message"]
    assert len(summary["recoveries"]) == 1, summary["recoveries"]
    (rec,) = summary["recoveries"]
    assert lost(summary) == {0, 1} and rec["outcome"] == "hot-swapped", rec
    assert pids["before"] and pids["after"], pids
    assert {s: pids["before"][s] for s in (2, 3)} == {s: pids["after"][s] for s in (2, 3)}, pids
    assert on_one_spare_node(tmp_path, [0, 1]), final_slots(tmp_path)
    equal, why = compare_final_states(tmp_path, reference)
    assert equal, why


def test_a_stopped_agent_loses_its_node_and_its_processes_fence_themselves(reference, tmp_path):
    """A SIGSTOPped agent (its processes train on): its record and its board beat stop
    together, so the job declares the node lost at ``ft.node_timeout_s`` and the node's
    processes fence themselves at the same timeout; the stopped agent is killed at the fence
    (nothing is left), spares take both ranks, and the end state is the failure-free one."""
    ev = "faults.events=[{rank:2,step:8,phase:mid_step,kind:stop_agent}]"
    summary, pids = run_watching(BASE + ["ft.num_spares=2", ev], tmp_path, before=4, after=14)
    assert summary["outcome"] == "completed", summary["message"]
    assert len(summary["recoveries"]) == 1, summary["recoveries"]
    (rec,) = summary["recoveries"]
    assert lost(summary) == {2, 3} and rec["outcome"] == "hot-swapped", rec
    assert {s: pids["before"][s] for s in (0, 1)} == {s: pids["after"][s] for s in (0, 1)}, pids
    logs = "".join(f.read_text() for f in (tmp_path / "logs").glob("*.log"))
    assert "the node agent has been silent" in logs  # a process of the node fenced itself
    assert on_one_spare_node(tmp_path, [2, 3]), final_slots(tmp_path)
    equal, why = compare_final_states(tmp_path, reference)
    assert equal, why
    assert job_processes(tmp_path) == []  # the stopped agent too


def test_a_node_lost_while_its_spare_receives_a_state_is_recovered_by_the_next_spare(
        reference, tmp_path):
    # rank 1 dies; node 0 has no free spare, so slot 6 takes it (node 3's one slot: the tightest
    # fit, node 2 stays whole) and dies with its node while receiving rank 1's shard; slot 4
    # (node 2) takes rank 1 from the same replica
    ev = ("faults.events=[{rank:1,step:8,phase:mid_step,kind:kill},"
          "{slot:6,step:0,phase:transfer,kind:kill_node}]")
    summary = run_job(compose_train(BASE + FORK + ["ft.num_spares=3", ev], tmp_path), log=quiet)
    assert summary["outcome"] == "completed", summary["message"]
    assert lost(summary) == {1}
    assert summary["recoveries"][-1]["outcome"] == "hot-swapped"
    rank1_slots = {json.loads(line)["slot"] for line in (tmp_path / "metrics.jsonl").read_text()
                   .splitlines() if json.loads(line)["rank"] == 1}
    assert rank1_slots == {1, 4}
    equal, why = compare_final_states(tmp_path, reference)
    assert equal, why
