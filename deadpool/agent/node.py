"""One node's agent: the only process of a node that talks to the coordinator's store in steady
state.

``NodeAgent`` is the logic, driven by three callers in the agent process (``agent/__main__.py``),
or by the control-plane benchmark for thousands of simulated nodes::

    tick()          every ft.agent_interval_s: read the board (each local process's beat and
                    progress), judge them with a ``watchdog.Liveness`` on this node's clock, and
                    write one sealed record ``node/<n>`` (format: ``watchdog.NodeLiveness``);
                    every second or so, check the coordinator's heartbeat
    apply(event)    a pushed event (agent/events.py): abort -> the board's abort generation;
                    plan -> fetch the plan once for the node (a delta), hand its text to the
                    local processes (a file next to the board) and restart their progress clocks; fence ->
                    SIGKILL the named local processes; done / stop -> board flags
    on_exit(slot)   a local process exited (seen by the process's waiter thread within
                    milliseconds): written at once, and the coordinator woken
                    (``nodes/changed``, a hint it reads every loop, then ``coord/wake``)
    check_rounds()  when a rank rings the board's doorbell: the node's part of the ranks'
                    agreements (``deadpool.rounds``: the newest step all its ranks replicated,
                    their snapshot-interval vote) changed -> written at once (the coordinator
                    reads it within half an interval); the results come back as ``protected``
                    / ``interval`` events for the board. And the reports its ranks wrote since
                    (``report_file``: a status after an abort, a new generation's timings, ...)
                    -> one sealed key per node, kind and generation (``Keys.node_report``),
                    rewritten as more arrive

What the node costs the store in steady state: one record per interval and one coordinator
heartbeat read per second, whatever the number of its processes; per recovery, a write or two
per node and kind of report instead of one per rank.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from deadpool import reports
from deadpool.agent.board import COORD_LOST, COORD_SEEN, JOB_DONE, JOB_STOP, NodeBoard
from deadpool.launcher import process_stopped
from deadpool.protocol import Keys, Plan, Seal, wake_coordinator
from deadpool.protocol_wire import fetch_plan
from deadpool.watchdog import IDLE, PEER_WAIT, Liveness

NODES_CHANGED = "nodes/changed"  # a wake-up hint for the coordinator (unsealed: it only wakes)
KEEP_PLAN_FILES = 4


def node_key(node: int) -> str:
    return f"node/{node}"


def write_whole(path: Path, text: str) -> None:
    """Write ``path`` so that a reader sees all of ``text`` or no file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def plan_file(node_dir: Path, generation: int) -> Path:
    return Path(node_dir) / f"plan-{generation}.wire"


def report_file(node_dir: Path, index: int, n: int) -> Path:
    """The ``n``-th report of the process of local record ``index`` (``agent.client.NodeLink
    .report``): JSON ``{"g", "kind", "rank", "text"}``."""
    return Path(node_dir) / f"report-{index}-{n}.json"


