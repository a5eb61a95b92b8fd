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

**Spread** (``spread_part``, the job's final checkpoint, ``checkpoint.final``): every rank
writes at once at the end of a job, so the time is the slowest rank's; one replica writing a
whole group's shared tensors would make it dp times the others'. Each shared tensor is cut
instead into ``dp`` contiguous parts of its flat elements, data-parallel rank ``d`` writing part
``d`` under ``<name>@part``, and its header names the parts (``shared_parts``: shape, dtype, its
own bounds) and the group in dp order (``shared_group``)::

    dp2, ZeRO-1      rank_0: params@part [0, n/2),  master, exp_avg, exp_avg_sq, step
                     rank_1: params@part [n/2, n),  master, exp_avg, exp_avg_sq, step

``read_full_rank`` joins a rank's parts back (each read in place into its slice of the whole
tensor); for any other checkpoint it is ``dcp_io.read_rank_state``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from deadpool.checkpoint.dcp_io import load_rank_state, read_rank_state
from deadpool.checkpoint.files import SHARED_FROM, SHARED_PARTS
from deadpool.topology import ParallelDims

# header keys: SHARED_FROM, the ranks whose directories hold this rank's shared tensors;
# SHARED_PARTS, name -> {shape, dtype, lo, hi} of a spread tensor (both in ``files``)
SHARED_GROUP = "shared_group"  # header key: the data-parallel group in dp order (the parts' writers)
PART = "@part"  # suffix of a spread tensor's part in a rank's directory


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


def part_bounds(numel: int, dp: int, d: int) -> tuple[int, int]:
    """Flat elements [lo, hi) of a shared tensor that data-parallel rank ``d`` of ``dp`` writes
    (contiguous, sizes differing by at most one element)."""
    q, r = divmod(numel, dp)
    lo = d * q + min(d, r)
    return lo, lo + q + (d < r)


def spread_part(state: dict[str, torch.Tensor], header: dict, shared_names, layout: dict | None,
                rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    """What ``rank`` writes of ``state`` in a spread checkpoint (module docstring): its unique
    tensors whole, its part of each shared one (views: nothing copied), and the header."""
    shared = [k for k in state if k in set(shared_names or ())]
    if not layout or int(layout.get("dp", 1)) <= 1 or not shared:
        return state, header
    dims = ParallelDims(int(layout["dp"]), int(layout.get("tp", 1)), int(layout.get("pp", 1)),
                        ranks_per_node=int(layout.get("tp", 1)))
    c = dims.coords(rank)
    out = {k: v for k, v in state.items() if k not in shared}
    parts = {}
    for k in shared:
        t = state[k]
        lo, hi = part_bounds(t.numel(), dims.dp, c["dp"])
        if hi > lo:  # (a part of no elements is not written)
            out[k + PART] = t.reshape(-1)[lo:hi]
        parts[k] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                    "lo": lo, "hi": hi}
    group = [dims.rank_of(c["pp"], d, c["tp"]) for d in range(dims.dp)]
    return out, dict(header, **{SHARED_PARTS: parts, SHARED_GROUP: group})


def read_full_rank(step_dir: Path, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Rank ``rank``'s whole state and its header from a checkpoint step directory, its spread
    tensors joined from its group's parts (``read_rank_state`` of anything else)."""
    state, header = read_rank_state(step_dir, rank)
    parts = header.pop(SHARED_PARTS, None)
    group = header.pop(SHARED_GROUP, None)
    if not parts:
        return state, header
    for name, p in parts.items():
        full = torch.empty(tuple(p["shape"]), dtype=getattr(torch, p["dtype"]))
        flat = full.view(-1)
        for d, q in enumerate(group):
            lo, hi = part_bounds(flat.numel(), len(group), d)
            if hi == lo:
                continue
            if q == rank:
                flat[lo:hi].copy_(state.pop(name + PART))
            else:  # only the part is read of a peer's directory, in place into its slice
                load_rank_state(step_dir, q, {name + PART: flat[lo:hi]})
        state[name] = full
    return state, header
