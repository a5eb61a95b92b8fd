"""Control-plane benchmark: the store protocol with N fake ranks and the real coordinator.

    python experiments/bench_control_plane.py --ranks 512,2048,8192,16384 --out DIR
        [--protocol new,old] [--duration-s 10] [--ranks-per-node 8] [--procs 2] [--threads 8]
        [--dilation 1|auto|D1,D2,...] [--phases steady,exit,node]

``--protocol new`` (node agents, deadpool/agent): per fake node a real ``NodeAgent`` on a real
shared-memory board, following the coordinator's pushed events on its own blocking store
connection, fetching each plan (a delta) once, writing its sealed record every
``ft.agent_interval_s``; the node's processes are fake (they beat into the board at each of the
agent's ticks, write their status next to the board after an abort, which their agent sends on
in one key per node, and see a plan one local poll after their agent has it). The coordinator is the real one with ``watchdog.NodeLiveness`` and
the real ``launcher.AgentLauncher`` minus process start-up (as under a remote launcher, a dead
agent shows only as a silent record). An exit is the agent's ``waitpid`` returning; a silent
node is an agent that stops. ``--protocol old`` is what follows:

One process holds the real ``TCPStore`` (``auth.serve_store``) and the real ``Coordinator`` (its
loop: detection, abort, status collection, planning, plan writing) with a launcher stand-in.
``--procs`` other processes hold the N fake ranks plus warm spares, ``--threads`` store
connections each, speaking the worker's store protocol (no torch, no training):

    every heartbeat_interval_s  set hb/<slot> (sealed), get coord/hb, every 4th beat check fence
    every collective_poll_s     a training rank checks g<g>/abort (the abort watcher, comm.py)
    every 10 ms                 a process waiting for a plan checks plan/<g> (every 10th poll
                                also job/stop); an idle spare also reads job/step every 50 ms
    after an abort              post its sealed RankStatus (``reports.post``), then wait for
                                the next plan
    every --snapshot-every-s    a training rank's snapshot agreements (``deadpool.rounds``):
                                its replicated step (an ``add`` on ``repl_done/<step>``), and
                                every 16th an interval vote (2 adds, 2 reads)

Under ``--protocol new`` the same agreements go through the board: each node's ranks set their
words, the agent writes its record at once, the coordinator pushes ``protected`` (and the vote's
``interval``) as events every agent follows. Not modelled: the progress line (rank 0 only),
group rendezvous and state transfer. A real rank opens five store connections; the fake ranks of
one thread share one.

Per N it measures, in order:

    steady  ``--duration-s`` of steady state: store requests per second per rank (the fake
            ranks' and the coordinator's; a multi_get counts one), and the coordinator's CPU (its
            loop and heartbeat threads, not the store's own thread) as a fraction of one core
    exit    rank 1's process exits (the launcher's poll reports it) -> detected
            (``exit_detect_s``) -> plan g+1 written (``detect_to_plan_s``: the abort, every
            survivor's status, the crash, error, bad-copy and fault reports, planning, the plan;
            ``recovery_store_ops``: the coordinator's store requests meanwhile, O(nodes +
            failures) with posted reports) -> read by every live fake process
            (``plan_everywhere_s``)
    node    every rank of one node goes silent, no exit seen (as under srun) -> detected
            (``node_detect_s``: bounded below by ``ft.heartbeat_hard_timeout_s``, 10 s, unless
            an abort finds them silent first)

``--dilation D`` multiplies every protocol period and timeout by D (the coordinator's own 10 ms
loop excepted), so the offered load is 1/D: the fake ranks' rates are reported multiplied by D
and the period-driven times (node detection, plan reads) divided by D (undilated equivalents;
an exit is seen by the undilated loop and reported as measured), and D is written in the table (``auto``: N / 256, at least 1; a
list: one per size). Dilation stretches what is driven by periods; the plan's bytes (every rank
reads the whole plan) are not stretched, so ``plan_everywhere_s`` under dilation is optimistic
at large N. ``--phases`` leaves phases out (the node phase waits D x 10 s). A size is ``survived`` when the fake
ranks kept their schedule (lag below one heartbeat interval), the coordinator declared no healthy
rank dead, and both recoveries were planned and read everywhere in time; the sizes after the
first one that does not survive are not run.

Writes ``DIR/table.csv`` (``ranks, protocol, store_ops_per_s_per_rank, exit_detect_s,
node_detect_s, plan_everywhere_s, coordinator_cpu_frac, detect_to_plan_s, recovery_store_ops,
dilation, survived``; ``detect_to_plan_s`` is divided by D, as the statuses come at the
fake processes' dilated pace) and
``DIR/runs.json``. Not modelled in either protocol: the progress line, group rendezvous and
transfers.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import json
import multiprocessing as mp
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool import auth, reports  # noqa: E402
from deadpool.agent.events import EventLog  # noqa: E402
from deadpool.coordinator import Coordinator  # noqa: E402
from deadpool.launcher import AgentLauncher  # noqa: E402
from deadpool.policies import buddy_table  # noqa: E402
from deadpool.protocol import Keys, Plan, RankStatus, Seal  # noqa: E402
from deadpool.protocol_wire import decode_plan  # noqa: E402
from deadpool.topology import ParallelDims  # noqa: E402
from deadpool.train import compose_config  # noqa: E402
from deadpool.watchdog import NodeLiveness  # noqa: E402

COLUMNS = ["ranks", "protocol", "store_ops_per_s_per_rank", "exit_detect_s", "node_detect_s",
           "plan_everywhere_s", "coordinator_cpu_frac", "detect_to_plan_s", "recovery_store_ops",
           "dilation", "survived"]
STEP = 10  # the step every fake rank is at
VOTE_EVERY = 16  # snapshots between snapshot-interval votes (snapshot.schedule's default every)
MAX_GEN = 3
# per thread, in the shared stats array: requests, max lag, window seen, then per generation
# (latest plan read time, number of processes that read it)
FIELDS = 3 + 2 * MAX_GEN
ALIVE, DEAD, SILENT = 0, 1, 2


# -- the fake ranks (other processes) ------------------------------------------------------------
class FakeRanks:
    """The fake processes of one thread: each slot's state, driven by a heap of due events."""

    def __init__(self, store, seal: Seal, slots, world: int, rpn: int, periods: dict, flags,
                 stats, base: int, window):
        self.store, self.seal, self.flags, self.stats, self.base = store, seal, flags, stats, base
        self.world, self.periods, self.window = world, periods, window
        self.ward = {}
        table = buddy_table(ParallelDims(dp=world, ranks_per_node=rpn), "ring_over_nodes")
        for r, b in enumerate(table):
            self.ward[b] = r
        # "wait": the generation whose plan the process waits for; None while it trains
        self.s = {slot: {"rank": None, "gen": 0, "wait": 0, "n": 0, "seen": False, "polls": 0,
                         "spare_t": 0.0} for slot in slots}
        self.plans: dict[int, tuple[bytes, Plan]] = {}  # one parse per process and generation
        self.ops, self.lag, self.win = 0, 0.0, 0
        now = time.monotonic()
        self.heap = []
        for i, slot in enumerate(slots):  # spread the first beats over one interval
            off = periods["hb"] * i / max(1, len(slots))
            self.heap.append((now + off, 0, slot))
            self.heap.append((now + off, 1, slot))
            if periods["snap"]:
                self.heap.append((now + periods["snap"], 2, slot))
        heapq.heapify(self.heap)
        for slot in slots:
            key = Keys.spare_ready(slot)
            store.set(key, seal.wrap(key, repr(time.time())))
            self._beat(slot)

    def _op(self, n: int = 1) -> None:
        self.ops += n

    def _beat(self, slot: int) -> None:
        st = self.s[slot]
        st["n"] += 1
        key = Keys.heartbeat(slot)
        phase = "forward" if st["wait"] is None else "wait_plan"
        self.store.set(key, self.seal.wrap(key, f"{st['n']} {st['n']} {STEP} {phase}"))
        if not st["seen"]:
            st["seen"] = self.store.check([Keys.COORD_HB])
            self._op()
        if st["seen"]:
            self.store.get(Keys.COORD_HB)
            self._op()
        if st["n"] % 4 == 1:
            self.store.check([Keys.fence(slot)])
            self._op()
        self._op()

    def _watch(self, slot: int) -> float:
        """One poll of the abort key (training) or the plan key (waiting); the next period."""
        st = self.s[slot]
        if st["wait"] is None:  # training in st["gen"]: the abort watcher
            keys = Keys(st["gen"])
            self._op()
            if self.store.check([keys.abort]):
                r = st["rank"]
                status = RankStatus(r, slot, STEP, [STEP], {self.ward[r]: [STEP]})
                reports.post(self.store, self.seal, keys.status(r), status.to_json())
                self._op(2)
                st["wait"] = st["gen"] + 1
                return self.periods["plan"]
            return self.periods["poll"]
        key = Keys.plan_full(st["wait"])  # today's protocol: every process reads the whole plan
        st["polls"] += 1
        self._op()
        if self.store.check([key]):
            raw = self.store.get(key)
            self._op()
            g = st["wait"]
            cached = self.plans.get(g)
            if cached is None or cached[0] != raw:
                cached = (raw, decode_plan(self.seal.unwrap(key, raw), None))
                self.plans[g] = cached
            self._read_plan(g)
            rank = cached[1].rank_of_slot(slot)
            if rank is not None:
                st.update(rank=rank, gen=g, wait=None)
                return self.periods["poll"]
            st["wait"] = g + 1
        elif st["polls"] % 10 == 0:
            self.store.check([Keys.JOB_STOP])
            self._op()
        if st["rank"] is None and time.monotonic() - st["spare_t"] > self.periods["spare"]:
            st["spare_t"] = time.monotonic()  # an idle spare reads the job's step
            if self.store.check([Keys.JOB_STEP]):
                self.store.get(Keys.JOB_STEP)
                self._op()
            self._op()
        return self.periods["plan"]

    def _snapshot(self, slot: int) -> None:
        """A training rank's snapshot agreements through the store (``rounds.StoreRounds``):
        its replicated step counted, and every ``VOTE_EVERY`` snapshots an interval vote."""
        st = self.s[slot]
        if st["wait"] is not None:
            return
        st["snap"] = st.get("snap", 0) + 1
        keys = Keys(st["gen"])
        self.store.add(keys.repl_done(st["snap"]), 1)
        self._op()
        if st["snap"] % VOTE_EVERY == 0:
            self.store.add(keys.interval_vote(st["snap"], 1), 1)
            self.store.add(keys.interval_voters(st["snap"]), 1)
            self.store.add(keys.interval_voters(st["snap"]), 0)  # (one poll: all voted)
            self.store.add(keys.interval_vote(st["snap"], 1), 0)
            self._op(4)

    def _read_plan(self, g: int) -> None:
        if g < MAX_GEN:
            i = self.base + 3 + 2 * g
            self.stats[i] = max(self.stats[i], time.time())
            self.stats[i + 1] += 1

    def run(self, stop) -> None:
        while self.heap and not stop.is_set():
            due, kind, slot = self.heap[0]
            now = time.monotonic()
            if due > now:
                time.sleep(min(due - now, 0.005))
                continue
            heapq.heappop(self.heap)
            if self.flags[slot] != ALIVE:
                continue  # dead or silent: nothing more from this process
            if self.window.value != self.win:
                self.win, self.lag = self.window.value, 0.0
            self.lag = max(self.lag, now - due)
            try:
                if kind == 0:
                    self._beat(slot)
                    nxt = self.periods["hb"]
                elif kind == 2:
                    self._snapshot(slot)
                    nxt = self.periods["snap"]
                else:
                    nxt = self._watch(slot)
            except Exception:  # the store went away (the size is over)
                return
            heapq.heappush(self.heap, (due + nxt if now - due < nxt else now + nxt, kind, slot))
            self.stats[self.base] = self.ops
            self.stats[self.base + 1] = self.lag
            self.stats[self.base + 2] = self.win


