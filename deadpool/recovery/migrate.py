"""Planned swaps: live ranks moved to warm spares without losing or recomputing a step.

Two reasons start one, each named in the record's ``detected_by``::

    straggler   a rank's own compute is slower than its stage position's peers
                (``deadpool.rank.straggler``; ``ft.straggler.action=migrate``, else reported once)
    drain       an operator drains a node (``python -m deadpool.drain``)

It is the failure protocol (``deadpool.recovery``) entered without a failure, at a step boundary::

    pause     push ``pause (g, T)``, T a few steps ahead of the job (the node agents write it on
              their boards); every rank holds at the top of step T with its snapshot of T
              replicated to its buddies (``recovery.pause``). If some rank passed T before its
              board had the word, the pause moves on (its peers wait on it inside step T)
    abort     every rank paused at T: abort g (steps 2-3 of a recovery: collect statuses; every
              rank reports live at T)
    plan      the moving ranks' processes leave the plan; each moving rank's state at T comes
              from its own process (``Source("retiring", <its slot>)``, ``from_retiring``: the
              pause snapshot, checked by the spare against the checksums of that process's
              sealed status), or, where that process stopped beating or reported no snapshot of
              T, from its buddies' replicas (with ZeRO the shard's replica plus a data-parallel
              peer's parameters); every other rank keeps its live state: resume at T, 0 steps
              recomputed; a spare per moving rank (``plan.assign_spares``); plan g+1 names the
              moving processes in ``Plan.retire``: they send their state (``pause.send_own``),
              and the survivors keep their processes and the groups the spares do not touch
    account   a ``RecoveryRecord`` (outcome ``migrated``) completed like any other
    retire    the retired processes stay until g+1 runs: once its record completed (every rank
              took its first step and is protected again) the coordinator seals
              ``pause.running_key(g+1)`` and they exit (``pause.retire``). If g+1 is aborted
              first (a spare died before its first step), they exit on the abort and the next
              plan restores the moved rank from its buddies' replicas, like any failure's

A retiring process that dies after the plan named it fails the spare's receive (a collective
error): the next plan keeps the spare on the rank and gives it the buddy's replica, no rank lost,
0 steps recomputed (tests/integration/test_migrate.py, with a spare killed in its receive too).

A retiring process that stops (SIGSTOP, a hang the node agent sees as a stopped process, or a
lost beat) before g+1 ran is fenced by the coordinator, which watches the retired slots until
then (``Migrations.retiring_lost``, from ``detect.failures``), and g+1 is aborted at once
(``detected_by: retiring_lost``) rather than left to the spare's receive timeout; the next plan
is the same as for a death. What it does not do (partial): a retiring process whose training
thread hangs while its heartbeat thread beats is not seen (no progress is asked of it); a retired process waiting for g+1 is not a
source the next plan can use (it reports no status); the pause step is still replicated to the
buddies (the fallback needs it); a node agent left with no process stays up until the job ends.
Without node agents (no board to push the pause to) nothing migrates: stragglers are only
reported and drains refused.
"""

from __future__ import annotations

import math
import time

from deadpool.control.drain import Requests
from deadpool.rank import straggler
from deadpool.recovery import detect, pause, plan, timeline
from deadpool.store.protocol import Keys, Plan, Source

PAUSE_MOVE_S = 3.0  # not every rank holds at the pause this long after it was pushed: move it


