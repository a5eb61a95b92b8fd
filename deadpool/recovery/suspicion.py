"""Liveness-only suspicions that would cost the job a copy: judged again before anyone is fenced.

The progress watchdog and a soft heartbeat timeout are liveness-only evidence: a rank that is
only slow (a loaded host, a GC pause, a file-system stall) looks exactly like a hung one. Fencing
a slow rank costs a swap; fencing a rank together with every holder of its state (its replica's
buddies, its data-parallel peers) costs the job: the plan finds no copy and, without a disk
checkpoint, the failure-free job ends ``unrecoverable`` (measured under load with a 3 s progress
timeout: experiments/results/runtime/false_positives). Hence the rule::

    hard evidence (exit, seen stopped, hard beat timeout, a     -> fenced at once, as ever
      broken collective naming it, node lost)
    liveness-only suspects whose fencing, with the hard ones,   -> fenced at once (a swap)
      leaves every rank a copy (``copies_survive``)
    liveness-only suspects whose fencing would leave some rank  -> held back for ``hold_s``;
      without any copy                                             fenced then if still
                                                                   suspected ("confirmed"),
                                                                   else forgotten ("cleared")

A liveness-only suspect is judged only once it has been suspected for ``settle_s`` (two node
records, ``settle_seconds``): a rank and its holder that stall together are seen a beat apart
(each process's heartbeat, each node's record, has its own phase), and judged alone the first
would be fenced (a swap) and its holder then killed for its silence. ``hold_s`` is
``ft.liveness_hold_s`` (null: one more ``progress_timeout_s``, at most
``HOLD_CAP_S``), so a real hang of a rank and its holder still ends as before, ``hold_s`` later;
nothing waits unboundedly. After an abort the same rule extends, once and by ``hold_s``, the
wait for statuses of silent ranks whose heartbeats live, when the statuses in hand cover no rank
state (``status_grace``). Every hold is logged and kept in ``held`` (``summary.json``:
``liveness_held_back``).

"Copy" is the recovery plan's own notion (``plan.plan_resume``): ``copies_survive`` asks it to
plan from made-up statuses in which every process left holds its own state and the replicas its
buddy role gives it, at one step past 0 (so that no rank is drawn afresh).
"""

from __future__ import annotations

import time

from deadpool.recovery import plan
from deadpool.store.protocol import RankStatus
from deadpool.topology import Topology

HOLD_CAP_S = 30.0  # a hold never lasts longer than this unless ft.liveness_hold_s says so
LIVENESS_ONLY = ("progress", "heartbeat")  # how a liveness-only suspect is detected


def copies_survive(dims, ft: dict, replicates: bool, fenced, generation: int = 0) -> bool:
    """Whether, with the processes of ranks ``fenced`` gone, every rank's state keeps a copy in
    memory that the recovery plan would use (its own process, a data-parallel peer, a replica)."""
    fenced = set(fenced)
    if not fenced:
        return True
    world = list(range(dims.world_size))
    topo = Topology(dims, 0, generation, ft["buddy_policy"], int(ft.get("replicas", 1)))
    step = 1
    statuses = {r: RankStatus(r, r, step, [step], {}) for r in world if r not in fenced}
    if replicates:
        for owner in world:
            for h in topo.buddies(owner):
                if h in statuses and h != owner:
                    statuses[h].replicas[owner] = [step]
    region = dims.replica_region(ft.get("replicate", "unique"))
    got = plan.plan_resume(statuses, world, dims.state_peers, topo.buddies,
                           tuple(ft.get("state_sources", plan.SOURCE_KINDS)),
                           sharded=dims.optimizer_sharded, replica_has_shared=region == "all")
    return got.resume_step is not None


def settle_seconds(ft: dict) -> float:
    """How long a liveness-only suspect waits for others before it is judged: two node records
    (``ft.agent_interval_s``; each node writes one per interval, at its own moment), so that a
    rank and its holder seen stalled a beat apart on two nodes are judged as one set."""
    return 2 * float(ft.get("agent_interval_s", 0.25))


