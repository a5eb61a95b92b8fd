"""Step 1-3 of a recovery (coordinator side): detect a failure, abort the generation and fence the
dead, then collect what every process that answers can resume from.

Failure signals, each named in the record's ``detected_by``::

    process exit        (the launcher owns the process)            -> "exit"
    heartbeat staleness (a stopped or unreachable process)         -> "heartbeat"
    progress staleness  (a hung training thread, heartbeat alive)  -> "progress"
    a rank's report     (its step raised, or a collective broke)   -> "exception" /
                                                                      "collective_error"

Every function takes the ``Coordinator`` (its store, launcher, membership and liveness tracker).
The reports read here (crash, error, bad copy, fault, status) are posted (``reports.post``): each
read costs O(1) store requests and O(reports) bytes however many ranks the job has, so a
recovery costs the store O(nodes + failures) requests, not O(ranks).
Deadlines run on ``time.monotonic()``: a wall-clock step (NTP) during a recovery must neither
declare silent ranks failed early nor keep the coordinator waiting. ``time.time()`` is only the
detection timestamp ``t_detect``, which records compare with the ranks' own wall-clock stamps.
"""

from __future__ import annotations

import json
import signal
import time

from deadpool.recovery.report_text import summarize
from deadpool.store import reports
from deadpool.store.protocol import Keys, RankStatus


def failures(coord) -> tuple[dict[int, str], float] | None:
    """Failed ranks of the current generation with how each was seen, or None.

    ``({}, t)`` means the generation must be aborted although no rank is known dead (a
    collective broke, or every rank is stuck waiting on the others)."""
    coord.read_counters()
    coord.read_heartbeats()
    members = coord.members
    failed: dict[int, str] = {}
    coord.evidence.clear()  # (what ``note`` keeps is for this detection's recovery only)
    keys = Keys(coord.gen)
    suspects = coord.suspects()  # every rank's slot, or under node agents the flagged ones
    hung, stuck = coord.live.hung(members.ranks.values())
    by_slot = {s: r for r, s in members.ranks.items()} if suspects or hung else {}
    for rank in sorted(by_slot[s] for s in suspects if s in by_slot):
        slot = members.ranks[rank]
        if (code := coord.launcher.poll(slot)) is not None:
            crashed = _crash_reports(coord, {rank: slot})
            failed[rank] = "exception" if crashed else "exit"
            coord.evidence[rank] = exit_text(code)
        elif coord.lost(slot):
            failed[rank] = "heartbeat"
            note(coord, rank, slot)
    for slot in hung:
        if slot in by_slot and by_slot[slot] not in failed:
            failed[by_slot[slot]] = "progress"
            note(coord, by_slot[slot], slot)
    held = getattr(coord, "suspicion", None)  # liveness-only suspects that would cost a copy
    if held is not None:
        failed = held.filter(failed, members.ranks.__getitem__, coord.gen)
    if not failed and _collective_error(coord, keys):
        for rank in _crash_reports(coord, members.ranks):
            failed[rank] = "exception"
        if not failed:
            return {}, time.time()  # a collective broke; culprit not yet known
    check_spares(coord)
    mig = getattr(coord, "migrations", None)  # retired processes still owed to this generation
    if mig is not None and mig.retiring_lost(coord) and not failed:
        coord.abort_cause = "retiring_lost"
        return {}, time.time()
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
    deadline = time.monotonic() + float(coord.ft["heartbeat_timeout_s"]) * 1.5
    while time.monotonic() < deadline:
        found = failures(coord)
        if found and found[0]:
            break
        time.sleep(poll_s)
    return found[0] if found else {}


def abort_and_fence(coord, failed: dict[int, str], reason: str | None = None) -> None:
    """Set the generation's abort key (every rank leaves what it waits on within one poll) and
    SIGKILL the failed ranks' processes (a stopped process must never come back)."""
    coord.announce_abort(reason or f"ranks {sorted(failed)} failed",
                         fence=[coord.members.ranks[rank] for rank in failed])