class Migrations:
    """The coordinator's planned swaps (``coord.migrations``): ``poll`` once per loop turn."""

    def __init__(self, coord):
        s = straggler.settings(coord.ft)
        self.enabled, self.action = bool(s["enabled"]), str(s["action"])
        self.detector = straggler.StragglerDetector(s["threshold"], s["steps"], s["skip_steps"],
                                                    s["min_excess_s"])
        self.drains = Requests()
        self.wanted: dict[int, str] = {}  # rank -> why (straggler | drain)
        self.drain_ids: list[int] = []    # requests answered once the plan is out
        self.drained_nodes: set[int] = set()
        self.pause: tuple[int, int, float] | None = None  # (g, T, pushed at: monotonic)
        self.t_detect = 0.0
        self.gen = coord.gen
        self._rate = (time.monotonic(), coord.job_step)  # to place T past the records' lag
        self.retiring: tuple[int, list[int]] | None = None  # (g+1, slots) waiting for g+1 to run

    # -- what to move ---------------------------------------------------------------------------
    def _new_generation(self, coord) -> None:
        """A recovery happened meanwhile: a pause of the old generation is void; the detector
        skips the new generation's first steps."""
        self.gen, self.pause = coord.gen, None
        self.wanted = {r: w for r, w in self.wanted.items() if w == "drain"}
        self.detector.restarted(max(coord.job_step, 0))
        self._rate = (time.monotonic(), coord.job_step)

    def _stragglers(self, coord) -> None:
        if not self.enabled or coord.events is None:
            return
        slot_rank = {s: r for r, s in coord.members.ranks.items()}
        words = {slot_rank[s]: w for s, w in coord.live.compute.items() if s in slot_rank}
        pos = {r: coord.dims.coords(r)["pp"] for r in words}
        for r in self.detector.observe(words, pos):
            step, c = straggler.unpack_compute(words[r])
            what = (f"rank {r} (slot {coord.members.ranks[r]}) is a straggler: its fastest of "
                    f"{self.detector.steps} steps to {step} took {c * 1e3:.1f} ms of compute")
            if self.action == "migrate" and self._free_spares(coord, set()) > len(self.wanted):
                coord.log(f"[coordinator] {what}; migrating it to a spare")
                self.wanted[r] = "straggler"
                self.t_detect = self.t_detect or time.time()
            else:
                coord.log(f"[coordinator] {what}; no spare free to take it: reported only")

    def _free_spares(self, coord, off_nodes: set[int]) -> int:
        node = plan.node_of_slot(coord)
        return sum(1 for s in coord.members.spares if node(s) not in off_nodes)

    def _drains(self, coord) -> None:
        for i, n in self.drains.poll(coord):
            node = plan.node_of_slot(coord)
            ranks = sorted(r for r, s in coord.members.ranks.items() if node(s) == n)
            free = self._free_spares(coord, self.drained_nodes | {n}) - len(self.wanted)
            if coord.events is None:
                Requests.reply(coord, i, False, "refused: draining needs node agents "
                               "(launcher.agents=true)")
            elif len(ranks) > free:
                Requests.reply(coord, i, False, f"refused: node {n} holds {len(ranks)} rank(s) "
                               f"{ranks}, and {max(free, 0)} warm spare(s) are free off it")
            else:
                self.wanted.update({r: "drain" for r in ranks})
                self.drain_ids.append(i)
                self.drained_nodes.add(n)
                self._retire_spares(coord, n)
                self.t_detect = self.t_detect or time.time()
                if not ranks:
                    Requests.reply(coord, i, True, f"drained: node {n} holds no rank")

    def _retire_spares(self, coord, n: int) -> None:
        node = plan.node_of_slot(coord)
        for s in [s for s in coord.members.spares if node(s) == n]:
            coord.members.spares.remove(s)
            coord.launcher.kill(s)

    # -- the loop's hook ------------------------------------------------------------------------
    def poll(self, coord) -> bool:
        """Called by the coordinator's loop when no recovery is open; True when it planned a
        migration (the loop then goes round again)."""
        self._release_retired(coord)
        if coord.gen != self.gen:
            self._new_generation(coord)
        self._drains(coord)
        if self.pause is None:
            self._stragglers(coord)
            if self.wanted and coord.pending is None:
                self._push_pause(coord)
            return False
        g, T, t0 = self.pause
        if self._all_paused(coord, T):
            what, retired = migrate(coord, dict(self.wanted), self.t_detect)
            self.retiring = (coord.gen, retired) if retired else None
            self._done(coord, what)
            return True
        if time.monotonic() - t0 > PAUSE_MOVE_S:
            coord.log(f"[coordinator] gen {g}: not every rank held at step {T}; moving the pause")
            self._push_pause(coord, later=T)
        return False

    def retiring_lost(self, coord) -> list[int]:
        """Retired processes that died or stopped (the node's record says so, or their beat is
        lost) while generation g+1, which may still take a moved rank's state from them, has not
        run yet: fenced now, and forgotten. A stopped sender would leave the spare waiting in
        its receive for the transfer's own timeouts; the caller aborts g+1 instead (when nothing
        else failed), and the next plan takes the rank from its buddies' replicas at the same
        step (the pause step is replicated for this)."""
        if self.retiring is None or coord.gen != self.retiring[0]:
            return []
        g, slots = self.retiring
        gone = [s for s in slots if coord.launcher.poll(s) is not None or coord.lost(s)]
        if gone:
            left = [s for s in slots if s not in gone]
            self.retiring = (g, left) if left else None
            coord.launcher.fence(gone)
            coord.log(f"[coordinator] gen {g}: retiring slot(s) {gone} died or stopped before "
                      "the generation ran; fenced")
        return gone

    def _release_retired(self, coord) -> None:
        """The loop asks only with no record open: generation g+1 still current means its record
        completed (every rank took its first step), and the retired processes may go. A newer
        generation means g+1 was aborted: they left on its abort."""
        if self.retiring is None:
            return
        g, slots = self.retiring
        self.retiring = None
        if coord.gen == g:
            key = pause.running_key(g)
            coord.store.set(key, coord.seal.wrap(key, "1"))
            coord.log(f"[coordinator] gen {g} runs: retired slot(s) {slots} may exit")

    def _push_pause(self, coord, later: int = -1) -> None:
        """T: far enough past the newest step the records showed that no rank reaches it before
        its board has the word (the records lag by up to an agent interval)."""
        t, s = self._rate
        rate = max(0.0, coord.job_step - s) / max(time.monotonic() - t, 1e-3)
        ahead = max(3, math.ceil(rate * 4 * float(coord.ft["agent_interval_s"])) + 2)
        T = max(coord.job_step + ahead, later + ahead)
        self.pause = (coord.gen, T, time.monotonic())
        coord.events.push("pause", g=coord.gen, step=T)

    def _all_paused(self, coord, T: int) -> bool:
        words = [coord.live.compute.get(s, 0) for s in coord.members.ranks.values()]
        return all(straggler.unpack_compute(w) == (T, None) for w in words)

    def _done(self, coord, what: str) -> None:
        for i in self.drain_ids:
            Requests.reply(coord, i, True, f"drained: {what}")
        self.drain_ids, self.wanted, self.pause, self.t_detect = [], {}, None, 0.0
        self.gen = coord.gen
        self.detector.restarted(max(coord.job_step, 0))


