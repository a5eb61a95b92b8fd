"""Every disk write and read of a running rank's state, in one place.

The runtime writes a rank's state to disk in four situations, and reads it back in one:

    save_live          periodic checkpoint from the live state (ft=checkpoint_restart, or
                       persistence with snapshots off); async through the rank's AsyncPersister
    (engine)           periodic checkpoint from a snapshot: the copier hands a private copy to
                       the same AsyncPersister (``SnapshotEngine._persist``)
    write_for_stop     no spare left: the consistent state of the resume step, every rank's,
                       from memory (own state, a peer's, or a replica held)
    write_held         the coordinator is gone: the rank's own snapshots from the newest
                       protected step on, unique state only (no replicas)
    load               a rank's state from a step directory, written at this layout or another
                       (an elastic job: ZeRO-1 state re-cut; another tp or pp: ``relayout``)

``trainer`` is the rank's ``deadpool.rank.trainer.Trainer`` (its engine, optimizer and header).
"""

from __future__ import annotations

from pathlib import Path

import torch

from deadpool.checkpoint.dcp_io import load_rank_state, save_rank_state
from deadpool.checkpoint.files import (is_complete, latest_step_dir, rank_complete, read_header,
                                       read_meta, write_meta)
from deadpool.checkpoint.relayout import load_relayout
from deadpool.checkpoint.retention import prune
from deadpool.checkpoint.unique import SHARED_PARTS, read_full_rank, unique_part
from deadpool.snapshot.layout import StateLayout, decode_header
from deadpool.snapshot.transfer import outgoing
from deadpool.topology import ParallelDims


def _at(dims: ParallelDims) -> dict:
    """The layout a rank directory is written at (``checkpoint.files``: one per step)."""
    return {"layout": dims.layout, "world_size": dims.world_size}


def save_live(trainer, root, step: int, dims: ParallelDims, asynchronous: bool, wait: bool) -> None:
    """Write the rank's live state to disk as the checkpoint of ``step``.

    ``asynchronous`` (ft.persist_async, the default): copy the state into a host staging buffer
    on this thread (what ``dcp.async_save``'s default stager does), then write it with
    ``dcp.async_save`` on an upload thread while training goes on; the previous write must be
    done first, since its buffer is reused. Otherwise ``dcp.save`` on this thread. ``wait``:
    block until the write is on disk (to measure it)."""
    if not asynchronous:  # unique state only, as the persister writes it (checkpoint.unique)
        state, header = unique_part(trainer.state_dict(), trainer.header(), trainer.shared_names(),
                                    dims.layout, trainer.rank)
        save_rank_state(root, step, trainer.rank, state, header, **_at(dims))
        write_meta(root, step, dims.world_size, "periodic", layout=dims.layout)
        keep = trainer.cfg["ft"].get("keep_checkpoints")
        if keep and is_complete(Path(root) / f"step_{step}"):
            prune(root, keep, protect=step)
        return
    persister, layout = trainer.engine.persister, trainer.engine.layout
    persister.wait()  # raises CheckpointWriteError for a failed previous write
    if trainer._ckpt_buf is None:
        trainer._ckpt_buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    for dst, src in zip(layout.views(trainer._ckpt_buf), trainer.engine.tensors):
        dst.copy_(src.detach())
    persister.rank = trainer.rank
    persister.submit(step, layout.state_dict(trainer._ckpt_buf), trainer.header(), dims.world_size)
    if wait:
        persister.wait()


def write_replica(engine, dims: ParallelDims, root, step: int, owner: int, flat, header: bytes) -> None:
    """Write a held replica of ``owner`` (whose stage may differ from this rank's: its layout
    travels in the header) to disk; a sharded replica (unique region only) names the
    data-parallel peers whose directories hold its parameters."""
    hdr = decode_header(header)
    layout = StateLayout.from_desc(hdr["layout"])
    if engine.repl_region == "all":
        save_rank_state(root, step, owner, layout.state_dict(flat), hdr, **_at(dims))
        return
    split = hdr["layout"]["split"]
    full = torch.zeros(max(layout.nbytes, split + flat.numel()), dtype=torch.uint8)
    full[split:split + flat.numel()].copy_(flat)
    state = {e.name: v for e, v in zip(layout.entries, layout.views(full)) if e.offset >= split}
    hdr["shared_from"] = [q for q in dims.state_peers(owner) if q != owner]
    save_rank_state(root, step, owner, state, hdr, **_at(dims))


