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