def fake_process(host, port, secret, slots, world, rpn, periods, flags, stats, first, threads,
                 window, stop):
    seal = Seal(secret)
    parts = [slots[i::threads] for i in range(threads)]
    runners = []
    for i, part in enumerate(parts):
        store = auth.open_store(host, port, secret, timeout_s=300)
        fr = FakeRanks(store, seal, part, world, rpn, periods, flags, stats,
                       (first + i) * FIELDS, window)
        runners.append(threading.Thread(target=fr.run, args=(stop,), daemon=True))
    for t in runners:
        t.start()
    for t in runners:
        t.join()


# -- the new protocol's fake nodes (other processes) -------------------------------------------------
class FakeNodes:
    """The fake nodes of one thread under node agents: per node a real ``NodeAgent`` (its real
    board in shared memory, record, pushed events on its own blocking store connection, plan
    fetch) whose processes are fake: they beat into the board, write their status next to it
    after an abort (as ``recovery.restore.report_status`` does; their agent sends the node's on
    in one key) and count when the plan reached
    them. A process checks the board every ``periods["plan"]`` (a local read, no store
    request): reactions are scheduled that much after the event."""

    def __init__(self, host, port, secret, nodes: dict, world, rpn, periods, ft, flags, stats,
                 base, window, exit_req, root: Path, decode):
        from deadpool.agent.board import NodeBoard
        from deadpool.agent.node import NodeAgent
        from deadpool.groups import keepable_keys

        self.host, self.port, self.secret = host, port, secret
        self.seal, self.flags, self.stats, self.base = Seal(secret), flags, stats, base
        self.periods, self.window, self.exit_req = periods, window, exit_req
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
            self.heap.append((now + periods["agent"] * i / max(1, len(nodes)), node))
        heapq.heapify(self.heap)
        self.reacts: list[tuple[float, int, str, int]] = []  # (due, node, what, generation)
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
        from deadpool.agent.events import EventFollower

        agent = self.agents[node]
        follower = EventFollower(lambda: CountedOps(auth.open_store(
            self.host, self.port, self.secret, timeout_s=300), self.store), self.seal, wait_s=60.0)
        while not stop.is_set():
            try:
                ev = follower.next(stop)
            except Exception:  # a connection refused under load: retry, as the real agent does
                time.sleep(0.5)
                continue
            if ev is None or all(self.flags[s] == SILENT for s in self.slots[node]):
                continue
            with self.lock:
                agent.apply(ev)
                if ev["kind"] in ("abort", "plan"):
                    heapq.heappush(self.reacts, (time.monotonic() + self.periods["plan"], node,
                                                 ev["kind"], int(ev["g"])))

    def react(self, node, what, g):
        """The node's processes saw the board change."""
        agent = self.agents[node]
        by_slot = _by_slot(agent.plan)
        if what == "abort":  # each process writes its status next to the board
            from deadpool.agent.client import write_report

            for s in self._alive(node):
                r = by_slot.get(s)
                if r is not None and agent.ranks_gen[s] == g:
                    status = RankStatus(r, s, STEP, [STEP], {self.ward.get(r, r): [STEP]})
                    write_report(agent.board, agent.node_dir, agent.index[s], g, "status", r,
                                 status.to_json(), seal=self.seal)
                    agent.ranks_gen[s] = None
            agent.check_reports()  # (the agent's rounds thread: within a few ms)
            return
        n = 0  # (the processes decode the same text the agent decoded: its plan is theirs)
        for s in self._alive(node):
            agent.ranks_gen[s] = g if s in by_slot else None
            n += 1
        if g < MAX_GEN:
            i = self.base + 3 + 2 * g
            self.stats[i] = max(self.stats[i], time.time())
            self.stats[i + 1] += n

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
                while self.reacts and self.reacts[0][0] <= now:
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
            self.stats[self.base] = self.store.ops
            self.stats[self.base + 1] = self.lag
            self.stats[self.base + 2] = self.win
            time.sleep(min(0.002, max(0.0, self.heap[0][0] - time.monotonic())) if self.heap else 0)


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


