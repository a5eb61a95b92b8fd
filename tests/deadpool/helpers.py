"""Run per-rank functions in threads against one TCPStore (fast process-group tests)."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist


def master_store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30), use_libuv=True)


def client(port: int):
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30),
                         use_libuv=True)


def shorten_timeouts(comm, timeout_s: float):
    """Give a communicator's groups a short op timeout once they are connected. Tests that
    abandon an op in flight need it (the process would wait for the op at exit), but connecting
    under it is flaky on a loaded 2-core machine, where a peer's low-priority replication-group
    thread can be held off for seconds."""
    for group in comm.groups.values():
        group.pg.set_timeout(timedelta(seconds=timeout_s))
    return comm


def run_threads(fn, n: int, timeout_s: float = 60.0) -> list:
    results, errors = [None] * n, [None] * n

    def wrap(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # surfaced below
            errors[r] = e

    threads = [threading.Thread(target=wrap, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), "rank thread hung"
    for e in errors:
        if e is not None:
            raise e
    return results