def hold_seconds(ft: dict) -> float:
    """How long a held-back suspicion waits for a second judgement (``ft.liveness_hold_s``)."""
    own = ft.get("liveness_hold_s")
    if own is not None:
        return float(own)
    return min(float(ft["progress_timeout_s"]), HOLD_CAP_S)


class Suspicions:
    """The coordinator's held-back liveness suspicions. ``survive(fenced)``: ``copies_survive``
    for the current layout; ``liveness_only(slot)``: the slot's beat is not lost by hard
    evidence (the hard timeout, seen stopped, its node lost); ``decide(statuses)``: the plan's
    decision from the statuses in hand (``plan.decide``). ``for_coordinator`` wires them."""

    def __init__(self, hold_s: float, survive, liveness_only, decide=None, log=print,
                 clock=time.monotonic, settle_s: float = 0.0):
        self.hold_s, self._survive, self.liveness_only = hold_s, survive, liveness_only
        self._survives: dict[frozenset, bool] = {}  # of this generation (asked every pass)
        self.decide = decide  # statuses -> the plan's decision (``status_grace``)
        self.settle_s = settle_s
        self.log, self.clock = log, clock
        self.seen: dict[int, float] = {}   # rank -> when it was first suspected (liveness only)
        self.since: dict[int, float] = {}  # rank -> when its suspicion was first held back
        self.held: list[dict] = []  # one record per hold: ranks, how, outcome, held_s
        self._open: dict[int, dict] = {}  # rank -> its open record
        self.generation = -1

    def filter(self, failed: dict[int, str], slot_of, generation: int) -> dict[int, str]:
        """The ranks of ``failed`` (rank -> how detected) to fence now: those with hard evidence,
        and liveness-only ones suspected for ``settle_s`` (so that a rank and its holder stalled
        a beat apart are judged together), unless fencing every liveness-only suspect would leave
        a rank's state without a copy and the hold has not run out. Must be called on every
        detection pass (an empty ``failed`` included): a held rank absent from it has cleared."""
        if generation != self.generation:  # a new plan: old suspicions are moot
            self._close_all("superseded")
            self.seen.clear()
            self._survives.clear()
            self.generation = generation
        now = self.clock()
        soft = {r for r, how in failed.items()
                if how in LIVENESS_ONLY and self.liveness_only(slot_of(r))}
        for r in [r for r in self.seen if r not in soft]:
            del self.seen[r]
            self._close(r, "cleared")
        if not soft:
            return failed
        for r in soft:
            self.seen.setdefault(r, now)
        hard = {r: how for r, how in failed.items() if r not in soft}
        ripe = {r for r in soft if now - self.seen[r] >= self.settle_s or r in self.since}
        if not ripe:
            return hard
        if self.hold_s <= 0 or not self.survive(set(hard)):
            # the hard ones lose a copy anyway: holding back gains nothing
            for r in [r for r in self.since if r in ripe]:
                self._close(r, "confirmed")
            return {r: how for r, how in failed.items() if r in hard or r in ripe}
        if self.survive(set(failed)):
            # a swap at worst; a rank already held keeps its hold (its partner may have woken
            # a moment before it: fencing it now would be a needless swap)
            out = {r for r in ripe if r not in self.since
                   or now - self.since[r] >= self.hold_s}
            for r in [r for r in self.since if r in out]:
                self._close(r, "confirmed")
            return {r: how for r, how in failed.items() if r in hard or r in out}
        fresh = sorted(r for r in soft if r not in self.since)
        if fresh:
            rec = {"ranks": fresh, "how": {str(r): failed[r] for r in fresh},
                   "generation": generation, "outcome": "held", "held_s": None,
                   "cleared": [], "fenced": [], "t": time.time()}
            self.held.append(rec)
            for r in fresh:
                self.since[r] = now
                self._open[r] = rec
            self.log(f"[coordinator] gen {generation}: rank(s) {fresh} suspected "
                     f"({', '.join(sorted(set(failed[r] for r in fresh)))}, liveness only) held "
                     f"back up to {self.hold_s:g} s: fencing {sorted(failed)} would leave some "
                     f"rank's state without a copy")
        # bounded by the oldest hold: ranks suspected since are fenced with it, not waited for
        if max(now - self.since[r] for r in soft) >= self.hold_s:
            for r in sorted(soft):
                self._close(r, "confirmed")
            return failed
        return hard

    def survive(self, fenced) -> bool:
        """``copies_survive`` of the current layout, once per set and generation (``filter``
        asks on every detection pass while a hold lasts; the plan is linear in the ranks)."""
        key = frozenset(fenced)
        if key not in self._survives:
            self._survives[key] = self._survive(set(key))
        return self._survives[key]

    def status_grace(self, statuses, silent, slot_of) -> float:
        """Seconds more to wait for the statuses of ``silent`` ranks after an abort: ``hold_s``,
        when each has liveness-only evidence against it and the plan from ``statuses`` (those in
        hand) finds no copy of some rank; else 0. The caller must ask once per abort."""
        if not silent or self.hold_s <= 0:
            return 0.0
        if not all(self.liveness_only(slot_of(r)) for r in silent):
            return 0.0
        if self.decide(statuses).resume_step is not None:
            return 0.0
        self.held.append({"ranks": sorted(silent), "how": {str(r): "no_status" for r in silent},
                          "generation": self.generation, "outcome": "status_wait",
                          "held_s": self.hold_s, "cleared": [], "fenced": [], "t": time.time()})
        self.log(f"[coordinator] rank(s) {sorted(silent)} silent after the abort but beating: "
                 f"waiting {self.hold_s:g} s more for their statuses (without them no copy of "
                 f"some rank's state is left)")
        return self.hold_s

    def _close(self, rank: int, outcome: str) -> None:
        """``rank``'s suspicion ended: ``cleared`` (it progressed), ``confirmed`` (fenced) or
        ``superseded`` (a new generation started meanwhile). Its hold's record is complete when
        every rank of it ended: outcome cleared / confirmed when all ended alike, else mixed."""
        t0 = self.since.pop(rank, None)
        rec = self._open.pop(rank, None)
        if rec is None:
            return
        rec["fenced" if outcome == "confirmed" else "cleared"].append(rank)
        held_s = round(self.clock() - t0, 3) if t0 is not None else 0.0
        rec["held_s"] = max(rec["held_s"] or 0.0, held_s)
        self.log(f"[coordinator] gen {rec['generation']}: liveness suspicion of rank {rank} "
                 f"{outcome} after {held_s} s held back" + (": fenced" if outcome == "confirmed"
                                                            else ""))
        if len(rec["cleared"]) + len(rec["fenced"]) == len(rec["ranks"]):
            rec["outcome"] = ("confirmed" if not rec["cleared"] else
                              outcome if not rec["fenced"] else "mixed")

    def _close_all(self, outcome: str) -> None:
        for r in list(self.since):
            self._close(r, outcome)


def liveness_only(coord, slot: int) -> bool:
    """The evidence against ``slot``'s process is liveness only: its beat is younger than the
    hard timeout, nobody saw it stopped, and (under node agents) its node's record is fresh."""
    live = coord.live
    if (live.beat_age(slot) or 0.0) > live.hard_s or coord.launcher.is_stopped(slot):
        return False
    if getattr(live, "stopped", None) is not None and live.stopped(slot):
        return False
    node_age = getattr(live, "node_age", None)
    if node_age is not None:
        age = node_age(live.node_of(slot))
        if age is not None and age > live.node_timeout_s:
            return False
    return getattr(live, "exit_code", lambda s: None)(slot) is None


def for_coordinator(coord) -> Suspicions:
    """The coordinator's ``Suspicions``, judged against its current layout (a reshape included)."""
    return Suspicions(hold_seconds(coord.ft),
                      lambda fenced: copies_survive(coord.dims, coord.ft, coord.replicates,
                                                    fenced, coord.gen),
                      lambda slot: liveness_only(coord, slot),
                      decide=lambda statuses: plan.decide(coord, statuses), log=coord.log,
                      settle_s=settle_seconds(coord.ft))
