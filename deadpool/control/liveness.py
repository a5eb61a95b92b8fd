"""Liveness, as the coordinator judges it: when each process's counters last changed.

A process's heartbeat ``hb/<slot>`` carries its beat and its training thread's progress
(deadpool/rank/watchdog.py writes the progress, deadpool/rank/heartbeat.py the beat). The
coordinator never compares clocks across hosts: it records, on its own monotonic clock, when it
last saw each counter change.

    beat unchanged for heartbeat_timeout_s (soft)  -> suspect; lost if the launcher sees the
                                                      process stopped
    beat unchanged for heartbeat_hard_timeout_s    -> lost
    progress unchanged for progress_timeout_s      -> the training thread is hung (a stuck kernel
      while the heartbeat lives                       or collective, a deadlock), unless it is
                                                      waiting on peers (PEER_WAIT phases) or has
                                                      nothing to do (IDLE phases)

A phase's progress bound adapts to the job (``Liveness.stalled``): never below ``ADAPT_FACTOR``
times the longest that phase was seen to take in this job, capped at ``ADAPT_CAP`` x
``progress_timeout_s`` (NVIDIA resiliency-ext computes its timeouts from observed intervals the
same way). A host that was once slow in a phase gets the benefit of the doubt there; a real hang
is still found, at most ``ADAPT_CAP`` progress timeouts in. It only lengthens a bound, so it
never declares anyone sooner than the configured timeout.

A rank stuck in a peer-wait phase is not to blame while some peer is stuck elsewhere; if no rank
progresses and every stalled one is waiting on peers, the generation itself is stuck (a collective that never
completes): the coordinator aborts it, and whoever cannot answer is fenced.

``Liveness`` judges processes from their heartbeats (the coordinator without node agents, and
each node agent for its own processes); ``NodeLiveness`` judges them from the node agents'
records (the coordinator under node agents).
"""

from __future__ import annotations

import heapq
import json
import threading
import time
from collections import deque

from deadpool.rank.watchdog import IDLE, PEER_WAIT, phase_bound

ADAPT_FACTOR = 3.0  # a phase's bound: at least this x the longest it was seen to take ...
ADAPT_CAP = 2.0     # ... but never above this x progress_timeout_s


class Liveness:
    """Coordinator side: when each slot's heartbeat and progress counters last changed."""

    def __init__(self, soft_s: float, hard_s: float, progress_s: float, clock=time.monotonic):
        self.soft_s, self.hard_s, self.progress_s = soft_s, hard_s, progress_s
        self.clock = clock
        self._beat: dict[int, tuple[int, float]] = {}       # slot -> (beat, t seen changing)
        self._prog: dict[int, tuple[int, float]] = {}       # slot -> (progress, t seen changing)
        self.step: dict[int, int] = {}
        self.phase: dict[int, str] = {}
        self.longest: dict[str, float] = {}  # watched phase -> the longest it was seen to take
        self.lock = threading.Lock()

    def observe(self, slot: int, value: str | bytes | None) -> None:
        if value is None:
            return
        if isinstance(value, bytes):
            value = value.decode()
        try:
            beat_s, prog_s, step_s, phase = value.split(" ", 3)
            beat, prog, step = int(beat_s), int(prog_s), int(step_s)
        except ValueError:
            return  # not ours (or torn): ignore
        self.update(slot, beat, prog, step, phase)

    def update(self, slot: int, beat: int, prog: int, step: int, phase: str) -> None:
        """One reading of a slot's counters (``observe`` parses a heartbeat value into this)."""
        now = self.clock()
        with self.lock:
            last = self._beat.get(slot)
            if last is not None and beat < last[0]:
                return  # an older beat written again (a replay): no news, and no progress either
            if last is None or beat > last[0]:
                self._beat[slot] = (beat, now)
            seen = self._prog.get(slot)
            if seen is None or seen[0] != prog:
                if seen is not None:  # the phase read last ended (or more than one did): an
                    self._took(self.phase.get(slot, "start"), now - seen[1])  # over-estimate
                self._prog[slot] = (prog, now)
            self.step[slot], self.phase[slot] = step, phase

    def _took(self, phase: str, seconds: float) -> None:
        name = phase.partition("/")[0]
        if name not in IDLE and name not in PEER_WAIT and seconds > self.longest.get(name, 0.0):
            self.longest[name] = seconds

    def bound(self, phase: str) -> float:
        """The progress bound of ``phase`` now: its own (``watchdog.phase_bound``), lengthened to
        ``ADAPT_FACTOR`` x the longest it took in this job, at most ``ADAPT_CAP`` x ``progress_s``."""
        adapted = min(ADAPT_FACTOR * self.longest.get(phase.partition("/")[0], 0.0),
                      ADAPT_CAP * self.progress_s)
        return max(phase_bound(phase, self.progress_s), adapted)

    def reset_progress(self, slot: int) -> None:
        """Start the progress clock anew (a process was just given work)."""
        with self.lock:
            p = self._prog.get(slot)
            if p is not None:
                self._prog[slot] = (p[0], self.clock())

    def beat_age(self, slot: int) -> float | None:
        b = self._beat.get(slot)
        return None if b is None else self.clock() - b[1]

    def progress_age(self, slot: int) -> float | None:
        p = self._prog.get(slot)
        return None if p is None else self.clock() - p[1]

    def progress_of(self, slot: int) -> int | None:
        """The slot's progress counter as last read (None before its first beat)."""
        p = self._prog.get(slot)
        return None if p is None else p[0]

    def evidence(self, slot: int) -> str:
        """What the coordinator last knew of ``slot``, for a message naming it lost."""
        beat, prog = self.beat_age(slot), self.progress_age(slot)
        return (f"beat {'never seen' if beat is None else f'{beat:.1f} s old'}, phase "
                f"{self.phase.get(slot, '?')} unchanged for "
                f"{'?' if prog is None else f'{prog:.1f}'} s")

    def beat_lost(self, slot: int, is_stopped) -> bool:
        age = self.beat_age(slot)
        if age is None or age <= self.soft_s:
            return False
        return age > self.hard_s or is_stopped(slot)

    def stalled(self, slot: int) -> bool:
        """Progress has not changed for ``progress_s`` in a phase that must make progress."""
        if self.phase.get(slot, "start") in IDLE:
            return False
        age = self.progress_age(slot)
        return age is not None and age > self.bound(self.phase.get(slot, ""))

    def hung(self, slots: list[int]) -> tuple[list[int], bool]:
        """(slots whose training thread is hung, whether the whole group is stuck in peer waits)."""
        stalled = [s for s in slots if self.stalled(s)]
        own = [s for s in stalled if self.phase.get(s) not in PEER_WAIT]
        busy = [s for s in slots if self.phase.get(s, "start") not in IDLE]
        # stuck only when nobody progresses: a peer waiting on a slow-but-moving rank is fine
        return own, bool(stalled) and not own and len(stalled) == len(busy)


