"""Fault injection from config: kill, hang or crash a rank at a given step and phase.

Faults are keyed by (rank, step, phase) and fire once per job, recorded in the store first (the
coordinator reads the time of the fault to measure detection and recovery). A fault is tied to
the *launch slot* that held the rank when it fired, so the spare that replaces a killed rank does
not kill itself again when it replays the same step.

    kill       SIGKILL the process (a crashed node)
    stop       SIGSTOP the process (a hung node: sockets stay open, heartbeats stop)
    exception  raise in the training step (the rank reports it and leaves)
"""

from __future__ import annotations

import enum
import json
import os
import signal
import time
from dataclasses import dataclass

from deadpool.protocol import Keys


class Fault(str, enum.Enum):
    KILL = "kill"
    STOP = "stop"
    EXCEPTION = "exception"


PHASES = ("step_start", "mid_step", "replication")


class InjectedFault(RuntimeError):
    """Raised by an ``exception`` fault inside the training step."""


@dataclass(frozen=True)
class FaultEvent:
    rank: int
    step: int
    phase: str
    kind: Fault

    @classmethod
    def from_cfg(cls, d) -> "FaultEvent":
        phase = str(d["phase"])
        if phase not in PHASES:
            raise ValueError(f"fault phase {phase!r} is not one of {PHASES}")
        return cls(int(d["rank"]), int(d["step"]), phase, Fault(str(d["kind"])))


class FaultInjector:
    """Fires the configured faults for one process. ``fire`` is called at each (step, phase)."""

    def __init__(self, events, slot: int, store=None):
        self.events = [e if isinstance(e, FaultEvent) else FaultEvent.from_cfg(e) for e in events]
        self.slot = slot
        self.store = store
        self.rank: int | None = None
        self.fired: set[FaultEvent] = set()

    def set_rank(self, rank: int) -> None:
        self.rank = rank

    def fire(self, step: int, phase: str) -> None:
        for ev in self.events:
            if ev.rank == self.rank and ev.step == step and ev.phase == phase and ev not in self.fired:
                # only the process that first held the rank at this step carries the fault
                key = Keys.fault_fired(ev.rank, ev.step, ev.phase)
                if self.store is not None and self.store.add(key, 1) != 1:
                    continue
                self.fired.add(ev)
                self._act(ev)

    def _act(self, ev: FaultEvent) -> None:
        if self.store is not None:
            rec = {"t": time.time(), "rank": ev.rank, "step": ev.step, "phase": ev.phase,
                   "kind": ev.kind.value, "slot": self.slot}
            self.store.set(Keys.fault(self.slot), json.dumps(rec))
        if ev.kind is Fault.KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        elif ev.kind is Fault.STOP:
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            raise InjectedFault(f"injected exception on rank {ev.rank} at step {ev.step} ({ev.phase})")
