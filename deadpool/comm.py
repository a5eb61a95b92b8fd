"""The communicator: the one object that owns every process group of one generation.

A generation's groups are created in a fresh store namespace (``g{generation}/...``) so a rebuilt
group never meets keys left by a broken one. When a failure is declared the whole object is parked
(kept referenced, never used again: gloo groups with an op in flight block on delete, and buffers of
abandoned ops may still be written) and the next generation builds a new one.

Groups:
  world  every rank                       (barriers, small control collectives)
  dp     this rank's data-parallel group  (gradient all-reduce)
  repl   every rank, used by the snapshot replication thread only (one group per thread: two
         threads driving one gloo group abort the process) and, before that thread starts, by the
         main thread for state transfer to a spare.
TP and PP groups slot in the same way (``ParallelDims.axis_groups``).

Survivors must never sit in a collective until its timeout: ``wait`` polls the generation's abort
key between short waits and raises ``Aborted`` once it is set.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from deadpool.protocol import Keys
from deadpool.topology import Topology


class Aborted(RuntimeError):
    """The coordinator (or a peer) declared a failure in this generation."""


class CollectiveError(RuntimeError):
    """A collective failed locally (a peer's connection closed, a timeout)."""


def _new_group(backend: str, store, prefix: str, rank: int, size: int, timeout_s: float):
    pstore = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(pstore, rank, size, timedelta(seconds=timeout_s))
    if backend == "nccl":  # pragma: no cover - needs CUDA
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(pstore, rank, size, opts)
    raise ValueError(f"unknown backend {backend!r} (gloo | nccl)")


class Communicator:
    """Process groups of one generation for one rank. Build with ``Communicator.build``."""

    def __init__(self, topo: Topology, store, backend: str, poll_s: float, timeout_s: float):
        self.topo = topo
        self.store = store
        self.backend = backend
        self.poll = timedelta(seconds=poll_s)
        self.timeout_s = timeout_s
        self.keys = Keys(topo.generation)
        self.groups: dict[str, object] = {}
        self.group_ranks: dict[str, list[int]] = {}

    @classmethod
    def build(cls, topo: Topology, store, backend: str = "gloo", poll_s: float = 0.02,
              timeout_s: float = 120.0, repl_nice: int = 0) -> "Communicator":
        self = cls(topo, store, backend, poll_s, timeout_s)
        dims, g = topo.dims, topo.generation
        world = list(range(dims.world_size))
        self._add("world", f"g{g}/world/", world)
        for i, ranks in enumerate(dims.axis_groups("dp")):
            if topo.rank in ranks:
                self._add("dp", f"g{g}/dp{i}/", ranks)
        # The replication channel always runs on gloo over host memory (pinned buffers on CUDA).
        # It is created from a lower-priority thread so gloo's I/O threads for it inherit that
        # priority: replication traffic then yields the CPU to training.
        _in_thread(lambda: self._add("repl", f"g{g}/repl/", world, backend="gloo"), repl_nice)
        return self

    def _add(self, name: str, prefix: str, ranks: list[int], backend: str | None = None):
        self.groups[name] = _new_group(backend or self.backend, self.store, prefix,
                                       ranks.index(self.topo.rank), len(ranks), self.timeout_s)
        self.group_ranks[name] = ranks

    def group(self, name: str):
        return self.groups[name]

    def group_rank(self, name: str, rank: int) -> int:
        return self.group_ranks[name].index(rank)

    # -- failure-aware waiting -------------------------------------------------------------------
    def aborted(self) -> bool:
        return self.store.check([self.keys.abort])

    def raise_if_aborted(self) -> None:
        if self.aborted():
            raise Aborted(self.store.get(self.keys.abort).decode())

    def wait(self, work) -> None:
        """Wait for ``work``; raise ``Aborted`` if the generation is aborted meanwhile.

        Must be used for every collective on the critical path. A local error (peer gone) is
        reported to the store so that ranks not connected to the dead one stop waiting at once.
        """
        while True:
            try:
                work.wait(self.poll)
                return
            except RuntimeError as e:
                msg = str(e)
                if "timed out" in msg.lower() or "timeout" in msg.lower():
                    if self.aborted():
                        raise Aborted(self.store.get(self.keys.abort).decode()) from None
                    continue
                self.report_error(msg)
                raise CollectiveError(msg) from None

    def report_error(self, msg: str) -> None:
        self.store.set(self.keys.error(self.topo.rank), msg[:500])
        self.store.add(self.keys.num_errors, 1)
        # Waking every survivor now is cheaper than waiting for the coordinator to confirm.
        if not self.store.check([self.keys.abort]):
            self.store.set(self.keys.abort, f"collective error on rank {self.topo.rank}: {msg[:200]}")

    def allreduce_mean(self, flat: torch.Tensor, group: str = "dp") -> None:
        pg = self.groups[group]
        self.wait(pg.allreduce([flat]))
        flat.div_(len(self.group_ranks[group]))

    def barrier(self) -> None:
        t = torch.zeros(1)
        self.wait(self.groups["world"].allreduce([t]))

    def park(self) -> None:
        """Called when the generation is over. Groups stay referenced (see module doc)."""
        if self.backend == "nccl":  # pragma: no cover - needs CUDA
            for name, pg in self.groups.items():
                if name != "repl":
                    try:
                        pg.abort()
                    except Exception:
                        pass
        _PARKED.append(self)


_PARKED: list[Communicator] = []


def _in_thread(fn, nice: int) -> None:
    from deadpool.snapshot import lower_thread_priority

    err: list[BaseException] = []

    def run():
        lower_thread_priority(nice)
        try:
            fn()
        except BaseException as e:  # re-raised in the caller
            err.append(e)

    t = threading.Thread(target=run, name="repl-group-init")
    t.start()
    t.join()
    if err:
        raise err[0]
