"""A rank's training state as one flat byte buffer: where each tensor lives, its two regions,
their checksums, and the JSON header that travels with every snapshot.

**Regions.** The flat buffer holds the *shared* tensors first (identical on every rank of the
data-parallel group: parameters, and the optimizer state when it is not sharded) and the rank's
*unique* tensors after them (its ZeRO-1 optimizer shard: under ``precision=bf16`` the fp32
master shard and the moments, while the shared bf16 parameters are only their rounding). Each region has its own checksum. A
state on the wire names its region: ``all``, ``shared`` or ``unique``; what a buddy's replica
holds is ``topology.replica_region``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import xxhash

HEADER_BYTES = 1 << 16  # JSON metadata (step, RNG states, data position) must fit
_ALIGN = 64
REGIONS = ("all", "shared", "unique")


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """A plain model's and ``torch.optim.AdamW``'s state in a fixed order: parameters, then the
    AdamW state per parameter. For tools and tests that snapshot a stock torch model (the
    runtime's own order is ``ZeroOptimizer.state_tensors``)."""
    out = [(f"param/{n}", p) for n, p in model.named_parameters()]
    for n, p in model.named_parameters():
        st = opt.state[p]
        for k in ("exp_avg", "exp_avg_sq", "step"):
            out.append((f"{k}/{n}", st[k]))
    return out


@dataclass
class Entry:
    name: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple


class StateLayout:
    """Where each state tensor lives in the flat byte buffer."""

    @classmethod
    def from_desc(cls, desc: dict) -> "StateLayout":
        """The layout a snapshot header describes (``SnapshotEngine.layout_desc``)."""
        self = cls([])
        self.entries = [Entry(n, o, b, getattr(torch, d), tuple(sh)) for n, o, b, d, sh in
                        desc["entries"]]
        self.nbytes = self.entries[-1].offset + self.entries[-1].nbytes if self.entries else 0
        return self

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]):
        self.entries: list[Entry] = []
        off = 0
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            self.entries.append(Entry(name, off, nbytes, t.dtype, tuple(t.shape)))
            off += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self.nbytes = off

    def gaps(self) -> list[tuple[int, int]]:
        """The byte ranges no tensor covers (each tensor starts ``_ALIGN``-aligned)."""
        out, end = [], 0
        for e in self.entries:
            if e.offset > end:
                out.append((end, e.offset))
            end = e.offset + e.nbytes
        return out + ([(end, self.nbytes)] if self.nbytes > end else [])

    def zero_gaps(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` with its ``gaps`` zeroed (a new buffer holds whatever the allocator last had
        there: two snapshots of one state would differ in bytes no copy writes)."""
        for a, b in self.gaps():
            flat[a:b] = 0
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.entries]

    def state_dict(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {e.name: v for e, v in zip(self.entries, self.views(flat))}

    def state_dict_live(self, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {e.name: t for e, t in zip(self.entries, tensors)}


def checksum(flat: torch.Tensor) -> int:
    """XXH3-64 of the bytes (the ``xxhash`` package: ~28 GB/s on one core here, 9x zlib's
    checksum, and it releases the GIL, so the copier thread hashes beside the training thread).
    Not cryptographic: it detects torn transfers and memory corruption, not tampering."""
    return xxhash.xxh3_64_intdigest(flat.numpy())



def region_crcs(flat: torch.Tensor, split: int) -> tuple[int, int]:
    """Checksums of the shared region ``flat[:split]`` and of the unique region ``flat[split:]``."""
    return checksum(flat[:split]), checksum(flat[split:])


def encode_header(header: dict) -> bytes:
    b = json.dumps(header).encode()
    if len(b) > HEADER_BYTES:
        raise ValueError(f"snapshot header is {len(b)} bytes, more than {HEADER_BYTES}")
    return b


def decode_header(b: bytes) -> dict:
    return json.loads(b.decode())

