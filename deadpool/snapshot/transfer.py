"""Recovery transfers: a rank being restored receives its state from the holders the plan names.

Runs before the new generation's replication starts, inside ``Communicator.run_abortable``.
``outgoing`` picks what a holder sends (its own snapshot, or a replica it holds, cut to a region),
``transfer`` moves the pieces over one 2-rank group per (holder, receiver) and checks each
against the checksums the plan names; ``SnapshotEngine.install`` then makes the received state
live.

**What a receiver trusts.** The checksums that travel with the data are the sender's word, and
the pair groups' rendezvous goes through the store, which any client can write: a consistent
(data, checksum) pair from the wrong process would pass a check against them. So a holder
reports the checksums of every copy it can send in its sealed ``RankStatus``
(``held_checksums``: a checksum per region and one of the header, per copy, never per tensor),
the planner copies them into the sealed plan's ``Source``, and the receiver checks the bytes and
the header against those alone. The header names the state's step, owner and layout, which
``install`` checks against the plan.
"""

from __future__ import annotations

import torch
import xxhash

from deadpool.errors import CorruptState
from deadpool.snapshot.layout import decode_header, encode_header, region_crcs
from deadpool.snapshot.wire import blocking, post_sends, recv_state


def header_digest(header: bytes) -> int:
    """The checksum of a snapshot header (its step, owner and layout travel in it)."""
    return xxhash.xxh3_64_intdigest(header)


def held_checksums(eng, live_step: int | None, header_fn, has_state: bool):
    """What a status reports (``RankStatus.crcs``): ``{"own/<step>" | "<owner>/<step>":
    [shared, unique, header]}`` for every local snapshot and replica held, and the live state's
    copy ``(step, flat, header, crc)`` when the live step has no snapshot (its checksum must be
    known before the plan; the copy is what ``outgoing`` then sends, so it matches), else None.
    Main thread only, after replication stopped."""
    out, live_copy = {}, None
    if has_state:
        for step in eng.local_steps():
            slot = eng.local_slot(step)
            out[f"own/{step}"] = [*slot.crc, header_digest(slot.header)]
        if live_step is not None and live_step not in eng.local_steps():
            flat = torch.zeros(eng.layout.nbytes, dtype=torch.uint8)
            with torch.no_grad():
                torch._foreach_copy_(eng.layout.views(flat), eng.tensors)
            header = encode_header(dict(header_fn(), layout=eng.layout_desc))
            crc = region_crcs(flat, eng.bounds["unique"][0])
            live_copy = (live_step, flat, header, crc)
            out[f"own/{live_step}"] = [*crc, header_digest(header)]
    with eng._lock:
        for owner, reps in eng.replicas.items():
            for rep in reps:
                if rep.verified is not False:
                    out[f"{owner}/{rep.step}"] = [*rep.crc, header_digest(rep.header)]
    return out, live_copy


def outgoing(eng, kind: str, owner: int, step: int, live_step: int | None, header_fn,
             region: str = "all", live_copy=None):
    """What to send for a plan source: ``(bytes of region, header, crc)``. Main thread only.

    ``kind="replica"``: the replica of ``owner`` at ``step``; otherwise this rank's own state
    at ``step`` (its local snapshot; the live state's copy its status reported, ``live_copy``;
    else taken now from the live state if it is at ``step``).
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
    if live_copy is not None and live_copy[0] == step and step not in eng.local_steps():
        _, flat, header, crc = live_copy
        return eng.region(flat, region), header, crc
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
    region, expected)``, at most one per region (e.g. the unique region from a replica holder
    and the shared region from a data-parallel peer), ``expected`` the plan's checksums of the
    copy (``[shared, unique, header]``, entries the region lacks ignored; see the module's
    docstring). Every send is posted before any receive (no cycle can deadlock). Pieces land in
    one fresh buffer (an abandoned transfer may still write into it) and each is checked against
    ``expected``, never against the checksums sent with it (``CorruptState`` on a mismatch, or
    when the plan names none). Returns ``(buffer, header, crc)`` or None.
    """
    me = comm.topo.rank
    # one 2-rank group per (holder, receiver), created in one global order (deadlock-free); a
    # retiring process (a slot's name, not a rank: ``recovery.restore.retiring_peer``) pairs with
    # its receiver alone, last
    pairs = sorted({(me, dst) for dst, _, _ in sends} | {(r[0], me) for r in recvs},
                   key=lambda p: (isinstance(p[0], str), str(p[0]) if isinstance(p[0], str) else p))
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
        for src, owner, region, want in recvs:
            got_step, hdr, _, got_region = recv_state(
                comm.pair_group(None, src, me), 0, eng.region(buf, region), eng.chunk_bytes,
                wait=blocking, after_first_chunk=lambda: eng.fault_hook(step, "transfer"))
            if not _as_reported(eng, buf, region, hdr, want) or (got_step, got_region) != (
                    step, region):
                raise CorruptState(f"{region} state of rank {owner} at step {step} from rank "
                                   f"{src} is not the copy its holder reported (got step "
                                   f"{got_step}, region {got_region}; checksums {want})",
                                   src if isinstance(src, int) else -1, owner, step)
            c = tuple(want[:2])
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


def _as_reported(eng, buf, region: str, header: bytes, want) -> bool:
    """The received ``region`` (and, with the unique region, the header) has the checksums the
    plan names; never true when it names none."""
    shared, unique, hdr = (list(want or []) + [None] * 3)[:3]
    if region in ("all", "shared") and (
            shared is None or not eng.verify_region(buf, "shared", (shared, 0))):
        return False
    if region in ("all", "unique") and (
            unique is None or hdr is None or header_digest(header) != hdr
            or not eng.verify_region(buf, "unique", (0, unique))):
        return False
    return True


def check_header(header: bytes, step: int, layout: dict, owner: int | None, holder: int,
                 rank: int | None) -> bytes:
    """A received state's header names ``step``, this rank's ``layout`` and (when the plan names
    one) ``owner``; returns it, renamed to ``rank`` when given (a peer's state becomes this
    rank's own snapshot). ``CorruptState`` naming ``holder`` otherwise."""
    h = decode_header(header)
    got = (h.get("step"), h.get("layout"), h.get("rank") if owner is not None else None)
    if got != (step, layout, owner):
        raise CorruptState(f"received state is not the one the plan names: (step, owner) "
                           f"{(got[0], h.get('rank'))} for {(step, owner)}"
                           + ("" if got[1] == layout else ", another layout"),
                           holder, owner, step)
    return header if rank is None or h.get("rank") == rank else encode_header(dict(h, rank=rank))
