"""Per-step asynchronous in-memory snapshots, replicated to a buddy rank off the critical path.

Each rank holds::

    local ring:  its own snapshots of the last ``num_local_slots`` snapshot steps (rollback targets)
    replicas:    the last complete snapshots of its ward (what a spare is rebuilt from)

Modules, in the order a snapshot travels:

    layout.py       the flat buffer: tensor offsets, shared/unique regions, checksums (XXH3-64),
                    the JSON header (what a replica holds: ``topology.replica_region``)
    buffers.py      a ring slot and a held replica
    engine.py       ``SnapshotEngine``: the ring, the copier thread, what the rank can resume from
    ring.py         the ring's buffers, allocated in the background; the CUDA side-stream copy
    persist.py      periodic disk checkpoints handed over from finished snapshots
    replication.py  ``Replicator``: sends each snapshot to the buddy, receives the ward's
    held.py         the replicas held: what is kept, and whether a step counts replicated
    wire.py         the wire format of one state (meta, header, chunks)
    transfer.py     recovery transfers: what a holder sends, and receiving a rank's pieces
    schedule.py     which steps are snapshotted (the interval, widened when the cycle lags)

A replica is checked against the sender's checksum either on receipt (``verify="eager"``) or when
it is used (``verify="lazy"``, the default): every state sent to a spare is checked by the receiver
against the checksum the snapshot was taken with, and a mismatch is reported so that the planner
picks another source. Lazy verification takes one checksum pass per step off the steady state, and
keeps a survivor's status report O(1) (no checksum of GB-scale replicas before answering).

With ``replicate="unique"`` only the unique region (the ZeRO-1 optimizer shard) is replicated (a
live data-parallel peer holds the rest: the planner then restores a rank from its buddy's replica
plus a peer's parameters), so replication moves 1/dp of the optimizer state instead of the whole
state; ``replicate="full"`` replicates everything (needed when no data-parallel peer may survive).
Headers (step, data position, RNG state) travel as JSON; nothing received is ever unpickled.
"""

from deadpool.errors import CorruptState
from deadpool.snapshot.buffers import Replica, Slot
from deadpool.snapshot.engine import SnapshotEngine
from deadpool.snapshot.layout import (HEADER_BYTES, REGIONS, StateLayout, checksum, decode_header,
                                      encode_header, region_crcs, state_tensors)
from deadpool.snapshot.schedule import SnapshotSchedule

__all__ = ["CorruptState", "HEADER_BYTES", "REGIONS", "Replica", "Slot", "SnapshotEngine",
           "SnapshotSchedule", "StateLayout", "checksum", "decode_header", "encode_header",
           "region_crcs", "state_tensors"]
