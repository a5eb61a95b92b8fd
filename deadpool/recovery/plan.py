"""Step 4 of a recovery: from the survivors' reports, decide the resume step, where each rank's
state comes from, which spare takes which rank, and which groups survivors keep.

``plan_resume`` is a pure function, so it is tested without processes.

Its inputs are the ``RankStatus`` of every
process that answered (survivors, and spares that took a rank in an interrupted recovery), the
job's ranks, which ranks hold the same state (data-parallel peers of one model shard) and which
holds whose replica. For every rank the output names where its state at the resume step comes
from, in this order of preference::

    live     the rank's own process is already at the resume step
    local    its own process rolls back to its own snapshot of the resume step
    peer     a live process holding the same state (a data-parallel peer) sends its copy
    replica  a process holding the rank's replica sends it: with ``ft.replicas=k`` any of its k
             buddies that is alive and holds the step (the first in buddy order), or any other
             holder; so with two ranks dead, one the other's first buddy, the second buddy serves

At step 0 a rank may also be drawn afresh (``init``: the initial state is a function of the
seed and its coordinates), which covers a ZeRO shard lost before its first replica; this is only
offered when step 0 is a candidate already (some survivor still holds it), never to turn a lost
rank into a restart from scratch. (``ft.state_sources`` may swap peer and replica.) With a sharded optimizer (ZeRO-1) a rank's state
is two regions: parameters, shared with its data-parallel peers, and its optimizer shard, which
no peer has. A peer can then only serve the parameters: the source is the shard's replica
holder, plus ``shared_from``, a live peer that sends the parameters, unless the replicas hold the
whole state (``ft.replicate=full``). When no data-parallel copy of the parameters is left (every
peer dead, or dirty with no snapshot of the step) the shard replicas of the whole group serve
them: each holds its rank's master weights (``ZeroOptimizer.state_tensors``, fp32 included),
and the group's master shards, rounded to the parameters' dtype, are the parameters
(``params_from``: per data-parallel rank of the group, the holder of its shard's replica). Under ``precision=bf16`` the shard also holds the fp32
master weights, of which a peer's bf16 parameters are only the rounding: the same rule keeps
a master shard from ever being rebuilt from a peer (``test_plan.py`` shows it through
``decide``). The resume step is the newest step for which
every rank has a source. A rank with none at any step is lost from memory; ``recovery.fallbacks`` then
falls back to the newest complete disk checkpoint (source ``disk``, every rank). Copies a receiver
found corrupt (checksum mismatch) are passed in ``bad`` as ``(holder, owner, step)`` and never chosen
again. Recomputation is therefore at most the steps since the newest step every rank can reach.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field

from deadpool.rank.comm import resolve_backend
from deadpool.rank.groups import keepable_groups, reusable_groups
from deadpool.recovery import detect
from deadpool.store.protocol import RankStatus, Source
from deadpool.topology import Topology

SOURCE_KINDS = ("peer", "replica")


@dataclass
class RecoveryDecision:
    resume_step: int | None            # None: nothing in memory covers every rank
    sources: dict[int, Source]
    steps_recomputed: int
    reason: str = ""
    lost: list[int] = field(default_factory=list)  # ranks with no copy at any step

    def described_sources(self) -> dict[str, str]:
        """What a recovery record names: rank -> where its state comes from, live ones left out."""
        return {str(r): s.describe() for r, s in sorted(self.sources.items()) if s.kind != "live"}


def _has_own(st: RankStatus | None, step: int) -> bool:
    return st is not None and (st.live_step == step or step in st.local_steps)


def plan_resume(statuses: dict[int, RankStatus], world: list[int], equivalents, buddy_of,
                order: tuple[str, ...] = SOURCE_KINDS,
                bad: set[tuple[int, int, int]] = frozenset(), sharded: bool = False,
                replica_has_shared: bool = True) -> RecoveryDecision:
    """``equivalents(r)``: the data-parallel peers of ``r`` (same model shard; an equivalence
    class containing ``r``); ``buddy_of(r)``: the preferred holder of ``r``'s replica, or its
    holders in order of preference (``ft.replicas``: its buddies; any surviving holder of the
    step serves, the earliest in this order first);
    ``sharded``: each rank also holds state no peer has (a ZeRO-1 optimizer shard);
    ``replica_has_shared``: replicas include the shared region.

    Linear in the world size per candidate step: holders are indexed once (``_Holders``), never
    searched across every rank per rank."""
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
    holders = _Holders(statuses, equivalents, buddy_of, bad)
    covered: set[int] = set()
    for S in sorted(steps, reverse=True):
        pick = holders.chooser(S)  # spreads the transfers over holders (least loaded first)
        sources: dict[int, Source] = {}
        for r in world:
            src = _source(r, S, statuses, order, bad, pick, sharded, replica_has_shared,
                          holders.group)
            if src is None:
                break
            sources[r] = src
            covered.add(r)
        else:
            _attach_checksums(sources, statuses, S, holders.group)
            return RecoveryDecision(S, sources, max(0, live_max - S))
    # keep scanning to know which ranks have a copy at *some* step (for the message)
    for r in world:
        if r not in covered and any(_source(r, S, statuses, order, bad, holders.any_of(S),
                                            sharded, replica_has_shared, holders.group)
                                    for S in steps):
            covered.add(r)
    lost = [r for r in world if r not in covered]
    why = (f"no consistent copy of rank(s) {lost} survives in memory" if lost else
           "the ranks' snapshots and replicas share no step")
    return RecoveryDecision(None, {}, 0, why, lost)


def _source(r, S, statuses, order, bad, pick, sharded=False,
            replica_has_shared=True, group=None) -> Source | None:
    src = _held_source(r, S, statuses, order, bad, pick, sharded, replica_has_shared,
                       group or (lambda r: [r]))
    if src is None and S == 0:
        return Source("init", r)
    return src


def _held_source(r, S, statuses, order, bad, pick, sharded, replica_has_shared,
                 group) -> Source | None:
    st = statuses.get(r)
    if st is not None and st.live_step == S:
        return Source("live", r)
    if _has_own(st, S) and (r, r, S) not in bad:
        return Source("local", r)
    if sharded:  # the optimizer shard exists only in r's replicas
        h = pick(r, "replica")
        if h is None:
            return None
        if replica_has_shared:
            return Source("replica", h)
        q = pick(r, "peer")
        if q is not None:
            return Source("replica", h, shared_from=q)
        # no data-parallel copy of the parameters is left: each ZeRO shard's replica holds its
        # rank's master weights, which together are the parameters
        froms = [h if d == r else pick(d, "replica") for d in group(r)]
        return None if None in froms else Source("replica", h, params_from=froms)
    for kind in order:
        h = pick(r, kind)
        if h is not None:
            return Source(kind, h)
    return None


def _attach_checksums(sources: dict[int, Source], statuses, S: int, group) -> None:
    """Copy into each transfer's ``Source`` the checksums its holders reported of the copies they
    will send (``RankStatus.crcs``, sealed): the receiver checks those, never what the sender
    says (``snapshot.transfer``). Linear in the ranks that receive."""
    def reported(holder: int, owner: int | None):
        st = statuses.get(holder)
        return None if st is None else st.crcs.get(f"own/{S}" if owner is None else f"{owner}/{S}")

    for r, src in sources.items():
        if src.kind == "peer":
            src.crc = reported(src.holder, None)
        elif src.kind == "replica":
            src.crc = reported(src.holder, r)
            if src.shared_from is not None:
                src.shared_crc = (reported(src.shared_from, None) or [None])[0]
            if src.params_from is not None:
                crcs = [None if d == r else (reported(h, d) or [None, None])[1]
                        for d, h in zip(group(r), src.params_from)]
                src.params_crc = crcs if any(c is not None for c in crcs) else None


class _Holders:
    """Who can serve which rank's state at a step, indexed once per plan.

    A ``peer`` serves its own state (a corrupt copy is recorded as ``(q, q, S)``): the holders of
    ``r``'s state at ``S`` are its data-parallel peers with their own state at ``S``. A
    ``replica`` holder serves ``r``'s replica (recorded as ``(holder, r, S)``); its buddies are
    preferred, in order (``ft.replicas``: a dead or stale first buddy passes to the second). Among
    several, the least loaded serves (then, for peers, one already at ``S``, so
    that no rollback is needed to serve; then the lowest rank). Loads only grow during a plan,
    so the least loaded peer is kept in a heap per data-parallel group and step whose stale
    entries are refreshed when they surface.
    """

    def __init__(self, statuses, equivalents, buddy_of, bad):
        self.statuses, self.equivalents, self.buddy_of, self.bad = statuses, equivalents, buddy_of, bad
        self._group: dict[int, list[int]] = {}  # rank -> its peers (one list shared by the class)
        self.replica_holders: dict[int, list[int]] = {}  # owner -> ranks holding some replica
        self._own_at: dict[tuple[int, int], list[int]] = {}
        for q, st in sorted(statuses.items()):
            for owner in st.replicas:
                self.replica_holders.setdefault(owner, []).append(q)

    def group(self, r: int) -> list[int]:
        g = self._group.get(r)
        if g is None:
            g = list(self.equivalents(r))
            for q in g:
                self._group[q] = g
            self._group[r] = g
        return g

    def _replicas(self, r: int, S: int) -> list[int]:
        return [q for q in self.replica_holders.get(r, ()) if q != r
                and S in self.statuses[q].replicas.get(r, []) and (q, r, S) not in self.bad]

    def any_of(self, S: int):
        """``pick`` that only says whether some holder exists (loads left alone)."""
        def pick(r: int, kind: str) -> int | None:
            if kind == "peer":
                return next((q for q in self._own(self.group(r), S) if q != r), None)
            found = self._replicas(r, S)
            return found[0] if found else None
        return pick

    def _own(self, g: list[int], S: int) -> list[int]:
        """The members of group ``g`` holding their own uncorrupted state at ``S`` (cached)."""
        key = (id(g), S)
        if key not in self._own_at:
            self._own_at[key] = [q for q in g if _has_own(self.statuses.get(q), S)
                                 and (q, q, S) not in self.bad]
        return self._own_at[key]

    def chooser(self, S: int):
        """``pick(r, kind)``: the holder that serves ``r``'s state at ``S``, charged one load."""
        load: dict[int, int] = {}
        heaps: dict[int, list] = {}

        def pick(r: int, kind: str) -> int | None:
            if kind == "replica":
                found = self._replicas(r, S)
                if not found:
                    return None
                pref = self.buddy_of(r)
                pref = (pref,) if isinstance(pref, int) else tuple(pref)
                # its buddies in order (the first alive with the step serves), then any holder
                q = min(found, key=lambda q: (pref.index(q) if q in pref else len(pref),
                                              load.get(q, 0), q))
            else:
                q = self._least_loaded_peer(r, S, load, heaps)
                if q is None:
                    return None
            load[q] = load.get(q, 0) + 1
            return q
        return pick

    def _least_loaded_peer(self, r: int, S: int, load: dict, heaps: dict) -> int | None:
        g = self.group(r)
        h = heaps.get(id(g))
        if h is None:
            h = [(0, self.statuses[q].live_step != S, q) for q in self._own(g, S)]
            heapq.heapify(h)
            heaps[id(g)] = h
        skipped, found = [], None
        while h:
            held, behind, q = h[0]
            now = load.get(q, 0)
            if held != now:  # charged since (as a replica holder, or by another rank's pick)
                heapq.heapreplace(h, (now, behind, q))
            elif q == r:
                skipped.append(heapq.heappop(h))
            else:
                found = q
                heapq.heapreplace(h, (now + 1, behind, q))  # the caller charges the load
                break
        for e in skipped:
            heapq.heappush(h, e)
        return found


# -- the coordinator's use of it -----------------------------------------------------------------
def decide(coord, statuses: dict[int, RankStatus]) -> RecoveryDecision:
    """``plan_resume`` with the job's facts: its ranks, data-parallel peers, buddies, the
    configured source order, the copies known corrupt and what ranks and replicas hold."""
    dims = coord.dims
    topo = Topology(dims, 0, coord.gen, coord.ft["buddy_policy"], int(coord.ft.get("replicas", 1)))
    return plan_resume(statuses, list(range(dims.world_size)), dims.state_peers, topo.buddies,
                       tuple(coord.ft["state_sources"]), coord.bad,
                       sharded=dims.optimizer_sharded, replica_has_shared=coord.replica_region == "all")


def assign_spares(coord, lost: dict[int, int] | None = None
                  ) -> tuple[dict[int, int], list[int], list[int]]:
    """Give each rank without a process a warm spare (``ft.spare_policy``, which sees the node of
    every dead rank's slot and of every spare), as long as there are spares. ``lost``: rank -> the
    slot it held until the failure (absent: the slot of its rank). Spares whose process is gone
    are dropped first (``detect.check_spares``), so a lost node's spares are never given out. A
    node's dead ranks that end up split over several nodes are logged. Returns ``(assignments
    rank -> slot, ranks that needed one, spares used)``."""
    detect.check_spares(coord)
    members, dims = coord.members, coord.dims
    node = node_of_slot(coord)
    need = [r for r in range(dims.world_size) if r not in members.ranks]
    lost = lost or {}
    dead = {r: node(lost.get(r, r)) for r in need}
    chosen = coord.spare_policy(dead, {s: node(s) for s in members.spares},
                                {node(s) for s in members.ranks.values()})
    assignments, used = dict(members.ranks), []
    for d in need:
        if d in chosen:
            members.spares.remove(chosen[d])
            assignments[d] = chosen[d]
            used.append(chosen[d])
    for n in sorted(set(dead.values())):
        ranks = [r for r in need if dead[r] == n and r in chosen]
        went = sorted({node(chosen[r]) for r in ranks})
        if len(went) > 1:
            coord.log(f"[coordinator] rank(s) {ranks} of node {n} split over nodes {went} "
                      f"(slots {[chosen[r] for r in ranks]}, ft.spare_policy="
                      f"{coord.ft['spare_policy']}; same_node_first splits only when no node "
                      f"has room for all): a tensor-parallel group among them now crosses nodes")
    return assignments, need, used


