"""Starting one process of a job: its environment, a new interpreter or a fork, and a kill.

What the launchers (``deadpool.launch.launcher``) and the node agents (``deadpool.agent``) both
do to a single process: ``start_worker`` runs ``python -m deadpool.rank.worker`` for a slot,
``fork_worker`` forks the calling process into one instead (``launcher.fork_workers``),
``sigkill`` and ``process_stopped`` fence and inspect it. Nothing here knows about nodes, plans
or the coordinator.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from deadpool.rank import nccl_env
from deadpool.store import auth

PR_SET_NAME = 15  # prctl(2)


def local_rank(slot: int, num_devices: int | None = None) -> int:
    """The device index of a local process: its slot, round-robin over the visible GPUs (all 0
    without GPUs)."""
    if num_devices is None:  # (counted through NVML where it can be: no CUDA context here, so a
        num_devices = torch.cuda.device_count()  # node agent may still fork its processes)
    return slot % num_devices if num_devices > 0 else 0


def job_env(secret: str | None, sockets: dict | None = None) -> dict:
    """The environment of a job's local processes: the job's secret in it (never argv, job.json
    or a log); ``sockets``: the interface they talk over (``netif.socket_env``; else loopback,
    every process of the local launcher being on this host)."""
    env = dict(os.environ)
    env.update(sockets or {"GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo")})
    env["PYTHONUNBUFFERED"] = "1"
    if secret is not None:
        env[auth.SECRET_ENV] = secret
        env.pop(auth.SECRET_FILE_ENV, None)
    return env


def start_worker(run_dir: Path, job_json: Path, slot: int, env: dict, share_gpu: bool = False,
                 preexec_fn=None, keep_local_rank: bool = False) -> tuple[subprocess.Popen, Path]:
    """Start the process of ``slot`` (its output appended to ``logs/slot<slot>.log``: a relaunch
    appends). One GPU per local rank: the worker selects cuda:LOCAL_RANK (spares too: a spare's
    device is fixed at launch; with fewer GPUs than processes they share round-robin), from the
    slot unless ``keep_local_rank`` (a Slurm node's agent sets it from the process's place on
    its node: ``agent.__main__.child_env``)."""
    log, local_env = _worker_log_env(run_dir, slot, env, share_gpu, keep_local_rank)
    proc = subprocess.Popen(
        [sys.executable, "-m", "deadpool.rank.worker", "--job", str(job_json), "--slot", str(slot)],
        stdout=open(log, "a"), stderr=subprocess.STDOUT, env=local_env,
        start_new_session=preexec_fn is None, preexec_fn=preexec_fn)
    return proc, log


def _worker_log_env(run_dir, slot: int, env: dict, share_gpu: bool,
                    keep_local_rank: bool) -> tuple[Path, dict]:
    log = Path(run_dir) / "logs" / f"slot{slot}.log"
    local_env = dict(env) if keep_local_rank else dict(env, LOCAL_RANK=str(local_rank(slot)))
    if share_gpu:
        local_env.update(nccl_env.share_gpu_env(slot))
    return log, local_env


def fork_worker(run_dir: Path, job_json: Path, slot: int, env: dict, share_gpu: bool = False,
                preexec_fn=None, keep_local_rank: bool = False,
                t_exec: float | None = None) -> tuple["ForkedProcess", Path]:
    """``start_worker`` without a new interpreter (``launcher.fork_workers``): a node agent forks
    itself, torch and ``deadpool.rank.worker`` already imported, and the child runs the worker's
    ``main`` in the environment, session and log ``start_worker`` would give it. A node saves
    one interpreter start and torch import (~2 s of CPU each here) per process. ``t_exec``: when
    the forking process itself started (the child's start-up counts from there, as an exec'd
    one's counts from its interpreter's start)."""
    from deadpool.rank import worker

    log, local_env = _worker_log_env(run_dir, slot, env, share_gpu, keep_local_rank)
    argv = ["--job", str(job_json), "--slot", str(slot)]
    return fork_main(worker.main, argv, log, local_env, preexec_fn, t_exec, worker,
                     name=f"dp-slot{slot}"), log


class ForkedProcess:
    """A child of this process from ``fork_main``, with the part of ``subprocess.Popen`` the
    launchers use (``pid``, ``returncode``, ``poll``, ``wait``): a signal's exit is ``-signum``,
    one thread may block in ``wait`` while others ``poll``."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None
        self._lock = threading.Lock()

    def _reap(self, flags: int) -> None:
        pid, status = os.waitpid(self.pid, flags)
        if pid:
            self.returncode = os.waitstatus_to_exitcode(status)

    def poll(self) -> int | None:
        if self.returncode is None and self._lock.acquire(blocking=False):
            try:
                if self.returncode is None:
                    self._reap(os.WNOHANG)
            finally:
                self._lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            with self._lock:
                if self.returncode is None:
                    self._reap(0)
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode


def fork_main(main, argv: list[str], log: Path, env: dict, preexec_fn=None,
              t_exec: float | None = None, module=None, name: str = "") -> ForkedProcess:
    """Fork this process and run ``main(argv)`` in the child as ``python -m`` would run it in a
    new interpreter: stdout and stderr appended to ``log``, no descriptor of the parent's kept,
    ``env`` as its whole environment, a session of its own (or ``preexec_fn``), default signal
    handlers; an exception is printed and exits 1, ``SystemExit`` exits with its code (so does an
    int that ``main`` returns), and the
    child never returns into the caller's code. ``module.T_EXEC`` (the worker's start time) is set
    to ``t_exec``. Its command line stays the parent's; ``name`` becomes its process name (``ps
    -o comm``, ``/proc/<pid>/comm``, 15 characters at most).

    Refused in a process that runs a second Python thread: the child would hold a copy of every
    lock as it was at the fork. Objects the parent holds are frozen out of the child's garbage
    collector, so no finalizer of the parent's runs there (one could close a descriptor the
    child has reused). Why not ``multiprocessing``'s fork start: it gives the agent's waiter
    threads no ``Popen`` to wait on, and its child replaces stdin and exits on its own terms."""
    if threading.active_count() > 1:
        raise RuntimeError(f"fork_main: this process runs {threading.active_count()} threads; "
                           "a fork would copy locks another thread may hold (fork before any "
                           "thread starts)")
    log = Path(log)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    gc.collect()
    gc.freeze()
    pid = os.fork()
    if pid:
        gc.unfreeze()
        os.close(fd)
        return ForkedProcess(pid)
    code = 1
    try:  # the child
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        _close_descriptors_from(3)
        if preexec_fn is not None:
            preexec_fn()
        else:
            os.setsid()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
                    signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if name:
            _set_process_name(name)
        os.environ.clear()
        os.environ.update(env)
        if module is not None:
            module.T_EXEC = time.time() if t_exec is None else t_exec
        sys.argv = [getattr(module, "__file__", "") or sys.argv[0], *argv]
        code = main(argv)  # (an int: the exit status, as ``python -m``'s ``sys.exit(main())``)
        code = code if isinstance(code, int) else 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _set_process_name(name: str) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _close_descriptors_from(low: int) -> None:
    for name in os.listdir("/proc/self/fd"):
        if int(name) >= low:
            try:
                os.close(int(name))
            except OSError:
                pass


def sigkill(proc: subprocess.Popen | None) -> None:
    """SIGKILL a child process that still runs."""
    if proc is not None and proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def process_stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP, traced) or gone, from /proc (Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t", "Z", "X")
