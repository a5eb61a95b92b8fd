"""The end of a job: wait for every rank's final state while its writers make progress.

A fixed bound on writing the final state (it was 120 s) calls a successful job failed whenever
the state is large or the disk slow: 8 B parameters at dp 496 do not reach a shared file system
in two minutes. ``FinalWait`` instead fails a rank only when its writer *stops making progress*
for ``stall_s`` seconds (the progress watchdog's rule, ``ft.progress_timeout_s``): each rank
publishes a value that changes as its write goes on (bytes written, tensors written, a beat of
its writer thread), and the coordinator waits as long as that value keeps changing. A writer
that exits without its record fails the job at once (the caller checks the process).

``write_final_state`` writes one rank's part of the job's final checkpoint: a checkpoint of unique
state (``checkpoint.unique``, spread: each tensor the data-parallel replicas hold identically is
written once, its parts spread over the replicas; each rank's unique tensors by itself) under
``<run>/final/step_<S>/``, which resumes (``ft.resume_from=<run>/final``) and exports like any
checkpoint. It shows progress: a call of ``on_progress`` per tensor copied to the host and per
``CHUNK_BYTES`` written, into a temporary directory installed under its name only once
complete (a reader never takes a partial directory for a final state). The header of each rank
carries the digest of its *whole* state (``digest``), so a comparison of two runs
(``report.compare_final_states``) still sees the parts a rank did not write. The coordinator's
side of the wait is ``recovery.finish``.

``final_digest`` is the job's final digest from the ranks' own digests (each rank hashes its
state where it lies; nothing is read back from disk to compute it).
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from deadpool.checkpoint.files import (WRITTEN_AT, _header_text, _tmp_rank_dir, _write_error,
                                       install_rank, layout_tag, rank_dir, write_meta)
from deadpool.checkpoint.unique import spread_part

CHUNK_BYTES = 64 << 20  # progress is shown at least this often while writing (64 MiB)


class _ProgressStream:
    """A file's writes, in chunks of at most ``CHUNK_BYTES``, each followed by ``on_progress``
    (one storage of a large tensor is one write: on a slow disk it must not look stalled)."""

    def __init__(self, f, on_progress: Callable[[], None]):
        self.f, self.on_progress, self.bytes = f, on_progress, 0

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        for i in range(0, len(mv), CHUNK_BYTES):
            self.f.write(mv[i:i + CHUNK_BYTES])
            self.on_progress()
        self.bytes += len(mv)
        return len(mv)

    def __getattr__(self, name):  # tell, flush, fileno, close: the file's own
        return getattr(self.f, name)


class _ProgressFS(FileSystem):
    """DCP's local file system whose written files are ``_ProgressStream``s (opened with this
    module's ``open``, which a test may slow down); ``bytes`` counts what they wrote."""

    def __init__(self, on_progress: Callable[[], None]):
        super().__init__()
        self.on_progress, self.bytes = on_progress, 0

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as f:
                yield f
            return
        with open(path, mode) as f:  # (``open`` as this module sees it)
            stream = _ProgressStream(f, self.on_progress)
            yield stream
            self.bytes += stream.bytes


def write_final_state(root: Path, step: int, rank: int, state: dict[str, torch.Tensor],
                      header: dict, *, shared_names, layout: dict, world_size: int,
                      on_progress: Callable[[], None],
                      on_first_write: Callable[[], None] | None = None) -> int:
    """Write ``rank``'s part of the final checkpoint of ``step`` under ``root`` (module doc):
    ``state`` its whole state (name -> tensor), ``header`` its header including its state's
    ``digest``, ``shared_names`` the tensors its data-parallel peers hold identically, ``layout``
    the degrees it runs at. Calls ``on_progress`` as it goes and ``on_first_write`` (a fault
    hook) once its first bytes are on disk. Returns the bytes of files written. Must be called
    by the rank's training thread, whose progress the coordinator watches; raises (leaving no
    ``rank_<r>`` behind) if the write fails."""
    part, header = spread_part(state, header, shared_names, layout, rank)
    host = {}
    for k, v in part.items():  # its own copy: a view would carry the whole flat buffer
        host[k] = v.detach().to("cpu", copy=True)
        on_progress()
    tag = layout_tag(world_size, layout)
    text = _header_text(dict(header, **{WRITTEN_AT: tag}))
    final, first = rank_dir(root, step, rank), [on_first_write]

    def progressed():
        on_progress()
        hook, first[0] = first[0], None
        if hook is not None:
            hook()
    tmp = _tmp_rank_dir(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        writer = dcp.FileSystemWriter(tmp)
        writer.fs = _ProgressFS(progressed)
        dcp.save(host, storage_writer=writer, no_dist=True)
        install_rank(tmp, final, text, tag)
    except CheckpointException as e:  # (a BaseException: the error that happened, named)
        shutil.rmtree(tmp, ignore_errors=True)
        err = _write_error(f"final state of rank {rank} to {final}", e)
        raise err from err.__cause__
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_meta(root, step, world_size, "final", layout=layout)
    return writer.fs.bytes + len(text)


def final_digest(finals: dict[int, dict], world_size: int) -> str | None:
    """SHA-256 over the ranks' digests in rank order (None unless every rank reported)."""
    if len(finals) != world_size or set(finals) != set(range(world_size)):
        return None
    h = hashlib.sha256()
    for r in range(world_size):
        h.update(finals[r]["digest"].encode())
    return h.hexdigest()


class FinalWait:
    """Which ranks' final records are missing, and which of their writers stalled.

    ``update(done, progress)`` once per poll: ``done`` the ranks whose record arrived,
    ``progress`` rank -> its writer's progress value (anything comparable with ``==``; absent:
    unchanged). A rank stalls when its value has not changed for ``stall_s`` seconds since the
    wait began or since it last changed. There is no bound on the whole wait."""

    def __init__(self, ranks: Iterable[int], stall_s: float, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.stall_s = float(stall_s)
        now = clock()
        self.pending = set(ranks)
        self._last = {r: (None, now) for r in self.pending}

    def update(self, done: Iterable[int], progress: dict[int, object]) -> None:
        self.pending -= set(done)
        now = self.clock()
        for r in self.pending:
            if r in progress and progress[r] != self._last[r][0]:
                self._last[r] = (progress[r], now)

    def stalled(self) -> list[int]:
        now = self.clock()
        return sorted(r for r in self.pending if now - self._last[r][1] > self.stall_s)

    @property
    def finished(self) -> bool:
        return not self.pending
