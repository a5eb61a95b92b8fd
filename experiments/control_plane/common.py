"""What the fake ranks and nodes share: the step they are at, the per-thread stats layout, and
store clients that count their requests."""

from __future__ import annotations

import resource
import time

STEP = 10  # the step every fake rank is at
VOTE_EVERY = 16  # snapshots between snapshot-interval votes (snapshot.schedule's default every)
MAX_GEN = 3
# per thread, in the shared stats array: requests, max lag, window seen, slots announced (start-up
# progress), the nodes' reactions to aborts (when the latest ended, time.time(); their CPU in all;
# how many), then per generation (latest plan read time, number of processes that read it)
OPS, LAG, WIN, BUILT, REACT_T, REACT_CPU, REACT_N = 0, 1, 2, 3, 4, 5, 6
FIELDS = 7 + 2 * MAX_GEN
ALIVE, DEAD, SILENT = 0, 1, 2


def plan_read_t(g: int) -> int:
    """Offset in a thread's stats of generation ``g``'s latest plan read time."""
    return 7 + 2 * g


def plan_reads(g: int) -> int:
    """Offset in a thread's stats of how many of its processes read plan ``g``."""
    return 8 + 2 * g


def note_plan_read(stats, base: int, g: int, n: int = 1) -> None:
    """``n`` processes of the thread whose stats start at ``base`` read plan ``g`` now."""
    if g < MAX_GEN:
        stats[base + plan_read_t(g)] = max(stats[base + plan_read_t(g)], time.time())
        stats[base + plan_reads(g)] += n


class CountedOps:
    """A store client counting its requests into ``into.ops`` (itself by default)."""

    def __init__(self, store, into=None):
        self._store, self._into, self.ops = store, into or self, 0

    def __getattr__(self, name):
        fn = getattr(self._store, name)

        def call(*a, **k):
            self._into.ops += 1
            return fn(*a, **k)
        return call


class Counted:
    """The coordinator's store, counting requests (a multi_get or a multi-key check is one),
    in all and by method."""

    def __init__(self, store):
        self._store, self.requests, self.by_method = store, 0, {}

    def __getattr__(self, name):
        fn = getattr(self._store, name)

        def call(*a, **k):
            self.requests += 1
            self.by_method[name] = self.by_method.get(name, 0) + 1
            return fn(*a, **k)
        return call


def raise_fd_limit(need: int, log=print) -> None:
    """Raise this process's open-file limit (inherited by the fake processes) to at least
    ``need``, as far as the hard limit allows: under node agents the store's process holds one
    connection per fake node's event follower (2,049 at 16,384 ranks) and each fake process
    half of them, past a common soft limit of 1,024 (a connection refused for it looks like
    load, and its node never reads a plan)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if hard != resource.RLIM_INFINITY and hard < need:
        log(f"[bench] open files: hard limit {hard} < {need} needed; raise it (ulimit -Hn)",
            flush=True)
