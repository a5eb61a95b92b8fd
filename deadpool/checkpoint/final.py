"""The end of a job: wait for every rank's final state while its writers make progress.

A fixed bound on writing the final state (it was 120 s) calls a successful job failed whenever
the state is large or the disk slow: 8 B parameters at dp 496 do not reach a shared file system
in two minutes. ``FinalWait`` instead fails a rank only when its writer *stops making progress*
for ``stall_s`` seconds (the progress watchdog's rule, ``ft.progress_timeout_s``): each rank
publishes a value that changes as its write goes on (bytes written, tensors written, a beat of
its writer thread), and the coordinator waits as long as that value keeps changing. A writer
that exits without its record fails the job at once (the caller checks the process).

``write_final_state`` writes one rank's final state so that it shows that progress: a call of
``on_progress`` per tensor copied to the host and per ``CHUNK_BYTES`` written, into a temporary
file installed under its name only once complete (a reader never takes a partial file for a
final state). The coordinator's side of the wait is ``recovery.finish``.

``final_digest`` is the job's final digest from the ranks' own digests (each rank hashes its
state where it lies; nothing is read back from disk to compute it).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from deadpool.checkpoint.files import atomic_open

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

    def flush(self) -> None:
        self.f.flush()


def write_final_state(state: dict[str, torch.Tensor], path: Path,
                      on_progress: Callable[[], None]) -> int:
    """Save ``state`` (each tensor as its own host copy: a view of a flat buffer would otherwise
    save the whole buffer) to ``path``, calling ``on_progress`` as it goes. Returns the bytes
    written. Must be called by the rank's training thread, whose progress the coordinator
    watches; raises (leaving nothing under ``path``) if the write fails."""
    host = {}
    for k, v in state.items():
        host[k] = v.detach().to("cpu", copy=True)
        on_progress()
    with atomic_open(path, "wb", opener=open) as f:  # (``open`` as this module sees it)
        stream = _ProgressStream(f, on_progress)
        torch.save(host, stream)
    return stream.bytes


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
