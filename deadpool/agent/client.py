"""A rank's side of its node agent: the board instead of the store for everything it polls.

    NodeLink.attach()   the board of the agent that started this process (None when no agent
                        did: the process then polls the store, as under srun today)
    BoardHeartbeat      the heartbeat thread: beat and progress into the board, fences and the
                        coordinator's loss out of it (``heartbeat.Heartbeat``'s interface)
    NodeLink            plans, aborts, done / stop and the job's step, read from the board and
                        the plan files the agent writes; the rank's reports to the coordinator
                        (status, timings, ...) written to files the agent sends on
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from deadpool.agent.board import (COORD_LOST, COORD_SEEN, JOB_DONE, JOB_STOP, NODE_DIR_ENV,
                                  NODE_INDEX_ENV, Doorbell, NodeBoard, open_doorbell, ring,
                                  waker_name)
from deadpool.agent.files import (CRASH, file_context, plan_file, read_file, report_path,
                                  report_text, write_whole)
from deadpool.rank.watchdog import Progress
from deadpool.store import auth, reports
from deadpool.store.protocol import Keys, Seal


def write_report(board, node_dir: Path, index: int, generation: int, kind: str, rank: int,
                 text: str, seal: Seal | None = None) -> None:
    """Local record ``index``'s next report, sealed with the job's secret (the agent sends on
    nothing else): in the record's mailbox on the board where it fits, else its file
    (``agent.node.report_file``); then its count on the board (the process of that record is
    the count's only writer)."""
    seal = seal or Seal(None)
    n = board.reports(index) + 1
    path = report_path(os.fspath(node_dir), index, n)
    sealed = seal.wrap(file_context(path), report_text(generation, kind, rank, text))
    if not board.put_report(index, n, sealed.encode("utf-8")):
        write_whole(path, sealed)
    board.set_reports(index, n)


def _job_seal(environ=os.environ) -> Seal:
    """The job's seal, from the secret the agent passed its children (none: unsealed, tests)."""
    if environ.get(auth.SECRET_ENV) or environ.get(auth.SECRET_FILE_ENV):
        return Seal(auth.load_secret(environ))
    return Seal(None)


def report_crash(slot: int, text: str, seal: Seal, connect, environ=os.environ) -> None:
    """A crashed process's last word for the coordinator (``crash/<slot>``, read when it sees the
    exit: ``recovery.detect``): through the node agent that started it, like its other reports
    (a file next to the board; the agent posts it before it writes the exit), else posted to the
    store on a client ``connect()`` opens."""
    link = NodeLink.attach(environ)
    if link is not None:
        link.report(-1, CRASH, slot, text)
    else:
        reports.post(connect(), seal, Keys.crash(slot), text)


class NodeLink:
    def __init__(self, node_dir: Path, index: int, seal: Seal | None = None):
        self.node_dir = Path(node_dir)
        self.index = index
        self.seal = seal if seal is not None else _job_seal()
        self.board = NodeBoard.open(self.node_dir / "board")
        self.slot = self.board.slot_of(index)
        self._lock = threading.Lock()
        self._bell = open_doorbell(self.node_dir)
        self._waker = Doorbell(self.node_dir, waker_name(index))  # rung by the agent (plans, flags)

    def wake(self) -> None:
        """Ring the agent's doorbell: a word it must act on at once changed."""
        ring(self._bell)

    def sleep(self, timeout_s: float) -> bool:
        """Block until the agent publishes a plan or sets a flag, or ``timeout_s``; True if woken
        (a ring left from while this process was busy also counts: the caller looks again)."""
        return self._waker.wait(timeout_s)

    @classmethod
    def attach(cls, environ=os.environ) -> "NodeLink | None":
        where = environ.get(NODE_DIR_ENV)
        return None if not where else cls(Path(where), int(environ[NODE_INDEX_ENV]),
                                          seal=_job_seal(environ))

    def plan_text(self, generation: int) -> str | None:
        """Plan ``generation``'s wire text (``deadpool.store.wire``) once the agent holds it (it writes
        each plan in turn); the caller decodes it against the plan it holds. A reader so far
        behind that the agent dropped that plan's file (it keeps the newest few) gets the
        newest plan's text instead: the caller decodes it, or on ``BaseMismatch`` reads the
        newest in full (``deadpool.store.wire.fetch_plan`` jumps to it too). Raises
        ``auth.AuthError`` for a file the job did not seal."""
        newest = self.board.plan_generation
        if newest < generation:
            return None
        for g in (generation, newest):
            path = plan_file(self.node_dir, g)
            try:
                return self.seal.unwrap(file_context(path), read_file(path))
            except FileNotFoundError:
                continue
        # (the agent replaced the newest meanwhile: the next poll finds it)
        return None

    def report(self, generation: int, kind: str, rank: int, text: str) -> None:
        """Rank ``rank``'s report of ``kind`` (status, timing, first_step, protected) for the
        coordinator: the file, then the board word the agent watches; the agent sends its
        node's reports on together (``NodeAgent.check_reports``)."""
        with self._lock:  # the training and replication threads both report
            write_report(self.board, self.node_dir, self.index, generation, kind, rank, text,
                         self.seal)
        self.wake()

    def aborted(self, generation: int) -> bool:
        return self.board.abort_generation >= generation

    @property
    def done(self) -> bool:
        return self.board.flag(JOB_DONE)

    @property
    def stopped(self) -> bool:
        return self.board.flag(JOB_STOP)

    @property
    def job_step(self) -> int | None:
        step = self.board.job_step
        return None if step < 0 else step


class BoardHeartbeat(threading.Thread):
    """``heartbeat.Heartbeat`` through the node's board: no store round trip per beat.

    It also watches the agent's own beat: an agent silent for ``node_timeout_s`` (stopped, or cut
    off) is a node whose fences cannot arrive, so the process fences itself. The worker passes
    ``ft.node_timeout_s`` less one agent interval: the job declares the node lost once its
    record has been silent for ``ft.node_timeout_s``, and the process must be gone by then (at
    the same timeout it raced the coordinator's kill of a stopped agent, which takes it along)."""

    def __init__(self, link: NodeLink, interval_s: float, progress: Progress,
                 node_timeout_s: float = float("inf")):
        super().__init__(name="heartbeat", daemon=True)
        self.link, self.interval_s, self.progress = link, interval_s, progress
        self.node_timeout_s = node_timeout_s
        self.coordinator_lost = threading.Event()
        self.seen_coordinator = False
        self.n = 0
        self.beat()

    def beat(self) -> None:
        self.n += 1
        p = self.progress
        self.link.board.write_beat(self.link.index, os.getpid(), self.n, p.count, p.step, p.phase)

    def run(self):
        board = self.link.board
        agent, t_agent = board.agent_beat, time.monotonic()
        while True:
            self.beat()
            if board.fenced(self.link.index):  # declared dead: never come back (after SIGCONT)
                os.kill(os.getpid(), signal.SIGKILL)
            if board.agent_beat != agent:
                agent, t_agent = board.agent_beat, time.monotonic()
            elif time.monotonic() - t_agent > self.node_timeout_s:
                print(f"[deadpool] slot {self.link.slot}: the node agent has been silent for "
                      f"{self.node_timeout_s} s; this node is lost, leaving", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if board.flag(COORD_SEEN):
                self.seen_coordinator = True
            if board.flag(COORD_LOST):
                self.coordinator_lost.set()
            time.sleep(self.interval_s)