class CountedOps:
    """A store client counting its requests into ``into.ops`` (itself by default)."""

    def __init__(self, store, into=None):
        self._store, self._into, self.ops = store, into or self, 0

    def __getattr__(self, name):
        fn = getattr(self._store, name)

        def call(*a, **k):
            self._into.ops += 1
            return fn(*a, **k)
        return call


def fake_nodes_process(host, port, secret, nodes, world, rpn, periods, ft, flags, stats, first,
                       threads, window, exit_req, stop):
    from deadpool.protocol_wire import decode_plan

    cache = {}

    def decode(text, prev, keys=None):  # one decode per process and text (a real node decodes
        key = (text, None if prev is None else prev.generation)  # its own, on its own CPU)
        if key not in cache:
            cache[key] = decode_plan(text, prev, keys)
        return cache[key]

    root = Path(tempfile.mkdtemp(prefix="bench_cp_nodes_", dir="/dev/shm"
                                 if Path("/dev/shm").is_dir() else None))
    items = sorted(nodes.items())
    parts = [dict(items[i::threads]) for i in range(threads)]
    runners = []
    for i, part in enumerate(parts):
        fn = FakeNodes(host, port, secret, part, world, rpn, periods, ft, flags, stats,
                       (first + i) * FIELDS, window, exit_req, root / f"t{i}", decode)
        runners.append(threading.Thread(target=fn.run, args=(stop,), daemon=True))
    for t in runners:
        t.start()
    for t in runners:
        t.join()
    import shutil
    shutil.rmtree(root, ignore_errors=True)


