"""Which process groups a rank belongs to, and which of them survivors may keep after a failure.

Pure functions of the layout (no process group is touched): the communicator builds the groups
``rank_groups`` lists, and the planner asks ``reusable_groups`` which ones of ``all_groups`` a
recovery can keep. Each is linear in the world size (the recovery path must not be quadratic:
at 16k ranks an O(N^2) step takes minutes).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType

from deadpool.policies import buddies_table
from deadpool.settings import layout_cfg
from deadpool.topology import ParallelDims, Topology, repl_name


def rank_groups(topo: Topology) -> list[tuple[str, str, list[int], bool]]:
    """This rank's groups as ``(name, key, ranks, is_replication)``, in creation order.

    ``key`` names the group the same way on every member and in every generation (the store
    prefix adds the generation); groups are created sorted by key (see the module doc).
    """
    dims, rank = topo.dims, topo.rank
    c = dims.coords(rank)
    out = []
    for axis in ("dp", "tp"):
        ranks = dims.axis_group(axis, rank)
        if len(ranks) > 1:
            rest = "-".join(f"{a}{c[a]}" for a in ("pp", "dp", "tp") if a != axis)
            out.append((axis, f"{axis}/{rest}", ranks, False))
    if dims.pp > 1:
        def pair(s):  # activations stage s -> s+1 (fwd) and gradients s+1 -> s (bwd)
            a, b = dims.rank_of(s, c["dp"], c["tp"]), dims.rank_of(s + 1, c["dp"], c["tp"])
            return (f"ppf/{a}-{b}", [a, b]), (f"ppb/{b}-{a}", [b, a])
        if c["pp"] < dims.pp - 1:
            (kf, rf), (kb, rb) = pair(c["pp"])
            out += [("pp_send_fwd", kf, rf, False), ("pp_recv_bwd", kb, rb, False)]
        if c["pp"] > 0:
            (kf, rf), (kb, rb) = pair(c["pp"] - 1)
            out += [("pp_recv_fwd", kf, rf, False), ("pp_send_bwd", kb, rb, False)]
        if dims.virtual_stages > 1 and c["pp"] in (0, dims.pp - 1):  # interleaved: wrap-around
            (kf, rf), (kb, rb) = wrap_pair(dims, c["dp"], c["tp"])
            out += ([("pp_send_wrap_fwd", kf, rf, False), ("pp_recv_wrap_bwd", kb, rb, False)]
                    if c["pp"] == dims.pp - 1 else
                    [("pp_recv_wrap_fwd", kf, rf, False), ("pp_send_wrap_bwd", kb, rb, False)])
    for j, (buddy, ward) in enumerate(zip(topo.buddies(), topo.wards())):
        if buddy != rank:  # one 2-rank group per holder (ft.replicas) and per ward
            out.append((repl_name("out", j), f"repl/{rank}-{buddy}", [rank, buddy], True))
            out.append((repl_name("in", j), f"repl/{ward}-{rank}", [ward, rank], True))
    return sorted(out, key=lambda g: g[1])


def wrap_pair(dims: ParallelDims, dp: int, tp: int):
    """Interleaved 1F1B's groups from the last stage back to the first (model chunk ``c`` of the
    last rank feeds chunk ``c + 1`` of rank 0): ``(key, ranks)`` for activations and for their
    gradients, apart from the stage-to-stage pairs so that each group carries one direction."""
    a, b = dims.rank_of(dims.pp - 1, dp, tp), dims.rank_of(0, dp, tp)
    return (f"ppwf/{a}-{b}", [a, b]), (f"ppwb/{b}-{a}", [b, a])


def all_groups(dims: ParallelDims, buddy_policy: str, replicas: int = 1) -> dict[str, list[int]]:
    """Every group of the layout, key -> ranks: the union of every rank's ``rank_groups``,
    enumerated once per group (O(world size)) rather than once per member."""
    out: dict[str, list[int]] = {}
    for axis in ("dp", "tp"):
        if getattr(dims, axis) > 1:
            for ranks in dims.axis_groups(axis):
                c = dims.coords(ranks[0])
                rest = "-".join(f"{a}{c[a]}" for a in ("pp", "dp", "tp") if a != axis)
                out[f"{axis}/{rest}"] = ranks
    for s in range(dims.pp - 1):
        for dp in range(dims.dp):
            for tp in range(dims.tp):
                a, b = dims.rank_of(s, dp, tp), dims.rank_of(s + 1, dp, tp)
                out[f"ppf/{a}-{b}"], out[f"ppb/{b}-{a}"] = [a, b], [b, a]
    if dims.virtual_stages > 1:
        for dp in range(dims.dp):
            for tp in range(dims.tp):
                for key, ranks in wrap_pair(dims, dp, tp):
                    out[key] = ranks
    for r, bs in enumerate(buddies_table(dims, buddy_policy, replicas)):
        for b in bs:
            if b != r:
                out[f"repl/{r}-{b}"] = [r, b]
    return out


def reusable_groups(counts: dict[int, dict[str, list[int]]], members: dict[str, list[int]],
                    replaced: set[int]) -> list[str]:
    """Group keys the next generation may keep: no member is replaced, and every member reports
    the group with all its posted ops completed and the same number posted. After an abort the
    members of a healthy group may have left it at different ops (one posted an all-reduce the
    others never reached); such a group is out of step and must be rebuilt."""
    keep = []
    for key, ranks in sorted(members.items()):
        if key.startswith(("repl", "xfer")) or replaced & set(ranks):
            continue
        seen = [counts.get(r, {}).get(key) for r in ranks]
        if all(c is not None and c[0] == c[1] == seen[0][0] for c in seen):
            keep.append(key)
    return keep


def layout_group_keys(cfg: dict, layout: dict) -> list[str]:
    """``keepable_keys`` of the configured job ``cfg`` at a plan's ``layout`` (``Plan.layout``:
    an in-place elastic width; empty at the configured one)."""
    c = layout_cfg(cfg, layout)
    return keepable_keys(ParallelDims.from_config(c["parallel"]), c["ft"]["buddy_policy"])


def keepable_keys(dims: ParallelDims, buddy_policy: str) -> list[str]:
    """The keys of the groups a recovery can keep (``reusable_groups`` never keeps replication
    or transfer groups): what a plan's ``keep_groups`` is a subset of, on the wire
    (``deadpool.store.wire``), so coordinator and readers must compute the same."""
    return sorted(keepable_groups(dims, buddy_policy))


@functools.lru_cache(maxsize=4)
def keepable_groups(dims: ParallelDims, buddy_policy: str) -> Mapping[str, tuple[int, ...]]:
    """``all_groups`` less the replication and transfer groups (which no recovery keeps), key
    -> ranks, read-only: made once per layout (the coordinator asks at every recovery; at 16,384
    ranks making it cost ~0.2 s of detection -> plan)."""
    return MappingProxyType({k: tuple(v) for k, v in all_groups(dims, buddy_policy).items()
                             if not k.startswith(("repl", "xfer"))})
