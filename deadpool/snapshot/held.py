"""The replicas a rank holds of its wards: keeping what its ``Replicator`` received.

A replica is kept only when it is whole (``verify="eager"``: its checksum matches the one its
sender took) and only while it may still be needed: the newest protected step of each ward and
anything newer (``SnapshotEngine``'s invariant). Whether every replica of a step was kept decides
whether this rank counts that step replicated: a step counts as protected only once every rank
holds what it must of it, so a dropped replica must never be counted.
"""

from __future__ import annotations

import torch

from deadpool.snapshot.buffers import Replica
from deadpool.snapshot.layout import checksum


def verify(engine, flat: torch.Tensor, crc: tuple) -> bool:
    """``flat`` (a received replica of ``engine.repl_region``) matches its sender's checksum."""
    if engine.repl_region == "all":
        return engine.verify_region(flat, "all", crc)
    return checksum(flat) == crc[1]


def keep_received(engine, got: list[tuple], repl) -> bool | None:
    """Keep the replicas ``repl`` received of one step, ``(ward, step, buffer, header, crc)``
    each; under eager verification one that fails its checksum is dropped. Returns None once
    ``repl`` was stopped, else whether every one was kept: only then has this rank replicated
    the step (counting a step with a dropped replica would protect it, and let every rank drop
    its older replicas, while no whole copy of that ward at that step exists)."""
    kept = True
    for ward, step, buf, header, crc in got:
        verified = None
        if engine.verify == "eager":
            if not verify(engine, buf, crc):
                kept = False  # a torn or corrupt replica never counts
                continue
            verified = True
        if not _commit(engine, Replica(ward, step, buf, header, crc, engine.repl_region,
                                       verified), repl):
            return None
    return kept


def _commit(engine, rep: Replica, repl) -> bool:
    with engine._lock:
        if repl.stopped:
            return False
        reps = [r for r in engine.replicas.get(rep.owner, []) if r.step != rep.step]
        reps.append(rep)
        reps.sort(key=lambda r: r.step)
        # keep the newest protected replica and everything newer (at least two)
        keep_from = min(engine._protected, reps[-2].step if len(reps) > 1 else rep.step)
        engine.replicas[rep.owner] = [r for r in reps if r.step >= keep_from]
        return True
