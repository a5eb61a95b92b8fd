"""The wire format of a state sent between two ranks (replication and recovery transfers).

One state is: a 6-int64 meta message (step, bytes, the two region checksums, header length,
region), a fixed-size header message (the JSON header, zero-padded to ``HEADER_BYTES``), then the
bytes in chunks of ``chunk_bytes``, each a point-to-point message with its own tag. Sends are
posted asynchronously; nothing received is ever unpickled.
"""

from __future__ import annotations

import torch

from deadpool.snapshot.layout import HEADER_BYTES, REGIONS


def _to_i64(h: int) -> int:  # a 64-bit digest in an int64 tensor, and back
    return h - (1 << 64) if h >= 1 << 63 else h


def _from_i64(v: int) -> int:
    return v & 0xFFFFFFFFFFFFFFFF



def blocking(work) -> None:
    # Point-to-point waits must not use a timeout: a timed-out send/recv breaks the pair. A dead
    # peer is fenced (SIGKILLed) by the coordinator, which closes its sockets and ends this wait.
    work.wait()


def _meta(step: int, nbytes: int, crc: tuple, header_len: int, region: str) -> torch.Tensor:
    return torch.tensor([step, nbytes, _to_i64(crc[0]), _to_i64(crc[1]), header_len,
                         REGIONS.index(region)],
                        dtype=torch.int64)


def _chunks(flat: torch.Tensor, chunk_bytes: int):
    for off in range(0, flat.numel(), chunk_bytes):
        yield flat[off:off + chunk_bytes]


def post_sends(pg, dst: int, step: int, flat, header: bytes, crc: tuple, region: str,
                chunk_bytes: int, after_first_chunk=None) -> list:
    hdr = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    hdr[:len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    works = [pg.send([_meta(step, flat.numel(), crc, len(header), region)], dst, 0),
             pg.send([hdr], dst, 1)]
    for i, c in enumerate(_chunks(flat, chunk_bytes)):
        works.append(pg.send([c], dst, 2 + i))
        if i == 0 and after_first_chunk is not None:
            after_first_chunk()  # sends are asynchronous: the rest is not posted yet
    return works


def recv_state(pg, src: int, flat, chunk_bytes: int, wait,
                after_first_chunk=None) -> tuple[int, bytes, tuple, str]:
    """Receive one state into ``flat`` (a tensor of the expected size, or a function giving a
    buffer for the announced size)."""
    meta = torch.zeros(6, dtype=torch.int64)
    hdr = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    wait(pg.recv([meta], src, 0))
    step, nbytes, crc0, crc1, hlen, region = (int(x) for x in meta.tolist())
    if callable(flat):
        flat = flat(nbytes)
    if nbytes != flat.numel():
        raise RuntimeError(f"state layout mismatch: peer sends {nbytes} bytes, expected {flat.numel()}")
    wait(pg.recv([hdr], src, 1))
    for i, c in enumerate(_chunks(flat, chunk_bytes)):
        wait(pg.recv([c], src, 2 + i))
        if i == 0 and after_first_chunk is not None:
            after_first_chunk()
    return step, bytes(hdr[:hlen].numpy()), (_from_i64(crc0), _from_i64(crc1)), REGIONS[region]
