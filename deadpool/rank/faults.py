"""Fault injection from config: kill, stop, crash, hang or corrupt a process at a chosen moment.

A fault names its target by ``rank`` (whichever process holds that rank when the moment comes) or
by ``slot`` (a launch slot: a warm spare, or the process that takes over a rank), a ``step`` and
a ``phase``. It fires the first time its target reaches ``phase`` at a step >= ``step``, once per
job: the first firing is recorded in the store (the coordinator reads its time to measure
detection and recovery), so the spare that replays the step does not fire it again.

Phases of training (the step number is the step being computed)::

    step_start / forward   before the forward pass
    backward               after the forward pass, before backward
    mid_step               after backward, before the gradient all-reduce
    allreduce              inside the gradient all-reduce (peers are waiting in it)
    optimizer              after the all-reduce, before the gradient norm and the optimizer step
    param_gather           inside the optimizer step: this rank's shard is updated, its
                           data-parallel peers wait for it in the parameter all-gather
    snapshot_copy          in the snapshot copier thread
    replication            in the replication thread, after the first chunk is sent

Phases of a recovery (the step number is the resume step)::

    status        after the abort, before this rank reports what it can resume from
    rebuild       inside the group rebuild (after the world group, before the others)
    transfer      inside the state transfer (sender: first chunk posted; receiver: first chunk in)
    rollback      before rolling back to a local snapshot
    repl_restart  after replication restarted, before the first step
    idle          a warm spare waiting for a plan (step: the job's newest step)
    checkpoint    before writing the resume step's state to disk for the coordinator (an
                  in-place elastic regroup, or a checkpoint-and-stop)
    final         inside the job's final write, once its first bytes are on disk (at the job's
                  last step, which a ``step`` below it names too; ``checkpoint.final``)

Kinds::

    kill       SIGKILL the process (a crashed process)
    kill_node  SIGKILL the process's node agent, then the process: the whole node is lost (its
               other processes die with their agent; needs launcher.agents=true)
    stop       SIGSTOP the process (a hung node: sockets stay open, heartbeats stop)
    stop_agent SIGSTOP the process's node agent (a hung agent, its processes running on): its
               record and board beat stop together, so the job declares the node lost and the
               node's processes fence themselves; the stopped agent is killed at the fence
               (needs launcher.agents=true)
    exception  raise in the thread that reached the phase (the step, or a helper thread)
    hang       that thread sleeps forever while the process and its heartbeat live on
               (a stuck kernel or collective: only the progress watchdog can see it)
    corrupt    flip bytes in the replicas this process holds (caught by the checksum when used);
               in a step phase, one parameter bit: ``where: shard_copy`` (default) a copy of a
               dp peer's shard, ``where: tp_replicated`` a norm weight (``recovery.integrity``)
    slow       from step ``step`` on, this process sleeps ``delay_s`` in every step, counted as
               its own compute (a throttled GPU: ``deadpool.rank.straggler``); it stays with the
               process, so the spare that takes its rank over is not slow (``phase`` optional)
    stall      the thread that reached the phase sleeps ``delay_s`` once, then goes on, while
               the heartbeat thread keeps beating (a transient hiccup: a GC pause, a file-system
               stall); in a phase that must progress, longer than ``ft.progress_timeout_s`` it
               looks like a hang to the progress watchdog (a false detection to survive)
"""

from __future__ import annotations

import enum
import json
import os
import signal
import time
from dataclasses import dataclass

from deadpool.agent.board import NODE_DIR_ENV
from deadpool.store import reports
from deadpool.store.protocol import Keys, Seal

TRAIN_PHASES = ("step_start", "forward", "backward", "pp_warmup", "pp_cooldown", "mid_step",
                "allreduce", "optimizer", "param_gather", "snapshot_copy", "replication")
RECOVERY_PHASES = ("status", "rebuild", "transfer", "rollback", "repl_restart", "idle",
                   "checkpoint", "final")
PHASES = TRAIN_PHASES + RECOVERY_PHASES


class Fault(str, enum.Enum):
    KILL = "kill"
    KILL_NODE = "kill_node"
    STOP = "stop"
    STOP_AGENT = "stop_agent"
    EXCEPTION = "exception"
    HANG = "hang"
    CORRUPT = "corrupt"
    SPIKE = "spike"
    SLOW = "slow"
    STALL = "stall"


class InjectedFault(RuntimeError):
    """Raised by an ``exception`` fault."""