def migrate(coord, moving: dict[int, str], t_detect: float) -> tuple[str, list[int]]:
    """Steps 2-6 of a recovery for ranks ``moving`` (rank -> why), every rank paused at a step
    boundary: abort, collect, plan (their state from the pause step's replicas, every other rank
    live), give each a spare, publish plan g+1 retiring their processes. Returns what moved and
    the slots retired."""
    g = coord.gen
    keys = Keys(g)
    coord.announce_abort(f"migrating rank(s) {sorted(moving)}")
    failed: dict[int, str] = {}
    statuses = detect.collect_statuses(coord, failed, keys)
    if failed:  # a process died meanwhile: an ordinary recovery (asked again later if need be)
        coord.recover(failed, time.time())
        return "interrupted by a failure", []
    faults = detect.collect_faults(coord, set(moving))
    decision = plan.decide(coord, {r: st for r, st in statuses.items() if r not in moving})
    rec = timeline.open_record(coord, moving, faults, decision, t_detect, [])
    old = {r: coord.members.ranks.pop(r) for r in moving}
    assignments, need, used = plan.assign_spares(coord, old)
    if decision.resume_step is None or len(assignments) < coord.dims.world_size:
        coord.members.spares += used  # nothing moves: every rank resumes live where it paused
        coord.members.ranks.update(old)
        decision, assignments, need, used = plan.decide(coord, statuses), dict(
            coord.members.ranks), [], []
        coord.log(f"[coordinator] gen {g + 1}: migration of rank(s) {sorted(moving)} cancelled "
                  "(no spare, or their state is not in the replicas); resuming as before")
        rec.update(resume_step=decision.resume_step, steps_recomputed=decision.steps_recomputed)
    from_retiring(coord, decision, statuses, old, need)
    rec.update(spare_slot=timeline.one_or_list(used), sources=decision.described_sources(),
               **({} if faults else {"fault": "none"}))
    keep = plan.groups_to_keep(coord, statuses, need, g + 1)
    nxt = Plan(g + 1, "train", assignments, decision.resume_step, decision.sources,
               reason=f"ranks {sorted(need)} migrated to slots {used}", keep_groups=keep,
               layout=coord.layout, retire=sorted(old[r] for r in need))
    coord.write_plan(nxt)
    coord.members.ranks = dict(assignments)
    coord.members.generation = g + 1
    for slot in assignments.values():
        coord.live.reset_progress(slot)
    rec.update(groups_kept=len(keep), plan_s=nxt.t_written - t_detect, t_plan=nxt.t_written,
               bytes_transferred=0)
    coord.pending = rec
    what = f"rank(s) {sorted(need)} -> spare slot(s) {used} at step {decision.resume_step}"
    coord.log(f"[coordinator] gen {g + 1}: migrated {what} ({', '.join(sorted(set(moving.values())))}"
              f"; {decision.steps_recomputed} step(s) recomputed)")
    return what, nxt.retire


def from_retiring(coord, decision, statuses: dict, old: dict[int, int], need) -> None:
    """Each moved rank's state from its own process (``Source`` kind ``retiring``: the pause
    step's snapshot, checked against the checksums its sealed status reported), where that
    process is still beating and reported the snapshot; else the buddies' replicas stay."""
    S = decision.resume_step
    for r in need:
        st = statuses.get(r)
        crc = None if st is None else st.crcs.get(f"own/{S}")
        if crc is not None and not coord.lost(old[r]):
            decision.sources[r] = Source("retiring", old[r], crc=list(crc))
