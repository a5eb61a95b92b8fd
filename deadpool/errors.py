"""The runtime's exceptions, in one module every other one may import (no import cycles).

The recovery path tells failures apart by type, never by error text:

    Aborted          the generation was declared failed (the abort key is set): leave, report
    CollectiveError  a collective failed locally (a peer's socket closed, a timeout)
    CoordinatorLost  the coordinator stopped answering: save what is held and exit
    PassThrough      raised inside an abortable helper, handled by the caller itself
    CorruptState     a state does not match the checksum it was taken with (a PassThrough)
    JobFailed        the job cannot go on (start-up failed, a final state is missing)
"""

from __future__ import annotations


class Aborted(RuntimeError):
    """The coordinator (or a peer) declared a failure in this generation."""


class CollectiveError(RuntimeError):
    """A collective failed locally (a peer's connection closed, a timeout)."""


class CoordinatorLost(RuntimeError):
    """The coordinator stopped answering (its heartbeat stopped, or its store is gone)."""


class PassThrough(RuntimeError):
    """An error from an abortable helper that the caller handles itself (not a comm failure)."""


class CorruptState(PassThrough):
    """A state received (or about to be restored) does not match the checksum it was taken with."""

    def __init__(self, msg: str, holder: int, owner: int, step: int):
        super().__init__(msg)
        self.holder, self.owner, self.step = holder, owner, step


class JobFailed(RuntimeError):
    """The job cannot go on (a process failed at start-up or while writing its final state)."""


class WriterLost(JobFailed):
    """A process died while writing its part of a checkpoint from memory (``rank``, ``slot``):
    the checkpoint is incomplete. An in-place elastic regroup plans again without it."""

    def __init__(self, rank: int, slot: int, message: str):
        super().__init__(message)
        self.rank, self.slot = rank, slot