# -- the coordinator's side ------------------------------------------------------------------------
class Counted:
    """The coordinator's store, counting requests (a multi_get or a multi-key check is one),
    in all and by method."""

    def __init__(self, store):
        self._store, self.requests, self.by_method = store, 0, {}

    def __getattr__(self, name):
        fn = getattr(self._store, name)

        def call(*a, **k):
            self.requests += 1
            self.by_method[name] = self.by_method.get(name, 0) + 1
            return fn(*a, **k)
        return call


class Stop(Exception):
    """Ends the coordinator's loop once a size is measured."""


class Launcher:
    """The launcher stand-in: an exit is reported by ``poll``; a kill silences the fake slot."""

    def __init__(self, flags):
        self.flags, self.exited, self.stopped = flags, {}, False

    def poll(self, slot):
        if self.stopped:
            raise Stop()
        return self.exited.get(slot)

    def is_stopped(self, slot):
        return False

    def kill(self, slot):
        self.flags[slot] = DEAD

    def fence(self, slots):
        for slot in slots:
            self.kill(slot)

    def log_tail(self, slot, lines=20):
        return ""


class BenchAgents(AgentLauncher):
    """The real agent launcher's coordinator side, with agents started by the benchmark (as
    under a remote launcher: an agent's death is seen only by its silent record)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.stopped = False

    def start(self, slots):
        pass

    def node_gone(self, slot):
        return False

    def poll(self, slot):
        if self.stopped:
            raise Stop()
        return super().poll(slot)


class BenchCoordinator(Coordinator):
    """The real coordinator, noting when it detected each failure and wrote each plan, and per
    recovery how long from its detection to its plan written (``time.monotonic()``) and how
    many store requests the coordinator made meanwhile (abort, fences, status, report and fault
    collection, the plan)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.detected: list[tuple[dict, float]] = []
        self.plans: dict[int, float] = {}
        self.to_plan: dict[int, tuple[float, int]] = {}  # generation -> (seconds, requests)
        self.to_plan_by_method: dict[int, dict[str, int]] = {}
        self._found: tuple[float, int, dict] | None = None

    def recover(self, failed, t_detect):
        self.detected.append((dict(failed), t_detect))
        self._found = (time.monotonic(), self.store.requests,  # (failures() just returned)
                       dict(self.store.by_method))
        super().recover(failed, t_detect)

    def write_plan(self, p):
        super().write_plan(p)
        self.plans[p.generation] = p.t_written
        if self._found is not None:
            t, n, by = self._found
            self.to_plan[p.generation] = (time.monotonic() - t, self.store.requests - n)
            self.to_plan_by_method[p.generation] = {
                k: v - by.get(k, 0) for k, v in self.store.by_method.items() if v > by.get(k, 0)}
            self._found = None


