"""Launchers start and fence the processes of a job; the coordinator never starts them itself.

``LocalLauncher`` starts every worker and warm spare as a child process of the coordinator on this
machine, so process exit is observable (``poll``) and a hung process can be fenced (SIGKILL).
On SLURM / torchrun the processes are started by ``srun``; ``ExternalLauncher`` then has no
handles: failures are seen through heartbeats and collective errors only, and fencing is a store
key that a remote process's heartbeat thread honours (see experiments/slurm/).

Both hand the job's secret (deadpool/auth.py) to nobody but the job: ``LocalLauncher`` puts it in
each child's environment only, ``ExternalLauncher`` seals the fences it writes with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from deadpool import auth, nccl_env
from deadpool.protocol import Keys


def local_rank(slot: int, num_devices: int | None = None) -> int:
    """The device index of a local process: its slot, round-robin over the visible GPUs (all 0
    without GPUs)."""
    if num_devices is None:
        num_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return slot % num_devices if num_devices > 0 else 0


class LocalLauncher:
    def __init__(self, run_dir: Path, job_json: Path, secret: str | None = None,
                 share_gpu: bool = False):
        self.run_dir = Path(run_dir)
        self.share_gpu = share_gpu  # several NCCL ranks per GPU (nccl_env.share_gpu_env)
        self.job_json = Path(job_json)
        self.secret = secret
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, Path] = {}

    def start(self, slots: list[int]) -> None:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env["PYTHONUNBUFFERED"] = "1"
        if self.secret is not None:  # the children's environment only: never argv, job.json or a log
            env[auth.SECRET_ENV] = self.secret
            env.pop(auth.SECRET_FILE_ENV, None)
        for slot in slots:
            log = self.run_dir / "logs" / f"slot{slot}.log"
            self.logs[slot] = log
            # one GPU per local rank: the worker selects cuda:LOCAL_RANK (spares too: a spare's
            # device is fixed at launch; with fewer GPUs than processes they share round-robin)
            local_env = dict(env, LOCAL_RANK=str(local_rank(slot)))
            if self.share_gpu:
                local_env.update(nccl_env.share_gpu_env(slot))
            self.procs[slot] = subprocess.Popen(
                [sys.executable, "-m", "deadpool.worker", "--job", str(self.job_json), "--slot", str(slot)],
                stdout=open(log, "a"), stderr=subprocess.STDOUT, env=local_env,  # "a": relaunches
                start_new_session=True)

    def poll(self, slot: int) -> int | None:
        """Exit code of the process in ``slot``, or None while it runs."""
        return self.procs[slot].poll()

    def is_stopped(self, slot: int) -> bool:
        """True if the process is stopped (SIGSTOP, traced) or gone, from /proc (Linux)."""
        p = self.procs.get(slot)
        if p is None or p.poll() is not None:
            return True
        try:
            stat = Path(f"/proc/{p.pid}/stat").read_text()
        except OSError:
            return True
        return stat.rsplit(")", 1)[1].split()[0] in ("T", "t", "Z", "X")

    def kill(self, slot: int) -> None:
        """Fence: a declared-dead process must never come back (a SIGSTOPped one would)."""
        p = self.procs.get(slot)
        if p is not None and p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait_all(self, timeout_s: float) -> None:
        for slot, p in self.procs.items():
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill(slot)
                p.wait()

    def log_tail(self, slot: int, lines: int = 20) -> str:
        try:
            return "\n".join(self.logs[slot].read_text().splitlines()[-lines:])
        except OSError:
            return ""


class ExternalLauncher:
    """Processes started elsewhere (srun, torchrun): no exit codes, fencing through the store."""

    def __init__(self, store, secret: str | None = None):
        self.store = store  # the job's namespaced store (auth.namespaced)
        self.secret = secret

    def start(self, slots: list[int]) -> None:
        pass

    def poll(self, slot: int) -> int | None:
        return None

    def is_stopped(self, slot: int) -> bool:
        return False  # remote: only the hard heartbeat timeout (or a peer's error) can tell

    def kill(self, slot: int) -> None:
        key = Keys.fence(slot)  # sealed for this key: a copy under another slot's key is refused
        self.store.set(key, "1" if self.secret is None else auth.seal(self.secret, "1", context=key))

    def wait_all(self, timeout_s: float) -> None:
        pass

    def log_tail(self, slot: int, lines: int = 20) -> str:
        return ""


def job_processes(run_dir) -> list[int]:
    """PIDs of this machine's processes whose command line names ``run_dir``'s job file (a job's
    workers and spares): tests and the fault campaign check that none outlives its job."""
    needle = str(Path(run_dir) / "job.json").encode()
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if needle in (p / "cmdline").read_bytes():
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids
