"""Step 7 and 9 of a recovery (worker side): report what this process holds after an abort, and
bring its rank to the resume step from the source the plan names.

    report_status   the generation was aborted: stop replication, park the communicator, tell
                    the coordinator which states this process can resume from (``RankStatus``)
    restore         per the plan's ``Source`` for this rank: keep the live state, roll back to a
                    local snapshot, receive a peer's or a replica holder's copy, read the disk
                    checkpoint, or draw the initial state; and serve what others need from here
    transfers       this rank's part of the plan's transfers (what it sends, what it receives)
    stop_to_disk    the plan says checkpoint_and_stop: write the resume step's state to disk

Every function takes the ``Worker`` (its trainer, store, injector and progress marker).
"""

from __future__ import annotations

import json

from deadpool.checkpoint import rank_state
from deadpool.errors import CollectiveError, CorruptState
from deadpool.rank.comm import Communicator
from deadpool.snapshot import masters
from deadpool.snapshot.transfer import held_checksums, outgoing
from deadpool.store import reports
from deadpool.store.protocol import Keys, Plan, RankStatus, RankTimings, now


def report_status(worker, plan: Plan, rank: int, comm: Communicator | None) -> None:
    """The generation was aborted: park its communicator (the worker keeps it referenced) and
    write this process's ``RankStatus`` for the coordinator's planner."""
    tr = worker.trainer
    if tr.engine is not None:
        tr.engine.stop_replication()
    if comm is not None:
        comm.park()
        worker.parked.append(comm)
    worker.prev_comm = comm
    worker.progress.set(tr.step, "status")
    worker.injector.fire(plan.resume_step, "status")
    # a rank cut inside its optimizer step holds a torn live state: only its snapshots count
    live = tr.step if worker.has_state and not tr.dirty else None
    eng = tr.engine
    # the live state is copied (to checksum it) only where a data-parallel peer may need it
    dims = getattr(worker, "dims", None)
    serves_live = dims is not None and len(dims.state_peers(rank)) > 1
    crcs, worker.live_copy = held_checksums(eng, live if serves_live else None, tr.header,
                                            worker.has_state) if eng is not None else ({}, None)
    st = RankStatus(rank, worker.slot, live,
                    eng.local_steps() if worker.has_state and eng is not None else [],
                    eng.replica_steps() if eng is not None else {},
                    comm.group_counts() if comm is not None else {}, crcs)
    reports.send(worker.store, worker.seal, worker.link, Keys(plan.generation), "status", rank,
                 st.to_json())


def restore(worker, plan: Plan, rank: int, comm: Communicator, timing: RankTimings) -> None:
    """Bring this rank to ``plan.resume_step`` from the source the plan names."""
    tr = worker.trainer
    S = plan.resume_step
    if worker.starts_job(plan):
        resume = worker.ft["resume_from"]
        timing.transferred = now()
        if resume:
            rank_state.load(tr, worker.dims, resume, rank)
        timing.rolled_back = now()  # the checkpoint load
        worker.has_state = True
        if worker.ft["snapshot"]:
            tr.snapshot_now()
        return
    sends, recvs = transfers(worker, plan, rank)
    mine = plan.sources[rank]
    group = worker.dims.state_peers(rank)
    live = tr.step if worker.has_state and not tr.dirty else None
    # no data-parallel copy of the parameters left: the group's shards rebuild them
    msends = masters.master_sends(tr.engine, plan.sources, rank, S, live, tr.header,
                                  worker.dims.state_peers)
    mrecvs = masters.master_recvs(mine, rank, group)
    if sends or recvs or msends or mrecvs:
        worker.progress.set(S, "transfer")
        try:
            got = comm.run_abortable(lambda: masters.moves(tr.engine, comm, sends, recvs, msends,
                                                           mrecvs, S, rank, group),
                                     "state transfer")
        except CorruptState as e:
            _report_corrupt(worker, plan, rank, comm, e)
        if got is not None:
            try:
                tr.apply_header(tr.engine.install(S, *got, **install_checks(plan, rank)))
            except CorruptState as e:
                _report_corrupt(worker, plan, rank, comm, e)
            worker.has_state = True
            timing.bytes_received = sum(tr.engine.region(got[0], r[2]).numel() for r in recvs)
            timing.bytes_received += len(mrecvs) * tr.engine.region(got[0], "unique").numel()
    worker.live_copy = None
    timing.transferred = now()
    worker.progress.set(S, "rollback")
    worker.injector.fire(S, "rollback")
    if mine.kind == "local":
        try:
            tr.apply_header(tr.engine.restore_local(S, rank))
        except CorruptState as e:
            _report_corrupt(worker, plan, rank, comm, e)
    elif mine.kind == "disk":
        rank_state.load(tr, worker.dims, mine.dir, rank)
        worker.has_state = True
    elif mine.kind == "init":  # drawn from the seed by build(): the state of step 0
        tr.apply_header({"step": 0})
        worker.has_state = True
    elif mine.kind == "live" and tr.step != S:
        raise RuntimeError(f"plan says live state at step {S} but rank is at {tr.step}")
    timing.rolled_back = now()
    tr.engine.truncate_after(S)  # snapshots of the abandoned timeline must never be resumed
    if S not in tr.engine.local_steps():
        tr.snapshot_now()  # replication restarts from the resume step's snapshot


