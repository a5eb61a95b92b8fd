"""Overlapped parameter all-gather for the ZeRO optimizer (``zero.py``), a mixin of ``ZeroOptimizer``.

Overlapped parameter all-gather (``overlap_param_gather``, off by default). As in Megatron's
distributed optimizer, ``step`` of step s posts the gather and returns, and the forward of step
s + 1 waits for each piece just before its first use (forward pre-hooks, ``hook_forward``), so
the gather overlaps the tail of step s and the head of the next forward:
  - pieces: the gradient buckets, in buffer order (the forward's: the embedding first). Buckets
    lie inside one owner's shard, so each piece is one ``broadcast`` from its owner, in place
    (a gloo broadcast's wait polls like the all-gather's; ``test_zero.py``). Cutting pieces
    across every shard as Megatron does would change the shard layout the snapshots and
    ``reshard_state`` rely on, and turn the per-bucket ``reduce`` into a reduce-scatter,
    unpollable on gloo. The values are copies either way: bitwise the non-overlapped result.
  - waits: a module holding parameters waits, in posting order, for every pending bucket that
    starts below the end of its own parameters. Once a step's buckets are waited (the first
    micro-batch of a pipeline stage) the hooks find nothing pending: later micro-batches,
    activation recomputation and evaluation do not wait. Every wait is ``comm.wait``, so a
    dead peer aborts the forward (``Aborted`` out of the hook) instead of hanging it.
  - readers other than the forward (snapshot, checkpoint, evaluation, the end of training, the
    next ``step``) must first call ``wait_param_gather`` (the trainer's ``settle_params``).
    A snapshot step therefore waits at its end as without overlap: on snapshot steps only the
    post is overlapped, which ``experiments/bench_overhead.py`` measures (arms ``off_ov``,
    ``on_ov``).
  - fault tolerance: step s is done once the master shards are updated, but the live state is
    torn (other owners' buckets in flight) until the last bucket has arrived, so
    ``param_gather_pending`` keeps ``Trainer.dirty`` true until then (stream-ordered, until a
    host sync has seen the waits complete: an op cut by an abort completes with junk). An abort
    in that window rolls the rank back to a snapshot or a peer instead of resuming from its
    live state; the state is never resumed torn. The ``param_gather`` fault phase still fires
    between the update and the posts. Left to build: report the clean regions (own shard,
    master, moments) after such an abort and re-gather the parameters from their owners
    instead of rolling back; on NCCL the window lasts until the next step's host sync.
Measured before it was built (``param_gather_s``, gloo on 2 CPU cores, default workload, steps
40-79): the gather took 3.6 ms of a 77 ms step at dp=2 (4.7 %), 9.5 ms of 154 ms at dp=4, and
2.8 / 6.8 ms alone after a barrier: the rest is the ranks' skew, which overlap only moves to the
next wait, and gloo moves the bytes on CPU threads that compete with the forward for the same
cores. With overlap on, ``param_gather_s`` is the host time a step spends posting and waiting.
"""

from __future__ import annotations

import time

import torch.distributed as dist

__all__ = ["ParamGather"]


class ParamGather:
    """The overlapped gather's half of ``ZeroOptimizer``: it reads ``flat_params``, ``shard_numel``,
    ``params``, ``offsets``, ``overlap_param_gather`` and ``_gather_edges`` / ``_gathers`` /
    ``_gather_comm`` / ``_unsynced``, which ``ZeroOptimizer.__init__`` sets."""

    def _add_gather_time(self, t0: float) -> None:
        self.last_gather_s = (self.last_gather_s or 0.0) + time.perf_counter() - t0

    def _post_gathers(self, comm, pg) -> None:
        """Post one broadcast per bucket from the rank owning it, in buffer (forward) order."""
        if self._gathers:
            raise RuntimeError("the previous step's parameter all-gather was never finished")
        self._gather_comm = comm
        for lo, hi in self._gather_edges:
            opts = dist.BroadcastOptions()
            opts.rootRank = lo // self.shard_numel
            self._gathers.append((lo, pg.broadcast([self.flat_params[lo:hi]], opts)))

    @property
    def param_gather_pending(self) -> bool:
        """Some parameters are not yet known to hold the last step's values: a posted bucket
        not waited for, or (stream-ordered) waited but not yet confirmed by ``synced``."""
        return bool(self._gathers) or self._unsynced

    def wait_param_gather(self, upto: int | None = None) -> None:
        """Wait, in posting order, for the pending buckets starting below flat offset ``upto``
        (None: all of them), through ``comm.wait`` (abortable: raises ``Aborted`` and leaves the
        rest pending). A no-op when nothing is pending."""
        if not self._gathers:
            return
        t0 = time.perf_counter()
        comm = self._gather_comm
        while self._gathers and (upto is None or self._gathers[0][0] < upto):
            comm.wait(self._gathers[0][1])
            self._gathers.pop(0)
            self._unsynced = comm.stream_ordered
        if not self._gathers:
            self._gather_comm = None
        self._add_gather_time(t0)

    def synced(self) -> None:
        """Stream-ordered: the caller's ``comm.sync()`` just confirmed every wait queued so far
        (an op cut by an abort also completes on the device, with junk: only a sync that saw the
        device finish before the abort makes its output count)."""
        self._unsynced = False

    def abandon_param_gather(self) -> None:
        """Forget the pending buckets (the generation was aborted and the live state replaced:
        their works belong to a parked communicator). See the module docstring on abandoned ops."""
        self._gathers, self._gather_comm, self._unsynced = [], None, False

    def hook_forward(self, module: torch.nn.Module) -> None:
        """With ``overlap_param_gather``: register a forward pre-hook on every submodule of
        ``module`` that holds some of these parameters itself; it waits for the pending buckets
        up to the last of them (``wait_param_gather``), so the first micro-batch's forward
        waits for each bucket just before its first use and every later forward (micro-batches,
        activation recomputation, evaluation) finds nothing pending. Every parameter must be
        read only inside the forward of the module that holds it (a parent reading a child's
        weight would see the previous step's values: the bitwise tests catch that)."""
        if not self.overlap_param_gather:
            return
        where = {id(p): off + p.numel() for p, off in zip(self.params, self.offsets)}
        for m in module.modules():
            ends = [where[id(p)] for p in m.parameters(recurse=False) if id(p) in where]
            if ends:
                m.register_forward_pre_hook(self._pre_hook(max(ends)))

    def _pre_hook(self, end: int):
        def wait(module, args):
            if self._gathers:
                self.wait_param_gather(end)
        return wait
