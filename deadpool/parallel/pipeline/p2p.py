"""Point-to-point messages between pipeline stages, over the communicator's 2-rank groups.

A message is a ``broadcast`` from the sender in a group of two, because a collective's wait can be
polled in short slices (``comm.wait`` raises ``Aborted`` once the generation is aborted) where a
gloo recv cannot. Each group carries one direction, so its op order is the same on both ends as
long as the sender's sends and the receiver's receives come in the same order. Sends are posted
asynchronously and waited on later (``Sends``): the only blocking ops of a schedule are receives,
each into a fresh buffer.
"""

from __future__ import annotations

import torch


def peer(comm, group: str) -> int:
    """The other rank of a 2-rank group."""
    me = comm.topo.rank
    return next(r for r in comm.group_ranks[group] if r != me)


class Sends:
    """Posted sends (work, tensor): the tensor is kept alive until its send is complete."""

    def __init__(self, comm):
        self.comm, self.pending = comm, []

    def post(self, t: torch.Tensor, group: str) -> None:
        t = t.detach().contiguous()
        self.pending.append((self.comm.broadcast_async(t, group, self.comm.topo.rank), t))
        # reap finished sends (wait() on a completed work returns at once or raises its error)
        still = []
        for work, buf in self.pending:
            if work.is_completed():
                self.comm.wait(work)
            else:
                still.append((work, buf))
        self.pending = still

    def wait_all(self) -> None:
        for work, _ in self.pending:
            self.comm.wait(work)
        self.pending = []


def recv(comm, group: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """The next tensor the peer sends over ``group`` (blocking; abortable through ``comm.wait``)."""
    buf = torch.empty(shape, dtype=dtype, device=device)
    comm.wait(comm.broadcast_async(buf, group, peer(comm, group)))
    return buf
