"""A process group that counts its ops: how a recovery tells a group every member left cleanly
(reusable by the next generation, ``groups.reusable_groups``) from one left mid-op.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist


class Counted:
    """A process group that counts the ops posted on it and the ones seen complete, so that a
    recovery can tell a group all members left cleanly (reusable) from one left mid-op. A
    backend error on posting goes through the owning communicator's ``failed`` (``comm``; the
    next generation's once it takes the group over)."""

    _POSTING = frozenset({"allreduce", "broadcast", "reduce_scatter", "allgather", "send", "recv",
                          "_reduce_scatter_base", "_allgather_base", "reduce_scatter_tensor_coalesced",
                          "allgather_into_tensor_coalesced", "allreduce_coalesced", "barrier",
                          "reduce", "gather", "scatter", "alltoall", "alltoall_base"})

    def __init__(self, pg, comm=None):
        self.pg = pg
        self.owner(comm)
        self.posted = self.completed = 0

    def owner(self, comm) -> None:
        # weakly: a reference cycle would leave the group to the garbage collector, which may
        # then delete it, op in flight, on whichever thread it runs (and block there)
        self.comm = (lambda: None) if comm is None else weakref.ref(comm)

    def __getattr__(self, name):
        attr = getattr(self.pg, name)
        if name not in self._POSTING:
            return attr

        def post(*args, **kwargs):
            try:
                work = attr(*args, **kwargs)
            except dist.DistError as e:  # e.g. posting on an aborted NCCL communicator
                comm = self.comm()
                if comm is None:
                    raise
                raise comm.failed(f"posting {name}", e) from None
            self.posted += 1
            return CountedWork(work, self)
        return post


class CountedWork:
    def __init__(self, work, group: Counted):
        self.work, self.group, self.done = work, group, False

    def wait(self, *args):
        out = self.work.wait(*args)
        if not self.done:
            self.done = True
            self.group.completed += 1
        return out

    def __getattr__(self, name):
        return getattr(self.work, name)
