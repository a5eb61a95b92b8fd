"""The global gradient norm over every axis (dp, tp, pp) and clipping by it, with no group that
spans all ranks.

After ``ZeroOptimizer.reduce_grads`` each rank holds the averaged gradient of its ZeRO shard of
its (pp, tp) slice of the model. The squared norm of the whole model's gradient is the sum over
ranks of each shard's sum of squares, with one care: a parameter every tensor-parallel rank holds
whole (the RMSNorm weights, ``tensor.layers.tp_replicated``) has the same gradient on each of
them and is counted on tp rank 0 only (``runs`` leaves it out elsewhere). The sum travels:

  1. all-reduce over "dp": the squares of this (pp, tp) slice (its shards tile it);
  2. all-reduce over "tp": the stage's;
  3. along the pipeline: stage 0 sends its sum to stage 1, which adds its own and passes it on;
     the last stage then holds the total and sends it back, stage by stage. 2 (pp - 1) hops of
     one scalar over the 2-rank pipeline groups the schedule already uses. A pp-wide group
     would be one more group per (dp, tp) to rebuild on every recovery, and a world group would
     be rebuilt by every recovery and span every rank; a chain of scalars costs microseconds
     next to a step.

Every rank ends with the same bits: a group's all-reduce gives all its members one result, the
pipeline's total is computed once on the last stage and sent back, and every (dp, tp) chain adds
identical stage sums in the same order. So every rank takes the same decision on a non-finite
norm (the trainer skips the step). Every op is waited with ``comm.wait``: abortable like the
rest of the step. Sums are accumulated in float64.

``global_max`` takes the same route with max for sum: the job-wide maximum of one number per
rank (the disk-checkpoint interval every rank adopts, ``Trainer._decide_interval``), with no store
request and no O(ranks) read on any rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from deadpool.parallel.pipeline.schedule import host_scalar

__all__ = ["global_grad_norm", "global_max", "clip_"]


def _chain(total: torch.Tensor, comm, combine=torch.add) -> torch.Tensor:
    """Sum (``combine``) ``total`` along this rank's pipeline (first to last stage) and hand the
    result back to every stage."""
    me = comm.topo.rank
    has = comm.has
    if has("pp_recv_fwd"):  # not the first stage: add what the stages before sent
        got = torch.empty_like(total)
        src = next(r for r in comm.group_ranks["pp_recv_fwd"] if r != me)
        comm.wait(comm.broadcast_async(got, "pp_recv_fwd", src))
        total = combine(got, total)
    if has("pp_send_fwd"):  # not the last stage: pass it on, then receive the result back
        comm.wait(comm.broadcast_async(total, "pp_send_fwd", me))
        src = next(r for r in comm.group_ranks["pp_recv_bwd"] if r != me)
        comm.wait(comm.broadcast_async(total, "pp_recv_bwd", src))
    if has("pp_send_bwd"):
        comm.wait(comm.broadcast_async(total, "pp_send_bwd", me))
    return total


def global_grad_norm(grad_shard: torch.Tensor, runs: list[tuple[int, int]], comm) -> float:
    """The L2 norm of the whole model's gradient: ``runs`` are the ranges of ``grad_shard``
    this rank counts (``ZeroOptimizer.owned_runs``). Must be called by every rank of the job at
    the same point of the step (after ``reduce_grads``). Abortable."""
    sq = torch.zeros((), dtype=torch.float64, device=grad_shard.device)
    for a, b in runs:
        sq += torch.linalg.vector_norm(grad_shard[a:b].float(), dtype=torch.float32).double() ** 2
    if comm is not None:
        for axis in ("dp", "tp"):
            if comm.has(axis):
                comm.allreduce(sq, axis)
        sq = _chain(sq, comm)
        comm.sync()  # NCCL: the collectives above were queued on the stream (abortable wait)
    return host_scalar(sq) ** 0.5


def global_max(value: float, comm, device="cpu") -> float:
    """The largest ``value`` any rank of the job passed (every rank must call this at the same
    point; exact for integers below 2**53). Abortable."""
    t = torch.tensor(float(value), dtype=torch.float64, device=device)
    for axis in ("dp", "tp"):
        if comm.has(axis):
            comm.allreduce(t, axis, op=dist.ReduceOp.MAX)
    t = _chain(t, comm, torch.maximum)
    comm.sync()
    return host_scalar(t)


def clip_(grad_shard: torch.Tensor, max_norm: float, norm: float) -> float:
    """Scale ``grad_shard`` in place so that the global norm ``norm`` becomes at most
    ``max_norm`` (``torch.nn.utils.clip_grad_norm_``'s rule, epsilon included). Returns the
    factor (1.0: untouched, also for a non-finite norm: the caller decides about that step)."""
    if not math.isfinite(norm):
        return 1.0
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        grad_shard.mul_(coef)
        return coef
    return 1.0