def thread_cpu(thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def config(n: int, rpn: int, dilation: float, run_dir: Path) -> dict:
    cfg = compose_config(["model=tiny"], run_dir)
    cfg["parallel"] = dict(cfg["parallel"], dp=n, tp=1, pp=1, ranks_per_node=rpn)
    ft = dict(cfg["ft"], num_spares=rpn + 1, startup_timeout_s=600.0)
    for k in ("heartbeat_interval_s", "heartbeat_timeout_s", "heartbeat_hard_timeout_s",
              "coordinator_timeout_s", "status_timeout_s", "collective_poll_s", "progress_timeout_s",
              "agent_interval_s", "node_timeout_s"):
        ft[k] = float(ft[k]) * dilation
    cfg["ft"] = ft
    cfg["faults"] = dict(cfg["faults"], events=[])
    return cfg


def wait_for(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def run_size(n: int, args, protocol: str = "old", log=print) -> dict:
    D, rpn = args.dilation_of[n], args.ranks_per_node
    if n < 2 * rpn or n % rpn:
        raise SystemExit(f"--ranks {n}: needs at least two nodes of --ranks-per-node {rpn}")
    run_dir = Path(tempfile.mkdtemp(prefix="bench_cp_"))
    cfg = config(n, rpn, D, run_dir)
    ft = cfg["ft"]
    slots = list(range(n + int(ft["num_spares"])))
    secret = auth.new_secret()
    master = auth.serve_store("127.0.0.1", 0, timeout_s=300)
    store = Counted(auth.namespaced(master, secret))
    ctx = mp.get_context("spawn")
    flags = ctx.Array("b", len(slots), lock=False)
    nthreads = args.procs * args.threads
    stats = ctx.Array("d", nthreads * FIELDS, lock=False)
    window = ctx.Value("i", 0, lock=False)
    exit_req = ctx.Value("i", -1, lock=False)
    stop = ctx.Event()
    periods = {"hb": float(ft["heartbeat_interval_s"]), "poll": float(ft["collective_poll_s"]),
               "plan": 0.01 * D, "spare": 0.05 * D, "agent": float(ft["agent_interval_s"]),
               "snap": args.snapshot_every_s * D}
    live = events = None
    if protocol == "new":
        cfg["launcher"] = dict(cfg["launcher"], agents=True)
        nodes = {node: slots[node * rpn:(node + 1) * rpn] for node in range(-(-len(slots) // rpn))}
        names = sorted(nodes)
        procs = [ctx.Process(target=fake_nodes_process, daemon=True, args=(
            "127.0.0.1", master.port, secret, {k: nodes[k] for k in names[i::args.procs]}, n, rpn,
            periods, ft, flags, stats, i * args.threads, args.threads, window, exit_req, stop))
            for i in range(args.procs)]
        events = EventLog(store, Seal(secret))
        launcher = BenchAgents(run_dir, run_dir / "job.json", secret, cfg, None, events)
        live = launcher.live = NodeLiveness(
            float(ft["heartbeat_timeout_s"]), float(ft["heartbeat_hard_timeout_s"]),
            float(ft["node_timeout_s"]), launcher.node_of_slot.get)
    else:
        procs = [ctx.Process(target=fake_process, daemon=True, args=(
            "127.0.0.1", master.port, secret, slots[i::args.procs], n, rpn, periods, flags, stats,
            i * args.threads, args.threads, window, stop)) for i in range(args.procs)]
        launcher = Launcher(flags)
    for p in procs:
        p.start()
    coord = BenchCoordinator(cfg, store, launcher, log=lambda line: None, secret=secret,
                             live=live, events=events)
    def run_coordinator():
        try:
            coord.run()
        except Stop:
            pass
    ct = threading.Thread(target=run_coordinator, daemon=True, name="coordinator")
    ct.start()
    out = {"ranks": n, "protocol": protocol, "dilation": D, "survived": False}

    def reads(g):
        return sum(stats[t * FIELDS + 4 + 2 * g] for t in range(nthreads))

    def last_read(g):
        return max(stats[t * FIELDS + 3 + 2 * g] for t in range(nthreads))

    def fake_ops():
        return sum(stats[t * FIELDS] for t in range(nthreads))

    def lag():
        return max(stats[t * FIELDS + 1] for t in range(nthreads)
                   if stats[t * FIELDS + 2] == window.value)

    def alive():
        return sum(1 for s in slots if flags[s] == ALIVE)
    try:
        t0 = time.time()
        if not wait_for(lambda: 0 in coord.plans and reads(0) >= len(slots), 600):
            out["failed"] = f"start-up: {int(reads(0))} of {len(slots)} read plan 0"
            return out
        out["startup_s"] = time.time() - t0
        time.sleep(2 * periods["hb"] + 1.0)  # every schedule running
        window.value = 1
        time.sleep(periods["hb"] * 2)
        ops0, req0, t_a = fake_ops(), store.requests, time.time()
        cpu0, proc0 = thread_cpu(ct) + thread_cpu(coord._beating), time.process_time()
        time.sleep(args.duration_s)
        ops1, req1, t_b = fake_ops(), store.requests, time.time()
        cpu1, proc1 = thread_cpu(ct) + thread_cpu(coord._beating), time.process_time()
        # the rest of this process's CPU is the store's own thread (the main thread sleeps)
        out["store_cpu_frac"] = (proc1 - proc0 - (cpu1 - cpu0)) / (t_b - t_a)
        out["steady_lag_s"] = lag() / D
        # the fake ranks' rate undilated; the coordinator's as measured (its 10 ms loop is not
        # dilated, only its heartbeat reads are: this undercounts those at D > 1)
        rate = (ops1 - ops0) / (t_b - t_a) * D + (req1 - req0) / (t_b - t_a)
        out["store_ops_per_s"] = rate
        out["store_ops_per_s_per_rank"] = rate / n
        out["coordinator_cpu_frac"] = (cpu1 - cpu0) / (t_b - t_a)
        out["coordinator_requests_per_s"] = (req1 - req0) / (t_b - t_a)
        out["fake_ops_per_s_per_rank"] = (ops1 - ops0) / (t_b - t_a) * D / n
        if coord.detected:
            bad = coord.detected[0][0]
            out["failed"] = (f"{len(bad)} healthy rank(s) declared failed in steady state, e.g. "
                             f"{dict(list(bad.items())[:4])}")
            return out
        period = float(ft["agent_interval_s" if protocol == "new" else "heartbeat_interval_s"])
        if out["steady_lag_s"] > period / D:
            out["failed"] = f"fake ranks lag their schedule by {out['steady_lag_s']:.3f} s"
        if "exit" not in args.phases:
            out["survived"] = "failed" not in out
            return out
        # exit: rank 1's process exits
        t_exit = time.time()
        if protocol == "new":
            exit_req.value = coord.members.ranks[1]  # its agent's waitpid returns
        else:
            launcher.exited[coord.members.ranks[1]] = -9
            flags[coord.members.ranks[1]] = DEAD
        if not wait_for(lambda: 1 in coord.plans and reads(1) >= alive(), 120 * D):
            out["failed"] = f"exit: plan 1 read by {int(reads(1))} of {alive()}"
            return out
        # an exit is seen by the coordinator's own 10 ms loop, which is not dilated
        out["exit_detect_s"] = coord.detected[0][1] - t_exit
        out["exit_detected_by"] = coord.detected[0][0]
        out["plan_everywhere_s"] = (last_read(1) - coord.plans[1]) / D
        # detection -> plan: the abort, the survivors' statuses (through their agents: period
        # driven, so divided by D like the plan reads), reports, faults, planning, the plan
        out["detect_to_plan_measured_s"], out["recovery_store_ops"] = coord.to_plan[1]
        out["detect_to_plan_s"] = coord.to_plan[1][0] / D
        out["recovery_store_ops_by_method"] = coord.to_plan_by_method[1]
        out["plan_bytes"] = len(store.get(Keys.plan(1) if protocol == "new" else Keys.plan_full(1)))
        time.sleep(1.0 * D)
        # a node goes silent (no exit seen)
        node = [coord.members.ranks[r] for r in range(n - rpn, n)]  # the last node
        t_node = time.time()
        for s in node:
            flags[s] = SILENT
        if "node" not in args.phases:
            out["survived"] = "failed" not in out
            return out
        if not wait_for(lambda: 2 in coord.plans and reads(2) >= alive(), 120 * D):
            out["failed"] = f"node: plan 2 read by {int(reads(2))} of {alive()}"
            return out
        out["node_detect_s"] = (coord.detected[1][1] - t_node) / D
        out["node_detected_by"] = coord.detected[1][0]
        out["plan_everywhere_node_s"] = (last_read(2) - coord.plans[2]) / D
        out["detect_to_plan_node_s"] = coord.to_plan[2][0] / D
        out["recovery_store_ops_node"] = coord.to_plan[2][1]
        out["survived"] = "failed" not in out
        return out
    finally:
        stop.set()
        launcher.stopped = True  # ends the coordinator's loop at its next poll
        ct.join(timeout=30)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        del master


def write_table(rows: list[dict], out: Path) -> None:
    """``DIR/table.csv``: these rows, and the rows already there for other (ranks, protocol)
    pairs (so sizes run separately, or the new protocol's rows, share one table)."""
    path = out / "table.csv"
    fresh = {(str(r["ranks"]), r["protocol"]): {k: (round(v, 6) if isinstance(v, float) else v)
                                                 for k, v in r.items() if k in COLUMNS}
             for r in rows}
    kept = []
    if path.exists():
        with open(path) as f:
            kept = [r for r in csv.DictReader(f) if (r["ranks"], r["protocol"]) not in fresh]
    table = sorted(kept + list(fresh.values()), key=lambda r: (r["protocol"], int(r["ranks"])))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(table)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="512,2048,8192,16384")
    ap.add_argument("--out", required=True)
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--dilation", default="1", help="1 | auto (N / 256) | one per size: 2,8,...")
    ap.add_argument("--phases", default="steady,exit,node")
    ap.add_argument("--snapshot-every-s", type=float, default=1.0,
                    help="a training rank replicates a snapshot this often (0: none)")
    ap.add_argument("--protocol", default="new,old",
                    help="old (every process polls the store) | new (node agents) | both")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.ranks.split(",")]
    if args.dilation == "auto":
        args.dilation_of = {n: max(1.0, n / 256) for n in sizes}
    else:
        ds = [float(x) for x in args.dilation.split(",")]
        if len(ds) not in (1, len(sizes)):
            ap.error("--dilation: one value, auto, or one per size")
        args.dilation_of = dict(zip(sizes, ds * len(sizes) if len(ds) == 1 else ds))
    args.phases = set(args.phases.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for protocol in args.protocol.split(","):
        run_protocol(protocol, sizes, args, out, rows)


def run_protocol(protocol: str, sizes: list[int], args, out: Path, rows: list[dict]) -> None:
    for n in sizes:
        print(f"[bench] {n} ranks, protocol {protocol}, dilation {args.dilation_of[n]:g}",
              flush=True)
        row = run_size(n, args, protocol)
        rows.append(row)
        print("[bench] " + json.dumps(row), flush=True)
        write_table(rows, out)
        runs = out / "runs.json"
        older = [r for r in (json.loads(runs.read_text()) if runs.exists() else [])
                 if (r["ranks"], r["protocol"]) not in {(x["ranks"], x["protocol"]) for x in rows}]
        runs.write_text(json.dumps(older + rows, indent=1))
        if not row["survived"]:
            print(f"[bench] {n} ranks not survived ({row.get('failed')}); larger sizes not run",
                  flush=True)
            break


if __name__ == "__main__":
    main()
