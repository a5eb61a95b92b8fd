"""The hot-swap planner: from survivors' reports, decide the resume step and who restores what.

A pure function, so it is tested without processes. Inputs are the ``RankStatus`` of every
process that answered (survivors, and spares that took a rank in an interrupted recovery), the
job's ranks, which ranks hold the same state (data-parallel peers of one model shard) and which
holds whose replica. For every rank the output names where its state at the resume step comes
from, in this order of preference::

    live     the rank's own process is already at the resume step
    local    its own process rolls back to its own snapshot of the resume step
    peer     a live process holding the same state (a data-parallel peer) sends its copy
    replica  the process holding the rank's replica (its buddy, or any other holder) sends it

At step 0 a rank may also be drawn afresh (``init``: the initial state is a function of the
seed and its coordinates), which covers a ZeRO shard lost before its first replica; this is only
offered when step 0 is a candidate already (some survivor still holds it), never to turn a lost
rank into a restart from scratch. (``ft.state_sources`` may swap peer and replica.) With a sharded optimizer (ZeRO-1) a rank's state
is two regions: parameters, shared with its data-parallel peers, and its optimizer shard, which
no peer has. A peer can then only serve the parameters: the source is the shard's replica
holder, plus ``shared_from``, a live peer that sends the parameters, unless the replicas hold the
whole state (``ft.replicate=full``). The resume step is the newest step for which
every rank has a source. A rank with none at any step is lost from memory; the coordinator then
falls back to the newest complete disk checkpoint (source ``disk``, every rank). Copies a receiver
found corrupt (CRC mismatch) are passed in ``bad`` as ``(holder, owner, step)`` and never chosen
again. Recomputation is therefore at most the steps since the newest step every rank can reach.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deadpool.protocol import RankStatus

SOURCE_KINDS = ("peer", "replica")


@dataclass
class RecoveryDecision:
    resume_step: int | None            # None: nothing in memory covers every rank
    sources: dict[int, dict]
    steps_recomputed: int
    reason: str = ""
    lost: list[int] = field(default_factory=list)  # ranks with no copy at any step


def _has_own(st: RankStatus | None, step: int) -> bool:
    return st is not None and (st.live_step == step or step in st.local_steps)


def plan_resume(statuses: dict[int, RankStatus], world: list[int], equivalents, buddy_of,
                order: tuple[str, ...] = SOURCE_KINDS,
                bad: set[tuple[int, int, int]] = frozenset(), sharded: bool = False,
                replica_has_shared: bool = True) -> RecoveryDecision:
    """``equivalents(r)``: the data-parallel peers of ``r`` (same model shard); ``buddy_of(r)``:
    the preferred holder of ``r``'s replica; ``sharded``: each rank also holds state no peer has
    (a ZeRO-1 optimizer shard); ``replica_has_shared``: replicas include the shared region."""
    for kind in order:
        if kind not in SOURCE_KINDS:
            raise ValueError(f"ft.state_sources: {kind!r} is not one of {SOURCE_KINDS}")
    steps: set[int] = set()
    for st in statuses.values():
        steps.update(st.local_steps)
        if st.live_step is not None:
            steps.add(st.live_step)
        for held in st.replicas.values():
            steps.update(held)
    live_max = max((st.live_step for st in statuses.values() if st.live_step is not None),
                   default=0)
    covered: set[int] = set()
    for S in sorted(steps, reverse=True):
        load: dict[int, int] = {}  # holder -> transfers it serves (spread peer sends)
        sources: dict[int, dict] = {}
        for r in world:
            src = _source(r, S, statuses, equivalents, buddy_of, order, bad, load, sharded,
                          replica_has_shared)
            if src is None:
                break
            sources[r] = src
            covered.add(r)
        else:
            return RecoveryDecision(S, sources, max(0, live_max - S))
    # keep scanning to know which ranks have a copy at *some* step (for the message)
    for r in world:
        if r not in covered and any(_source(r, S, statuses, equivalents, buddy_of, order, bad, {},
                                            sharded, replica_has_shared) for S in steps):
            covered.add(r)
    lost = [r for r in world if r not in covered]
    why = (f"no consistent copy of rank(s) {lost} survives in memory" if lost else
           "the ranks' snapshots and replicas share no step")
    return RecoveryDecision(None, {}, 0, why, lost)


def _source(r, S, statuses, equivalents, buddy_of, order, bad, load, sharded=False,
            replica_has_shared=True) -> dict | None:
    src = _held_source(r, S, statuses, equivalents, buddy_of, order, bad, load, sharded,
                       replica_has_shared)
    if src is None and S == 0:
        return {"kind": "init", "holder": r}
    return src


def _held_source(r, S, statuses, equivalents, buddy_of, order, bad, load, sharded,
                 replica_has_shared) -> dict | None:
    st = statuses.get(r)
    if st is not None and st.live_step == S:
        return {"kind": "live", "holder": r}
    if _has_own(st, S) and (r, r, S) not in bad:
        return {"kind": "local", "holder": r}
    if sharded:  # the optimizer shard exists only in r's replicas
        h = _pick(r, S, "replica", statuses, equivalents, buddy_of, bad, load)
        if h is None:
            return None
        if replica_has_shared:
            return {"kind": "replica", "holder": h}
        q = _pick(r, S, "peer", statuses, equivalents, buddy_of, bad, load)
        return None if q is None else {"kind": "replica", "holder": h, "shared_from": q}
    for kind in order:
        h = _pick(r, S, kind, statuses, equivalents, buddy_of, bad, load)
        if h is not None:
            return {"kind": kind, "holder": h}
    return None


def _pick(r, S, kind, statuses, equivalents, buddy_of, bad, load) -> int | None:
    """The holder serving ``r``'s state at ``S`` from a ``peer`` (its own state: a corrupt copy
    is recorded as ``(q, q, S)``) or a ``replica`` (recorded as ``(holder, r, S)``)."""
    if kind == "peer":
        holders = [q for q in equivalents(r) if q != r and _has_own(statuses.get(q), S)
                   and (q, q, S) not in bad]
        # prefer a peer already at S (no rollback needed to serve), then the least loaded
        holders.sort(key=lambda q: (load.get(q, 0), statuses[q].live_step != S, q))
    else:
        holders = [q for q, st_q in statuses.items() if q != r
                   and S in st_q.replicas.get(r, []) and (q, r, S) not in bad]
        pref = buddy_of(r)
        holders.sort(key=lambda q: (q != pref, load.get(q, 0), q))
    if not holders:
        return None
    load[holders[0]] = load.get(holders[0], 0) + 1
    return holders[0]
