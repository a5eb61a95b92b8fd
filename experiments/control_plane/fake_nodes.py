"""Fake nodes of ``--protocol new``: per node a real ``NodeAgent`` on a real shared-memory board,
its processes fake (see ``FakeNodes``)."""

from __future__ import annotations

import gc
import heapq
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from deadpool.policies import buddy_table
from deadpool.store import auth
from deadpool.store.protocol import Keys, RankStatus, Seal
from deadpool.topology import ParallelDims
from experiments.control_plane.common import (ALIVE, BUILT, DEAD, FIELDS, LAG, OPS, REACT_CPU,
                                              REACT_N, REACT_T, SILENT, STEP, VOTE_EVERY, WIN,
                                              CountedOps, note_plan_read)


class FakeNodes:
    """The fake nodes of one thread under node agents: per node a real ``NodeAgent`` (its real
    board in shared memory, record, pushed events on its own blocking store connection, plan
    fetch) whose processes are fake: they beat into the board, write their status to the board
    after an abort (as ``recovery.restore.report_status`` does; their agent sends the node's on
    in one key) and count when the plan reached
    them. A process sees an abort ``periods["abort"]`` and a plan ``periods["plan"]`` after its
    agent put it on the board (a local read, no store request)."""

    def __init__(self, host, port, secret, nodes: dict, world, rpn, periods, ft, flags, stats,
                 base, window, exit_req, root: Path, decode):
        from deadpool.agent.board import NodeBoard
        from deadpool.agent.node import NodeAgent
        from deadpool.rank.groups import keepable_keys

        self.host, self.port, self.secret = host, port, secret
        self.seal, self.flags, self.stats, self.base = Seal(secret), flags, stats, base
        self.periods, self.window, self.exit_req = periods, window, exit_req
        self.give_up_s = float(ft["node_timeout_s"])
        self.store = CountedOps(auth.open_store(host, port, secret, timeout_s=300))
        dims = ParallelDims(dp=world, ranks_per_node=rpn)
        self.ward = {b: r for r, b in enumerate(buddy_table(dims, "ring_over_nodes"))}
        keys = keepable_keys(dims, "ring_over_nodes")
        self.lock = threading.Lock()
        self.agents, self.slots = {}, {}
        self.heap = []
        now = time.monotonic()
        for i, (node, slots) in enumerate(sorted(nodes.items())):
            where = root / f"node{node}"
            where.mkdir(parents=True)
            board = NodeBoard.create(where / "board", slots)
            agent = NodeAgent(node, board, self.store, self.seal, ft, where, group_keys=keys,
                              decode=decode, kill=self._fence)
            self.agents[node], self.slots[node] = agent, slots
            agent.beats = {s: 0 for s in slots}
            agent.ranks_gen = {s: None for s in slots}  # generation a slot trains in (None: waits)
            agent.snap_due, agent.snap_step = now + periods["snap"], 0
            agent.publish()
            for s in slots:
                key = Keys.spare_ready(s)
                self.store.set(key, self.seal.wrap(key, repr(time.time())))
            stats[base + BUILT] += len(slots)  # start-up progress: slots announced
            self.heap.append((now + periods["agent"] * i / max(1, len(nodes)), node))
        heapq.heapify(self.heap)
        self.reacts: list[tuple[float, int, str, int]] = []  # (due, node, what, generation)
        self.woken = threading.Event()  # a follower queued a reaction: the runner looks at once
        self.win, self.lag = 0, 0.0

    def _fence(self, slot):
        self.flags[slot] = DEAD

    def _alive(self, node):
        return [s for s in self.slots[node] if self.flags[s] == ALIVE]

    def tick(self, node):
        agent = self.agents[node]
        alive = self._alive(node)
        if not alive and all(self.flags[s] == SILENT for s in self.slots[node]):
            return False  # the node went silent: its agent is gone with it
        for s in alive:  # the processes' heartbeat threads (fake: beat once per agent tick)
            agent.beats[s] += 1
            i = agent.index[s]
            phase = "forward" if agent.ranks_gen[s] is not None else "wait_plan"
            agent.board.write_beat(i, 1, agent.beats[s], agent.beats[s], STEP, phase)
        agent.tick()
        now = time.monotonic()
        if self.periods["snap"] and now >= agent.snap_due:
            # the node's training ranks finished replicating their next snapshot (and every
            # VOTE_EVERY snapshots voted an interval): their board words (rounds.BoardRounds),
            # which the agent's rounds thread sends on within milliseconds
            agent.snap_due = max(agent.snap_due + self.periods["snap"], now)
            agent.snap_step += 1
            for s in alive:
                g = agent.ranks_gen[s]
                if g is not None:
                    i = agent.index[s]
                    agent.board.set_replicated(i, g, agent.snap_step)
                    if agent.snap_step % VOTE_EVERY == 0:
                        agent.board.set_vote(i, g, agent.snap_step, 1)
            agent.check_rounds()
        return True

    def follow(self, node, stop):
        """The node agent's events thread: the real follower and applier (a failing event is
        retried with a fresh client, as ``agent.loops.EventApplier`` does in the agent; past
        ``ft.node_timeout_s`` the agent goes deaf and this node is lost to the job, which the
        benchmark then reports). Every wait is bounded: ``stop`` ends it within ``wait_s``."""
        from deadpool.agent.events import EventFollower
        from deadpool.agent.loops import EventApplier

        agent = self.agents[node]
        follower = EventFollower(lambda: CountedOps(auth.open_store(
            self.host, self.port, self.secret, timeout_s=300), self.store), self.seal, wait_s=60.0)
        applier = EventApplier(agent, lambda: self.store, self.give_up_s, log=self._log)
        while not stop.is_set():
            try:
                ev = follower.next(stop)
            except Exception:  # a connection refused under load: retry, as the real agent does
                stop.wait(0.5)
                continue
            if ev is None or all(self.flags[s] == SILENT for s in self.slots[node]):
                continue
            if not applier(ev):  # deaf: the node leaves (its record and board beat stop)
                return
            if ev["kind"] in ("abort", "plan"):
                with self.lock:
                    heapq.heappush(self.reacts, (time.monotonic() + self.periods[ev["kind"]],
                                                 node, ev["kind"], int(ev["g"])))
                self.woken.set()

    def _log(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def react(self, node, what, g):
        """The node's processes saw the board change."""
        agent = self.agents[node]
        by_slot = _by_slot(agent.plan)
        if what == "abort":  # each process writes its status next to the board
            from deadpool.agent.client import write_report

            cpu = time.thread_time()
            for s in self._alive(node):
                r = by_slot.get(s)
                if r is not None and agent.ranks_gen[s] == g:
                    status = RankStatus(r, s, STEP, [STEP], {self.ward.get(r, r): [STEP]})
                    write_report(agent.board, agent.node_dir, agent.index[s], g, "status", r,
                                 status.to_json(), seal=self.seal)
                    agent.ranks_gen[s] = None
            agent.check_reports()  # (the agent's rounds thread: within a few ms)
            # what one node spent reacting (on a real node, its own CPU), and when its reports
            # were out (this machine runs every node's reaction on its 2 cores, one after another)
            self.stats[self.base + REACT_CPU] += time.thread_time() - cpu
            self.stats[self.base + REACT_N] += 1
            self.stats[self.base + REACT_T] = max(self.stats[self.base + REACT_T], time.time())
            return
        n = 0  # (the processes decode the same text the agent decoded: its plan is theirs)
        for s in self._alive(node):
            agent.ranks_gen[s] = g if s in by_slot else None
            n += 1
        note_plan_read(self.stats, self.base, g, n)

    def run(self, stop):
        followers = [threading.Thread(target=self.follow, args=(node, stop), daemon=True)
                     for node in self.agents]
        for t in followers:
            t.start()
        while self.heap and not stop.is_set():
            now = time.monotonic()
            if self.window.value != self.win:
                self.win, self.lag = self.window.value, 0.0
            with self.lock:
                ex = self.exit_req.value
                if ex >= 0:
                    for node, slots in self.slots.items():
                        if ex in slots and self.flags[ex] == ALIVE:
                            self.flags[ex] = DEAD
                            self.agents[node].on_exit(ex, -9)  # its agent's waitpid returns
                # one node's reaction per turn, between the agents' ticks: a real agent's record
                # thread does not wait for its ranks' reports, so 128 nodes' reactions queued on
                # this thread must not hold every record back (they did: the coordinator then saw
                # 5,800 silent ranks at 16,384 and declared them failed)
                if self.reacts and self.reacts[0][0] <= now:
                    _, node, what, g = heapq.heappop(self.reacts)
                    self.react(node, what, g)
                due, node = self.heap[0]
                if due <= now:
                    heapq.heappop(self.heap)
                    self.lag = max(self.lag, now - due)
                    try:
                        if self.tick(node):
                            nxt = self.periods["agent"]
                            heapq.heappush(self.heap, (due + nxt if now - due < nxt else now + nxt,
                                                       node))
                    except Exception:  # the store went away (the size is over)
                        return
            self.stats[self.base + OPS] = self.store.ops
            self.stats[self.base + LAG] = self.lag
            self.stats[self.base + WIN] = self.win
            # sleep until the next tick or reaction is due; a follower queuing a reaction, the
            # benchmark's exit request and the end wake it (``watch``). (A 2 ms turn per runner,
            # each checking the cross-process stop event, was most of the harness's own CPU, a
            # cost no real node has, taken from the recovery it measures on 2 cores.)
            nxt = min(self.heap[0][0] if self.heap else float("inf"),
                      self.reacts[0][0] if self.reacts else float("inf"))
            wait = nxt - time.monotonic()
            if wait > 0:
                self.woken.wait(wait)
                self.woken.clear()


WATCH_S = 0.002  # how often one thread per fake process reads the benchmark's exit request and stop


def watch(stop, exit_req, local_stop: threading.Event, runners: list) -> None:
    """The fake process's one reader of the benchmark's shared words: the exit request (each
    runner then looks at once) and ``stop`` (a cross-process event: ``local_stop`` is what the
    runners and followers check, without the lock every ``is_set`` of the shared one takes)."""
    seen = exit_req.value
    while not stop.wait(WATCH_S):
        if exit_req.value != seen:
            seen = exit_req.value
            for fn in runners:
                fn.woken.set()
    local_stop.set()
    for fn in runners:
        fn.woken.set()


_BY_SLOT: dict[int, tuple[object, dict]] = {}


def _by_slot(plan) -> dict:
    """slot -> rank of a plan, once per plan object (``Plan.rank_of_slot`` scans every rank)."""
    if plan is None:
        return {}
    got = _BY_SLOT.get(id(plan))
    if got is None or got[0] is not plan:
        got = (plan, {v: k for k, v in plan.assignments.items()})
        _BY_SLOT[id(plan)] = got
    return got[1]


def fake_nodes_process(host, port, secret, nodes, world, rpn, periods, ft, flags, stats, first,
                       threads, window, exit_req, stop, shm_root):
    from deadpool.store.wire import decode_plan

    cache, lock = {}, threading.Lock()

    def decode(text, prev, keys=None):
        """One decode per process and text (a real node decodes its own, on its own CPU): the
        first thread to ask decodes under the lock, the node agents asking meanwhile wait for
        it (without the lock, 1,024 agents' threads decoded the 16,384-rank plan 0 at once)."""
        key = (text, None if prev is None else prev.generation)
        with lock:
            if key not in cache:
                cache[key] = decode_plan(text, prev, keys)
            return cache[key]

    root = Path(tempfile.mkdtemp(prefix=f"p{first}_", dir=shm_root))  # (removed by the caller too)
    items = sorted(nodes.items())
    parts = [dict(items[i::threads]) for i in range(threads)]
    fns = [FakeNodes(host, port, secret, part, world, rpn, periods, ft, flags, stats,
                     (first + i) * FIELDS, window, exit_req, root / f"t{i}", decode)
           for i, part in enumerate(parts)]
    # a real agent's process holds one node's objects; this one holds hundreds of nodes', which
    # every full collection scanned again (during a recovery too): they are long-lived, so frozen
    gc.collect()
    gc.freeze()
    local_stop = threading.Event()
    runners = [threading.Thread(target=fn.run, args=(local_stop,), daemon=True) for fn in fns]
    for t in runners:
        t.start()
    watch(stop, exit_req, local_stop, fns)
    for t in runners:
        t.join()
    shutil.rmtree(root, ignore_errors=True)