@dataclass(frozen=True)
class FaultEvent:
    rank: int | None
    step: int
    phase: str
    kind: Fault
    slot: int | None = None
    delay_s: float = 0.0  # a ``slow`` fault's sleep per step; a ``stall``'s one sleep
    where: str = ""       # a ``corrupt`` fault's parameter in a step: shard_copy, tp_replicated

    @classmethod
    def from_cfg(cls, d) -> "FaultEvent":
        phase = str(d.get("phase", "step_start") if str(d["kind"]) == "slow" else d["phase"])
        if phase not in PHASES:
            raise ValueError(f"fault phase {phase!r} is not one of {PHASES}")
        rank, slot = d.get("rank"), d.get("slot")
        if (rank is None) == (slot is None):
            raise ValueError(f"fault {dict(d)} must name exactly one of rank or slot")
        where = str(d.get("where") or "")
        if where not in ("", "shard_copy", "tp_replicated"):
            raise ValueError(f"fault where {where!r} is not shard_copy or tp_replicated")
        return cls(None if rank is None else int(rank), int(d["step"]), phase, Fault(str(d["kind"])),
                   None if slot is None else int(slot), float(d.get("delay_s", 0.0)), where)

    @property
    def key(self) -> str:
        who = f"r{self.rank}" if self.rank is not None else f"s{self.slot}"
        return Keys.fault_fired(who, self.step, self.phase)


class FaultInjector:
    """Fires the configured faults for one process. ``fire`` is called at each (step, phase).

    ``on_corrupt`` is called for a ``corrupt`` fault in the snapshot threads (the snapshot engine
    flips replica bytes), ``on_flip`` for one in the step (a parameter bit), ``on_spike`` for a
    ``spike`` (the trainer's loss of the step); the trainer sets the last two.
    """

    def __init__(self, events, slot: int, store=None, on_corrupt=None, seal=None):
        self.events = [e if isinstance(e, FaultEvent) else FaultEvent.from_cfg(e) for e in events]
        self.slot = slot
        self.store = store
        self.rank: int | None = None
        self.fired: set[FaultEvent] = set()
        self.on_corrupt = on_corrupt
        self.on_flip = self.on_spike = None
        self.seal = seal if seal is not None else Seal(None)  # the fault record is sealed
        self.delay_s = 0.0  # a fired ``slow`` fault: this process sleeps so long in every step

    def set_rank(self, rank: int | None) -> None:
        self.rank = rank

    def fire(self, step: int, phase: str) -> None:
        if not self.events:
            return
        for ev in self.events:
            if ev.phase != phase or step < ev.step or ev in self.fired:
                continue
            if ev.slot is not None and ev.slot != self.slot:
                continue
            if ev.rank is not None and ev.rank != self.rank:
                continue
            # only the first process to reach the moment carries the fault
            if self.store is not None and self.store.add(ev.key, 1) != 1:
                self.fired.add(ev)
                continue
            self.fired.add(ev)
            self._act(ev, step)

    def _act(self, ev: FaultEvent, step: int) -> None:
        t = time.time()
        if self.store is not None:
            rec = {"t": t, "rank": self.rank, "step": step, "phase": ev.phase,
                   "kind": ev.kind.value, "slot": self.slot}
            reports.post(self.store, self.seal, Keys.fault(self.slot), json.dumps(rec))
        print(f"[fault] {ev.kind.value} at {ev.phase} of step {step} (rank {self.rank}, slot "
              f"{self.slot}, t={t:.6f})", flush=True)  # t: how far apart two faults fired
        if ev.kind is Fault.KILL_NODE and os.environ.get(NODE_DIR_ENV):
            os.kill(os.getppid(), signal.SIGKILL)  # the agent: its children die with it
            os.kill(os.getpid(), signal.SIGKILL)
        if ev.kind is Fault.STOP_AGENT:
            if not os.environ.get(NODE_DIR_ENV):
                raise InjectedFault("a stop_agent fault needs node agents (launcher.agents=true)")
            os.kill(os.getppid(), signal.SIGSTOP)  # the agent; this process trains on
        elif ev.kind in (Fault.KILL, Fault.KILL_NODE):
            os.kill(os.getpid(), signal.SIGKILL)
        elif ev.kind is Fault.STOP:
            os.kill(os.getpid(), signal.SIGSTOP)
        elif ev.kind is Fault.HANG:
            while True:  # this thread is stuck; the others (heartbeat included) go on
                time.sleep(3600)
        elif ev.kind is Fault.SLOW:
            self.delay_s = ev.delay_s
        elif ev.kind is Fault.STALL:
            time.sleep(ev.delay_s)  # this thread only; the heartbeat beats on
        elif ev.kind is Fault.CORRUPT:
            in_step = ev.phase in TRAIN_PHASES and ev.phase not in ("snapshot_copy", "replication")
            hook = self.on_flip if in_step else self.on_corrupt
            self.where = ev.where  # read by on_flip
            if hook is not None:
                hook()
        elif ev.kind is Fault.SPIKE:
            if self.on_spike is not None:
                self.on_spike()
        else:
            raise InjectedFault(f"injected exception at {ev.phase} of step {step} (rank "
                                f"{self.rank}, slot {self.slot})")
