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
key between short waits and raises ``Aborted`` once it is set. What cannot be polled (a group's
rendezvous, point-to-point state transfer) runs in a helper thread through ``run_abortable``; the
main thread polls the abort key and abandons the helper on abort. Every wait is bounded by
elapsed time (``timeout_s``), never by parsing error text.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from deadpool.auth import AuthError
from deadpool.protocol import Keys, Seal
from deadpool.topology import Topology


class Aborted(RuntimeError):
    """The coordinator (or a peer) declared a failure in this generation."""


class CollectiveError(RuntimeError):
    """A collective failed locally (a peer's connection closed, a timeout)."""


class CoordinatorLost(RuntimeError):
    """The coordinator stopped answering (its heartbeat stopped, or its store is gone)."""


BACKENDS = ("auto", "gloo", "nccl")


def resolve_backend(device: str, backend: str = "auto") -> str:
    """The backend of the training groups (world, dp): ``auto`` is nccl on CUDA, gloo on CPU.

    gloo also reduces CUDA tensors (staged through host memory): use it to run several ranks on
    one GPU, which NCCL refuses. The replication group is gloo whatever this says.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    cuda = device.startswith("cuda")
    if backend == "auto":
        return "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise ValueError("backend=nccl needs device=cuda")
    return backend


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

    def __init__(self, topo: Topology, store, backend: str, poll_s: float, timeout_s: float,
                 lost: threading.Event | None = None, fault_hook=None, seal: Seal | None = None):
        self.topo = topo
        self.store = store
        self.backend = backend
        self.poll_s = poll_s
        self.poll = timedelta(seconds=poll_s)
        self.timeout_s = timeout_s
        self.keys = Keys(topo.generation)
        self.groups: dict[str, object] = {}
        self.group_ranks: dict[str, list[int]] = {}
        self.lost = lost or threading.Event()
        self.fault_hook = fault_hook or (lambda step, phase: None)
        self.seal = seal or Seal(None)
        self._abort_reason: str | None = None

    @classmethod
    def build(cls, topo: Topology, store, backend: str = "gloo", poll_s: float = 0.02,
              timeout_s: float = 120.0, repl_nice: int = 0, store_factory=None, lost=None,
              fault_hook=None, step: int = 0, seal: Seal | None = None) -> "Communicator":
        """Build this rank's groups of ``topo.generation``; abortable (raises ``Aborted``).

        ``store_factory`` must return a fresh store client: a rendezvous blocks the client it
        uses, and the main thread keeps polling the abort key on ``store`` meanwhile.
        """
        self = cls(topo, store, backend, poll_s, timeout_s, lost, fault_hook, seal)
        dims, g = topo.dims, topo.generation
        world = list(range(dims.world_size))
        gstore = store_factory() if store_factory is not None else store
        self.build_store = gstore  # free again once the build is done (callers may reuse it)

        def make():
            self._add(gstore, "world", f"g{g}/world/", world)
            self.fault_hook(step, "rebuild")
            for i, ranks in enumerate(dims.axis_groups("dp")):
                if topo.rank in ranks:
                    self._add(gstore, "dp", f"g{g}/dp{i}/", ranks)
            # The replication channel always runs on gloo over host memory (pinned buffers on
            # CUDA). It is created from a lower-priority thread so gloo's I/O threads for it
            # inherit that priority: replication traffic then yields the CPU to training.
            _in_thread(lambda: self._add(gstore, "repl", f"g{g}/repl/", world, backend="gloo"),
                       repl_nice)

        if store_factory is None:
            make()  # tests of the happy path: no helper thread needed
        else:
            self.run_abortable(make, "group rebuild")
        return self

    def _add(self, store, name: str, prefix: str, ranks: list[int], backend: str | None = None):
        self.groups[name] = _new_group(backend or self.backend, store, prefix,
                                       ranks.index(self.topo.rank), len(ranks), self.timeout_s)
        self.group_ranks[name] = ranks

    def group(self, name: str):
        return self.groups[name]

    def group_rank(self, name: str, rank: int) -> int:
        return self.group_ranks[name].index(rank)

    # -- failure-aware waiting -------------------------------------------------------------------
    def aborted(self) -> bool:
        """True once the generation's abort key holds a message sealed by this job."""
        if self._abort_reason is not None:
            return True
        if self.lost.is_set():
            raise CoordinatorLost("the coordinator stopped answering")
        if not self.store.check([self.keys.abort]):
            return False
        try:
            self._abort_reason = self.seal.unwrap(self.keys.abort, self.store.get(self.keys.abort))
        except AuthError:
            return False  # not written by this job: ignored
        return True

    def raise_if_aborted(self) -> None:
        if self.aborted():
            raise Aborted(self._abort_reason)

    def wait(self, work) -> None:
        """Wait for ``work``; raise ``Aborted`` if the generation is aborted meanwhile.

        Must be used for every collective on the critical path. A local error (peer gone, or the
        group's own timeout) is reported to the store so that ranks not connected to the dead one
        stop waiting at once. A poll slice and a real failure are told apart by the work's state
        (a failed work is completed), and the whole wait is bounded by ``timeout_s``.
        """
        t0 = time.monotonic()
        while True:
            if self.backend == "nccl":  # pragma: no cover - needs CUDA
                # a timed-out wait on NCCL aborts the communicator: poll completion instead
                if work.is_completed():
                    work.wait()
                    return
                time.sleep(min(self.poll_s, 0.0005))
            else:
                try:
                    work.wait(self.poll)
                    return
                except RuntimeError:
                    if work.is_completed():  # finished meanwhile, or failed: ask it again
                        try:
                            work.wait()
                            return
                        except RuntimeError as e:
                            self.report_error(str(e))
                            raise CollectiveError(str(e)) from None
            self.raise_if_aborted()
            if time.monotonic() - t0 > self.timeout_s:
                msg = f"collective did not complete within {self.timeout_s:.0f} s"
                self.report_error(msg)
                raise CollectiveError(msg)

    def run_abortable(self, fn, what: str):
        """Run ``fn()`` in a helper thread and return its result, polling the abort key.

        Raises ``Aborted`` if the generation is aborted first (the helper is abandoned: it may
        finish or fail later, and whatever it writes must be dropped by the caller),
        ``CollectiveError`` if ``fn`` raises or runs past ``timeout_s``. Other exceptions that
        must pass through (e.g. a corrupt transfer) are re-raised unchanged if they subclass
        ``PassThrough``.
        """
        box: dict = {}
        done = threading.Event()

        def run():
            try:
                box["value"] = fn()
            except BaseException as e:  # handed to the caller
                box["error"] = e
            done.set()

        threading.Thread(target=run, name=f"{what}-g{self.topo.generation}", daemon=True).start()
        t0 = time.monotonic()
        while not done.wait(self.poll_s):
            self.raise_if_aborted()
            if time.monotonic() - t0 > self.timeout_s:
                msg = f"{what} did not finish within {self.timeout_s:.0f} s"
                self.report_error(msg)
                raise CollectiveError(msg)
        err = box.get("error")
        if err is not None:
            if isinstance(err, PassThrough):
                raise err
            self.report_error(f"{what} failed: {err}")
            raise CollectiveError(f"{what} failed: {err}") from err
        return box.get("value")

    def report_error(self, msg: str) -> None:
        self.store.set(self.keys.error(self.topo.rank), msg[:500])
        self.store.add(self.keys.num_errors, 1)
        # Waking every survivor now is cheaper than waiting for the coordinator to confirm.
        if not self.store.check([self.keys.abort]):
            self.store.set(self.keys.abort, self.seal.wrap(
                self.keys.abort, f"collective error on rank {self.topo.rank}: {msg[:200]}"))

    def allreduce_mean(self, flat: torch.Tensor, group: str = "dp", on_posted=None) -> None:
        pg = self.groups[group]
        work = pg.allreduce([flat])
        if on_posted is not None:
            on_posted()
        self.wait(work)
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


class PassThrough(RuntimeError):
    """An error from an abortable helper that the caller handles itself (not a comm failure)."""


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