class NodeAgent:
    def __init__(self, node: int, board: NodeBoard, store, seal: Seal, ft: dict, node_dir: Path,
                 kill=None, group_keys=None, decode=None, clock=time.monotonic, wake=None):
        """``kill(slot)``: SIGKILL a local process; ``wake()``: ring every local process's waker
        (``board.waker_name``) after a plan or a flag it may be waiting on; ``group_keys``:
        ``groups.keepable_keys`` of the layout (plans on the wire may list kept groups as their
        complement), or a function of a plan's layout (``Plan.layout``) giving them: the agent
        then follows an in-place width change and decodes the next plans as deltas at the new
        width."""
        self.node, self.board, self.store, self.seal = node, board, store, seal
        self.node_dir = Path(node_dir)
        self.slots = [board.slot_of(i) for i in range(board.num_slots)]
        self.index = {s: i for i, s in enumerate(self.slots)}
        self.kill = kill or (lambda slot: None)
        self.wake = wake or (lambda: None)
        self._keys_for = group_keys if callable(group_keys) else None
        self.group_keys = group_keys({}) if callable(group_keys) else group_keys
        self._layout: dict = {}  # the layout of the plan held ({}: the configured width)
        self.decode = decode  # protocol_wire.decode_plan (the benchmark shares one per process)
        self.clock = clock
        self.live = Liveness(float(ft["heartbeat_timeout_s"]), float(ft["heartbeat_hard_timeout_s"]),
                             float(ft["progress_timeout_s"]), clock=clock)
        self.coordinator_timeout_s = float(ft["coordinator_timeout_s"])
        self.node_timeout_s = float(ft.get("node_timeout_s", float("inf")))
        self.last_contact = clock()  # the last record the store took (``silent_for``)
        self.coord_every_s = min(1.0, self.coordinator_timeout_s / 4)
        self.seq = 0
        self.exits: dict[int, int] = {}
        self.pids: dict[int, int] = {}
        self.assigned: set[int] = set()  # local slots holding a rank in the newest plan
        self.plan: Plan | None = None
        self.plan_generation = -1
        self.fenced: set[int] = set()
        self._coord = (-1, clock())  # (newest coordinator beat, when it advanced)
        self._coord_checked = -1e9
        self.coordinator_lost = False
        self._rounds: tuple | None = None  # the node's part of the agreements last written
        self._reports_read: dict[int, int] = {}  # local index -> reports sent on so far
        self._reports: dict[tuple[int, str], dict[str, str]] = {}  # (g, kind) -> rank -> text
        self._unsent: set[tuple[int, str]] = set()  # (g, kind) changed since its key was written

    # -- the periodic part ----------------------------------------------------------------------------
    def observe(self) -> None:
        for i, slot in enumerate(self.slots):
            pid, beat, prog, step, phase = self.board.read_beat(i)
            if beat > 0:
                self.pids[slot] = pid
                self.live.update(slot, beat, prog, step, phase)

    def record(self) -> str:
        """This node's sealed-record text (``watchdog.NodeLiveness`` reads it)."""
        live = self.live
        ranks = [s for s in self.slots if s in self.assigned and s not in self.exits]
        busy = [s for s in ranks if live.phase.get(s, "start") not in IDLE]
        stalled = [s for s in ranks if live.stalled(s)]
        own = [s for s in stalled if live.phase.get(s) not in PEER_WAIT]
        # the newest step includes the last beat of a process that just exited (the step it
        # died in: a restart's failed_at_step)
        steps = [live.step.get(s, -1) for s in self.slots if s in self.assigned]
        slow = {}
        for s in self.slots:
            age = live.beat_age(s)
            if s not in self.exits and age is not None and age > live.soft_s / 2:
                pid = self.pids.get(s)
                slow[str(s)] = [round(age, 3), pid is not None and process_stopped(pid)]
        head = f"{self.seq} {self.plan_generation} {max(steps, default=-1)} {len(busy)} {len(stalled)}"
        detail = {}
        self._rounds = replicated, vote = self.fold()
        if replicated is not None:
            detail["repl"] = replicated
        if vote is not None:
            detail["vote"] = vote
        if self.exits:
            detail["exit"] = {str(s): c for s, c in self.exits.items()}
        if slow:
            detail["slow"] = slow
        if own:
            detail["own"] = own
        return head + (" " + json.dumps(detail, separators=(",", ":")) if detail else "")

    def publish(self, urgent: bool = False) -> None:
        self.seq += 1
        key = node_key(self.node)
        self.store.set(key, self.seal.wrap(key, self.record()))
        self.last_contact = self.clock()
        if urgent:
            self.store.add(NODES_CHANGED, 1)
            wake_coordinator(self.store)

    def silent_for(self) -> float:
        """Seconds since the store last took this node's record: past ``ft.node_timeout_s`` the
        coordinator has declared the node lost (it reads the same records on its own clock)."""
        return self.clock() - self.last_contact

    def tick(self) -> None:
        self.observe()
        self.publish()
        now = self.clock()
        if now - self._coord_checked >= self.coord_every_s:
            self._coord_checked = now
            self.check_coordinator()
        if any(s not in self.assigned and s not in self.exits for s in self.slots):
            self._job_step()  # an idle spare's faults key on the job's step (faults.py)

    def fold(self) -> tuple[list | None, list | None]:
        """This node's part of the agreements of generation ``plan_generation``: [g, the newest
        step every local rank replicated] once each has replicated one, and [g, step, the widest
        interval] once each voted at that step (``deadpool.rounds``). None where not yet."""
        g = self.plan_generation
        ranks = [self.index[s] for s in sorted(self.assigned) if s not in self.exits]
        if not ranks:
            return None, None
        reps = [self.board.replicated(i) for i in ranks]
        replicated = [g, min(st for _, st in reps)] if all(rg == g for rg, _ in reps) else None
        votes = [self.board.vote(i) for i in ranks]
        vote = None
        if all(vg == g for vg, _, _ in votes) and len({st for _, st, _ in votes}) == 1:
            vote = [g, votes[0][1], max(k for _, _, k in votes)]
        return replicated, vote

    def check_rounds(self) -> None:
        """Write the record at once when the node's part of an agreement moved (without waking
        the coordinator: it reads every record each half interval anyway, and a wake per node
        per snapshot would have it read them all at every node's snapshot); send on the reports
        the local ranks wrote since the last check."""
        if self.fold() != self._rounds:
            self.publish()
        self.check_reports()

    def check_reports(self) -> None:
        """Send on the reports the local ranks wrote since the last check: one sealed key per
        generation and kind, holding every local rank's report of it so far (rewritten when
        one more arrives). Reports of generations two behind the newest are dropped."""
        for i in range(self.board.num_slots):
            n, done = self.board.reports(i), self._reports_read.get(i, 0)
            for k in range(done + 1, n + 1):
                path = report_file(self.node_dir, i, k)
                try:
                    r = json.loads(path.read_text())
                    path.unlink()
                except (OSError, ValueError):
                    continue  # (the rank writes the file before the word: not expected)
                at = (int(r["g"]), str(r["kind"]))
                self._reports.setdefault(at, {})[str(int(r["rank"]))] = r["text"]
                self._unsent.add(at)
            self._reports_read[i] = max(n, done)
        if not self._unsent:
            return
        newest = max(g for g, _ in self._reports)
        for at in [at for at in self._reports if at[0] < newest - 1]:
            del self._reports[at]
            self._unsent.discard(at)
        for g, kind in sorted(self._unsent):  # a store error leaves the rest for the next check
            reports.post(self.store, self.seal, Keys(g).node_report(kind, self.node),
                         json.dumps(self._reports[g, kind]))
            self._unsent.discard((g, kind))

    def check_coordinator(self, error: bool = False) -> None:
        """The coordinator's heartbeat advanced lately; else its processes save and exit."""
        beat = None
        if not error:
            try:  # once seen, the key always exists: one request, not two
                text = self.seal.open(Keys.COORD_HB, self.store.get(Keys.COORD_HB)) \
                    if self._coord[0] >= 0 or self.store.check([Keys.COORD_HB]) else None
                beat = None if text is None else int(text)
            except Exception:
                beat = None
        now = self.clock()
        if beat is not None and beat > self._coord[0]:
            self._coord = (beat, now)
            self.board.set_flag(COORD_SEEN)
        elif now - self._coord[1] > self.coordinator_timeout_s:
            self.lose_coordinator()

    def lose_coordinator(self) -> None:
        """The coordinator is gone (its heartbeat stopped, or a signal found the store silent):
        the node's processes save what they hold and exit (``agent.client.BoardHeartbeat``)."""
        if not self.coordinator_lost:
            self.coordinator_lost = True
            self.board.set_flag(COORD_LOST)
            self.wake()

    def _job_step(self) -> None:
        if self.store.check([Keys.JOB_STEP]):
            text = self.seal.open(Keys.JOB_STEP, self.store.get(Keys.JOB_STEP))
            if text is not None:
                self.board.set_job_step(int(text))

    # -- the pushed part ------------------------------------------------------------------------------
    def on_exit(self, slot: int, code: int) -> None:
        self.exits[slot] = code
        self.observe()  # the last beats, the dead process's included
        self.publish(urgent=True)

    def apply(self, event: dict) -> None:
        kind = event["kind"]
        if kind == "abort":
            self.board.announce_abort(int(event["g"]))
        elif kind == "plan":
            self._take_plan(int(event["g"]))
        elif kind == "fence":
            for slot in event["slots"]:
                if slot in self.index and slot not in self.fenced:
                    self.fenced.add(slot)
                    self.board.fence(self.index[slot])
                    self.kill(slot)
        elif kind == "protected":
            self.board.set_protected(int(event["g"]), int(event["step"]))
        elif kind == "interval":
            self.board.set_decision(int(event["g"]), int(event["step"]), int(event["k"]))
        elif kind == "done":
            self.board.set_flag(JOB_DONE)
        elif kind == "stop":
            self.board.set_flag(JOB_STOP)
        if kind in ("plan", "done", "stop"):
            self.wake()  # a process waiting for its plan (a warm spare) blocks on its waker

    def _take_plan(self, g: int) -> None:
        # fetched once per node; its processes get the same wire text (a delta of a few hundred
        # bytes), which each decodes against the plan it holds (NodeLink.plan_text)
        plan, text = fetch_plan(self.store, self.seal, g, self.plan, self.group_keys, self.decode)
        if self._keys_for is not None and plan.layout != self._layout:  # an in-place reshape
            self._layout, self.group_keys = plan.layout, self._keys_for(plan.layout)
        write_whole(plan_file(self.node_dir, g), text)
        self.plan, self.plan_generation = plan, g
        self.assigned = {s for s in self.slots if s in plan.slot_ranks}
        for s in self.assigned:  # every process starts the new generation's clock
            self.live.reset_progress(s)
        self.board.publish_plan(g)
        old = plan_file(self.node_dir, g - KEEP_PLAN_FILES)
        old.unlink(missing_ok=True)
