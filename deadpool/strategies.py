"""Fault-tolerance strategies of the runtime, chosen by the ``ft=`` config group.

A strategy is what a job does per step to be able to recover, and what it does when a rank
fails. The trainer and the coordinator ask the job's ``Strategy`` instead of branching on names:

    deadpool       per-step snapshots copied and replicated off the critical path (widened under
                   back-pressure, ``snapshot_schedule.py``); a failure is hot-swapped onto a warm
                   spare while the survivors keep their processes
    sync_snapshot  the same snapshots, but the training thread waits for each one's copy and
                   replication before the next step (no overlap); the same hot-swap
    none           nothing: the overhead reference; a failure ends the job cleanly

Checkpoint/restart (relaunch every process from the last disk checkpoint) and elastic shrink are
not runtime strategies yet; the simulator models both (``sim/strategies``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    name: str
    recovers: bool       # a failure is hot-swapped (else the job ends, outcome "unrecoverable")
    sync_snapshot: bool  # each snapshot is copied and replicated before the next step starts


STRATEGIES = {s.name: s for s in (Strategy("deadpool", recovers=True, sync_snapshot=False),
                                  Strategy("sync_snapshot", recovers=True, sync_snapshot=True),
                                  Strategy("none", recovers=False, sync_snapshot=False))}


def strategy_of(ft: dict) -> Strategy:
    """The strategy of a resolved ``ft`` config; raises ``ValueError`` on a bad combination."""
    name = ft.get("strategy", "deadpool")
    if name not in STRATEGIES:
        raise ValueError(f"ft.strategy must be one of {sorted(STRATEGIES)}, got {name!r}")
    s = STRATEGIES[name]
    if s.sync_snapshot and not ft["snapshot"]:
        raise ValueError("ft=sync_snapshot needs ft.snapshot=true")
    if not s.recovers and int(ft["num_spares"]) > 0:
        raise ValueError("ft=none recovers nothing: it takes no spares (ft.num_spares=0)")
    return s
