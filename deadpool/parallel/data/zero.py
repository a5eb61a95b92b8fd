"""ZeRO-1 (and ZeRO-2): AdamW state sharded across the data-parallel group.

Layout. All parameters of the rank (its pipeline stage's tensor-parallel shard) live in one flat
fp32 buffer ``flat_params``, zero-padded to a multiple of ``dp_size`` so it splits into
``dp_size`` equal shards; each ``nn.Parameter`` becomes a view of its slice, and its ``.grad`` a
view of the same slice of one flat ``flat_grads`` buffer. Both buffers are allocated once, so
autograd accumulates micro-batch gradients straight into ``flat_grads`` and the collectives run
on one contiguous tensor with no packing. Data-parallel rank ``r`` owns shard ``r``: it keeps
AdamW's ``exp_avg``/``exp_avg_sq`` only for that slice (1/dp of the optimizer memory).
ZeRO-2 (``shard_grads``, ``parallel.zero=2``) keeps no ``flat_grads``: ``grad_shard.py``.

A step:
  0. ``begin_step(comm, m)``: zero ``flat_grads`` and arm the gradient buckets (``buckets.py``):
     during the ``m`` micro-batches' backward, each bucket of ``flat_grads`` is reduced (sum)
     over dp as soon as autograd has written it, overlapping communication with backward.
  1. ``reduce_grads``: post what is left, wait for every bucket, divide this rank's shard by dp
     (gloo has no AVG). On a sharded optimizer each bucket lies inside one rank's shard and is
     reduced to that rank (see Collectives).
  2. ``step``: torch's ``AdamW`` (``fused`` by default: one pass over memory, 7x faster than the
     per-op loop on a CPU core) over a single flat parameter, the owned shard of
     ``flat_params``, whose ``.grad`` is the reduced gradient shard. Reusing torch's optimizer
     gives exactly its math: per element, the for-loop and foreach kernels do not care how
     elements are grouped into tensors (``test_zero.py`` checks it bitwise); the fused CPU
     kernel rounds its vector body and scalar tail differently, so it matches a per-tensor
     reference to rounding, and itself bitwise run to run (what recovery needs); then all-gather the updated shards in place
     into ``flat_params``, so every rank again holds identical full parameters (or only post
     the gather: see Overlapped parameter all-gather).
Mixed precision (``precision=bf16``). The parameters (hence ``flat_params``, autograd's
gradients and the activations) are bf16; AdamW updates an fp32 copy of the owned shard (the
*master* weights; the whole buffer when not sharded) and keeps fp32 moments, and the updated
master shard is rounded into the owned slice of ``flat_params`` before the all-gather
(Megatron's distributed optimizer). Gradients are accumulated over micro-batches and reduced
over dp in fp32 by default (``grad_reduce_dtype``): a post-accumulate-grad hook folds each
micro-batch's bf16 gradient into the fp32 ``main_grads`` buffer, which the buckets reduce; a
bf16 sum over many ranks and micro-batches keeps only 8 bits of mantissa. With bf16 reduction
``flat_grads`` itself is reduced and the owned shard cast to fp32 for AdamW.

Weight decay. ``decays(p)`` picks the decayed parameters; since AdamW's decoupled decay is a
separate multiply before the update, it is applied to the decayed runs of the owned shard and
the single AdamW runs without decay (see ``__init__``).

With ``shard=False`` (plain data parallelism) every rank all-reduces the full gradient and keeps
the full AdamW state; nothing is gathered. Padding elements have zero grads, so AdamW leaves
them at zero.

Collectives. On a sharded optimizer each bucket is summed on the rank whose shard holds it
(together the buckets are a reduce-scatter, split so it can start during backward); the
parameters are all-gathered with ``_allgather_base`` in place (its input is the caller's own
chunk of the output), so no staging buffers are needed. How a bucket reaches its owner:

  nccl  ``reduce`` to the owner; with ``reduce_scatter`` (``parallel.grad_reduce``) one
        reduce-scatter per group of aligned buckets instead (``reduce_scatter.py``).
  gloo  an uneven all-to-all in which only the owner receives: every rank's copy of the bucket
        lands in the owner's inbox (``dp`` x the bucket, one buffer per owned bucket: together
        one more copy of the reduction buffer), which the owner sums in rank order after the
        wait (``reduce_grads``). gloo's ``reduce`` of the buckets alone cost as much as DDP's
        whole all-reduce; with the all-to-all, gradient sync plus parameter all-gather against
        DDP's all-reduce, 4 ranks on 2 cores, 4.7 MB: 1.22x wall, 1.13x CPU, where ``reduce``
        gave 1.77x and 1.69x (``experiments/bench_grad_sync.py``).

Why not ``reduce_scatter`` on gloo: its wait ignores the timeout, so it cannot be polled
(``reduce_scatter.py``), while gloo's ``reduce``, all-to-all and all-gather poll fine
(``test_zero.py``). Every posted op is waited with ``comm.wait`` so a declared failure releases
the survivors within one poll interval.

After an abort the op is abandoned, not cancelled (see ``deadpool.rank.comm``). On NCCL, parking the
communicator aborts it. On gloo an abandoned op can in principle still complete later (only if
every peer of the group posts it) and write its output (an owned bucket's inbox, or
``flat_params``); recovery must not rely on those buffers until the old generation's ops are
done or its peers are known to be gone.

The communicator is an argument of every call: recovery replaces it, and nothing here keeps a
process group.

Overlapped parameter all-gather (``overlap_param_gather``, off by default): ``param_gather.py``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from deadpool.parallel.data.buckets import GradBuckets, bucket_edges
from deadpool.parallel.data.grad_shard import ShardedGrads
from deadpool.parallel.data.layout import _padded, state_nbytes
from deadpool.parallel.data.param_gather import ParamGather
from deadpool.parallel.data.reduce_scatter import aligned_edges, group_poster, send_to_owner
from deadpool.parallel.data.reshard import reshard_state  # noqa: F401 (its home before)

__all__ = ["ZeroOptimizer", "state_nbytes"]

PARAM_DTYPES = (torch.float32, torch.bfloat16)
ADAMW_IMPLS = ("fused", "foreach", "for_loop")


class ZeroOptimizer(ParamGather):
    """ZeRO-1 AdamW over one flat parameter buffer (see the module docstring); with
    ``shard_grads`` (``parallel.zero=2``, sharded and dp > 1) ZeRO-2: no full gradient buffer,
    each micro-batch's gradients reduced per bucket into this rank's shard (``grad_shard.py``;
    ``flat_grads`` and ``main_grads`` are None, ``grads`` the ``ShardedGrads``).

    Attributes: ``numel`` (real parameter elements), ``padded_numel`` (``flat_params.numel()``,
    a multiple of ``dp_size``), ``shard_numel`` (``padded_numel // dp_size``), ``shard_range``
    (this rank's ``[lo, hi)`` in the flat buffers), ``flat_params``, ``flat_grads``, ``mixed``
    (parameters in bf16 with an fp32 master copy), ``master`` (what AdamW updates: fp32) and
    ``grad_shard`` (its gradient, valid after ``reduce_grads``).

    ``decays(p) -> bool``: which parameters get weight decay (None: all of them, as one torch
    AdamW group). ``grad_reduce_dtype``: the dtype gradients are accumulated over micro-batches
    and reduced over dp in when the parameters are bf16 (fp32 by default, see Mixed precision).
    ``overlap_param_gather``: ``step`` posts the parameter all-gather and returns; the next
    forward waits for each bucket (see Overlapped parameter all-gather). ``reduce_scatter``: Collectives
    """

    def __init__(self, params: list[torch.nn.Parameter], *, dp_size: int, dp_rank: int, lr: float,
                 weight_decay: float, betas=(0.9, 0.95), eps: float = 1e-8, shard: bool = True,
                 adamw: str = "fused", bucket_bytes: int = 25 << 20,
                 first_bucket_bytes: int = 1 << 20, decays=None,
                 grad_reduce_dtype: torch.dtype = torch.float32,
                 overlap_param_gather: bool = False, shard_grads: bool = False,
                 max_buckets_in_flight: int = 2, reduce_scatter: bool = False):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        self.params = list({id(p): p for p in params}.values())  # tied weights once
        if not self.params:
            raise ValueError("ZeroOptimizer needs at least one parameter")
        device, dtype = self.params[0].device, self.params[0].dtype
        for p in self.params:
            if p.dtype not in PARAM_DTYPES or p.dtype != dtype or p.device != device:
                raise ValueError("all parameters must be float32, or all bfloat16, on one device "
                                 f"(got {p.dtype} on {p.device} beside {dtype} on {device})")
        if grad_reduce_dtype not in PARAM_DTYPES:
            raise ValueError(f"grad_reduce_dtype must be float32 or bfloat16, got {grad_reduce_dtype}")
        self.mixed = dtype != torch.float32
        self.dp_size, self.dp_rank, self.shard = dp_size, dp_rank, shard
        # the summed gradients are divided by this: the data-parallel width, or the number of
        # batches in the global batch when an elastic job computes several per rank (rank/trainer.py)
        self.grad_div = dp_size
        # host seconds of the last step's parameter all-gather, post to wait (gloo: the gather
        # itself; NCCL: only queuing it on the stream); None when nothing is gathered
        self.last_gather_s: float | None = None
        self.weight_decay = weight_decay
        self.numel = sum(p.numel() for p in self.params)
        self.padded_numel = _padded(self.numel, dp_size)
        self.shard_numel = self.padded_numel // dp_size
        lo = dp_rank * self.shard_numel
        self.shard_range = (lo, lo + self.shard_numel)

        self.flat_params = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        # ZeRO-2 keeps no full gradient buffer: autograd's gradients go to ShardedGrads
        self.grads_sharded = bool(shard_grads) and shard and dp_size > 1
        self.flat_grads = None if self.grads_sharded else torch.zeros_like(self.flat_params)
        self.offsets, off = [], 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                self.offsets.append(off)
                self.flat_params[off:off + n].copy_(p.reshape(-1))
                p.data = self.flat_params[off:off + n].view_as(p)
                if self.flat_grads is not None:
                    if p.grad is not None:
                        self.flat_grads[off:off + n].copy_(p.grad.reshape(-1))
                    p.grad = self.flat_grads[off:off + n].view_as(p)
                off += n

        # The tensor AdamW updates: the owned shard (views, so updates land in flat_params), or
        # everything when not sharded; under bf16 an fp32 copy of it (the master weights). A
        # Parameter made from a view shares its storage.
        sl = slice(*self.shard_range) if shard else slice(None)
        self._sl = sl
        self._param_shard = self.flat_params[sl]
        # gradients of the bf16 parameters accumulate (over micro-batches, from autograd hooks)
        # and are reduced in main_grads when grad_reduce_dtype is fp32; otherwise in flat_grads
        self.main_grads = (torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
                           if self.mixed and grad_reduce_dtype == torch.float32
                           and not self.grads_sharded else None)
        self._reduce_buf = self.flat_grads if self.main_grads is None else self.main_grads
        # the dtype the buckets travel in: ZeRO-2 stages each bucket in it
        reduce_dtype = grad_reduce_dtype if self.mixed else dtype
        if self.mixed:
            self._master = torch.nn.Parameter(self._param_shard.float())
            self._master.grad = (self.main_grads[sl] if self.main_grads is not None
                                 else torch.zeros_like(self._master))
        else:
            self._master = torch.nn.Parameter(self._param_shard)
            self._master.grad = (self.flat_grads[sl] if self.flat_grads is not None
                                 else torch.zeros_like(self._master))
        if adamw not in ADAMW_IMPLS:
            raise ValueError(f"adamw must be one of {ADAMW_IMPLS}, got {adamw!r}")
        impl = {"fused": dict(fused=True), "foreach": dict(foreach=True),
                "for_loop": dict(foreach=False)}[adamw]
        # Decay groups over one flat tensor: AdamW's decoupled decay ``p *= 1 - lr * wd`` comes
        # before, and independently of, the Adam update, so it is applied here to the runs of
        # decayed elements (views) and AdamW runs with weight_decay=0 on the whole shard: one
        # fused kernel still, and for the for-loop kernel bitwise torch's two-group AdamW.
        self._decay_views = None
        if decays is not None:
            runs = self.owned_runs(decays)
            self._decay_views = [self._master.detach()[a:b] for a, b in runs]
        self._adam = torch.optim.AdamW([self._master], lr=lr, betas=betas, eps=eps,
                                       weight_decay=weight_decay if decays is None else 0.0,
                                       **impl)
        # Allocate AdamW's state now (torch does it lazily at the first step): the snapshot
        # engine keeps references to these tensors, which torch then updates in place. The fused
        # kernel reads its step counter on the parameters' device.
        self._state = self._adam.state[self._master]
        self._state["step"] = torch.tensor(0.0, dtype=torch.float32,
                                           device=device if adamw == "fused" else "cpu")
        self._master_data = self._master.detach()  # one object: the snapshot engine keeps it
        self._state["exp_avg"] = torch.zeros_like(self._master_data)
        self._state["exp_avg_sq"] = torch.zeros_like(self._master_data)

        if self.main_grads is not None:  # before the buckets' hooks: they post what this folds
            for p, off in zip(self.params, self.offsets):
                p.register_post_accumulate_grad_hook(self._folder(off, p.numel()))
        # gradient buckets, each inside one shard when sharded (reduced to its owner)
        self.reduce_scatter = bool(reduce_scatter) and shard and dp_size > 1
        cuts = [r * self.shard_numel for r in range(dp_size)] if shard else []
        edges = (aligned_edges(self.shard_numel, dp_size, reduce_dtype.itemsize, bucket_bytes,
                               first_bucket_bytes) if self.reduce_scatter else
                 bucket_edges(self.padded_numel, reduce_dtype.itemsize, bucket_bytes,
                              first_bucket_bytes, cuts))
        if self.grads_sharded:  # ZeRO-2: the reduced shard is AdamW's gradient itself
            self.grads = ShardedGrads(self.params, self.offsets, shard_numel=self.shard_numel,
                                      dp_size=dp_size, dp_rank=dp_rank, edges=edges,
                                      reduce_dtype=reduce_dtype,
                                      max_in_flight=max_buckets_in_flight,
                                      reduce_scatter=self.reduce_scatter)
            self._master.grad = self.grads.shard
            self.buckets = self.grads
        else:
            self.grads = None
            self.buckets = GradBuckets(self.params, self.offsets, self.padded_numel, edges)
        # overlapped parameter all-gather (module docstring): the same buckets in buffer order,
        # which is the forward's; posted by step, each waited by the first forward that reads it
        self.overlap_param_gather = bool(overlap_param_gather) and shard and dp_size > 1
        self._gather_edges = sorted(self.buckets.edges)
        self._gathers: list[tuple[int, object]] = []  # (lo, work) posted, not yet waited
        self._gather_comm = None
        self._unsynced = False  # stream-ordered: gathers waited since the last confirming sync
        # gloo: the owned buckets' inboxes, lo -> (dp * (hi - lo),) (see Collectives)
        self._owned = [(lo, hi) for lo, hi in self.buckets.edges
                       if shard and lo // self.shard_numel == dp_rank]
        self._inbox: dict[int, torch.Tensor] = {}
        self._nothing = self._master.new_empty(0, dtype=reduce_dtype)

    def _folder(self, off: int, n: int):
        def fold(p: torch.Tensor) -> None:
            # autograd just accumulated this micro-batch into p.grad (bf16): move it into fp32
            self.main_grads[off:off + n].add_(p.grad.reshape(-1))
            p.grad.zero_()
        return fold

    @property
    def master(self) -> torch.Tensor:
        return self._master_data

    @property
    def grad_shard(self) -> torch.Tensor:
        """The reduced, averaged gradient of ``master`` (after ``reduce_grads``); scaling it in
        place (gradient clipping) scales the update."""
        return self._master.grad

    def owned_runs(self, select) -> list[tuple[int, int]]:
        """``[(a, b), ...]``: the element ranges of ``master`` (this rank's shard, or everything
        when not sharded) that belong to parameters with ``select(p)`` true, adjacent ones
        merged. Padding belongs to no parameter."""
        lo, hi = (self.shard_range if self.shard else (0, self.padded_numel))
        runs: list[tuple[int, int]] = []
        for p, off in zip(self.params, self.offsets):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a >= b or not select(p):
                continue
            if runs and runs[-1][1] == a - lo:
                runs[-1] = (runs[-1][0], b - lo)
            else:
                runs.append((a - lo, b - lo))
        return runs

    # -- the data-parallel group ---------------------------------------------------------------
    def _dp_group(self, comm):
        """The communicator's dp group, checked against this optimizer's layout (None if dp=1)."""
        if not comm.has("dp"):
            if self.dp_size > 1:
                raise RuntimeError(f"dp_size={self.dp_size} but the communicator has no dp group")
            return None
        ranks = comm.group_ranks["dp"]
        if len(ranks) != self.dp_size or ranks.index(comm.topo.rank) != self.dp_rank:
            raise RuntimeError(f"dp group {ranks} does not match dp_size={self.dp_size}, "
                               f"dp_rank={self.dp_rank} of rank {comm.topo.rank}")
        return comm.groups["dp"]

    # -- a step ----------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero ``flat_grads`` in place; ``p.grad`` stay views of it (never set them to None,
        e.g. with ``module.zero_grad()``: autograd would then allocate fresh tensors). ZeRO-2:
        forget the step's buckets and zero the gradient shard (``ShardedGrads.reset``)."""
        if self.grads is not None:
            self.grads.reset()
            return
        self.flat_grads.zero_()
        if self.main_grads is not None:
            self.main_grads.zero_()

    def begin_step(self, comm, num_microbatches: int = 1) -> None:
        """Must be called before the step's first forward: zeroes the gradients and arms the
        buckets so each is reduced during backward once its last micro-batch has written it."""
        self.zero_grad()
        self.last_gather_s = None
        pg = self._dp_group(comm)
        if pg is not None and self.grads is not None:
            self.grads.arm(comm, pg)  # every micro-batch's buckets, reduced as they land
        elif pg is not None:
            self.buckets.arm(self._poster(comm, pg), num_microbatches)

    def _poster(self, comm, pg):
        to_owner = self._to_owner(comm)
        if self.reduce_scatter and not to_owner:  # NCCL: one reduce-scatter per bucket group
            return group_poster(self._reduce_buf, self.shard_numel, self.dp_size, self.dp_rank, pg)

        def post(lo: int, hi: int):
            view = self._reduce_buf[lo:hi]
            if not self.shard:
                return pg.allreduce([view])  # default op: SUM
            owner = lo // self.shard_numel
            if to_owner:
                return self._send_to_owner(pg, view, lo, owner)
            opts = dist.ReduceOptions()
            opts.reduceOp, opts.rootRank = dist.ReduceOp.SUM, owner
            return pg.reduce([view], opts)
        return post

    def _to_owner(self, comm) -> bool:
        """Buckets go to their owner by all-to-all and are summed there (gloo, see Collectives)."""
        return self.shard and self.dp_size > 1 and comm.backend == "gloo"

    def _send_to_owner(self, pg, view: torch.Tensor, lo: int, owner: int):
        """Post the uneven all-to-all that puts every rank's ``view`` into ``owner``'s inbox."""
        if owner == self.dp_rank and lo not in self._inbox:
            self._inbox[lo] = view.new_empty(self.dp_size * view.numel())
        return send_to_owner(pg, view, owner, self.dp_size, self.dp_rank, self._inbox.get(lo),
                             self._nothing)

    def reduce_grads(self, comm, on_posted=None) -> None:
        """Average gradients over the dp group into ``grad_shard``: each bucket is summed into
        its owner's shard of the reduction buffer (the rest then holds stale values: do not read
        it) or, with ``shard=False``, all-reduced. Posts the buckets backward has not posted (all
        of them without ``begin_step``), then waits for every one. ``on_posted()`` runs once all
        are posted, and also when there is nothing to post (dp=1), so a fault-injection point at
        this phase exists in every layout. Abortable."""
        if self.main_grads is not None and self.buckets.post is None:
            # not armed: gradients written outside autograd are still in flat_grads
            self.main_grads.add_(self.flat_grads)
            self.flat_grads.zero_()
        pg = self._dp_group(comm)
        if pg is None:
            if on_posted is not None:
                on_posted()
        elif self.grads is not None:  # ZeRO-2: sums into the shard, which is master's grad
            self.grads.finish(comm, pg, on_posted)
        else:
            waits = []
            self.buckets.finish(self._poster(comm, pg), waits.append)
            if on_posted is not None:
                on_posted()
            for w in waits:
                comm.wait(w)
            if self._to_owner(comm):  # every rank's copy of each owned bucket is in: sum them
                for lo, hi in self._owned:
                    torch.sum(self._inbox[lo].view(self.dp_size, hi - lo), 0,
                              out=self._reduce_buf[lo:hi])
        if self.mixed and self.main_grads is None and self.grads is None:  # bf16: AdamW reads fp32
            self._master.grad.copy_(self.flat_grads[self._sl])
        if pg is not None or self.grad_div != 1:  # an elastic dp=1 rank computing 2+ batches
            self._master.grad.div_(self.grad_div)

    def step(self, comm, lr: float | None = None, on_updated=None) -> None:
        """AdamW on the owned shard at learning rate ``lr`` (None: the last one set), then
        all-gather the shards into ``flat_params`` (abortable; nothing to gather when not
        sharded). Under bf16 the updated master shard is rounded into this rank's slice of the
        bf16 parameters first, so every rank gathers the same rounding of every shard.
        ``on_updated()`` runs between the update and the gather (in every layout: a
        fault-injection point inside the step). With ``overlap_param_gather`` the gather is only
        posted, one broadcast per bucket, and ``step`` returns: the buckets are waited by the
        forward pre-hooks (``hook_forward``) or ``wait_param_gather``, which must run before
        anything else reads the parameters; ``step`` itself first waits for any still pending."""
        self.wait_param_gather()  # the last step's buckets read and write flat_params
        group = self._adam.param_groups[0]
        if lr is not None:
            group["lr"] = lr
        if self._decay_views and self.weight_decay:
            torch._foreach_mul_(self._decay_views, 1.0 - group["lr"] * self.weight_decay)
        self._adam.step()
        if self.mixed:
            self._param_shard.copy_(self._master_data)
        if on_updated is not None:
            on_updated()
        pg = self._dp_group(comm)
        if self.shard and pg is not None:
            t0 = time.perf_counter()  # host time: on NCCL only the post (it runs on the stream)
            if self.overlap_param_gather:
                self._post_gathers(comm, pg)
            else:
                comm.wait(pg._allgather_base(self.flat_params, self._param_shard))
            self._add_gather_time(t0)

    # -- state -----------------------------------------------------------------------------------
    def state_tensors(self) -> list[tuple[str, torch.Tensor, bool]]:
        """``(name, tensor, shared)`` in a fixed order: the flat parameters (shared: identical on
        every dp peer), the fp32 ``master`` weights (under bf16; in fp32 only when sharded, as a
        view of the owned slice of the parameters, so that the replicas of a data-parallel
        group's shards together hold its parameters: recovery rebuilds them from those when no
        peer is left, ``recovery.plan``), then AdamW's ``exp_avg``,
        ``exp_avg_sq`` (the owned shard, or the whole buffer when not sharded) and ``step``;
        all but the parameters shared only when not sharded. Under bf16 with ZeRO the master
        shard is unique to the rank like the moments: no peer's bf16 parameters can give it
        back (rounding lost its low bits). The same tensor objects for the optimizer's
        lifetime, updated in place. Gradients are not state: they are rebuilt every step."""
        st = self._state
        out = [("params", self.flat_params, True)]
        if self.mixed or self.shard:  # fp32 sharded: the owned slice of flat_params (a view)
            out.append(("master", self._master_data, not self.shard))
        return out + [("exp_avg", st["exp_avg"], not self.shard),
                      ("exp_avg_sq", st["exp_avg_sq"], not self.shard),
                      ("step", st["step"], not self.shard)]

    def state_nbytes(self) -> dict[str, int]:
        """``{"shared": bytes, "unique": bytes}`` the state occupies (see ``state_nbytes``): an
        fp32 ``master`` is a view of the parameters and not counted (a snapshot holds it twice)."""
        out = {"shared": 0, "unique": 0}
        for name, t, shared in self.state_tensors():
            if name != "master" or self.mixed:
                out["shared" if shared else "unique"] += t.numel() * t.element_size()
        return out
