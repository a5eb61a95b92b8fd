"""The end of a job, coordinator side: every rank's final record, waited for while it progresses.

Once every rank finished its last step the coordinator sets ``job/done``; each rank then writes
its part of the final checkpoint (``checkpoint.final.write_final_state``: one checkpoint of
unique state, the replicated tensors spread over the replicas) and posts its record (the digest
of its whole state, step, sizes) under ``final/<rank>``. ``collect_finals`` waits for those records as long as each
missing rank's writer makes progress (``checkpoint.final.FinalWait``), never for a fixed time:

    a missing rank's process exited             -> JobFailed at once (its log's tail)
    its beat is lost (stopped, gone)             -> JobFailed naming the rank
    its progress unchanged for the bound         -> JobFailed naming the rank ("stalled")
    every record in                              -> the job completed

The progress a rank shows is its heartbeat's progress counter (``watchdog.Progress``), which its
writer bumps per tensor copied and per chunk written; the bound is ``ft.progress_timeout_s`` (the
progress watchdog's). Under node agents there is no per-rank counter on the wire: each agent
judges its processes by that rule and flags the stalled ones (``own``), and the wait names a
flagged rank after two agent intervals more.
"""

from __future__ import annotations

import json
import time

from deadpool.checkpoint.final import FinalWait
from deadpool.errors import JobFailed
from deadpool.recovery import detect
from deadpool.store.protocol import Keys
from deadpool.store.reports import Reports

POLL_S = 0.01


def stall_bound_s(coord) -> float:
    """Seconds without progress after which a missing rank's writer is stalled."""
    if coord.events is None:
        return float(coord.ft["progress_timeout_s"])
    return 2 * float(coord.ft["agent_interval_s"])  # (the agent already waited progress_timeout_s)


def writers_progress(coord, ranks, poll: int) -> dict[int, object]:
    """rank -> a value that changes while its writer progresses (absent: no news)."""
    slots = {r: coord.members.ranks.get(r) for r in ranks}
    live = coord.live
    if coord.events is None:
        return {r: live.progress_of(s) for r, s in slots.items() if live.progress_of(s) is not None}
    flagged = set(live.hung(list(slots.values()))[0])
    return {r: poll for r, s in slots.items() if s not in flagged}


def collect_finals(coord) -> None:
    """Fill ``coord.finals`` (rank -> its final record) from every rank of the generation, or
    raise ``JobFailed`` naming the ranks whose writers failed (the module's table)."""
    world = coord.dims.world_size
    got = Reports(coord.store, coord.seal, Keys.final, range(world),
                  on_forged=lambda r: detect.forged(coord, f"final state of rank {r}"))
    bound = stall_bound_s(coord)
    wait = FinalWait(range(world), stall_s=bound)
    poll = 0
    while True:
        coord.tick()
        coord.read_heartbeats()
        for r, text in got.poll_new().items():
            coord.finals.setdefault(r, json.loads(text))
        poll += 1
        wait.update(set(coord.finals), writers_progress(coord, wait.pending, poll))
        if wait.finished:
            return
        for r in sorted(wait.pending):
            slot = coord.members.ranks.get(r)
            if coord.launcher.poll(slot) not in (None, 0):
                raise JobFailed(f"rank {r} failed while writing its final state:\n"
                                + coord.launcher.log_tail(slot))
            if coord.lost(slot):
                raise JobFailed(f"rank {r} (slot {slot}) stopped beating while writing its final "
                                "state (its process stopped or is gone)")
        stalled = wait.stalled()
        if stalled:  # never call a job completed without every rank's final state
            raise JobFailed(f"ranks {stalled} made no progress writing their final state for "
                            f"{bound:g} s (slots {[coord.members.ranks.get(r) for r in stalled]})")
        time.sleep(POLL_S)
