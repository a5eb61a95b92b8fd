"""The data-parallel gradient step as one reduce-scatter per bucket group (NCCL), and the gloo
all-to-all it replaces there; the choice between them (``parallel.grad_reduce``).

Per bucket (``zero.py``, Collectives) every bucket lies inside one owner's shard and is summed to
that owner: a ``reduce`` on NCCL, an all-to-all into the owner's inbox on gloo. With
``reduce_scatter`` the buckets are cut the same way in every shard (``aligned_edges``): the
``dp`` buckets at the same offset of each shard form a group, and the group is one
``reduce_scatter`` whose ``r``-th input is shard ``r``'s bucket, so every rank receives the sum
of its own bucket in one collective: ``dp`` times fewer collectives than per-bucket reduces
(at 8B over a 496-rank ring, ~1,200 reduces a step become ~1,200 / dp reduce-scatters).

Only on NCCL. gloo's ``reduce_scatter`` (torch 2.13) is emulated by all-reduces and its work's
``wait(timeout)`` ignores the timeout, so a rank waiting on a dead peer cannot be released by an
abort (``tests/deadpool/parallel/test_zero.py`` watches for a fix); NCCL's is a native kernel that
``abort()`` ends (the op completes with junk, which recovery never trusts). On gloo the aligned
buckets are still reduced one by one.

When a group is posted. Backward produces the flat buffer from its end, i.e. shard ``dp - 1``
first and shard 0 last; a group needs its piece of every shard, so it is posted with its shard-0
piece, in the last ``1 / dp`` of backward (the earlier pieces wait, staged). That is the cost of
keeping each rank's shard one contiguous range (what snapshots, ``reshard_state`` and recovery's
rebuild from replicas rely on): Megatron's layout, each bucket split over all ranks, would post
every group as soon as it is written but changes the shard layout. Left to build. Under ZeRO-2
the staged pieces are memory ZeRO-2 exists to save (up to ``(dp - 1) / dp`` of a gradient in
the reduction dtype): ``auto`` keeps per-bucket reduces for ZeRO-2, ``reduce_scatter`` forces it.

Bits. The reduced values are sums over ranks of the same per-rank buckets as the reduce path;
for two ranks any order gives the same bits (a + b == b + a), beyond that NCCL's ring order is
its own (equal to fp32 rounding; deterministic run to run for a fixed NCCL configuration, which
is what recovery needs). The CPU stand-in (``tests/deadpool/fake_nccl.py``) sums in rank order,
as the gloo path does, so there it is bitwise equal to gloo's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deadpool.parallel.data.buckets import bucket_edges

__all__ = ["GRAD_REDUCE", "aligned_edges", "group_poster", "post_group", "send_to_owner",
           "use_reduce_scatter"]

GRAD_REDUCE = ("auto", "reduce", "reduce_scatter")


def use_reduce_scatter(setting: str | None, backend: str | None, device: str, zero: int) -> bool:
    """``parallel.grad_reduce`` for a job on ``backend`` (the config's: ``auto`` is NCCL on
    CUDA, as ``comm.resolve_backend``) at ZeRO stage ``zero``: ``auto`` is reduce-scatter on
    NCCL under ZeRO-1 (ZeRO-2 keeps per-bucket reduces: module docstring); ``reduce_scatter``
    asks for it on NCCL whatever the stage; gloo never (not abortable). A communicator of
    another backend than the config's falls back to per-bucket reduces, correct either way."""
    setting = setting or "auto"
    if setting not in GRAD_REDUCE:
        raise ValueError(f"parallel.grad_reduce must be one of {GRAD_REDUCE}, got {setting!r}")
    if backend in (None, "auto"):
        backend = "nccl" if str(device).startswith("cuda") else "gloo"
    if backend != "nccl" or setting == "reduce" or not zero:
        return False
    return setting == "reduce_scatter" or int(zero) == 1


def aligned_edges(shard_numel: int, dp_size: int, itemsize: int, bucket_bytes: int,
                  first_bucket_bytes: int) -> list[tuple[int, int]]:
    """``bucket_edges`` cut inside one shard and repeated in every shard, in backward order
    (shard ``dp - 1``'s buckets first): bucket ``k`` of shard ``r`` is at index
    ``(dp - 1 - r) * K + k``, at the same offset of its shard for every ``r``."""
    rel = bucket_edges(shard_numel, itemsize, bucket_bytes, first_bucket_bytes, [])
    return [(r * shard_numel + a, r * shard_numel + b)
            for r in reversed(range(dp_size)) for a, b in rel]


def post_group(pg, pieces: list[torch.Tensor], out: torch.Tensor):
    """One reduce-scatter: ``out`` (this rank's) receives the sum over ranks of ``pieces[rank]``.
    ``out`` may be ``pieces[rank]`` itself: NCCL copies the input list into one flat buffer on
    its stream before the kernel runs."""
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    return pg.reduce_scatter([out], [pieces], opts)


def group_poster(buf: torch.Tensor, shard_numel: int, dp_size: int, dp_rank: int, pg):
    """ZeRO-1's poster for ``GradBuckets`` over aligned edges: a bucket of shard 0 posts its
    group's reduce-scatter (in place: this rank's bucket receives the sum); a bucket of another
    shard posts nothing (None: its group goes with shard 0's bucket, posted after it)."""
    s = shard_numel

    def post(lo: int, hi: int):
        if lo >= s:
            return None
        pieces = [buf[r * s + lo:r * s + hi] for r in range(dp_size)]
        return post_group(pg, pieces, pieces[dp_rank])
    return post


def send_to_owner(pg, view: torch.Tensor, owner: int, dp_size: int, dp_rank: int,
                  inbox, nothing: torch.Tensor):
    """gloo: post the uneven all-to-all that puts every rank's ``view`` into ``owner``'s
    ``inbox`` (``dp`` x the bucket; the owner sums it in rank order once waited)."""
    n = view.numel()
    if owner == dp_rank:
        out, out_splits = inbox, [n] * dp_size
    else:
        out, out_splits = nothing, [0] * dp_size
    in_splits = [n if r == owner else 0 for r in range(dp_size)]
    return pg.alltoall_base(out, view, out_splits, in_splits, dist.AllToAllOptions())