def _crash_reports(coord, slots: dict[int, int]) -> dict[int, str]:
    """rank -> the crash report its process sealed before exiting (``crash/<slot>``)."""
    return reports.read_posted(coord.store, coord.seal, {r: Keys.crash(s) for r, s in slots.items()},
                        on_forged=lambda r: forged(coord, f"crash report for rank {r}"))


def _collective_error(coord, keys: Keys) -> bool:
    """A rank of this generation sealed a report of a broken collective (``error/<rank>``).

    ``num_errors`` is only a hint of when to look (anyone reaching the store can bump it): the
    reports are read when it changes, and a bump with no sealed report behind it steers nothing.
    """
    n = coord.counter(keys.num_errors)
    g, seen, confirmed = coord.error_hint
    if g == keys.g and n == seen:
        return confirmed
    if g != keys.g:
        confirmed = False
    if n > 0:
        errors = reports.read_posted(coord.store, coord.seal,
                              {r: keys.error(r) for r in coord.members.ranks},
                              on_forged=lambda r: forged(coord, f"error report for rank {r}"))
        for rank, text in sorted(errors.items()):
            if (keys.g, rank) not in coord.errors_logged:
                coord.errors_logged.add((keys.g, rank))
                coord.log(f"[coordinator] gen {coord.gen}: rank {rank} reports: {summarize(text)}")
        confirmed = confirmed or bool(errors)
        if not confirmed:
            forged(coord, f"error counter of generation {keys.g} bumped with no report")
    coord.error_hint = (keys.g, n, confirmed)
    return confirmed


def forged(coord, what: str) -> None:
    """Log, once per kind of message, that one without the job's secret was ignored."""
    if what not in coord.forgeries:
        coord.forgeries.add(what)
        coord.log(f"[coordinator] {what} without the job's secret: ignored")


