"""Ledger: where every second of wall time went, and the event counters of one run.

Invariant (asserted by tests): ``useful_s + sum(badput_s.values()) == wall_s``. Useful time is
progress that is finally kept, in seconds at nominal (full-width, overhead-free) speed; every
other second lands in exactly one badput bucket.
"""

from __future__ import annotations

BUCKETS = (
    "ckpt_stall",  # training blocked while a checkpoint is written (sync) or snapshotted (async)
    "lost",  # rolled-back progress (recomputed or lost work), nominal seconds
    "detection",  # failure happened, not yet noticed
    "reconfiguration",  # communicator rebuild, state transfer, warm-up, shrink/regrow, failover
    "restart",  # full job restart: requeue, relaunch, checkpoint load
    "wait_spare",  # stalled: no spare node (or too few for the minimum width)
    "degraded",  # running below nominal throughput (shrunk or failed-over)
    "redundant",  # redundant computation (replication)
    "snapshot",  # steady-state in-memory snapshot overhead
)

COUNTERS = ("failures", "hangs", "corruptions", "planned_maintenance", "swaps", "restarts", "stalls", "shrinks",
            "regrows", "fallbacks", "reloads", "absorbed", "spare_failures", "masked", "empty_pool")


class Ledger:
    """Accumulates badput seconds per bucket and event counts."""

    def __init__(self) -> None:
        self.badput_s = dict.fromkeys(BUCKETS, 0.0)
        self.counts = dict.fromkeys(COUNTERS, 0)

    def add(self, bucket: str, seconds: float) -> None:
        self.badput_s[bucket] += seconds

    def count(self, counter: str, n: int = 1) -> None:
        self.counts[counter] += n
