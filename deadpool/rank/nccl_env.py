"""The NCCL / torch-NCCL environment every DeadPool worker runs with (locally and under srun).

DeadPool aborts a failed generation's NCCL groups itself (``Communicator``'s abort watcher) and
keeps the surviving processes: torch's own failure handling must not tear them down first. Each
variable below says why it is set. ``worker.main`` applies them before any CUDA or NCCL call
(torch reads them when a ``ProcessGroupNCCL`` is created, NCCL at communicator init).

``REQUIRED``   the hot-swap depends on these: set whatever the environment says (a warning
               names every value overridden)
``DEFAULTS``   behaviour DeadPool is measured with; a user may override them
``DETERMINISTIC``  with ``deterministic=true``: a spare's reductions must add in the same order
               as the rank it replaces, so NCCL's algorithm and protocol are pinned (otherwise
               NCCL's tuner may pick another algorithm for a communicator rebuilt with a new
               member, and the sums differ in the last bits)
``share_gpu``  test mode only: several ranks on one GPU (see ``share_gpu_env``)
"""

from __future__ import annotations

import os
import sys

REQUIRED = {
    # 3 (torch 2.13's default) makes the watchdog of a survivor that saw a peer die dump, sleep
    # about a minute and then terminate the process; torch's ``_abort_process_group`` asks for
    # error handling off when the application aborts groups itself.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    # ``work.wait()`` must make the compute stream wait, not block the host: the training thread
    # synchronises with the GPU once per step (``Communicator.sync``), never per collective.
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    # no flight-recorder dump when a collective times out or a peer dies (the dump is followed
    # by a sleep on the watchdog thread, and its key arms the heartbeat monitor below)
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    # torch's heartbeat monitor kills a process whose watchdog it thinks is stuck (480 s after a
    # dump key appears); DeadPool's own heartbeat and progress watchdog decide who is hung.
    "TORCH_NCCL_ENABLE_MONITORING": "0",
}

DEFAULTS = {
    # NCCL >= 2.22 connects an algorithm's channels lazily, at its first collective: the first
    # all-reduce that picks another algorithm would then connect on the training thread, where
    # a peer lost meanwhile hangs it in a call no abort frees. 0 connects every algorithm at
    # communicator init, inside the abortable group build.
    "NCCL_RUNTIME_CONNECT": "0",
}

DETERMINISTIC = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}


def share_gpu_env(slot: int) -> dict[str, str]:
    """Several NCCL ranks on one GPU (a test mode: ``launcher.share_gpu=true``).

    NCCL refuses two ranks of one communicator on the same device ("Duplicate GPU detected")
    when they share a host hash. A host id of its own per process makes NCCL treat each as a
    separate host and connect them through its socket transport over loopback. Slow
    (milliseconds per all-reduce): for correctness and recovery timing, never for throughput.
    (NCCL >= 2.30 has ``NCCL_MULTI_RANK_GPU_ENABLE=1`` for the same; the host ids work on every
    version.)"""
    return {"NCCL_HOSTID": f"deadpool-slot-{slot}", "NCCL_SOCKET_IFNAME": "lo",
            "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_MNNVL_ENABLE": "0",
            "NCCL_NVLS_ENABLE": "0"}


def nccl_env(deterministic: bool, environ=None) -> tuple[dict[str, str], list[str]]:
    """``(variables to set, warnings)`` for a worker, given its current environment."""
    environ = os.environ if environ is None else environ
    out, warnings = {}, []
    for k, v in REQUIRED.items():
        if environ.get(k, v) != v:
            warnings.append(f"{k}={environ[k]} overridden to {v}: DeadPool aborts NCCL groups "
                            "itself and keeps the surviving processes (deadpool/rank/nccl_env.py)")
        out[k] = v
    for k, v in DEFAULTS.items():
        out[k] = environ.get(k, v)
    if deterministic:
        for k, v in DETERMINISTIC.items():
            if environ.get(k, v) != v:
                warnings.append(f"{k}={environ[k]} overridden to {v}: deterministic=true pins "
                                "NCCL's algorithm so a spare's reductions match")
            out[k] = v
    return out, warnings


def apply(deterministic: bool) -> dict[str, str]:
    """Set the worker's NCCL environment in this process (before any CUDA or NCCL call)."""
    env, warnings = nccl_env(deterministic)
    for w in warnings:
        print(f"[deadpool] warning: {w}", file=sys.stderr, flush=True)
    os.environ.update(env)
    return env
