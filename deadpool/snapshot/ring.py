"""The local ring's buffers: allocated in the background, and filled on the device's side stream.

Pinning the ring (``ft.num_local_slots`` x the rank's state: 3 x 20 GB for a 1.4 B-parameter
rank under ``precision=bf16``) took about a minute on an H100 host, before the first step and
before a warm spare could report warm. ``RingAllocator`` does it on a thread of its own, slot by
slot in the order the engine first uses them; a snapshot waits only for its own slot's buffer.
"""

from __future__ import annotations

import threading

import torch

from deadpool.snapshot.buffers import Slot


class RingAllocator:
    """Gives each slot of ``slots`` a buffer from ``alloc`` on a background thread (``start``),
    or on demand (``ensure``); ``cond`` is the engine's condition guarding the slots."""

    def __init__(self, slots: list[Slot], alloc, cond: threading.Condition):
        self.slots, self.alloc, self.cond = slots, alloc, cond
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="snapshot-alloc", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for slot in self.slots:  # the engine takes the lowest-index empty slot first
            with self.cond:
                if slot.flat is not None:
                    continue
                slot.allocating = True
            flat = None
            try:
                flat = self.alloc()
            finally:
                with self.cond:
                    if slot.flat is None:
                        slot.flat = flat
                    slot.allocating = False
                    self.cond.notify_all()

    def ensure(self, slot: Slot) -> None:
        """Must be called before writing into ``slot``: waits while the thread is making its
        buffer, else allocates it here (a slot the thread has not reached, or no thread)."""
        with self.cond:
            while slot.allocating:
                self.cond.wait(0.01)
            if slot.flat is None:
                slot.flat = self.alloc()

    def done(self) -> bool:
        """Every slot has its buffer."""
        return all(s.flat is not None for s in self.slots)


def device_copy(views: list[torch.Tensor], tensors: list[torch.Tensor], stream):  # pragma: no cover - needs CUDA
    """Issue the device-to-host copy of ``tensors`` into the pinned ``views`` on ``stream``
    (after the compute stream's work so far); returns the event recorded after it."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # in pieces of at most 64 MB: another D2H read (the loss) waits for one piece at most in
        # the copy engine's queue, never for the whole state
        for v, t in zip(views, tensors):
            dst, src = v.reshape(-1), t.detach().reshape(-1)
            step_n = max(1, (64 << 20) // src.element_size())
            for off in range(0, src.numel(), step_n):
                dst[off:off + step_n].copy_(src[off:off + step_n], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    return event


def device_wait(event) -> None:  # pragma: no cover - needs CUDA
    """The compute stream waits for ``event`` (a GPU-side wait: the host goes on)."""
    torch.cuda.current_stream().wait_event(event)
