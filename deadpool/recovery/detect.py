"""Step 1-3 of a recovery (coordinator side): detect a failure, abort the generation and fence the
dead, then collect what every process that answers can resume from.

Failure signals, each named in the record's ``detected_by``::

    process exit        (the launcher owns the process)            -> "exit"
    heartbeat staleness (a stopped or unreachable process)         -> "heartbeat"
    progress staleness  (a hung training thread, heartbeat alive)  -> "progress"
    a rank's report     (its step raised, or a collective broke)   -> "exception" /
                                                                      "collective_error"

Every function takes the ``Coordinator`` (its store, launcher, membership and liveness tracker).
"""

from __future__ import annotations

import json
import time

from deadpool.protocol import Keys, RankStatus, announce_abort


def failures(coord) -> tuple[dict[int, str], float] | None:
    """Failed ranks of the current generation with how each was seen, or None.

    ``({}, t)`` means the generation must be aborted although no rank is known dead (a
    collective broke, or every rank is stuck waiting on the others)."""
    coord.read_heartbeats()
    members, store = coord.members, coord.store
    failed: dict[int, str] = {}
    keys = Keys(coord.gen)
    for rank, slot in members.ranks.items():
        if coord.launcher.poll(slot) is not None:
            crashed = store.check([Keys.crash(slot)])
            failed[rank] = "exception" if crashed else "exit"
        elif coord.lost(slot):
            failed[rank] = "heartbeat"
    by_slot = {s: r for r, s in members.ranks.items()}
    hung, stuck = coord.live.hung(list(by_slot))
    for slot in hung:
        failed.setdefault(by_slot[slot], "progress")
    if not failed and int(store.add(keys.num_errors, 0)) > 0:
        for rank, slot in members.ranks.items():
            if store.check([Keys.crash(slot)]):
                failed[rank] = "exception"
        if not failed:
            _log_errors(coord, keys)
            return {}, time.time()  # a collective broke; culprit not yet known
    check_spares(coord)
    if not failed and stuck:
        coord.log(f"[coordinator] gen {coord.gen}: no rank progressed for "
                  f"{coord.ft['progress_timeout_s']} s, all waiting on each other; regrouping")
        return {}, time.time()
    return (failed, time.time()) if failed else None


def name_culprit(coord, poll_s: float) -> dict[int, str]:
    """Only a collective broke (or all ranks wait on each other): give exit / heartbeat /
    progress a moment to name a dead rank. An empty answer means nobody is provably dead;
    ``collect_statuses`` then declares failed whoever does not report. A corrupt copy a receiver
    reported is its own cause: nobody needs to be named."""
    if _bad_reported(coord):
        return {}
    found = None
    deadline = time.time() + float(coord.ft["heartbeat_timeout_s"]) * 1.5
    while time.time() < deadline:
        found = failures(coord)
        if found and found[0]:
            break
        time.sleep(poll_s)
    return found[0] if found else {}


def abort_and_fence(coord, failed: dict[int, str], reason: str | None = None) -> None:
    """Set the generation's abort key (every rank leaves what it waits on within one poll) and
    SIGKILL the failed ranks' processes (a stopped process must never come back)."""
    announce_abort(coord.store, coord.seal, Keys(coord.gen),
                   reason or f"ranks {sorted(failed)} failed")
    for rank in failed:
        coord.launcher.kill(coord.members.ranks[rank])


def _log_errors(coord, keys: Keys) -> None:
    for rank in coord.members.ranks:
        if (keys.g, rank) not in coord.errors_logged and coord.store.check([keys.error(rank)]):
            coord.errors_logged.add((keys.g, rank))
            coord.log(f"[coordinator] gen {coord.gen}: rank {rank} reports: "
                      f"{coord.store.get(keys.error(rank)).decode()[:300]}")


def _bad_reported(coord) -> bool:
    """A receiver reported a corrupt copy in the current generation."""
    keys = Keys(coord.gen)
    return any(coord.store.check([keys.bad_source(r)]) for r in coord.members.ranks)


def check_spares(coord) -> None:
    """Drop warm spares whose process exited or stopped beating from the pool."""
    members = coord.members
    for slot in list(members.spares):
        if coord.launcher.poll(slot) is not None or coord.lost(slot):
            coord.log(f"[coordinator] warm spare in slot {slot} lost; pool now "
                      f"{len(members.spares) - 1}")
            coord.launcher.kill(slot)
            members.spares.remove(slot)


def collect_statuses(coord, failed: dict[int, str], keys: Keys) -> dict[int, RankStatus]:
    """Wait for every process of the aborted generation to report; whoever dies, stops or
    stays silent past ``status_timeout_s`` is declared failed (added to ``failed``) and fenced."""
    ranks, launcher = coord.members.ranks, coord.launcher
    deadline = time.time() + float(coord.ft["status_timeout_s"])
    statuses: dict[int, RankStatus] = {}
    while True:
        coord.read_heartbeats()
        for rank, slot in ranks.items():
            if rank in failed or rank in statuses:
                continue
            if coord.store.check([keys.status(rank)]):
                statuses[rank] = RankStatus.from_json(coord.store.get(keys.status(rank)))
            elif launcher.poll(slot) is not None:
                failed[rank] = "exit"
                launcher.kill(slot)
            elif coord.lost(slot):
                failed[rank] = "heartbeat"
                launcher.kill(slot)
        # Every rank that has not answered also stopped beating (soft timeout): silent to the
        # abort and no heartbeat are two independent signals, so they are lost now rather than
        # at the hard timeout. It matters under srun, where no process handle shows an exit.
        silent = [r for r in ranks if r not in failed and r not in statuses]
        if silent and all((coord.live.beat_age(ranks[r]) or 0.0) > coord.live.soft_s
                          for r in silent):
            for rank in silent:
                failed[rank] = "heartbeat"
                launcher.kill(ranks[rank])
        if len(statuses) + len(failed) >= len(ranks):
            return statuses
        if time.time() > deadline:
            for rank, slot in ranks.items():
                if rank not in failed and rank not in statuses:
                    failed[rank] = "no_status"
                    launcher.kill(slot)
            return statuses
        time.sleep(0.002)


def collect_bad_sources(coord, keys: Keys) -> list[dict]:
    """Copies that receivers found corrupt in the aborted generation: never used again
    (added to ``coord.bad`` as ``(holder, owner, step)``)."""
    found = []
    for rank in range(coord.dims.world_size):
        if coord.store.check([keys.bad_source(rank)]):
            b = json.loads(coord.store.get(keys.bad_source(rank)))
            coord.bad.add((int(b["holder"]), int(b["owner"]), int(b["step"])))
            found.append(b)
            coord.log(f"[coordinator] copy of rank {b['owner']}'s state at step {b['step']} held "
                      f"by rank {b['holder']} failed its CRC check; it will not be used")
    return found


def collect_faults(coord, dead: set[int]) -> dict[int, dict]:
    """The injected faults behind this recovery (the dead ranks' first, else one survivor's),
    newer than any already attributed: they date the failure (``t_kill``) and name its kind."""
    faults = {}
    for rank, slot in sorted(coord.members.ranks.items(), key=lambda rs: rs[0] not in dead):
        if coord.store.check([Keys.fault(slot)]):
            f = json.loads(coord.store.get(Keys.fault(slot)))
            if f["t"] > coord.fault_t and (rank in dead or not faults):
                faults[rank] = f
    coord.fault_t = max([coord.fault_t] + [f["t"] for f in faults.values()])
    return faults
