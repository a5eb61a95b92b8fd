"""Walltime, preemption and Ctrl-C with real processes (``deadpool.launch.stop``, ``recovery.preempt``).

A job started as a user starts it (``python -m deadpool.train``, dp4 + 1 warm spare under node
agents) gets a signal at a step: SIGTERM or SIGINT to its own process, or SIGTERM to every node
agent (as srun forwards a job's signals to its tasks). It must end within a bound with the newest
step every rank holds in memory complete on disk, a summary saying it was preempted and how to
resume, no process of the job left and no traceback; the same run directory then resumes with
``ft.resume_from=auto`` and ends bitwise equal (``torch.equal`` per tensor, per rank) to the
failure-free run of the same seed. A second Ctrl-C stops at once, still leaving no process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deadpool import checkpoint
from deadpool.launch.job import run_job
from deadpool.launch.launcher import job_processes
from deadpool.launch.report import compare_final_states
from tests.conftest import FORKED, compose_train

BASE = ["model=tiny", "parallel=dp4", "ft.num_spares=1", "num_steps=24", "log_every_steps=4"]
AT_STEP = 8  # the signal goes out once rank 0 logged this step
STOP_BOUND_S = 15.0  # signal -> the process ended, state on disk (measured 1.2-4.1 s on 2 cores)
REPO = Path(__file__).resolve().parents[2]
quiet = lambda *a, **k: None  # noqa: E731


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    summary = run_job(compose_train(BASE, run_dir), log=quiet)
    assert summary["outcome"] == "completed" and not summary["recoveries"]
    return run_dir


class Job:
    """``python -m deadpool.train`` in a run directory, its console collected line by line."""

    def __init__(self, run_dir: Path, extra: list[str] = ()):
        cmd = [sys.executable, "-m", "deadpool.train", *FORKED, *BASE, *extra,
               f"hydra.run.dir={run_dir}"]
        self.run_dir = run_dir
        self.p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.p.stdout), daemon=True).start()

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for_step(self, step: int, timeout_s: float = 240.0) -> None:
        """Until rank 0's metrics record ``step`` (its file is written as each step ends)."""
        metrics, deadline = self.run_dir / "metrics" / "slot0.jsonl", time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.p.poll() is None, f"the job ended before step {step}:\n{self.out}"
            if metrics.exists() and any(json.loads(line)["step"] >= step for line in
                                        metrics.read_text().splitlines() if line.strip()):
                return
            time.sleep(0.01)
        raise AssertionError(f"no step {step} within {timeout_s} s:\n{self.out}")

    def agents(self) -> list[int]:
        """The node agents: the job process's children (forked ranks are the agents'), or with
        launcher.fork_agents its zygote's (named dp-agent<n>)."""
        parent, found = {}, []
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit():
                    parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                pass
        for pid, ppid in parent.items():
            try:
                if (ppid == self.p.pid and b"deadpool.agent" in Path(f"/proc/{pid}/cmdline")
                        .read_bytes()) or (parent.get(ppid) == self.p.pid and Path(
                        f"/proc/{pid}/comm").read_text().startswith("dp-agent")):
                    found.append(pid)
            except OSError:
                pass
        return found

    def signal(self, sig: int, to: str) -> float:
        """Send ``sig`` to the job process or to every agent; returns the seconds until the job
        process ended."""
        targets = [self.p.pid] if to == "coordinator" else self.agents()
        assert targets, "no node agent found"
        t0 = time.monotonic()
        for pid in targets:
            os.kill(pid, sig)
        self.p.wait(timeout=120)
        return time.monotonic() - t0


def assert_nothing_left(run_dir: Path) -> None:
    deadline = time.monotonic() + 2.0  # (nothing should be left at all: a little slack for /proc)
    while job_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not job_processes(run_dir), "processes of the job outlived it"


