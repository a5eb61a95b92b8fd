"""Gradient buckets reduced from backward hooks, so data-parallel communication overlaps backward.

The gradients of a rank live in one flat buffer (``zero.py``). It is cut into buckets from the end
backwards, because backward produces the last layers' gradients first: bucket 0 is the tail of the
buffer, and is small (``first_bucket_bytes``, 1 MB like torch DDP) so the first reduction starts
early; the others are ``bucket_bytes`` (25 MB, DDP's default). On a sharded optimizer buckets are
also cut at shard boundaries, so each bucket belongs to exactly one data-parallel rank.

Every parameter gets a post-accumulate-grad hook. ``arm(m)`` (before the micro-batches of a step)
sets each parameter to expect ``m`` accumulations; when a parameter's last one lands, the buckets
it overlaps lose one pending parameter, and every bucket with none left is posted, always in
bucket order (so every rank of the group posts the same ops in the same order, whatever order
autograd runs hooks in). ``finish`` posts what is left (buckets of unused parameters, padding, or
everything when the gradients were written without autograd) and waits for all of them through
``comm.wait``: polled, so an abort of the generation releases the rank within one poll slice.

Unlike torch DDP this is no ``nn.Module`` wrapper and keeps no process group: the group is the one
of the communicator given to ``arm``, replaced by recovery. Gradient buffers are views of the flat
buffer, so nothing is copied into or out of buckets.
"""

from __future__ import annotations

import torch

__all__ = ["GradBuckets", "bucket_edges"]


def bucket_edges(numel: int, itemsize: int, bucket_bytes: int, first_bucket_bytes: int,
                 cuts: list[int]) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]`` element ranges covering ``[0, numel)`` from the end backwards: the first
    at most ``first_bucket_bytes``, the rest at most ``bucket_bytes``, none crossing a ``cuts``
    offset. At least one element each."""
    cuts = sorted({c for c in cuts if 0 < c < numel})
    out, hi, size = [], numel, max(1, first_bucket_bytes // itemsize)
    while hi > 0:
        lo = max(0, hi - size)
        lo = max([lo] + [c for c in cuts if c < hi])
        out.append((lo, hi))
        hi, size = lo, max(1, bucket_bytes // itemsize)
    return out


class GradBuckets:
    """Posts one reduction per bucket of ``flat_grads`` as soon as backward has finished writing it.

    ``post(lo, hi)`` must start an asynchronous reduction of ``flat_grads[lo:hi]`` and return its
    work; it runs inside backward (autograd's thread). ``params`` are views of ``flat_grads``'s
    buffer at ``offsets``.
    """

    def __init__(self, params: list[torch.nn.Parameter], offsets: list[int], numel: int,
                 edges: list[tuple[int, int]]):
        self.edges = edges
        self.members: list[list[int]] = []  # per parameter: the buckets it overlaps
        self.size = [0] * len(edges)        # per bucket: how many parameters overlap it
        for p, off in zip(params, offsets):
            lo, hi = off, off + p.numel()
            mine = [b for b, (a, z) in enumerate(edges) if a < hi and lo < z]
            self.members.append(mine)
            for b in mine:
                self.size[b] += 1
        self.index = {id(p): i for i, p in enumerate(params)}
        self.post = None
        self.works: list = []
        self.posted_in_backward = 0  # buckets posted from hooks in the current step (diagnostics)
        self._remaining: list[int] = []
        self._pending: list[int] = []
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self, post, num_microbatches: int) -> None:
        """Expect ``num_microbatches`` backward passes; post each bucket after the last one."""
        self.post = post
        self.works = []
        self.posted_in_backward = 0
        self._remaining = [num_microbatches] * len(self.members)
        self._pending = list(self.size)
        self._post_ready()  # buckets of padding only

    def _on_grad(self, p: torch.Tensor) -> None:
        if self.post is None:
            return
        i = self.index[id(p)]
        self._remaining[i] -= 1
        if self._remaining[i] == 0:
            for b in self.members[i]:
                self._pending[b] -= 1
            n = len(self.works)
            self._post_ready()
            self.posted_in_backward += len(self.works) - n

    def _post_ready(self) -> None:
        while len(self.works) < len(self.edges) and self._pending[len(self.works)] == 0:
            self.works.append(self.post(*self.edges[len(self.works)]))

    def finish(self, post, wait) -> None:
        """Post every bucket not yet posted (in order), then ``wait`` for each work; disarms.
        A ``post`` may return None: nothing of its own to wait for (a bucket whose group is
        reduce-scattered with a later bucket, ``reduce_scatter.py``)."""
        if self.post is None:  # never armed this step: post everything now
            self.post, self.works = post, []
        while len(self.works) < len(self.edges):
            self.works.append(self.post(*self.edges[len(self.works)]))
        works, self.works, self.post = self.works, [], None
        for w in works:
            if w is not None:
                wait(w)
