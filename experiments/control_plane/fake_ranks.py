"""Fake ranks of ``--protocol old``: processes speaking the worker's store protocol themselves
(no torch, no training), each thread driving its slots from a heap of due events."""

from __future__ import annotations

import heapq
import threading
import time

from deadpool.policies import buddy_table
from deadpool.store import auth, reports
from deadpool.store.protocol import Keys, Plan, RankStatus, Seal
from deadpool.store.wire import decode_plan
from deadpool.topology import ParallelDims
from experiments.control_plane.common import (ALIVE, BUILT, FIELDS, LAG, OPS, STEP, VOTE_EVERY,
                                              WIN, note_plan_read)


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
            stats[base + BUILT] += 1  # start-up progress: slots announced

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
        note_plan_read(self.stats, self.base, g)

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
            self.stats[self.base + OPS] = self.ops
            self.stats[self.base + LAG] = self.lag
            self.stats[self.base + WIN] = self.win


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