def transfers(worker, plan: Plan, rank: int):
    """This rank's part of the plan's state transfers: what it sends (its own state to a peer, a
    replica it holds, or its parameters to a rank restored from a sharded replica) and which
    pieces it receives, as ``snapshot.transfer.transfer`` takes them."""
    tr, S, eng = worker.trainer, plan.resume_step, worker.trainer.engine
    live = tr.step if worker.has_state and not tr.dirty else None
    copy = getattr(worker, "live_copy", None)  # the live state's copy its status reported
    sends = []
    for dst, src in sorted(plan.sources.items()):
        if src.kind not in ("peer", "replica"):
            continue
        whole = src.kind == "peer" or (src.shared_from is None and src.params_from is None)
        region = "all" if whole and (src.kind == "peer" or eng.repl_region == "all") else "unique"
        if src.holder == rank:  # (owner differs from dst only under faults.swap_routes)
            owner = dst if src.owner is None else src.owner
            sends.append((dst, region, outgoing(eng, src.kind, owner, S, live, tr.header, region,
                                                copy)))
        if src.shared_from == rank:
            sends.append((dst, "shared", outgoing(eng, "peer", dst, S, live, tr.header, "shared",
                                                  copy)))
    mine, recvs = plan.sources[rank], []
    # each piece is checked against the checksums its holder reported (the plan's), never the
    # ones sent with it (snapshot.transfer)
    if mine.kind == "peer":
        recvs.append((mine.holder, mine.holder, "all", mine.crc))  # its own: bad = (q, q, S)
    elif mine.kind == "retiring":  # from the slot that held the rank (recovery.pause.send_own)
        recvs.append((retiring_peer(mine.holder), rank, "all", mine.crc))
    elif mine.kind == "replica":
        sharded = mine.shared_from is not None or mine.params_from is not None
        region = "unique" if sharded else "all"
        recvs.append((mine.holder, rank, region, mine.crc))
        if mine.shared_from is not None:
            q = mine.shared_from
            recvs.append((q, q, "shared", [mine.shared_crc, None, None]))
    return sends, recvs


def install_checks(plan: Plan, rank: int) -> dict:
    """What ``SnapshotEngine.install`` checks a received state against: the owner the plan
    names (a peer sends its own state, a replica holder its ward's, or ``Source.owner``'s), the
    holder to blame, and the rank it becomes."""
    src = plan.sources[rank]
    if src.kind == "retiring":  # its own state, from a process that holds no rank now
        return {"owner": rank, "holder": -1, "rank": rank}
    owner = src.holder if src.kind == "peer" else rank if src.owner is None else src.owner
    return {"owner": owner, "holder": src.holder, "rank": rank}


def retiring_peer(slot: int) -> str:
    """The name a retiring process takes in its transfer's pair group (``xfer/s<slot>-<rank>``,
    group rank 0): not a rank of the generation."""
    return f"s{slot}"


def _report_corrupt(worker, plan: Plan, rank: int, comm: Communicator, e: CorruptState):
    """Tell the planner which copy failed its checksum (never used again), then regroup."""
    reports.post(worker.store, worker.seal, Keys(plan.generation).bad_source(rank), json.dumps(
        {"holder": e.holder, "owner": e.owner, "step": e.step}))
    comm.report_error(str(e))
    raise CollectiveError(str(e)) from None


def stop_to_disk(worker, plan: Plan, rank: int) -> None:
    """No spare is left (or the job regrows): write the state at the resume step to disk and
    count this rank done (``rank_state.write_for_stop``)."""
    worker.progress.set(plan.resume_step, "checkpoint")
    worker.injector.fire(plan.resume_step, "checkpoint")
    rank_state.write_for_stop(worker.trainer, worker.dims, worker.ft["checkpoint_dir"],
                              plan.resume_step, rank, plan.sources)
    keys = Keys(plan.generation)
    worker.store.set(keys.checkpointed(rank), worker.seal.wrap(keys.checkpointed(rank), "1"))
    worker.store.add(keys.checkpointed_count(), 1)  # a wake-up hint; the sealed key counts