def who(run_dir: Path, pids: list[int]) -> str:
    """What the job's processes left alive are (name, state, parent) and, after SIGUSR1 (a rank
    dumps its threads' stacks to its log: ``faulthandler``), the tails of the job's logs: a
    failure says where they stood."""
    lines = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()
            lines.append(f"pid {pid} {name} state {rest[0]} parent {rest[1]}")
            if name.startswith("dp-slot"):
                os.kill(pid, signal.SIGUSR1)
        except (OSError, ValueError):
            lines.append(f"pid {pid}: gone")
    time.sleep(1.0)
    for log in sorted((run_dir / "logs").glob("*.log")):
        lines += [f"--- {log.name}", log.read_text()[-2500:]]
    return "\n".join(lines)


def assert_no_traceback(job: Job) -> None:
    logs = "".join(f.read_text() for f in (job.run_dir / "logs").glob("*.log"))
    assert "Traceback" not in job.out, job.out
    assert "Traceback" not in logs, logs[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("sig,to", [(signal.SIGTERM, "coordinator"), (signal.SIGINT, "coordinator"),
                                    pytest.param(signal.SIGTERM, "agents", marks=pytest.mark.core)],
                         ids=["sigterm", "ctrl-c", "sigterm-to-agents"])
def test_a_signal_writes_the_newest_step_and_auto_resume_ends_bitwise_equal(reference, tmp_path,
                                                                           sig, to):
    run_dir = tmp_path / "run"
    job = Job(run_dir)
    job.wait_for_step(AT_STEP)
    took = job.signal(sig, to)
    print(f"\n{signal.Signals(sig).name} to the {to} -> job ended: {took:.2f} s")
    assert took < STOP_BOUND_S, job.out
    assert job.p.returncode == 128 + sig, job.out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "preempted", summary["message"]
    if to == "agents":  # each agent's request answered: no node took the coordinator-loss path
        logs = "".join(f.read_text() for f in (run_dir / "logs").glob("agent*.log"))
        assert logs.count("asked the coordinator") == 2 and "does not answer" not in logs, logs
    stop = summary["stop"]
    S = stop["resume_step"]
    # rank 0 logged step 8; a rank cut inside step 8 (its live state torn) holds 7 and older
    assert S is not None and AT_STEP - 1 <= S < 24 and S >= stop["at_step"] - 1, stop
    assert stop["signal"].startswith(signal.Signals(sig).name)
    assert stop["request_to_written_s"] < STOP_BOUND_S
    step_dir = run_dir / "checkpoints" / f"step_{S}"
    assert checkpoint.is_complete(step_dir)
    assert checkpoint.latest_step_dir(run_dir / "checkpoints") == step_dir
    assert "preempted" in job.out and "resume with ft.resume_from=auto" in job.out, job.out
    assert_nothing_left(run_dir)
    assert_no_traceback(job)
    assert len(job.out.splitlines()) < 20, job.out  # start-up, a few progress lines, the summary
    # the same run directory resumes by itself (a requeued job's command line does not change)
    t_resume = time.time()
    resumed = run_job(compose_train(BASE + ["ft.resume_from=auto"], run_dir), log=quiet)
    assert resumed["outcome"] == "completed", resumed["message"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert min(r["step"] for r in rows if r["t"] > t_resume) == S + 1  # from the checkpoint on
    equal, why = compare_final_states(run_dir, reference)
    assert equal, why


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_and_leaves_no_process(tmp_path):
    run_dir = tmp_path / "run"
    job = Job(run_dir)
    job.wait_for_step(AT_STEP)
    t0 = time.monotonic()
    job.p.send_signal(signal.SIGINT)
    time.sleep(0.05)
    job.p.send_signal(signal.SIGINT)
    job.p.wait(timeout=60)
    took = time.monotonic() - t0
    assert took < STOP_BOUND_S, job.out
    assert job.p.returncode == 128 + signal.SIGINT, job.out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "preempted"
    assert "SIGINT twice: stopped at once" in summary["message"], summary["message"]
    assert_nothing_left(run_dir)
    assert "Traceback" not in job.out, job.out


def test_auto_resume_without_a_checkpoint_starts_from_step_0_and_says_so(tmp_path):
    from deadpool.launch.job import resolve_resume

    cfg = compose_train(BASE + ["ft.resume_from=auto"], tmp_path)
    said: list[str] = []
    assert resolve_resume(cfg, said.append)["ft"]["resume_from"] is None
    assert "no complete checkpoint" in said[0] and "step 0" in said[0]
    ckpt = Path(cfg["ft"]["checkpoint_dir"])
    checkpoint.write_meta(ckpt, 5, 1, "test")  # incomplete: rank 0 never wrote its header
    assert resolve_resume(cfg, said.append)["ft"]["resume_from"] is None
    (ckpt / "step_5" / "rank_0").mkdir()
    (ckpt / "step_5" / "rank_0" / checkpoint.HEADER_FILE).write_text("{}")
    assert resolve_resume(cfg, said.append)["ft"]["resume_from"] == str(ckpt)
    assert "step 5" in said[-1]
    with pytest.raises(ValueError, match="stop_timeout_s"):
        # (a run directory of its own: this one holds the checkpoint above, refused first)
        run_job(compose_train(BASE + ["ft.stop_timeout_s=5", "ft.status_timeout_s=10"],
                              tmp_path / "bad_stop_timeout"), log=quiet)


@pytest.mark.slow
def test_a_rank_hung_while_it_writes_ends_the_job_within_stop_timeout_and_nothing_is_read(tmp_path):
    """Rank 1 hangs in its part of the write (heartbeat alive): the job still ends
    ``ft.stop_timeout_s`` after the signal, every process gone, and the incomplete step is never
    taken for a checkpoint."""
    run_dir = tmp_path / "run"
    job = Job(run_dir, ["ft.stop_timeout_s=6", "ft.status_timeout_s=3",
                        "faults.events=[{rank: 1, step: 0, phase: checkpoint, kind: hang}]"])
    job.wait_for_step(AT_STEP)
    took = job.signal(signal.SIGTERM, "coordinator")
    print(f"\nSIGTERM with a hung writer -> job ended: {took:.2f} s (ft.stop_timeout_s=6)")
    assert 6 <= took < 6 + STOP_BOUND_S, job.out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "preempted"
    assert "not written completely within ft.stop_timeout_s=6" in summary["message"]
    assert "a new run starts from step 0" in summary["message"]
    assert summary["stop"]["checkpoint"] is None
    assert checkpoint.latest_complete_step(run_dir / "checkpoints") is None
    assert_nothing_left(run_dir)


@pytest.mark.slow
def test_sigterm_to_the_agents_of_an_unreachable_coordinator_has_their_ranks_write_and_leave(
        reference, tmp_path):
    """The coordinator's host stopped (SIGSTOP: its store accepts connections, answers nothing)
    when srun forwards SIGTERM: each agent's request goes unanswered, so its ranks write what
    they hold at once (the coordinator-loss path) and the agents leave with them, long before
    ``ft.coordinator_timeout_s`` (30 s here) would have told them."""
    run_dir = tmp_path / "run"
    job = Job(run_dir, ["ft.coordinator_timeout_s=30"])
    job.wait_for_step(AT_STEP)
    agents = job.agents()
    assert len(agents) == 2, agents  # dp4 on one node of 4 slots, the spare on a second
    job.p.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        for pid in agents:
            os.kill(pid, signal.SIGTERM)
        alive = lambda: [p for p in job_processes(run_dir) if p != job.p.pid]  # noqa: E731
        # (waited for past the bound, up to the agents' own kill at ft.stop_timeout_s +
        # ft.coordinator_timeout_s = 55 s: a failure then says whether, and when, they left)
        while alive() and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        took = time.monotonic() - t0
        print("\nSIGTERM to the agents, coordinator stopped -> agents and ranks gone: "
              f"{took:.2f} s")
        left = alive()
        assert not left, f"processes outlived their agents' stop:\n{who(run_dir, left)}"
        assert took < 20, who(run_dir, [])
    finally:
        job.p.kill()
        job.p.wait()
    logs = "".join(f.read_text() for f in (run_dir / "logs").glob("agent*.log"))
    assert "does not answer" in logs, logs
    S = checkpoint.latest_complete_step(run_dir / "checkpoints")
    assert S is not None and S >= AT_STEP
    resumed = run_job(compose_train(BASE + ["ft.resume_from=auto"], run_dir), log=quiet)
    assert resumed["outcome"] == "completed", resumed["message"]
    equal, why = compare_final_states(run_dir, reference)
    assert equal, why
