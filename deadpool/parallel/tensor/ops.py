"""Autograd functions for the tensor-parallel (TP) group's communication.

Megatron's two conjugate operators mark where activations enter and leave a TP region:

  copy_to_tp      identity forward, all-reduce backward: the input of column-parallel layers.
                  Every rank computes with the full (replicated) activation but only its slice of
                  the output, so the input gradient is a partial sum over the ranks.
  reduce_from_tp  all-reduce forward, identity backward: the output of a row-parallel layer (each
                  rank holds a partial sum) becomes the full activation, replicated on all ranks.

With these two per block (attention and MLP) a transformer layer costs two all-reduces forward
and two backward. ``vocab_parallel_cross_entropy`` computes the loss from logits split over the
vocabulary without ever gathering them (vocabulary x tokens is the largest activation), and in
chunks of tokens (``CE_CHUNK_BYTES`` of fp32 logits at a time) once the logits exceed one chunk:
no fp32 copy, softmax or log-softmax of the whole ``(tokens, vocab)`` is ever held.

The communicator is an argument of every call (recovery replaces it); a Function keeps it in
``ctx`` only for its own backward. Without a "tp" group (tp == 1, or ``comm is None``) every op
is the identity, so the same layers run unsharded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.distributed as dist


def tp_size(comm) -> int:
    return len(comm.group_ranks["tp"]) if comm is not None and comm.has("tp") else 1


def _allreduce(t: torch.Tensor, comm, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if tp_size(comm) > 1:
        comm.allreduce(t, "tp", op=op)
    return t


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _allreduce(grad.contiguous().clone(), ctx.comm), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return _allreduce(x.contiguous().clone(), comm)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, comm) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient over "tp" backward."""
    return _CopyToTP.apply(x, comm) if tp_size(comm) > 1 else x


def reduce_from_tp(x: torch.Tensor, comm) -> torch.Tensor:
    """All-reduce (sum) over "tp" forward, identity backward."""
    return _ReduceFromTP.apply(x, comm) if tp_size(comm) > 1 else x


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, comm):
        # logits: (n, v_local), this rank's vocabulary slice [vocab_start, vocab_start + v_local)
        logits = logits.float()
        v_local = logits.shape[-1]
        # 1. global max for a stable softmax
        max_logit = _allreduce(logits.max(dim=-1).values, comm, dist.ReduceOp.MAX)
        shifted = logits - max_logit.unsqueeze(-1)
        # 2. targets owned by this rank; others contribute 0 to the target logit
        local = targets - vocab_start
        owned = (local >= 0) & (local < v_local)
        local = local.clamp(0, v_local - 1)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * owned
        exp = shifted.exp()
        # 3. sum of exponentials and the target logit in one all-reduce
        stats = _allreduce(torch.stack((exp.sum(dim=-1), target_logit)), comm)
        sum_exp, target_logit = stats[0], stats[1]
        exp.div_(sum_exp.unsqueeze(-1))  # softmax over the local slice, kept for backward
        ctx.save_for_backward(exp, local, owned)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        # d loss_i / d logit_ij = softmax_ij - [j == target_i], on this rank's columns only
        softmax, local, owned = ctx.saved_tensors
        g = softmax
        g.scatter_add_(-1, local.unsqueeze(-1), -owned.to(g.dtype).unsqueeze(-1))
        g.mul_(grad.unsqueeze(-1))
        return g, None, None, None


CE_CHUNK_BYTES = 64 * 2**20  # fp32 logits of one token chunk (chunked cross-entropy)


def ce_chunk_rows(v_local: int, chunk_bytes: int = CE_CHUNK_BYTES) -> int:
    """Tokens per chunk: as many rows of ``v_local`` fp32 logits as fit in ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * v_local))


class _ChunkedCE(torch.autograd.Function):
    """The cross-entropy of ``_VocabParallelCE`` over chunks of ``rows`` tokens: each chunk is
    cast to fp32, reduced (max, then sum-exp and target logit: the same two all-reduces per
    chunk, every rank of the group issuing them in the same order) and dropped; only the
    per-token log-sum-exp is kept. Backward recomputes each chunk's softmax from the logits (the
    input, kept in their own dtype) and writes its gradient in that dtype. The chunk order is
    fixed, so the result is bitwise the same run to run; against the unchunked kernels it
    differs in rounding only (softmax as ``exp(x - lse)`` rather than ``exp(x - max) / sum``)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, comm, rows):
        n, v_local = logits.shape
        local = targets - vocab_start
        owned = (local >= 0) & (local < v_local)
        local = local.clamp(0, v_local - 1)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        loss = torch.empty_like(lse)
        for s in range(0, n, rows):
            c = logits[s:s + rows]  # cast per chunk (a copy: the input is never written)
            max_logit = _allreduce(c.max(dim=-1).values.float(), comm, dist.ReduceOp.MAX)
            c = c.float() - max_logit.unsqueeze(-1)
            target = c.gather(-1, local[s:s + rows].unsqueeze(-1)).squeeze(-1) * owned[s:s + rows]
            stats = _allreduce(torch.stack((c.exp_().sum(dim=-1), target)), comm)
            log_sum = stats[0].log()
            loss[s:s + rows] = log_sum - stats[1]
            lse[s:s + rows] = log_sum + max_logit
        ctx.rows = rows
        ctx.save_for_backward(logits, local, owned, lse)
        return loss

    @staticmethod
    def backward(ctx, grad):
        logits, local, owned, lse = ctx.saved_tensors
        out, rows = torch.empty_like(logits), ctx.rows
        for s in range(0, logits.shape[0], rows):
            g = (logits[s:s + rows].float() - lse[s:s + rows].unsqueeze(-1)).exp_()
            g.scatter_add_(-1, local[s:s + rows].unsqueeze(-1),
                           -owned[s:s + rows].to(g.dtype).unsqueeze(-1))
            out[s:s + rows] = g.mul_(grad[s:s + rows].unsqueeze(-1))
        return out, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 comm, chunk_rows: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy ``(n,)`` from logits ``(n, v_local)`` split over the vocabulary.

    Three reductions over "tp" (max; then sum-exp and target logit together in one all-reduce)
    instead of gathering ``(n, vocab)`` logits. The backward needs no communication: the
    gradient of the local slice is ``softmax - one_hot(target)`` restricted to that slice. The
    saved softmax is reused in place as the gradient (backward runs once). No ignore index.

    More tokens than ``chunk_rows`` (default ``ce_chunk_rows(v_local)``, 64 MiB of fp32 logits):
    ``_ChunkedCE``, at any tp, whose fp32 working set is one chunk. At most one chunk: the
    unchunked kernels (bitwise as before: the test model's micro-batches are one chunk).
    """
    rows = chunk_rows or ce_chunk_rows(logits.shape[-1])
    if logits.shape[0] > rows:
        return _ChunkedCE.apply(logits, targets, vocab_start, comm, rows)
    if tp_size(comm) == 1:  # the whole vocabulary is here: torch's fused kernel
        return F.cross_entropy(logits.float(), targets, reduction="none")
    return _VocabParallelCE.apply(logits, targets, vocab_start, comm)