def _bad_reported(coord) -> bool:
    """A receiver reported a corrupt copy in the current generation."""
    keys = Keys(coord.gen)
    return bool(reports.read_posted(coord.store, coord.seal,
                             {r: keys.bad_source(r) for r in coord.members.ranks}))


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
    stays silent past ``status_timeout_s`` is declared failed (added to ``failed``) and fenced,
    unless the silent ones still beat and hold the only copies of some rank's state: then they
    get one more hold window (``suspicion.Suspicions.status_grace``)."""
    ranks, launcher = coord.members.ranks, coord.launcher
    deadline = time.monotonic() + float(coord.ft["status_timeout_s"])
    statuses: dict[int, RankStatus] = {}
    pending = coord.rank_reports(keys, "status", [r for r in ranks if r not in failed],
                                 lambda who: forged(coord, f"status for {who}"))
    by_slot = {s: r for r, s in ranks.items()}
    held, graced = getattr(coord, "suspicion", None), False
    if getattr(getattr(coord, "stopper", None), "why", None) is not None:
        held = None  # a stop keeps its own deadline (ft.stop_timeout_s): no grace
    while True:
        coord.read_heartbeats()
        for rank, text in pending.poll_new().items():  # (each report once, not all per turn)
            if rank not in failed and rank not in statuses:
                statuses[rank] = RankStatus.from_json(text)
        for slot in coord.suspects():
            rank = by_slot.get(slot)
            if rank is None or rank in failed or rank in statuses:
                continue
            if (code := launcher.poll(slot)) is not None:
                failed[rank] = "exit"
                coord.evidence[rank] = exit_text(code)
                launcher.kill(slot)
            elif coord.lost(slot):
                failed[rank] = "heartbeat"
                note(coord, rank, slot)
                launcher.kill(slot)
        # Every rank that has not answered also stopped beating (soft timeout): silent to the
        # abort and no heartbeat are two independent signals, so they are lost now rather than
        # at the hard timeout. It matters under srun, where no process handle shows an exit.
        # (Liveness-only too: not while fencing them with the failed would lose a copy; they
        # are then judged at the deadline, ``status_grace``, or by the hard timeout.)
        pending.forget(failed)
        silent = pending.missing
        if silent and all((coord.live.beat_age(ranks[r]) or 0.0) > coord.live.soft_s
                          for r in silent) and _may_fence(held, set(failed) | set(silent)):
            for r in silent:
                failed[r] = "heartbeat"
                note(coord, r, ranks[r], "silent to the abort")
            launcher.fence([ranks[r] for r in silent])
            pending.forget(failed)
        if len(statuses) + len(failed) >= len(ranks):
            return statuses
        if time.monotonic() > deadline and not graced and held is not None:
            graced = True  # once: silent but beating ranks that hold the only copies
            silent = [r for r in ranks if r not in failed and r not in statuses]
            deadline += held.status_grace(statuses, silent, ranks.__getitem__)
        if time.monotonic() > deadline:
            for rank, slot in ranks.items():
                if rank not in failed and rank not in statuses:
                    failed[rank] = "no_status"
                    note(coord, rank, slot)
                    launcher.kill(slot)
            return statuses
        time.sleep(0.002)


def note(coord, rank: int, slot: int, more: str = "") -> None:
    """Keep what the coordinator knew of a rank it declares failed on liveness alone (its beat,
    its node's record), for the message of a recovery that cannot go on (``described``)."""
    coord.evidence[rank] = ", ".join(x for x in (more, coord.live.evidence(slot)) if x)


def exit_text(code: int) -> str:
    """A process's exit status as a user reads it: ``exit code 1``, ``killed by SIGKILL``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def described(coord, failed: dict[int, str]) -> str:
    """``failed`` as a user reads it: each rank, how it was found and, for one found by its
    silence, what the coordinator knew of it then."""
    return ", ".join(f"rank {r} ({how}" + (f": {coord.evidence[r]}" if r in coord.evidence else "")
                     + ")" for r, how in sorted(failed.items()))


def _may_fence(held, ranks: set[int]) -> bool:
    """Fencing ``ranks`` on liveness alone leaves every rank a copy (``Suspicions.survive``)."""
    return held is None or held.survive(ranks)


def collect_bad_sources(coord, keys: Keys) -> list[dict]:
    """Copies that receivers found corrupt in the aborted generation: never used again
    (added to ``coord.bad`` as ``(holder, owner, step)``)."""
    found = []
    got = reports.read_posted(coord.store, coord.seal,
                       {r: keys.bad_source(r) for r in range(coord.dims.world_size)},
                       on_forged=lambda r: forged(coord, f"bad-source report of rank {r}"))
    for rank in sorted(got):
        b = json.loads(got[rank])
        coord.bad.add((int(b["holder"]), int(b["owner"]), int(b["step"])))
        found.append(b)
        coord.log(f"[coordinator] copy of rank {b['owner']}'s state at step {b['step']} held "
                  f"by rank {b['holder']} failed its CRC check; it will not be used")
    return found


def collect_faults(coord, dead: set[int]) -> dict[int, dict]:
    """The injected faults behind this recovery (the dead ranks' first, else one survivor's),
    newer than any already attributed: they date the failure (``t_kill``) and name its kind."""
    faults = {}
    got = reports.read_posted(coord.store, coord.seal,
                       {r: Keys.fault(s) for r, s in coord.members.ranks.items()},
                       on_forged=lambda r: forged(coord, f"fault record of rank {r}"))
    for rank in sorted((r for r in coord.members.ranks if r in got), key=lambda r: r not in dead):
        f = json.loads(got[rank])
        if f["t"] > coord.fault_t and (rank in dead or not faults):
            faults[rank] = f
    coord.fault_t = max([coord.fault_t] + [f["t"] for f in faults.values()])
    return faults
