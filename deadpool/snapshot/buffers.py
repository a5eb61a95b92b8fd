"""The buffers a rank holds: its local ring's slots (own snapshots) and the replicas of its ward."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch


@dataclass
class Slot:
    flat: torch.Tensor | None  # None: not allocated yet (written once a snapshot takes the slot)
    step: int = -1
    header: bytes = b""
    crc: tuple = (0, 0)  # checksum of the shared region, of the unique region
    released: threading.Event = field(default_factory=threading.Event)  # copy done: live may change
    copied: threading.Event = field(default_factory=threading.Event)    # copy and checksum done
    replicating: bool = False
    pending: bool = False     # queued for the copier, not yet copied and checksummed: not reusable
    allocating: bool = False  # the background allocation is making this slot's buffer
    cuda_event: object = None
    taken_at: float = 0.0  # perf_counter() when the snapshot was started (cycle time)


@dataclass
class Replica:
    owner: int
    step: int
    flat: torch.Tensor  # the replicated region only
    header: bytes
    crc: tuple
    region: str
    verified: bool | None = None  # None: not checked yet (lazy); False: known corrupt