def node_of_slot(coord):
    """``slot -> node``: the launcher's map under node agents (``launcher.AgentLauncher``, which
    also knows the nodes of a regrow), else ``slot // parallel.ranks_per_node``, the layout of
    ``topology.node_slots`` that the local launcher and srun's block distribution (``--slot-from-env``
    with ``ranks_per_node`` tasks per node) share."""
    known = getattr(coord.launcher, "node_of_slot", None) or {}
    rpn = coord.dims.ranks_per_node
    return lambda slot: known[slot] if slot in known else slot // rpn


def swap_routes(faults_cfg: dict, sources: dict[int, Source]) -> None:
    """Fault injection (``faults.swap_routes=[a, b]``): send rank a's state to b and b's to a, so
    a test can show that a wrong route is caught (``conf/faults``)."""
    swap = faults_cfg.get("swap_routes")
    if swap and all(int(r) in sources for r in swap):
        a, b = (int(r) for r in swap)
        sources[a], sources[b] = (dataclasses.replace(sources[b], owner=b),
                                  dataclasses.replace(sources[a], owner=a))


def groups_to_keep(coord, statuses: dict[int, RankStatus], replaced: list[int],
                   generation: int) -> list[str]:
    """``ft.rebuild=affected``: groups survivors may keep (``groups.reusable_groups``); on NCCL
    every group is rebuilt (the abort watcher has aborted them to free the streams)."""
    backend = resolve_backend(coord.cfg["device"], coord.cfg.get("backend", "auto"))
    if coord.ft.get("rebuild", "affected") != "affected" or backend != "gloo":
        return []
    members = keepable_groups(coord.dims, coord.ft["buddy_policy"])  # the layout's (cached)
    counts = {r: st.groups for r, st in statuses.items()}
    return reusable_groups(counts, members, set(replaced))
