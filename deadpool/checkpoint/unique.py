"""Checkpoints of unique state: a tensor several ranks hold identically is written once.

A rank's state has two regions (``snapshot.layout``): *shared* tensors, identical on every rank
of its data-parallel group (the parameters, and the optimizer state when it is not sharded), and
*unique* ones (its ZeRO-1 optimizer shard). A periodic checkpoint written by every rank in full
holds the shared region dp times: at dp 496 that is almost all of it. Here the data-parallel
rank 0 of each (pp, tp) group writes its whole state and every other rank writes only its unique
tensors, with ``shared_from`` in its header naming the rank whose directory holds the rest
(``rank_state.load`` reads them from there, as it reads a rank written from a sharded replica)::

    dp2 x tp1 x pp1, ZeRO-1     step_S/rank_0: params, master, exp_avg, exp_avg_sq, step
                                step_S/rank_1:         master, exp_avg, exp_avg_sq, step
                                               header: shared_from [0]

A step is complete only when every rank's directory is (``files.is_complete``), so a complete
step always holds the writer of every group's shared tensors. Used where every rank of the
layout writes its own state from its own copy (periodic checkpoints, live or from a snapshot);
a path where a rank's state may be written by another process from a replica that lacks the
shared region (``write_for_stop``) writes whole states instead.
"""

from __future__ import annotations

import torch

from deadpool.topology import ParallelDims

SHARED_FROM = "shared_from"  # header key: ranks whose directories hold this rank's shared tensors


def shared_writer(layout: dict | None, rank: int) -> int | None:
    """The rank that writes ``rank``'s shared tensors: data-parallel rank 0 of its (pp, tp)
    group; None when that is ``rank`` itself (or no layout is known: every rank writes all)."""
    if not layout or int(layout.get("dp", 1)) <= 1:
        return None
    dims = ParallelDims(int(layout["dp"]), int(layout.get("tp", 1)), int(layout.get("pp", 1)),
                        ranks_per_node=int(layout.get("tp", 1)))
    c = dims.coords(rank)
    return None if c["dp"] == 0 else dims.rank_of(c["pp"], 0, c["tp"])


def unique_part(state: dict[str, torch.Tensor], header: dict, shared_names, layout: dict | None,
                rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    """What ``rank`` writes of ``state``: all of it if it writes its group's shared tensors,
    else its state without ``shared_names`` and a header naming the writer of the rest."""
    writer = shared_writer(layout, rank)
    shared = set(shared_names or ())
    if writer is None or not shared:
        return state, header
    return ({k: v for k, v in state.items() if k not in shared},
            dict(header, **{SHARED_FROM: [writer]}))


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
