"""The node board: the shared memory through which a node agent and its local ranks talk.

One file per node, mapped by the agent and by each of its processes (``mmap``, on ``/dev/shm``
where it exists). Every field is a 64-bit word, written by one side only, so a reader never needs
a lock (a torn read across two words only shows a field one beat old, as the store's heartbeat
value did)::

    header (agent writes)      magic, abort generation (the newest generation aborted),
                               plan generation (the newest plan the agent holds for its ranks),
                               flags (coordinator seen / lost, job done / stop), job step, the
                               agent's own beat; the job's protected step and its latest
                               snapshot-interval decision (``deadpool.store.rounds``)
    one record per local slot  (the rank writes) pid, beat, progress count, step, phase, its
                               newest replicated step, its latest interval vote and how many
                               reports it wrote, which the agent sends on;
                               (the agent writes) fence, how many reports it took
    one mailbox per local slot a rank's newest report, when it fits and the agent took the one
                               before (``put_report``); else the report is a file next to the
                               board (``agent.node.report_file``)

A (generation, step) pair is packed into one word (``pack``), and a (generation, step, value)
triple (an interval vote or decision) into one word too (``pack3``): one aligned 64-bit store, so
a reader on any architecture sees the old triple or the new one, never a value of one with the
step of the other (a "value first, then the step word" protocol relies on x86's store order;
aarch64, e.g. GH200, may make the second store visible first, and Python has no barrier to
order them).

A process reads the header between its polled waits without a system call, where it used to ask
the store; its heartbeat is a few word writes, where it used to be three store round trips.

The other direction has a doorbell (``Doorbell``, a FIFO next to the board): after changing a word
the agent must act on at once (a replicated step, a vote, a report), a rank writes one byte to
it, and the agent, blocked on it, wakes. An idle node's agent then costs no CPU between its ticks.
Each local process has one too (``waker-<index>``), rung by the agent after it publishes a plan or
sets a flag: a warm spare waiting for its plan blocks on it instead of reading the board every
10 ms.
"""

from __future__ import annotations

import errno
import mmap
import os
import select
import zlib
from pathlib import Path

MAGIC = 0x4450_4E42_0005  # "DPNB" v5
HEADER_WORDS = 16
SLOT_WORDS = 24
MAILBOX_BYTES = 4096  # per slot: 3 words (report number, length, CRC-32), then the report
_MB_HEAD = 24
PHASE_BYTES = 64  # slot words 8-15
# header words
_MAGIC, _ABORT, _PLAN, _FLAGS, _JOB_STEP, _SLOTS, _AGENT_BEAT, _PROTECTED, _DECISION, _PAUSE = \
    range(10)  # _PAUSE: (g, step) every rank holds at for a migration (recovery.migrate)
# slot words
_SLOT, _PID, _BEAT, _PROG, _STEP, _FENCE, _REPLICATED, _VOTE = range(8)
_PHASE_WORD = 8
_COMPUTE = 16  # the rank's newest step and its compute time (straggler.pack_compute)
_REPORTS = 17
_TAKEN = 18  # (the agent writes) how many of the rank's reports it took
_STEP_BITS = 40


def pack(generation: int, step: int) -> int:
    """(generation, step) in one word: step >= -1 below 2**40, generation above."""
    return (generation << _STEP_BITS) | (step + 1)


def unpack(word: int) -> tuple[int, int]:
    if word < 0:
        return -1, -1
    return word >> _STEP_BITS, (word & ((1 << _STEP_BITS) - 1)) - 1


_K_BITS, _S3_BITS, _G3_BITS = 16, 30, 17  # 16 + 30 + 17 = 63: the word stays positive


def pack3(generation: int, step: int, value: int) -> int:
    """(generation, step, value) in one word: value below 2**16, step >= -1 below 2**30 - 1,
    generation below 2**17. Out of range raises (never a silently wrapped word)."""
    if not (0 <= value < 1 << _K_BITS and -1 <= step < (1 << _S3_BITS) - 1
            and 0 <= generation < 1 << _G3_BITS):
        raise ValueError(f"(generation {generation}, step {step}, value {value}) does not fit "
                         "one board word")
    return (generation << (_S3_BITS + _K_BITS)) | ((step + 1) << _K_BITS) | value