class NodeLiveness:
    """Coordinator side under node agents (deadpool/agent): liveness from one record per node.

    Each agent judges its own processes with a ``Liveness`` on its own clock and writes a record
    every ``ft.agent_interval_s`` (``agent.node.NodeAgent.record``)::

        "<seq> <plan> <step> <busy> <stalled>[ <json: exit, slow, own>]"

    ``seq`` must increase (a replayed record is no news); ``plan`` is the newest plan generation
    the agent applied; ``busy``/``stalled`` count its ranks in phases that must progress and those
    stalled (the node's share of ``Liveness.hung``); the JSON names exited processes (``exit``:
    slot -> code), processes whose beat is older than half the soft timeout (``slow``: slot ->
    [beat age, stopped]) and hung ones (``own``), and the node's part of the ranks' agreements
    (``repl``: [g, step], ``vote``: [g, step, interval]; ``deadpool.store.rounds``).

    A slot's beat age is the larger of what its agent reports and how long its node's record has
    not changed (a dead or cut-off node ages all its slots). Every question is answered from
    what the records flagged, so a loop costs O(nodes + flagged slots), never O(ranks).
    """

    def __init__(self, soft_s: float, hard_s: float, node_timeout_s: float, node_of,
                 clock=time.monotonic):
        self.soft_s, self.hard_s, self.node_timeout_s = soft_s, hard_s, node_timeout_s
        self.node_of = node_of  # slot -> node
        self.clock = clock
        self._seen: dict[int, tuple[int, float]] = {}     # node -> (seq, t seen changing)
        self._plan: dict[int, int] = {}                   # node -> plan generation applied
        self._counts: dict[int, tuple[int, int]] = {}      # node -> (busy, stalled)
        self._step: dict[int, int] = {}
        self._exit: dict[int, int] = {}                    # slot -> exit code
        self._slow: dict[int, tuple[float, float, bool]] = {}  # slot -> (age, t read, stopped)
        self._slow_of: dict[int, list[int]] = {}           # node -> its slots in _slow
        self._own: dict[int, list[int]] = {}               # node -> hung slots (none: no entry)
        self._ages: list[tuple[float, int]] = []  # heap of (t seen changing, node), stale ones lazy
        self._stale: set[int] = set()             # nodes whose record aged past the limit
        self.repl: dict[int, tuple[int, int]] = {}         # node -> (g, newest step replicated)
        self.vote: dict[int, tuple[int, int, int]] = {}    # node -> (g, vote step, interval)
        self.compute: dict[int, int] = {}  # slot -> its packed step and compute time (straggler)
        self.generation = 0
        self.lock = threading.Lock()
        self._lost: deque[list[int]] = deque()  # slots of nodes lost by presence (lose_node)

    def observe_node(self, node: int, text: str) -> None:
        head, _, tail = text.partition(" {")
        try:
            seq, plan, step, busy, stalled = (int(x) for x in head.split())
            detail = json.loads("{" + tail) if tail else {}
        except ValueError:
            return  # not ours (or torn): ignore
        now = self.clock()
        with self.lock:
            last = self._seen.get(node)
            if last is not None and seq <= last[0]:
                return  # unchanged, or an older record written again (a replay)
            self._seen[node] = (seq, now)
            heapq.heappush(self._ages, (now, node))
            self._stale.discard(node)
            self._plan[node], self._step[node] = plan, step
            self._counts[node] = (busy, stalled)
            for s, code in detail.get("exit", {}).items():
                self._exit[int(s)] = int(code)
            for s in self._slow_of.pop(node, ()):
                self._slow.pop(s, None)
            slow = detail.get("slow")
            if slow:
                self._slow_of[node] = [int(s) for s in slow]
                for s, (age, stopped) in slow.items():
                    self._slow[int(s)] = (float(age), now, bool(stopped))
            own = detail.get("own")
            if own:
                self._own[node] = [int(s) for s in own]
            else:
                self._own.pop(node, None)
            if "repl" in detail:
                self.repl[node] = tuple(int(x) for x in detail["repl"])
            if "vote" in detail:
                self.vote[node] = tuple(int(x) for x in detail["vote"])
            for s, w in detail.get("cmp", {}).items():  # (straggler.unpack_compute)
                self.compute[int(s)] = int(w)

    def lose_node(self, node: int, slots) -> None:
        """Node ``node``'s agent is known dead (its presence connection ended,
        ``agent.presence``): each of its ``slots`` not seen exiting before exited with SIGKILL,
        as its processes did with it. Safe from another thread: taken in by the coordinator's
        own thread at its next question (``suspects``, ``exit_code``)."""
        self._lost.append(list(slots))

    def _take_lost(self) -> None:
        while self._lost:
            for s in self._lost.popleft():
                self._exit.setdefault(s, -9)

    def new_generation(self, generation: int) -> None:
        """Plan ``generation`` was written: stall counts of agents that have not applied it yet
        are from the last generation and do not count (``Liveness.reset_progress``)."""
        self.generation = generation

    def reset_progress(self, slot: int) -> None:
        pass  # the agent restarts its processes' progress clocks when it applies a plan

    @property
    def max_step(self) -> int:
        return max(self._step.values(), default=-1)

    def node_age(self, node: int) -> float | None:
        seen = self._seen.get(node)
        return None if seen is None else self.clock() - seen[1]

    def exit_code(self, slot: int) -> int | None:
        self._take_lost()
        return self._exit.get(slot)

    def stopped(self, slot: int) -> bool:
        slow = self._slow.get(slot)
        return slow is not None and slow[2]

    def beat_age(self, slot: int) -> float | None:
        node = self.node_age(self.node_of(slot))
        slow = self._slow.get(slot)
        own = None if slow is None else slow[0] + self.clock() - slow[1]
        return node if own is None else max(own, node or 0.0)

    def evidence(self, slot: int) -> str:
        """What the coordinator last knew of ``slot`` from its node's records (see ``Liveness``)."""
        node, beat = self.node_age(self.node_of(slot)), self.beat_age(slot)
        flags = [w for w, on in (("stopped", self.stopped(slot)),
                                 ("hung", slot in self._own.get(self.node_of(slot), ()))) if on]
        node_s = "never seen" if node is None else f"{node:.1f} s old"
        beat_s = "never seen" if beat is None else f"{beat:.1f} s old"
        return ", ".join([f"its node's record {node_s}", f"beat {beat_s}", *flags])

    def beat_lost(self, slot: int, is_stopped) -> bool:
        node = self.node_age(self.node_of(slot))
        if node is not None and node > self.node_timeout_s:
            return True  # the node's agent went silent: its processes are gone with it
        age = self.beat_age(slot)
        if age is None or age <= self.soft_s:
            return False
        return age > self.hard_s or self.stopped(slot) or is_stopped(slot)

    def stale_nodes(self) -> list[int]:
        """Nodes whose record has not changed for the soft (or node) timeout. O(records aged
        since the last call + stale nodes), not O(nodes): the coordinator asks at every turn of
        its waits, and at 2,048 nodes a scan per 2 ms turn was a fifth of its CPU in a recovery."""
        limit = self.clock() - min(self.soft_s, self.node_timeout_s)
        with self.lock:
            while self._ages and self._ages[0][0] < limit:
                t, n = heapq.heappop(self._ages)
                seen = self._seen.get(n)
                if seen is not None and seen[1] == t:  # (not seen changing since: stale)
                    self._stale.add(n)
            return sorted(self._stale)

    def suspects(self, slots_of_node) -> set[int]:
        """Slots worth a closer look: exited, slow, hung, or on a node whose record is stale
        (``slots_of_node(node)``)."""
        self._take_lost()
        out = set(self._exit) | set(self._slow)
        for own in self._own.values():  # (only nodes with hung slots have an entry)
            out.update(own)
        for n in self.stale_nodes():
            out.update(slots_of_node(n))
        return out

    def hung(self, slots=None) -> tuple[list[int], bool]:
        """``Liveness.hung`` over the records of agents that applied the current plan."""
        current = [n for n, g in self._plan.items() if g >= self.generation]
        own = sorted(s for n in current for s in self._own.get(n, []))
        busy = sum(self._counts[n][0] for n in current)
        stalled = sum(self._counts[n][1] for n in current)
        return own, bool(stalled) and not own and stalled == busy