def write_for_stop(trainer, dims: ParallelDims, root, step: int, rank: int, sources: dict) -> None:
    """No spare is left: write the state at ``step`` to disk (DCP). Each rank writes its own
    state; the holder a source names writes a dead rank's (from its replica, or its own state
    when it is a data-parallel peer). ``sources``: the plan's, rank -> ``Source``."""
    eng = trainer.engine
    src = sources[rank]
    if src.kind == "local":
        trainer.apply_header(eng.restore_local(step, rank))
    if src.kind in ("live", "local"):  # else this process holds nothing: its holder writes it
        save_rank_state(root, step, rank, trainer.state_dict(), trainer.header(), **_at(dims))
    for owner, s in sources.items():
        if s.holder == rank and s.kind == "peer":
            flat, header, _ = outgoing(eng, "peer", owner, step, trainer.step, trainer.header)
            save_rank_state(root, step, owner, eng.layout.state_dict(flat), decode_header(header),
                            **_at(dims))
        elif s.holder == rank and s.kind == "replica":
            rep = eng.replica(owner, step)
            write_replica(eng, dims, root, step, owner, rep.flat, rep.header)


def write_held(trainer, dims: ParallelDims, root, reason: str) -> list[int]:
    """The coordinator is gone: write this rank's own consistent state, unique state only
    (``checkpoint.unique``: the group's parameters by its dp rank 0), as a step directory that
    resumes like any checkpoint. Its snapshots from the newest step it knows protected on: a
    rank may know an older protected step than another, but every rank holds a snapshot of the
    newest one any rank knows (the snapshot invariant), so that step is complete on disk once
    every rank has written. No replicas: the ranks are alive (each writes its own), and a replica
    written too would be the whole job's state again. Returns the steps written."""
    eng, world, layout, written = trainer.engine, dims.world_size, dims.layout, []
    floor = eng.protected_floor()
    for step in sorted((s for s in eng.local_steps() if s >= floor), reverse=True):
        slot = eng.local_slot(step)
        state, header = unique_part(eng.layout.state_dict(slot.flat), decode_header(slot.header),
                                    trainer.shared_names(), layout, trainer.rank)
        save_rank_state(root, step, trainer.rank, state, header, **_at(dims))
        write_meta(root, step, world, reason, layout=layout)
        written.append(step)
    return written


def load(trainer, dims: ParallelDims, step_dir, rank: int) -> None:
    """Load ``rank``'s state from a checkpoint step directory (``latest_step_dir`` of a root).
    A rank written from a sharded replica holds only its unique tensors; its parameters come
    from a data-parallel peer's directory of the same step (``shared_from`` in its header)."""
    step_dir = latest_step_dir(step_dir)
    layout = read_meta(step_dir).get("layout")
    if layout is not None and (int(layout["tp"]), int(layout["pp"]), int(
            layout.get("virtual_stages", 1))) != (dims.tp, dims.pp, dims.virtual_stages):
        load_relayout(trainer, dims, step_dir, rank, layout)  # tp or pp changed (and dp, maybe)
        return
    if layout is not None and int(layout["dp"]) != dims.dp:
        _load_resharded(trainer, dims, step_dir, rank, layout)
        return
    header = read_header(step_dir, rank)
    if header.get(SHARED_PARTS) is not None:  # a final checkpoint (its parts spread: unique.py)
        full, header = read_full_rank(step_dir, rank)
        for name, t in trainer.state_dict().items():
            t.copy_(full[name].reshape(t.shape))
        trainer.apply_header(header)
        return
    if header.get("shared_from") is None:
        trainer.apply_header(load_rank_state(step_dir, rank, trainer.state_dict()))
        return
    state, shared = trainer.state_dict(), set(trainer.shared_names())
    for q in header["shared_from"]:
        if rank_complete(step_dir, q) and read_header(step_dir, q).get("shared_from") is None:
            load_rank_state(step_dir, q, {k: v for k, v in state.items() if k in shared})
            break
    else:
        raise RuntimeError(f"{step_dir}: rank {rank}'s parameters are in none of "
                           f"{header['shared_from']}")
    trainer.apply_header(load_rank_state(
        step_dir, rank, {k: v for k, v in state.items() if k not in shared}))


def _load_resharded(trainer, dims: ParallelDims, step_dir: Path, rank: int, layout: dict) -> None:
    """Load a checkpoint written at another data-parallel width (an elastic job that shrank or
    regrows): this stage's state from every old data-parallel rank, re-cut for this rank's
    shard (``zero.reshard_state``)."""
    from deadpool.parallel.data.zero import reshard_state

    c = dims.coords(rank)
    old = ParallelDims(int(layout["dp"]), dims.tp, dims.pp, dims.tp)
    states, header = [], None
    for d in range(old.dp):
        st, hdr = read_full_rank(step_dir, old.rank_of(c["pp"], d, c["tp"]))
        states.append(st)
        header = header or hdr
    new = reshard_state(states, trainer.opt.numel, dims.dp, c["dp"], trainer.opt.shard)
    for name, t in trainer.state_dict().items():
        t.copy_(new[name].reshape(t.shape))
    trainer.apply_header(header)