def unpack3(word: int) -> tuple[int, int, int]:
    if word < 0:
        return -1, -1, 0
    return (word >> (_S3_BITS + _K_BITS), ((word >> _K_BITS) & ((1 << _S3_BITS) - 1)) - 1,
            word & ((1 << _K_BITS) - 1))

COORD_SEEN, COORD_LOST, JOB_DONE, JOB_STOP = 1, 2, 4, 8
# set by the agent in its children's environment: where the board is, and the child's record
NODE_DIR_ENV, NODE_INDEX_ENV = "DEADPOOL_NODE_DIR", "DEADPOOL_NODE_INDEX"
DOORBELL = "doorbell"  # the FIFO next to the board


def waker_name(index: int) -> str:
    """The FIFO through which the agent wakes its local process of record ``index``."""
    return f"waker-{index}"


class Doorbell:
    """A FIFO next to the board that its owner blocks on (``wait``) and others ring (``ring``, or
    the module's ``ring`` on an ``open_doorbell`` end): the agent's, rung by its ranks after
    writing a word it must act on, and each process's waker, rung by the agent. The owner holds
    a writer end itself, so the FIFO never reads as closed while no one else has it open."""

    def __init__(self, node_dir: Path, name: str = DOORBELL):
        path = Path(node_dir) / name
        try:
            os.mkfifo(path, 0o600)
        except FileExistsError:
            pass
        self._r = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self._w = os.open(path, os.O_WRONLY | os.O_NONBLOCK)

    def ring(self) -> None:
        ring(self._w)

    def wait(self, timeout_s: float) -> bool:
        """Block until a ring or ``timeout_s``; True if rung (every pending ring is consumed)."""
        ready, _, _ = select.select([self._r], [], [], timeout_s)
        if not ready:
            return False
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass
        return True

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


