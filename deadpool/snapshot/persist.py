"""Periodic disk checkpoints written from snapshots: the copier thread hands a copy of a finished
snapshot to the asynchronous disk writer (``checkpoint.AsyncPersister``)."""

from __future__ import annotations

import torch

from deadpool.snapshot.buffers import Slot
from deadpool.snapshot.layout import decode_header


def persist_snapshot(engine, slot: Slot) -> None:
    """Hand a copy of ``slot``'s snapshot to ``engine.persister`` (copier thread).

    The copy into a buffer the writer owns until it is done happens here, off the training
    thread; the writer then needs no staging copy of its own. If the previous write is still
    running this checkpoint is skipped (counted), never waited for."""
    p = engine.persister
    if p is None or p.in_flight:
        if p is not None:
            p.skipped += 1
        return
    if engine._persist_flat is None:
        engine._persist_flat = torch.empty_like(slot.flat)
    engine._persist_flat.copy_(slot.flat)
    try:
        p.submit(slot.step, engine.layout.state_dict(engine._persist_flat),
                 decode_header(slot.header), engine.persist_world)
    except Exception as e:  # a failed earlier write must not stop snapshots
        print(f"[deadpool] periodic checkpoint of step {slot.step} not written: {e}", flush=True)
