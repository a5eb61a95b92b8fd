"""Parameters rebuilt from a data-parallel group's ZeRO shards, when no copy of them is left.

Every data-parallel copy of a model shard can be lost at once (dp2: a rank and its peer), and
then no peer can send a restored rank its parameters. Each rank's ZeRO shard replica holds its
master weights (``ZeroOptimizer.state_tensors``: under bf16 the fp32 master shard, in fp32 the
owned slice of the parameters), and the group's master shards in data-parallel order, rounded to
the parameters' dtype, are the parameters bit for bit: the optimizer step writes exactly that
rounding into its slice and the all-gather concatenates the slices. The plan names, per
data-parallel rank of the group, the holder of its shard's replica (``Source.params_from``).

This is a second round of transfers after ``snapshot.transfer.transfer`` (which brings the
restored rank its own shard), inside the same abortable section: every rank finishes the first
round before it posts anything of the second, and within a round every send is posted before
any receive, so neither round can deadlock. Each shard received is checked against the checksum
its holder reported (``Source.params_crc``, from the sealed status, never the sender's word;
``CorruptState`` names its holder, never used again).
"""

from __future__ import annotations

import torch

from deadpool.errors import CorruptState
from deadpool.snapshot.layout import checksum
from deadpool.snapshot.transfer import outgoing, transfer
from deadpool.snapshot.wire import blocking, post_sends, recv_state


def master_sends(eng, sources: dict, rank: int, step: int, live_step, header_fn, group_of):
    """What this rank sends for the plan's ``params_from``: ``(dst, member, (bytes, header,
    crc))`` for each member shard replica it is named to serve, in one order both ends derive."""
    out = []
    for dst, src in sorted(sources.items()):
        if src.params_from is None:
            continue
        for d, h in zip(group_of(dst), src.params_from):
            if h == rank and d != dst:
                out.append((dst, d, outgoing(eng, "replica", d, step, live_step, header_fn,
                                             "unique")))
    return out


def master_recvs(source, rank: int, group: list[int]) -> list[tuple[int, int, int | None]]:
    """``(holder, member, unique checksum the plan names)`` for each other member's shard this
    rank receives (its own shard comes with its replica in the first round)."""
    if source.params_from is None:
        return []
    want = source.params_crc or [None] * len(group)
    return [(h, d, c) for d, h, c in zip(group, source.params_from, want) if d != rank]


def _exchange(eng, comm, sends, recvs, step: int) -> dict[int, torch.Tensor]:
    me = comm.topo.rank
    pairs = sorted({(me, dst) for dst, _, _ in sends} | {(r[0], me) for r in recvs})
    for a, b in pairs:  # one global order (deadlock-free), as in the first round
        comm.pair_group(comm.build_store, a, b)
    works = []
    for dst, _, (flat, header, crc) in sends:
        works += post_sends(comm.pair_group(None, me, dst), 1, step, flat, header, crc,
                            "unique", eng.chunk_bytes)
    got = {}
    a, b = eng.bounds["unique"]
    for h, d, want in recvs:
        buf = torch.empty(b - a, dtype=torch.uint8)
        got_step, _, _, region = recv_state(comm.pair_group(None, h, me), 0, buf,
                                            eng.chunk_bytes, wait=blocking)
        if got_step != step or region != "unique" or want is None or checksum(buf) != want:
            raise CorruptState(f"shard of rank {d} at step {step} from rank {h} failed "
                               f"verification (got step {got_step}, region {region}, CRC "
                               f"mismatch)", h, d, step)
        got[d] = buf
    for w in works:
        w.wait()
    return got


def rebuild_params(eng, buf: torch.Tensor, rank: int, group: list[int],
                   shards: dict[int, torch.Tensor]) -> int:
    """Write the parameters into ``buf`` (a full state of this rank's layout whose unique region
    holds its own shard) from the group's master shards; returns the shared region's checksum."""
    entries = {e.name: e for e in eng.layout.entries}
    p, m = entries["params"], entries["master"]
    split = eng.bounds["unique"][0]
    params = buf[p.offset:p.offset + p.nbytes].view(p.dtype)
    n = m.nbytes // m.dtype.itemsize
    buf[p.offset + p.nbytes:split].zero_()  # alignment padding: the same bytes on every rebuild
    with torch.no_grad():
        for i, d in enumerate(group):
            unique = buf[split:] if d == rank else shards[d]
            master = unique[m.offset - split:m.offset - split + m.nbytes].view(m.dtype)
            params[i * n:(i + 1) * n].copy_(master)  # the rounding the optimizer step makes
    return checksum(buf[:split])


def moves(eng, comm, sends, recvs, msends, mrecvs, step: int, rank: int, group: list[int]):
    """Both rounds of a restore's transfers (inside ``run_abortable``): ``transfer``'s, then the
    group's shards; returns what ``transfer`` returns, its parameters rebuilt when ``mrecvs``."""
    got = transfer(eng, comm, sends, recvs, step) if sends or recvs else None
    if msends or mrecvs:
        shards = _exchange(eng, comm, msends, mrecvs, step)
        if mrecvs:
            buf, header, crc = got
            got = (buf, header, (rebuild_params(eng, buf, rank, group, shards), crc[1]))
    return got
