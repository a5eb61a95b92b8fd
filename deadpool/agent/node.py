"""One node's agent: the only process of a node that talks to the coordinator's store in steady
state.

``NodeAgent`` is the logic, driven by three callers in the agent process (``agent/__main__.py``),
or by the control-plane benchmark for thousands of simulated nodes::

    tick()          every ft.agent_interval_s: read the board (each local process's beat and
                    progress), judge them with a ``liveness.Liveness`` on this node's clock,
                    write one sealed record ``node/<n>`` (format: ``liveness.NodeLiveness``;
                    in the agent process handed to a writer thread, ``run_writer``) and beat
                    the board. The coordinator declares the node lost when the record stops,
                    its processes fence themselves when the board beat stops
                    (``client.BoardHeartbeat``): the beat stops with the record when the agent
                    is stopped or deaf, or when the store answers the coordinator but takes
                    no record from this node (``record_stuck``). A tick never waits on the
                    store: the coordinator's silence is judged on this clock from what
                    ``poll_store`` (another thread, its own client) last saw
    poll_store()    every second or so: the coordinator's heartbeat, the job's step
    apply(event)    a pushed event (agent/events.py; ``fetch`` first does its store reads, and
                    ``agent.loops.EventApplier`` retries or escalates): abort -> the board's abort generation;
                    plan -> fetch the plan once for the node (a delta), hand its text to the
                    local processes (a file next to the board) and restart their progress clocks; fence ->
                    SIGKILL the named local processes; done / stop -> board flags
    on_exit(slot)   a local process exited (seen by the process's waiter thread within
                    milliseconds): written at once, and the coordinator woken
                    (``nodes/changed``, a hint it reads every loop, then ``coord/wake``)
    check_rounds()  when a rank rings the board's doorbell: the node's part of the ranks'
                    agreements (``deadpool.store.rounds``: the newest step all its ranks replicated,
                    their snapshot-interval vote) changed -> written at once (the coordinator
                    reads it within half an interval); the results come back as ``protected``
                    / ``interval`` events for the board. And its ranks' new reports (a
                    status, timings: mailboxes on the board, or files) -> one sealed key per
                    node, kind and generation (``Keys.node_report``), rewritten as more arrive

The agent's state is guarded by its own lock, never held across a store call: a read that
stalls (a stopped coordinator, a plan fetch) holds up its own thread only. An agent that cannot
go on (``go_deaf``: events it cannot apply) stops its record and board beat: its node is lost.

What the node costs the store: one record per interval and one coordinator heartbeat read per
second, whatever its processes; per recovery, a write or two per node and kind of report.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from deadpool.agent.board import COORD_LOST, COORD_SEEN, JOB_DONE, JOB_STOP, NodeBoard
from deadpool.agent.files import (CRASH, file_context, plan_file, read_file,  # noqa: F401
                                  read_report, report_file, report_path, write_whole)
from deadpool.control.liveness import Liveness
from deadpool.launch.procs import process_stopped
from deadpool.rank.watchdog import IDLE, PEER_WAIT
from deadpool.store import reports
from deadpool.store.protocol import NODES_CHANGED, Keys, Plan, Seal, node_key, wake_coordinator
from deadpool.store.wire import fetch_plan

KEEP_PLAN_FILES = 4


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
        self.decode = decode  # deadpool.store.wire.decode_plan (the benchmark shares one per process)
        self.clock = clock
        self.lock = threading.RLock()  # the agent's state; never held across a store call
        self._send = threading.Lock()  # records go out in order (held across a write only)
        self.deaf: str | None = None  # why this agent cannot go on (``go_deaf``)
        # wait for the store's answer after each record (``silent_for`` then counts records the
        # store took, not records handed to a socket that may lead nowhere: a cut-off host)
        self.ack_records = False
        self._writer = False  # records handed to ``run_writer``'s thread
        self._outbox: tuple[str, bool] | None = None
        self._wake_writer = threading.Event()
        self.stuck_after_s = max(1.0, 4 * float(ft.get("agent_interval_s", 0.25)))
        self.on_forged = None  # called with a node file's name that failed its seal
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
        with self.lock:
            for i, slot in enumerate(self.slots):
                pid, beat, prog, step, phase = self.board.read_beat(i)
                if beat > 0:
                    self.pids[slot] = pid
                    self.live.update(slot, beat, prog, step, phase)

    def record(self) -> str:
        """This node's sealed-record text (``liveness.NodeLiveness`` reads it)."""
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
        self._rounds = replicated, vote = self._fold()
        if replicated is not None:
            detail["repl"] = replicated
        if vote is not None:
            detail["vote"] = vote
        if cmp := {str(s): w for s in ranks if (w := self.board.compute(self.index[s])) > 0}:
            detail["cmp"] = cmp  # each rank's newest step and compute time (rank/straggler.py)
        if self.exits:
            detail["exit"] = {str(s): c for s, c in self.exits.items()}
        if slow:
            detail["slow"] = slow
        if own:
            detail["own"] = own
        return head + (" " + json.dumps(detail, separators=(",", ":")) if detail else "")

    def publish(self, urgent: bool = False) -> bool:
        """Write the record (False, nothing written, once the agent went deaf). The text is
        made under the lock, the write is not; with a writer thread (``run_writer``) it is
        handed over and written there (a store that does not answer holds up only that)."""
        key = node_key(self.node)
        with self.lock:
            if self.deaf is not None:
                return False
            self.seq += 1
            text = self.seal.wrap(key, self.record())
            if self._writer:
                urgent = urgent or (self._outbox is not None and self._outbox[1])
                self._outbox = (text, urgent)
        if self._writer:
            self._wake_writer.set()
        else:
            self._write(text, urgent)
        return True

    def _write(self, text: str, urgent: bool) -> None:
        key = node_key(self.node)
        with self._send:
            self.store.set(key, text)
            if self.ack_records:  # a set is not answered: this is, after the set (one stream)
                self.store.check([key])
        self.last_contact = self.clock()
        if urgent:
            self.store.add(NODES_CHANGED, 1)
            wake_coordinator(self.store)

    def run_writer(self, stop) -> None:
        """The writer thread's loop (``agent.__main__``): the newest record handed over, each
        written once; a store error raises (the caller reconnects and calls again)."""
        self._writer = True
        while not stop.is_set():
            self._wake_writer.wait(0.5)
            self._wake_writer.clear()
            with self.lock:
                out, self._outbox = self._outbox, None
            if out is not None:
                try:
                    self._write(*out)
                except Exception:
                    with self.lock:  # written by the next try unless a newer one came
                        self._outbox = self._outbox or out
                    raise

    def record_stuck(self) -> bool:
        """The store answers the coordinator (its heartbeat advanced since) but has not taken
        this node's record for a while: the job is about to declare the node lost, so its
        processes must fence themselves (the board beat stops). A coordinator that stopped
        answering is not this: its processes then save and exit (``coordinator_timeout_s``)."""
        silent = self.silent_for()
        since_coord = self.clock() - self._coord[1]
        return (silent > self.stuck_after_s and self._coord[0] >= 0
                and silent - since_coord > self.stuck_after_s)

    def go_deaf(self, why: str) -> None:
        """This agent cannot carry out the coordinator's events: from now on it writes no
        record and no board beat, so the job declares its node lost within
        ``ft.node_timeout_s`` and the node's processes fence themselves just before
        (a node that is deaf but fresh would stall recoveries and never carry out a fence)."""
        with self.lock:
            if self.deaf is None:
                self.deaf = why

    def silent_for(self) -> float:
        """Seconds since the store last took this node's record (with ``ack_records``; else
        since one was last sent): past ``ft.node_timeout_s`` the coordinator has declared the
        node lost (it reads the same records on its own clock)."""
        return self.clock() - self.last_contact

    def tick(self) -> None:
        """Record and board beat, one signal; then the coordinator's silence, on this clock
        (no store read: ``poll_store`` reads, on its own thread and client). A failed write
        raises after the beat: the node's processes follow the agent, not the store (a stopped
        coordinator is the coordinator-loss path, a cut-off node fences itself by presence)."""
        self.observe()
        try:
            self.publish()
        finally:
            if self.deaf is None and not self.record_stuck():
                self.board.beat_agent()
            self.judge_coordinator()

    def poll_store(self, store=None) -> None:
        """The store reads the node needs now and then (every ``coord_every_s``): the
        coordinator's heartbeat, and the job's step for an idle spare's faults (rank/faults.py).
        ``store``: the caller's own client (a read that stalls holds up only its caller)."""
        store = store or self.store
        now = self.clock()
        if now - self._coord_checked < self.coord_every_s:
            return
        self._coord_checked = now
        self.check_coordinator(store=store)
        with self.lock:
            idle_spare = any(s not in self.assigned and s not in self.exits for s in self.slots)
        if idle_spare:
            self._job_step(store)

    def fold(self) -> tuple[list | None, list | None]:
        with self.lock:
            return self._fold()

    def _fold(self) -> tuple[list | None, list | None]:
        """This node's part of the agreements of generation ``plan_generation``: [g, the newest
        step every local rank replicated] once each has replicated one, and [g, step, the widest
        interval] once each voted at that step (``deadpool.store.rounds``). None where not yet."""
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

    def check_rounds(self, store=None) -> None:
        """Write the record at once when the node's part of an agreement moved (without waking
        the coordinator: it reads every record each half interval anyway, and a wake per node
        per snapshot would have it read them all at every node's snapshot); send on the reports
        the local ranks wrote since the last check (``store``: the caller's client for them)."""
        if self.fold() != self._rounds:
            self.publish()
        self.check_reports(store)

    def check_reports(self, store=None) -> None:
        """Send on the reports the local ranks wrote since the last check: one sealed key per
        generation and kind, holding every local rank's report of it so far (rewritten when
        one more arrives). Reports of generations two behind the newest are dropped, and so is
        one that fails its seal (``on_forged``). A crash report goes out at once as
        ``crash/<slot>`` of the process that wrote it (``client.report_crash``)."""
        crashes, where = {}, os.fspath(self.node_dir)
        with self.lock:
            for i in range(self.board.num_slots):
                n, done = self.board.reports(i), self._reports_read.get(i, 0)
                for k in range(done + 1, n + 1):
                    held, data = self.board.take_report(i, k)  # its mailbox, or a file
                    if held and data is None:
                        break  # not whole yet (its words seen out of order): the next check
                    r = read_report(report_path(where, i, k), self.seal, self.on_forged,
                                    data.decode("utf-8", "replace") if held else None)
                    done = k
                    if r is not None and r["kind"] == CRASH:
                        crashes[self.slots[i]] = r["text"]
                    if r is None or r["kind"] == CRASH:
                        continue
                    at = (int(r["g"]), str(r["kind"]))
                    self._reports.setdefault(at, {})[str(int(r["rank"]))] = r["text"]
                    self._unsent.add(at)
                if done != self._reports_read.get(i, 0):
                    self._reports_read[i] = done
                    self.board.set_taken(i, done)  # (its mailbox is free again)
        for slot, text in crashes.items():  # before its exit is written (``on_exit``)
            reports.post(store or self.store, self.seal, Keys.crash(slot), text)
        with self.lock:
            if not self._unsent:
                return
            newest = max(g for g, _ in self._reports)
            for at in [at for at in self._reports if at[0] < newest - 1]:
                del self._reports[at]
                self._unsent.discard(at)
            out = [(g, kind, json.dumps(self._reports[g, kind])) for g, kind in sorted(self._unsent)]
            self._unsent.clear()
        for n, (g, kind, text) in enumerate(out):
            try:
                reports.post(store or self.store, self.seal, Keys(g).node_report(kind, self.node),
                             text)
            except Exception:  # a store error leaves the rest for the next check
                with self.lock:
                    self._unsent.update((g2, k2) for g2, k2, _ in out[n:] if (g2, k2) in self._reports)
                raise

    def check_coordinator(self, error: bool = False, store=None) -> None:
        """Read the coordinator's heartbeat (``store``: the caller's client), then judge its
        silence (``judge_coordinator``)."""
        beat = -1
        store = store or self.store
        if not error and store is not None:
            try:
                beat = self.seal.count(store, Keys.COORD_HB, exists=self._coord[0] >= 0)
            except Exception:
                beat = -1
        with self.lock:
            if beat > self._coord[0]:
                self._coord = (beat, self.clock())
                self.board.set_flag(COORD_SEEN)
        self.judge_coordinator()

    def judge_coordinator(self) -> None:
        """The coordinator's heartbeat advanced within ``coordinator_timeout_s`` on this clock;
        else its processes save and exit. No store call: a read that hangs cannot delay it."""
        with self.lock:
            if self.clock() - self._coord[1] > self.coordinator_timeout_s:
                self.lose_coordinator()

    def lose_coordinator(self) -> None:
        """The coordinator is gone (its heartbeat stopped, or a signal found the store silent):
        the node's processes save what they hold and exit (``agent.client.BoardHeartbeat``)."""
        if not self.coordinator_lost:
            self.coordinator_lost = True
            self.board.set_flag(COORD_LOST)
            self.wake()

    def _job_step(self, store) -> None:
        if store.check([Keys.JOB_STEP]):
            text = self.seal.open(Keys.JOB_STEP, store.get(Keys.JOB_STEP))
            if text is not None:
                self.board.set_job_step(int(text))

    # -- the pushed part ------------------------------------------------------------------------------
    def on_exit(self, slot: int, code: int) -> None:
        with self.lock:
            self.exits[slot] = code
        try:  # its crash report (if any) first: the coordinator reads it when it sees the exit
            self.check_reports()
        except Exception:  # the store is gone: the exit is written all the same
            pass
        self.observe()  # the last beats, the dead process's included
        self.publish(urgent=True)

    def fetch(self, event: dict, store=None):
        """The store reads an event needs, done before ``apply`` and outside the lock (only the
        events thread changes the plan held): a plan's ``(plan, text)``, else None."""
        if event["kind"] != "plan":
            return None
        # fetched once per node; its processes get the same wire text (a delta of a few hundred
        # bytes), which each decodes against the plan it holds (NodeLink.plan_text)
        return fetch_plan(store or self.store, self.seal, int(event["g"]), self.plan,
                          self.group_keys, self.decode)

    def apply(self, event: dict, fetched=None) -> None:
        kind = event["kind"]
        if kind == "plan" and fetched is None:
            fetched = self.fetch(event)
        with self.lock:
            self._apply(event, kind, fetched)
        if kind in ("plan", "done", "stop"):
            self.wake()  # a process waiting for its plan (a warm spare) blocks on its waker

    def _apply(self, event: dict, kind: str, fetched) -> None:
        if kind == "abort":  # (carrying the fence of the ranks it is for: one event, not two)
            self.board.announce_abort(int(event["g"]))
            self._fence(event.get("slots", ()))
        elif kind == "plan":
            self._take_plan(*fetched)
        elif kind == "fence":
            self._fence(event["slots"])
        elif kind == "protected":
            self.board.set_protected(int(event["g"]), int(event["step"]))
        elif kind == "interval":
            self.board.set_decision(int(event["g"]), int(event["step"]), int(event["k"]))
        elif kind == "pause":  # a migration: every rank holds at this step (recovery.migrate)
            self.board.set_pause(int(event["g"]), int(event["step"]))
        elif kind == "done":
            self.board.set_flag(JOB_DONE)
        elif kind == "stop":
            self.board.set_flag(JOB_STOP)

    def _fence(self, slots) -> None:
        for slot in slots:
            if slot in self.index and slot not in self.fenced:
                self.fenced.add(slot)
                self.board.fence(self.index[slot])
                self.kill(slot)

    def _take_plan(self, plan: Plan, text: str) -> None:
        """Hand plan ``g`` (or the newer one ``fetch_plan`` jumped to) to the node's processes:
        its file, sealed, then the board's plan word; older files beyond the newest
        ``KEEP_PLAN_FILES`` go (a reader behind them gets the newest: ``NodeLink.plan_text``)."""
        g = plan.generation
        if g <= self.plan_generation:
            return  # (a jump already took it)
        if self._keys_for is not None and plan.layout != self._layout:  # an in-place reshape
            self._layout, self.group_keys = plan.layout, self._keys_for(plan.layout)
        path = plan_file(self.node_dir, g)
        write_whole(path, self.seal.wrap(file_context(path), text))
        self.plan, self.plan_generation = plan, g
        self.assigned = {s for s in self.slots if s in plan.slot_ranks}
        for s in self.assigned:  # every process starts the new generation's clock
            self.live.reset_progress(s)
        self.board.publish_plan(g)
        for old in self.node_dir.glob("plan-*.wire"):
            try:
                if int(old.stem.split("-")[1]) <= g - KEEP_PLAN_FILES:
                    old.unlink(missing_ok=True)
            except ValueError:
                pass
