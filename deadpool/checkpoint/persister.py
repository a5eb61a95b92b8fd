"""Periodic disk checkpoints of one rank, written off the training thread (``dcp.async_save``)."""

from __future__ import annotations

import shutil
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from deadpool.checkpoint.files import (WRITTEN_AT, CheckpointWriteError, _header_text,
                                       _tmp_rank_dir, _write_error, install_rank, is_complete,
                                       layout_tag, rank_dir, write_meta)
from deadpool.checkpoint.retention import prune
from deadpool.checkpoint.unique import state_bytes, unique_part
from deadpool.threads import lower_thread_priority


class _NoCopyStager(AsyncStager):
    """Hands the state dict to the upload thread as it is.

    async_save's default stager (DefaultStager -> StateDictStager) copies every tensor into a new
    CPU state dict, synchronously on the calling thread. The state given to ``AsyncPersister`` is
    already a private host copy that nobody writes until the upload is done (it is the persister's
    until then), so that would be a second full copy of the rank's state on the training thread
    for nothing. ``stage`` returns the dict itself (not a Future), and no synchronisation is
    needed afterwards (``_synchronize_after_execute = False``; the deprecated
    ``synchronize_staging`` is then never called). Passing a stager also keeps async_save from
    staging with the storage writer itself: ``dcp.FileSystemWriter`` is a ``BlockingAsyncStager``,
    which copies too."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def close(self) -> None:
        pass


class _RankDirWriter(dcp.FileSystemWriter):
    """DCP's file system writer (one data file, fsync'd, written on the calling thread:
    ``thread_count=1``) into a rank's temporary directory. ``finish`` - the StorageWriter hook DCP
    calls last, once data and ``.metadata`` are on disk - then runs ``on_finish`` (header.json,
    rename, meta.json) on the same upload thread, so the whole write stays off the training
    thread and a failure in any part of it reaches the returned future."""

    def __init__(self, path: Path, on_finish, nice: int):
        super().__init__(path)
        self._on_finish = on_finish
        self._nice = nice

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        # runs first on the upload thread, which async_save creates for this save alone
        lower_thread_priority(self._nice)
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        self._on_finish()


class _Job:
    def __init__(self, step: int, rank: int, final: Path, tmp: Path, future: Future, state):
        self.step, self.rank, self.final, self.tmp = step, rank, final, tmp
        self.future, self.state = future, state


class AsyncPersister:
    """Periodic disk checkpoints of one rank, written off the training thread, one at a time.

    ``submit`` hands over a private host copy of the state (e.g. ``StateLayout.state_dict`` of a
    flat buffer the caller will not touch until ``in_flight`` is False) and returns at once; the
    write goes through ``torch.distributed.checkpoint.async_save`` (thread executor, no process
    group, ``no_dist=True``, no staging copy), then ``header.json`` (completion marker) and the
    rename into ``rank_<r>``, then ``meta.json``. A failed write never raises on the training
    thread by itself: it is kept and raised as ``CheckpointWriteError`` from the next ``submit`` or
    ``wait``. ``rank`` may be (re)assigned before a submit (e.g. once a generation gives it).

    ``unique_state(shared_names, keep)``: write only the state no data-parallel peer writes
    (``checkpoint.unique``: the tensors named ``shared_names`` once per group, by its dp rank 0)
    and keep the newest ``keep`` complete steps (``checkpoint.retention``).
    """

    def __init__(self, root, rank: int | None = None, *, reason: str = "periodic", nice: int = 0):
        self.root = Path(root)
        self.rank = rank
        self.reason = reason
        self.layout: dict | None = None  # {"dp", "tp", "pp"} it writes at (meta.json), if known
        self.nice = int(nice)
        self.last_step_written: int | None = None
        self.skipped = 0                      # submits refused because a write was in flight
        self.last_write_s: float | None = None  # seconds the last successful write took
        self.last_bytes: int | None = None      # tensor bytes the last submit wrote
        self.shared_names: frozenset[str] = frozenset()
        self.keep: int | None = None
        self._job: _Job | None = None
        self._error: CheckpointWriteError | None = None
        self._stager = _NoCopyStager()
        self._closed = False

    def unique_state(self, shared_names, keep: int | None) -> None:
        """Write unique state only, and keep the newest ``keep`` complete steps (class doc)."""
        self.shared_names = frozenset(shared_names)
        self.keep = None if keep is None else int(keep)

    @property
    def in_flight(self) -> bool:
        """A write is running (its state tensors still belong to the persister)."""
        job = self._job
        return job is not None and not job.future.done()

    def submit(self, step: int, state: dict[str, torch.Tensor], header: dict, world_size: int) -> bool:
        """Start writing ``state`` (ownership passes to the persister until the write is done) as
        this rank's checkpoint of ``step``. Returns False, counting ``skipped``, if the previous
        write is still running; never blocks. Raises ``CheckpointWriteError`` for a previous
        write that failed (this state is then not submitted) and ``TypeError`` for a header that
        is not JSON-serialisable."""
        if self._closed:
            raise RuntimeError("AsyncPersister is closed")
        if self.rank is None:
            raise ValueError("AsyncPersister.rank is not set")
        if self._job is not None:
            if not self._job.future.done():
                self.skipped += 1
                return False
            self._harvest()
        self._raise_pending()
        rank, root, reason, layout, keep = self.rank, self.root, self.reason, self.layout, self.keep
        state, header = unique_part(state, header, self.shared_names, layout, rank)
        self.last_bytes = state_bytes(state)
        tag = layout_tag(world_size, layout)  # (one layout per step directory: files.py)
        # on the caller's thread: a caller bug, not an I/O failure
        text = _header_text(dict(header, **{WRITTEN_AT: tag}))
        final = rank_dir(root, step, rank)
        tmp = _tmp_rank_dir(final)
        t0 = time.perf_counter()

        def on_finish() -> None:  # on the upload thread, after the DCP files are on disk
            if install_rank(tmp, final, text, tag):
                write_meta(root, step, world_size, reason, layout=layout)
                if keep and is_complete(final.parent):
                    prune(root, keep, protect=step)
            self.last_write_s = time.perf_counter() - t0
            self.last_step_written = step

        # async_save in torch 2.13: THREAD runs dcp.save (no_dist=True: no process group, no
        # collectives) on a one-off thread; PROCESS needs an initialised default process group
        # (its daemon is set up with dist.get_rank and a TCPStore) and hands the state to another
        # process, so it is not usable here. On this thread async_save only wraps each top-level
        # entry (DCP's Stateful check + logging, ~25 us a tensor) and starts the upload thread;
        # the step directory and tmp are created by the writer, on the upload thread.
        try:
            res = dcp.async_save(state, storage_writer=_RankDirWriter(tmp, on_finish, self.nice),
                                 async_stager=self._stager, no_dist=True,
                                 async_checkpointer_type=AsyncCheckpointerType.THREAD)
        except (Exception, CheckpointException) as e:
            err = _write_error(f"could not start the checkpoint of step {step} (rank {rank}) "
                               f"to {final}", e)
            raise err from err.__cause__
        fut = res.upload_completion if isinstance(res, AsyncSaveResponse) else res
        self._job = _Job(step, rank, final, tmp, fut, state)
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the in-flight write is done (True) or ``timeout`` seconds passed (False);
        raises ``CheckpointWriteError`` if it - or an earlier unreported write - failed."""
        if self._job is not None:
            try:
                self._job.future.exception(timeout=timeout)
            except FutureTimeout:
                return False
            self._harvest()
        self._raise_pending()
        return True

    def close(self) -> None:
        """Wait for the in-flight write (raising its error, if any) and release resources."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._stager.close()

    def _harvest(self) -> None:
        job, self._job = self._job, None  # drops the state: the caller's buffer is free again
        exc = job.future.exception()
        if exc is None:
            return
        shutil.rmtree(job.tmp, ignore_errors=True)
        self._error = _write_error(f"asynchronous checkpoint of step {job.step} (rank {job.rank}) "
                                   f"to {job.final} failed", exc)

    def _raise_pending(self) -> None:
        err, self._error = self._error, None
        if err is not None:
            raise err
