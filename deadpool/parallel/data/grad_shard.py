"""ZeRO-2: gradients reduce-scattered per bucket as backward produces them, and kept sharded.

Under ZeRO-1 (``zero.py``) every rank keeps the full gradient buffer (``flat_grads``, and under bf16
with fp32 reduction the full fp32 ``main_grads`` too) until the step's last micro-batch has been
reduced: ``(2 + 4)`` bytes per parameter of gradients for ``12 / dp`` of optimizer state. Under
ZeRO-2 (``parallel.zero=2``, DeepSpeed's stage 2) a rank keeps only its own shard of the reduced
gradient (fp32, ``shard_numel`` elements: ``4 / dp`` bytes per parameter) plus the buckets in flight:

  - autograd writes each parameter's gradient as a fresh tensor (``p.grad`` is None between
    micro-batches); its post-accumulate-grad hook adds it, cast to the reduction dtype, into the
    staging buffer of each bucket it overlaps, and drops it (``p.grad = None``);
  - a bucket whose parameters have all landed since it was last posted is posted at once, in
    bucket order (bucket 0, the buffer's tail, is what backward produces first), every
    micro-batch: a ``reduce`` to the owner on NCCL, the all-to-all into the owner's inbox on gloo
    (``zero.py``, Collectives: the same ops, hence the same per-bucket sums, as ZeRO-1); with
    ``reduce_scatter`` on NCCL a bucket outside shard 0 stays staged until its group's shard-0
    bucket posts the group's reduce-scatter (``reduce_scatter.py``: staging memory grows);
  - at most ``max_in_flight`` buckets are posted and not yet waited: posting one more first waits
    for the oldest (``comm.wait``: an abort raises ``Aborted`` out of backward) and adds its sum
    into the owner's shard (a copy the first time in the step), then frees its buffers.

Bits. With one micro-batch per rank per step the sums are ZeRO-1's exactly (the same staging
values, the same collective, the same rank-order sum); with ``m`` micro-batches ZeRO-1 sums each
rank's ``m`` gradients first and then the ranks (``sum_r sum_m``), ZeRO-2 the ranks of each
micro-batch and then the micro-batches (``sum_m sum_r``), in fp32: equal to rounding, not bitwise
(``tests/deadpool/parallel/test_zero2.py`` states the tolerance). A run is still bitwise
reproducible, which is what recovery needs.

Every rank of a data-parallel group runs the same graph, so the posting sequence (round after
round of buckets in order) is the same on every rank. A bucket holding a parameter the forward
did not read never becomes ready: it and the buckets after it wait for ``finish``, which posts
the rest of the round, and one more full round if anything landed since (deterministic, since
identical graphs land identical sets). Gradients written outside autograd (tests) are read from
``p.grad`` by ``finish`` when the step was never armed.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from deadpool.parallel.data.reduce_scatter import post_group

__all__ = ["ShardedGrads"]


class ShardedGrads:
    """This rank's shard of the data-parallel gradient, reduced bucket by bucket during backward.

    ``params`` are the optimizer's parameters at ``offsets`` of a flat buffer of ``padded_numel``
    elements cut into ``dp_size`` shards of ``shard_numel``; ``edges`` the buckets (``bucket_edges``,
    each inside one shard). ``shard`` (fp32) holds the summed gradient of the owned shard after
    ``finish``; nothing else outlives a step.
    """

    def __init__(self, params: list[torch.nn.Parameter], offsets: list[int], *, shard_numel: int,
                 dp_size: int, dp_rank: int, edges: list[tuple[int, int]],
                 reduce_dtype: torch.dtype, max_in_flight: int = 2, reduce_scatter: bool = False):
        self.params, self.edges = params, edges
        # NCCL: aligned edges (``aligned_edges``), one reduce-scatter per group of dp buckets
        self.reduce_scatter, self._per_shard = reduce_scatter, len(edges) // dp_size
        self.shard_numel, self.dp_size, self.dp_rank = shard_numel, dp_size, dp_rank
        self.reduce_dtype, self.max_in_flight = reduce_dtype, max(1, int(max_in_flight))
        device = params[0].device
        self.shard = torch.zeros(shard_numel, dtype=torch.float32, device=device)
        # per parameter: (bucket, param lo, param hi, bucket lo, bucket hi) of each overlap
        self.pieces: list[list[tuple[int, int, int, int, int]]] = []
        self.size = [0] * len(edges)
        for p, off in zip(params, offsets):
            mine = []
            for b, (lo, hi) in enumerate(edges):
                a, z = max(lo, off), min(hi, off + p.numel())
                if a < z:
                    mine.append((b, a - off, z - off, a - lo, z - lo))
                    self.size[b] += 1
            self.pieces.append(mine)
        self.index = {id(p): i for i, p in enumerate(params)}
        self._nothing = torch.empty(0, dtype=reduce_dtype, device=device)
        self.posted = 0  # buckets posted this step (diagnostics, tests)
        # bytes of staging buffers and inboxes alive now, and their peak (the memory estimator's
        # in-flight term is checked against it: ``deadpool.launch.memory_tables.measure``)
        self.live_bytes = self.peak_bytes = 0
        self._pg = self._comm = None
        self.reset()
        for p in params:
            p.grad = None
            p.register_post_accumulate_grad_hook(self._on_grad)

    def reset(self) -> None:
        """Forget the step: staged and in-flight buckets (an aborted generation's works are
        abandoned, see ``zero.py``), the shard's contents, any gradient autograd left behind."""
        self._staging: list[torch.Tensor | None] = [None] * len(self.edges)
        self._seen: list[set[int]] = [set() for _ in self.edges]
        self._written = [False] * len(self.edges)
        self._in_flight: deque = deque()
        self._deferred: dict[int, torch.Tensor] = {}  # staged pieces of groups not yet posted
        self.live_bytes = 0
        self._next = 0
        self.posted = 0
        self.shard.zero_()
        for p in self.params:
            p.grad = None

    def arm(self, comm, pg) -> None:
        """Reduce over ``pg`` (the communicator's dp group) from the hooks until ``finish``."""
        self.reset()
        self._comm, self._pg = comm, pg

    # -- backward --------------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        if self._pg is None:
            return  # not armed: the gradient stays in p.grad for ``finish``
        self._take(self.index[id(p)], p)

    def _take(self, i: int, p: torch.Tensor) -> None:
        g = p.grad.reshape(-1)
        for b, a, z, sa, sz in self.pieces[i]:
            st = self._staging[b]
            if st is None:
                lo, hi = self.edges[b]
                st = self._staging[b] = torch.zeros(hi - lo, dtype=self.reduce_dtype,
                                                    device=g.device)
                self._count(st)
            st[sa:sz].add_(g[a:z])
            self._seen[b].add(i)
            self._post_ready()
        p.grad = None

    def _ready(self, b: int) -> bool:
        return len(self._seen[b]) == self.size[b]

    def _post_ready(self) -> None:
        start = self._next
        while self._ready(self._next):
            self._post(self._next)
            if self._next == start:  # a whole round of buckets with no parameter (padding)
                break

    def _post(self, b: int) -> None:
        lo, hi = self.edges[b]
        n = hi - lo
        st = self._staging[b]
        if st is None:
            st = torch.zeros(n, dtype=self.reduce_dtype, device=self.shard.device)
            self._count(st)
        self._staging[b], self._seen[b] = None, set()
        self._next = (b + 1) % len(self.edges)
        owner, pg = lo // self.shard_numel, self._pg
        group = self.reduce_scatter and self._comm.backend != "gloo"
        if group and owner > 0:  # posted with its group's shard-0 bucket, which comes later
            self._deferred[b] = st
            self.posted += 1
            return
        while len(self._in_flight) >= self.max_in_flight:
            self._retire()
        inbox = None
        if group:  # every rank receives its own bucket's sum: the shard's same offset
            pieces = [st] + [self._deferred.pop(b - r * self._per_shard)
                             for r in range(1, self.dp_size)]
            inbox = pieces[self.dp_rank]  # summed into in place
            work = post_group(pg, pieces, inbox)
            self._in_flight.append((b, pieces, inbox, work))
            self.posted += 1
            return
        if self._comm.backend == "gloo":  # the owner receives every rank's copy (zero.py)
            if owner == self.dp_rank:
                inbox, out_splits = st.new_empty(self.dp_size * n), [n] * self.dp_size
                self._count(inbox)
            else:
                out_splits = [0] * self.dp_size
            in_splits = [n if r == owner else 0 for r in range(self.dp_size)]
            work = pg.alltoall_base(self._nothing if inbox is None else inbox, st, out_splits,
                                    in_splits, dist.AllToAllOptions())
        else:
            opts = dist.ReduceOptions()
            opts.reduceOp, opts.rootRank = dist.ReduceOp.SUM, owner
            work = pg.reduce([st], opts)
        self._in_flight.append((b, st, inbox, work))
        self.posted += 1

    def _retire(self) -> None:
        """Wait for the oldest bucket in flight and add it into the shard if this rank owns it."""
        b, st, inbox, work = self._in_flight.popleft()
        self._comm.wait(work)
        lo, hi = self.edges[b]
        if isinstance(st, list):  # a group's reduce-scatter: ``inbox`` holds this rank's sum
            for t in st:
                self._count(t, -1)
            total, own = inbox, 0  # shard 0's bucket: the offset inside every shard
        else:
            self._count(st, -1)
            if inbox is not None:
                self._count(inbox, -1)
            if lo // self.shard_numel != self.dp_rank:
                return
            total = st if inbox is None else torch.sum(inbox.view(self.dp_size, hi - lo), 0)
            own = self.dp_rank * self.shard_numel
        dst = self.shard[lo - own:hi - own]
        if self._written[b]:
            dst.add_(total)
        else:
            dst.copy_(total)
            self._written[b] = True

    def _count(self, t: torch.Tensor, sign: int = 1) -> None:
        self.live_bytes += sign * t.numel() * t.element_size()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    # -- the end of the step ---------------------------------------------------------------------
    def finish(self, comm, pg, on_posted=None) -> None:
        """Post what backward has not (the rest of the round, then a full round if anything
        landed since; everything from ``p.grad`` when never armed), wait for every bucket,
        leave the summed gradient in ``shard``. ``on_posted()`` runs once all are posted."""
        if self._pg is None:  # gradients written outside autograd (zero_grad reset the rest)
            self._comm, self._pg = comm, pg
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    self._take(i, p)
        while self._next != 0:
            self._post(self._next)
        if any(self._seen) or any(st is not None for st in self._staging):
            for b in range(len(self.edges)):
                self._post(b)
        if on_posted is not None:
            on_posted()
        while self._in_flight:
            self._retire()
        self._pg = self._comm = None
