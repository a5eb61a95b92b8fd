"""A CPU stand-in for torch 2.13's ``ProcessGroupNCCL``, for the runtime's NCCL path.

The data moves over a real gloo group underneath; on top, the fake behaves as NCCL does where
DeadPool's correctness depends on it (torch 2.13, NCCL 2.2x; see docs/gpu.md):

- ``abort()`` makes every op in flight on the group complete at once, with junk in its output
  (an aborted kernel exits early): ``is_completed()`` turns true and ``wait()`` returns normally;
- posting on an aborted group raises ``DistBackendError`` ("NCCL communicator was aborted");
- ``wait()`` on a failed work raises ``DistBackendError``;
- ``wait(timeout)`` that expires aborts the communicator (torch's timed wait on NCCL does);
- ``wait()`` without a timeout is a stream wait on real NCCL (the host goes on). On CPU the
  host must have the data before it computes with it, so the fake blocks until the op completes
  or the group is aborted: the same calls in the same order, without the overlap;
- the work itself is asynchronous (gloo runs it on its own threads): ``is_completed()`` is
  false until it ran, and a device event recorded after it reports incomplete until then.

``FakeEvents`` replaces ``torch.cuda.Event`` and counts host synchronisations per thread: what
blocks the host on the device on real NCCL, i.e. an event recorded to be waited on, and the
issuing thread asking its own work whether it completed (a poll loop), waiting on it with a
timeout (torch's timed wait blocks the host) or synchronising it. A plain ``wait()`` is a stream
wait and is not counted.
``install(monkeypatch, script)`` puts both into ``deadpool.rank.comm``; ``script`` decides per posted
op whether it stalls (never completes, as when a peer dies inside it) or fails.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist

import deadpool.rank.comm as comm_mod

# every fake group made, kept referenced: a gloo group deleted with an op in flight blocks
KEEP: list = []


class Script:
    """What happens to the ``n``-th op ``name`` posted on the group made under store prefix
    ``prefix`` (``g{generation}/{group key}/``) by its member ``rank`` (the rank in the group)."""

    def stall(self, prefix: str, rank: int, name: str, n: int) -> bool:
        return False

    def fail(self, prefix: str, rank: int, name: str, n: int) -> str | None:
        return None

    def on_stall(self, group: "FakeNCCLGroup") -> None:
        pass


# per issuing thread: the works it posted that may not have run yet (a device event recorded
# now completes once they all did)
OUTSTANDING: dict[int, list] = {}
# the counter of host synchronisations (``FakeEvents.syncs``), set by ``install``
SYNCS: Counter = Counter()


class FakeNCCLGroup:
    def __init__(self, pg, prefix: str, rank: int, script: Script):
        self.pg, self.prefix, self.rank, self.script = pg, prefix, rank, script
        self.aborted = False
        self.abort_calls = 0
        self.posts: Counter = Counter()
        KEEP.append(self)

    def abort(self) -> None:
        self.abort_calls += 1
        self.aborted = True

    def _post(self, name: str, outs: list[torch.Tensor], launch) -> "FakeNCCLWork":
        if self.aborted:
            raise dist.DistBackendError(f"NCCL communicator was aborted on rank {self.rank}.")
        self.posts[name] += 1
        n = self.posts[name]
        if self.script.stall(self.prefix, self.rank, name, n):
            self.script.on_stall(self)
            work = FakeNCCLWork(self, None, outs)
        else:
            work = FakeNCCLWork(self, launch(), outs,
                                self.script.fail(self.prefix, self.rank, name, n))
        mine = OUTSTANDING.setdefault(threading.get_ident(), [])
        mine[:] = [w for w in mine if not w.done()] + [work]
        return work

    def allreduce(self, tensors, opts=None):
        return self._post("allreduce", tensors, lambda: self.pg.allreduce(tensors, opts)
                          if opts is not None else self.pg.allreduce(tensors))

    def broadcast(self, tensors, opts):
        return self._post("broadcast", tensors, lambda: self.pg.broadcast(tensors, opts))

    def reduce(self, tensors, opts):
        return self._post("reduce", tensors, lambda: self.pg.reduce(tensors, opts))

    def reduce_scatter(self, outputs, inputs, opts=None):
        """NCCL's list form: one output per rank, the ``r``-th input summed into rank ``r``'s.
        Underneath, an all-to-all of the flattened inputs (NCCL also flattens them first, so an
        output may alias an input) and, once it ran, a sum in rank order, as gloo's path sums
        (``parallel/data/zero.py``): bitwise its values. Abortable like every op of the fake; ``opts`` must
        be a SUM."""
        (out,), (chunks,) = outputs, inputs
        if opts is not None and opts.reduceOp != dist.ReduceOp.SUM:
            raise NotImplementedError("the fake reduce-scatters with SUM only")
        n, size = out.numel(), len(chunks)
        flat = torch.cat([c.reshape(-1) for c in chunks])
        inbox = flat.new_empty(size * n)
        work = self._post("reduce_scatter", [out], lambda: self.pg.alltoall_base(
            inbox, flat, [], [], dist.AllToAllOptions()))
        work.then = lambda: torch.sum(inbox.view(size, n), 0, out=out.view(-1))
        return work

    def _allgather_base(self, out, inp):
        return self._post("_allgather_base", [out], lambda: self.pg._allgather_base(out, inp))

    def __getattr__(self, name):
        return getattr(self.pg, name)


class FakeNCCLWork:
    def __init__(self, group: FakeNCCLGroup, work, outs, fail: str | None = None):
        self.group, self.work, self.outs, self.fail = group, work, outs, fail
        self.issuer = threading.get_ident()
        self.then = None  # runs once the op completed normally (the fake's reduce-scatter)

    def done(self) -> bool:
        """The device ran it (or it ended early: aborted, failed)."""
        return (self.group.aborted or self.fail is not None
                or (self.work is not None and self.work.is_completed()))

    def _host_sync(self) -> None:
        if threading.get_ident() == self.issuer:
            SYNCS[self.issuer] += 1

    def is_completed(self) -> bool:
        self._host_sync()  # the issuing host asking the device
        return self.done()

    def synchronize(self) -> None:
        self._host_sync()
        self.wait()

    def _junk(self) -> None:
        self.then = None
        for t in self.outs:
            t.fill_(float("nan") if t.is_floating_point() else -1)

    def wait(self, timeout: timedelta | None = None) -> bool:
        out = self._wait(timeout)
        if self.then is not None:  # dropped by ``_junk`` when the abort ended it early
            then, self.then = self.then, None
            then()
        return out

    def _wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is not None:
            self._host_sync()  # a timed wait blocks the host on real NCCL
        t0 = time.monotonic()
        while True:
            if self.fail is not None:
                raise dist.DistBackendError(self.fail)
            if self.group.aborted:  # the kernel exited early: complete, no error, junk
                self._junk()
                return True
            if timeout is not None and time.monotonic() - t0 > timeout.total_seconds():
                self.group.abort()  # a timed wait that expires aborts the communicator
                raise dist.DistBackendError("NCCL watchdog: work timed out, communicator aborted")
            if self.work is None:  # stalled: a peer died inside it
                time.sleep(0.002)
                continue
            try:
                self.work.wait(timedelta(milliseconds=5))
                return True
            except RuntimeError:  # a poll slice ran out, or the op failed: ask again if done
                if self.work.is_completed():
                    try:
                        self.work.wait()
                        return True
                    except RuntimeError as e:
                        raise dist.DistBackendError(f"NCCL error: {e}") from None


class FakeEvents:
    """``torch.cuda.Event`` for the communicator: ``record`` marks a host sync (per thread);
    ``query`` is false until every work the recording thread posted before it ran."""

    def __init__(self):
        self.syncs = SYNCS
        SYNCS.clear()
        OUTSTANDING.clear()

    def __call__(self):
        events = self

        class Event:
            def __init__(self):
                self.before: list = []

            def record(self):
                me = threading.get_ident()
                events.syncs[me] += 1
                self.before = [w for w in OUTSTANDING.get(me, []) if not w.done()]

            def query(self):
                self.before = [w for w in self.before if not w.done()]
                return not self.before

            def synchronize(self):
                while not self.query():
                    time.sleep(0.0005)
        return Event()


def install(monkeypatch, script: Script | None = None) -> FakeEvents:
    script = script or Script()
    real = comm_mod._new_group

    def new_group(backend, store, prefix, rank, size, timeout_s):
        if backend != "nccl":
            return real(backend, store, prefix, rank, size, timeout_s)
        return FakeNCCLGroup(real("gloo", store, prefix, rank, size, timeout_s), prefix, rank,
                             script)

    events = FakeEvents()
    monkeypatch.setattr(comm_mod, "_new_group", new_group)
    monkeypatch.setattr(comm_mod, "_connect", lambda pg: None, raising=False)
    monkeypatch.setattr(comm_mod, "_device_event", events, raising=False)
    return events


def allow_on_cpu(monkeypatch) -> None:
    """Let a job configured ``backend=nccl`` on ``device=cpu`` through (the fake serves it): its
    workers then build NCCL groups and its coordinator plans for NCCL (every group rebuilt after
    an abort, none kept), as on a GPU machine. Threaded jobs only (the patch is this process's)."""
    real = comm_mod.resolve_backend

    def resolve(device: str, backend: str = "auto") -> str:
        return "nccl" if backend == "nccl" else real(device, backend)

    import deadpool.recovery.plan as plan_mod
    import deadpool.rank.worker as worker_mod
    for mod in (comm_mod, plan_mod, worker_mod):
        monkeypatch.setattr(mod, "resolve_backend", resolve)
