"""A DeadPool job across the test bed's hosts, started the way ``experiments/slurm/deadpool_job.sh``
starts one under Slurm.

    root namespace   python -m deadpool.train launcher=slurm ...    the coordinator, its store
                                                                    bound to the bridge address
    host i           python -m deadpool.agent --job JOB --node-from-env
                     (SLURM_PROCID = SLURM_NODEID = i), which starts host i's ranks

Each process gets what srun would give it: ``SLURM_JOB_ID``, ``SLURM_JOB_NUM_NODES``,
``SLURM_PROCID``, ``DEADPOOL_STORE_HOST`` / ``_PORT`` and ``DEADPOOL_JOB_SECRET_FILE`` (a 0600 file
in the run directory, on the file system every host shares). Nothing else: in particular no
``GLOO_SOCKET_IFNAME``, so the job must find each host's interface itself.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from experiments.testbed.netns import TestBed

ROOT = Path(__file__).resolve().parents[2]
# variables of the caller's environment that a cluster's processes would not have (the test
# suite pins gloo to loopback for its single-host jobs)
DROP_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "DEADPOOL_JOB_SECRET",
            "DEADPOOL_STORE_HOST", "DEADPOOL_STORE_PORT")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ClusterJob:
    """One job on ``bed``: ``start()``, then watch it (``step``, ``summary``), inject faults
    through the bed, and ``wait()``. ``close()`` (or the context manager) leaves no process."""

    def __init__(self, bed: TestBed, run_dir: Path, overrides: list[str], ranks_per_node: int,
                 job_id: str | None = None):
        self.bed, self.run_dir = bed, Path(run_dir)
        self.overrides, self.ranks_per_node = list(overrides), ranks_per_node
        self.job_id = job_id or f"{os.getpid()}{int(time.time()) % 100000}"
        self.coord: subprocess.Popen | None = None
        self.agents: dict[int, subprocess.Popen] = {}
        self.t_start = None

    def env(self, **extra) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in DROP_ENV}
        env.update(PYTHONUNBUFFERED="1", SLURM_JOB_ID=self.job_id,
                   SLURM_JOB_NUM_NODES=str(len(self.bed.hosts)),
                   DEADPOOL_STORE_HOST=self.bed.gateway, DEADPOOL_STORE_PORT=str(self.port),
                   DEADPOOL_JOB_SECRET_FILE=str(self.secret_file), **extra)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        return env

    def start(self, timeout_s: float = 60.0) -> "ClusterJob":
        from deadpool.store.auth import new_secret

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.secret_file = self.run_dir / "job.secret"
        self.secret_file.unlink(missing_ok=True)
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(new_secret())
        (self.run_dir / "job.json").unlink(missing_ok=True)
        self.port = free_port(self.bed.gateway)
        self.t_start = time.monotonic()
        self.coord = subprocess.Popen(
            [sys.executable, "-m", "deadpool.train", "launcher=slurm",
             f"parallel.ranks_per_node={self.ranks_per_node}", f"hydra.run.dir={self.run_dir}",
             *self.overrides],
            cwd=ROOT, env=self.env(), stdout=open(self.run_dir / "coordinator.log", "w"),
            stderr=subprocess.STDOUT, start_new_session=True)
        job = self.run_dir / "job.json"
        deadline = time.monotonic() + timeout_s
        while True:
            if self.coord.poll() is not None:
                raise RuntimeError(f"the coordinator exited {self.coord.returncode}:\n"
                                   + self.log())
            if job.exists():
                try:
                    cfg = json.loads(job.read_text())
                    break
                except ValueError:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no job.json after {timeout_s} s:\n" + self.log())
            time.sleep(0.1)
        from deadpool.agent.__main__ import num_nodes

        n = num_nodes(cfg)
        if n > len(self.bed.hosts):
            raise ValueError(f"the job needs {n} nodes, the bed has {len(self.bed.hosts)} hosts")
        for i in range(n):
            self.agents[i] = self.bed.popen(
                i, [sys.executable, "-m", "deadpool.agent", "--job", str(job), "--node-from-env"],
                cwd=ROOT, env=self.env(SLURM_PROCID=str(i), SLURM_NODEID=str(i)),
                stdout=open(self.run_dir / f"agent{i}.out", "w"), stderr=subprocess.STDOUT)
        return self

    # -- watching ----------------------------------------------------------------------------------
    def log(self) -> str:
        try:
            return (self.run_dir / "coordinator.log").read_text()
        except OSError:
            return ""

    def step(self) -> int:
        """The newest step any rank has logged (its ``metrics/slot<n>.jsonl``; -1 before the
        first)."""
        newest = -1
        for f in (self.run_dir / "metrics").glob("slot*.jsonl"):
            try:
                with open(f, "rb") as fh:
                    fh.seek(max(0, f.stat().st_size - 4096))
                    tail = fh.read().decode(errors="replace").splitlines()[1:]
            except OSError:
                continue
            for line in tail:
                try:
                    newest = max(newest, int(json.loads(line).get("step", -1)))
                except ValueError:
                    pass
        return newest

    def wait_step(self, step: int, timeout_s: float = 120.0) -> float:
        """Block until a rank logged ``step``; returns the monotonic time it was seen."""
        deadline = time.monotonic() + timeout_s
        while self.step() < step:
            if self.coord.poll() is not None:
                raise RuntimeError(f"the job ended before step {step}:\n" + self.log())
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step} not reached in {timeout_s} s (at {self.step()}):\n"
                                   + self.log())
            time.sleep(0.02)
        return time.monotonic()

    def wait(self, timeout_s: float = 300.0) -> dict:
        """Wait for the coordinator to exit; returns summary.json (every agent then has a few
        seconds to leave, as deadpool_job.sh gives srun's step)."""
        try:
            self.coord.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the job did not end in {timeout_s} s:\n" + self.log()) from None
        for p in self.agents.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        return json.loads((self.run_dir / "summary.json").read_text())

    def close(self) -> None:
        for p in [self.coord, *self.agents.values()]:
            if p is not None and p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL) if p is self.coord else p.kill()
                except ProcessLookupError:
                    pass
                p.wait()
        for i in range(len(self.bed.hosts)):
            self.bed.kill_host(i)

    def __enter__(self) -> "ClusterJob":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