def open_doorbell(node_dir: Path) -> int | None:
    """A rank's end of its agent's doorbell (None if there is none: the agent then finds the
    rank's words at its next periodic look)."""
    try:
        return os.open(Path(node_dir) / DOORBELL, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return None


def ring(fd: int | None) -> None:
    if fd is None:
        return
    try:
        os.write(fd, b"\0")
    except OSError as e:  # full (the agent has rings pending anyway) or the agent is gone
        if e.errno not in (errno.EAGAIN, errno.EPIPE):
            raise


class NodeBoard:
    """A mapped board. ``create`` (the agent) sizes and initialises it; ``open`` (a rank) maps it.

    Slot records are indexed by the local index (0 .. slots-1); the launch slot each belongs to is
    written at creation."""

    def __init__(self, path: Path, mm: mmap.mmap):
        self.path = Path(path)
        self._mm = mm
        self.words = memoryview(mm).cast("q")
        if self.words[_MAGIC] != MAGIC:
            raise ValueError(f"{path} is not a DeadPool node board")
        self.num_slots = int(self.words[_SLOTS])
        self._mailboxes = 8 * (HEADER_WORDS + SLOT_WORDS * self.num_slots)

    @classmethod
    def create(cls, path: Path, slots: list[int]) -> "NodeBoard":
        mailboxes = 8 * (HEADER_WORDS + SLOT_WORDS * len(slots))
        size = mailboxes + MAILBOX_BYTES * len(slots)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        w = memoryview(mm).cast("q")
        w[_ABORT] = w[_PLAN] = w[_JOB_STEP] = w[_PROTECTED] = w[_DECISION] = w[_PAUSE] = -1
        w[_SLOTS] = len(slots)
        for i, slot in enumerate(slots):
            base = HEADER_WORDS + SLOT_WORDS * i
            w[base + _SLOT] = slot
            w[base + _STEP] = w[base + _REPLICATED] = w[base + _VOTE] = -1
        mm[mailboxes:size] = bytes(size - mailboxes)  # touched now: no page fault per first report
        w[_MAGIC] = MAGIC  # last: a reader that sees the magic sees an initialised board
        w.release()
        return cls(path, mm)

    @classmethod
    def open(cls, path: Path) -> "NodeBoard":
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(path, mm)

    # -- header (the agent writes, ranks read) --------------------------------------------------------
    @property
    def abort_generation(self) -> int:
        return int(self.words[_ABORT])

    def announce_abort(self, generation: int) -> None:
        if generation > self.words[_ABORT]:
            self.words[_ABORT] = generation

    @property
    def plan_generation(self) -> int:
        return int(self.words[_PLAN])

    def publish_plan(self, generation: int) -> None:
        self.words[_PLAN] = generation

    def flag(self, bit: int) -> bool:
        return bool(self.words[_FLAGS] & bit)

    def set_flag(self, bit: int) -> None:
        self.words[_FLAGS] = self.words[_FLAGS] | bit

    @property
    def agent_beat(self) -> int:
        return int(self.words[_AGENT_BEAT])

    def beat_agent(self) -> None:
        self.words[_AGENT_BEAT] = self.words[_AGENT_BEAT] + 1

    @property
    def job_step(self) -> int:
        return int(self.words[_JOB_STEP])

    def set_job_step(self, step: int) -> None:
        self.words[_JOB_STEP] = step

    @property
    def protected(self) -> tuple[int, int]:
        """(generation, step): the newest step every rank of that generation replicated."""
        return unpack(int(self.words[_PROTECTED]))

    def set_protected(self, generation: int, step: int) -> None:
        if pack(generation, step) > self.words[_PROTECTED]:  # never backwards
            self.words[_PROTECTED] = pack(generation, step)

    @property
    def decision(self) -> tuple[int, int, int]:
        """(generation, vote step, interval) of the newest snapshot-interval decision."""
        return unpack3(int(self.words[_DECISION]))

    def set_decision(self, generation: int, step: int, interval: int) -> None:
        self.words[_DECISION] = pack3(generation, step, interval)  # one store: read whole

    @property
    def pause(self) -> tuple[int, int]:
        return unpack(int(self.words[_PAUSE]))

    def set_pause(self, generation: int, step: int) -> None:
        self.words[_PAUSE] = pack(generation, step)

    def set_compute(self, index: int, word: int) -> None:
        self.words[self._base(index) + _COMPUTE] = word

    def compute(self, index: int) -> int:
        return int(self.words[self._base(index) + _COMPUTE])

    # -- slot records ---------------------------------------------------------------------------------
    def _base(self, index: int) -> int:
        if not 0 <= index < self.num_slots:
            raise IndexError(f"local index {index} not on this board ({self.num_slots} slots)")
        return HEADER_WORDS + SLOT_WORDS * index

    def slot_of(self, index: int) -> int:
        return int(self.words[self._base(index) + _SLOT])

    def index_of(self, slot: int) -> int:
        for i in range(self.num_slots):
            if self.words[HEADER_WORDS + SLOT_WORDS * i + _SLOT] == slot:
                return i
        raise KeyError(f"slot {slot} is not on this node's board")

    def write_beat(self, index: int, pid: int, beat: int, progress: int, step: int,
                   phase: str) -> None:
        """The rank's heartbeat: phase first, the beat last (a reader that sees the new beat sees
        the rest of it, but for a phase changing in between, one beat stale). The step word is
        the training thread's (``set_step``, as it enters a step): a beat writes it only when a
        new process claims the record (its first beat), never after, so the older copy of the
        step a beat carries can never lower it."""
        b = self._base(index)
        raw = phase.encode()[:PHASE_BYTES].ljust(PHASE_BYTES, b"\0")
        start = 8 * (b + _PHASE_WORD)
        self._mm[start:start + PHASE_BYTES] = raw
        w = self.words
        if w[b + _PID] != pid:
            w[b + _STEP] = step
        w[b + _PID], w[b + _PROG] = pid, progress
        w[b + _BEAT] = beat

    def set_step(self, index: int, step: int) -> None:
        """The rank's step as it enters it, between beats (one word; the next beat writes it
        again)."""
        self.words[self._base(index) + _STEP] = step

    def read_beat(self, index: int) -> tuple[int, int, int, int, str]:
        """(pid, beat, progress, step, phase) of a local slot."""
        b = self._base(index)
        w = self.words
        start = 8 * (b + _PHASE_WORD)
        phase = bytes(self._mm[start:start + PHASE_BYTES]).rstrip(b"\0").decode(errors="replace")
        return int(w[b + _PID]), int(w[b + _BEAT]), int(w[b + _PROG]), int(w[b + _STEP]), phase

    def set_replicated(self, index: int, generation: int, step: int) -> None:
        self.words[self._base(index) + _REPLICATED] = pack(generation, step)

    def replicated(self, index: int) -> tuple[int, int]:
        """(generation, step) a local rank last finished replicating."""
        return unpack(int(self.words[self._base(index) + _REPLICATED]))

    def set_vote(self, index: int, generation: int, step: int, interval: int) -> None:
        self.words[self._base(index) + _VOTE] = pack3(generation, step, interval)  # one store

    def vote(self, index: int) -> tuple[int, int, int]:
        """(generation, step, interval) of a local rank's latest snapshot-interval vote."""
        return unpack3(int(self.words[self._base(index) + _VOTE]))

    def set_reports(self, index: int, n: int) -> None:
        """A local rank wrote its ``n``-th report (the file first)."""
        self.words[self._base(index) + _REPORTS] = n

    def reports(self, index: int) -> int:
        """How many reports a local rank wrote (``agent.node.report_file``)."""
        return int(self.words[self._base(index) + _REPORTS])

    def put_report(self, index: int, n: int, data: bytes) -> bool:
        """Report ``n`` of local rank ``index`` into its mailbox (then ``set_reports``): no file
        and no system call on either side. False if it does not fit or the agent has not taken
        the report there yet: the caller writes a file instead."""
        at = self._mailboxes + MAILBOX_BYTES * index
        w, head = self.words, at // 8
        if len(data) > MAILBOX_BYTES - _MB_HEAD or w[head] > w[self._base(index) + _TAKEN]:
            return False
        self._mm[at + _MB_HEAD:at + _MB_HEAD + len(data)] = data
        w[head + 1], w[head + 2] = len(data), zlib.crc32(data)
        w[head] = n  # last (a reader that sees an unfinished one finds its CRC wrong: ``take``)
        return True

    def take_report(self, index: int, n: int) -> tuple[bool, bytes | None]:
        """(whether report ``n`` of local rank ``index`` is in its mailbox, its bytes). (True,
        None): it is there but not whole yet (its words seen out of order, on a machine whose
        stores are not seen in program order): look again later. (False, None): it is a file."""
        head = (self._mailboxes + MAILBOX_BYTES * index) // 8
        if self.words[head] != n:
            return False, None
        length, crc = int(self.words[head + 1]), int(self.words[head + 2])
        start = 8 * head + _MB_HEAD
        data = bytes(self._mm[start:start + min(max(0, length), MAILBOX_BYTES - _MB_HEAD)])
        return True, (data if zlib.crc32(data) == crc and len(data) == length else None)

    def set_taken(self, index: int, n: int) -> None:
        """The agent took the local rank's first ``n`` reports (its mailbox is free again)."""
        self.words[self._base(index) + _TAKEN] = n

    def fenced(self, index: int) -> bool:
        return bool(self.words[self._base(index) + _FENCE])

    def fence(self, index: int) -> None:
        self.words[self._base(index) + _FENCE] = 1

    def close(self) -> None:
        self.words.release()
        self._mm.close()
