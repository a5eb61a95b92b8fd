"""Recovery transfers: a rank being restored receives its state from the holders the plan names.

Runs before the new generation's replication starts, inside ``Communicator.run_abortable``.
``outgoing`` picks what a holder sends (its own snapshot, or a replica it holds, cut to a region),
``transfer`` moves the pieces over one 2-rank group per (holder, receiver) and checks each
against the checksum its region was taken with; ``SnapshotEngine.install`` then makes the
received state live.
"""

from __future__ import annotations

import torch

from deadpool.errors import CorruptState
from deadpool.snapshot.layout import decode_header
from deadpool.snapshot.wire import blocking, post_sends, recv_state


def outgoing(eng, kind: str, owner: int, step: int, live_step: int | None, header_fn,
             region: str = "all"):
    """What to send for a plan source: ``(bytes of region, header, crc)``. Main thread only.

    ``kind="replica"``: the replica of ``owner`` at ``step``; otherwise this rank's own state
    at ``step`` (its local snapshot; taken now from the live state if it is at ``step``).
    """
    if kind == "replica":
        rep = eng.replica(owner, step)
        if rep.region != "all" and region != rep.region:
            raise KeyError(f"the replica of rank {owner} holds the {rep.region} region, "
                           f"not {region}")
        if region == rep.region:
            return rep.flat, rep.header, rep.crc
        # a whole-state replica of another stage: cut at its owner's split, not ours
        split = decode_header(rep.header)["layout"]["split"]
        part = rep.flat[:split] if region == "shared" else rep.flat[split:]
        return part, rep.header, rep.crc
    if step not in eng.local_steps():
        if live_step != step:
            raise KeyError(f"no state of step {step} to send (live state is at {live_step})")
        eng.snapshot(step, header_fn())
        eng.drain()
    slot = eng.local_slot(step)
    return eng.region(slot.flat, region), slot.header, slot.crc


def transfer(eng, comm, sends: list[tuple], recvs: list[tuple], step: int):
    """Send states and receive this rank's pieces; runs in an abortable helper thread.

    ``sends``: ``(dst_rank, region, (bytes, header, crc))``; ``recvs``: ``(src_rank, owner,
    region)``, at most one per region (e.g. the unique region from a replica holder and the
    shared region from a data-parallel peer). Every send is posted before any receive (no
    cycle can deadlock). Pieces land in one fresh buffer (an abandoned transfer may still
    write into it) and each is checked against the checksum its region was taken with
    (``CorruptState`` on mismatch). Returns ``(buffer, header, crc)`` or None.
    """
    me = comm.topo.rank
    # one 2-rank group per (holder, receiver), created in one global order (deadlock-free)
    pairs = sorted({(me, dst) for dst, _, _ in sends} | {(src, me) for src, _, _ in recvs})
    for a, b in pairs:
        comm.pair_group(comm.build_store, a, b)
    works = []
    for dst, region, (flat, header, crc) in sends:
        works += post_sends(comm.pair_group(None, me, dst), 1, step, flat, header, crc,
                             region, eng.chunk_bytes,
                             after_first_chunk=lambda: eng.fault_hook(step, "transfer"))
    got = None
    if recvs:
        buf = torch.empty(eng.layout.nbytes, dtype=torch.uint8,
                          pin_memory=eng.pinned)
        crc, header = [0, 0], b""
        for src, owner, region in recvs:
            got_step, hdr, c, got_region = recv_state(
                comm.pair_group(None, src, me), 0, eng.region(buf, region), eng.chunk_bytes,
                wait=blocking, after_first_chunk=lambda: eng.fault_hook(step, "transfer"))
            if got_step != step or got_region != region or not eng.verify_region(buf, region, c):
                raise CorruptState(f"{region} state of rank {owner} at step {step} from rank "
                                   f"{src} failed verification (got step {got_step}, region "
                                   f"{got_region}, CRC mismatch)", src, owner, step)
            if region in ("all", "shared"):
                crc[0] = c[0]
            if region in ("all", "unique"):
                crc[1], header = c[1], hdr
            elif not header:
                header = hdr
        got = (buf, header, tuple(crc))
    for w in works:
        w.wait()
    return got
