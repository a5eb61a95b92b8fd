"""What the coordinator reads from the store each turn of its loop, and its own heartbeat.

``Observer`` holds these parts of ``deadpool.control.coordinator.Coordinator`` (which extends it): the
loop's tick and the ``coord/hb`` heartbeat it keeps alive (``_beat``), the wake-up counters read
in one request (``read_counters``, ``counter``), every process's heartbeat or, under node
agents, every node's record (``read_heartbeats``), the ranks' agreements pushed back to the
agents (``_agree``) and the slots that may have failed (``suspects``). It uses the
coordinator's state (``store``, ``seal``, ``live``, ``members``, ``launcher``, ``events``, ...).
"""

from __future__ import annotations

import time

from deadpool.control import drain
from deadpool.recovery import detect
from deadpool.store import reports
from deadpool.store.protocol import NODES_CHANGED, Keys, coordinator_beat_s, node_key


class Observer:
    """The store-reading side of ``Coordinator`` (see the module docstring)."""

    def tick(self) -> None:
        """The main loop is alive (the heartbeat thread only beats while it ticks)."""
        self._tick = time.monotonic()

    def _beat(self) -> None:
        """``coord/hb`` advances while the main loop turns: workers that see it stop (the
        coordinator died or hangs) save their state and exit; a node agent's stop request is
        answered when it advances (``launch.stop.ask``). One beat per
        ``protocol.coordinator_beat_s``."""
        n = 0
        interval = coordinator_beat_s(self.ft)
        while self.outcome == "running":
            if time.monotonic() - self._tick < float(self.ft["coordinator_timeout_s"]) / 2:
                n += 1
                try:
                    self.store.set(Keys.COORD_HB, self.seal.wrap(Keys.COORD_HB, str(n)))
                except Exception:
                    pass
            time.sleep(interval)

    def read_counters(self) -> None:
        """The wake-up counters a loop looks at (a node's change, error reports, finished ranks),
        in one store request instead of one ``add`` each: ``multi_get`` blocks on a missing key,
        so each is created at 0 once. Each value read serves one ``counter`` call; any later call
        asks the store itself, so a value is never older than the loop that read it."""
        keys = Keys(self.gen)
        names = [keys.num_errors, keys.finished_count, drain.HINT]
        if self.events is not None:
            names.append(NODES_CHANGED)
        try:
            for k in names:
                if k not in self._counters_made:
                    self.store.add(k, 0)
                    self._counters_made.add(k)
            self._counters = {k: int(v) for k, v in zip(names, self.store.multi_get(names))}
        except (ValueError, RuntimeError):  # not a number (a forgery): ask one by one instead
            self._counters = {}

    def counter(self, key: str) -> int:
        """A wake-up counter's value: from this loop's ``read_counters`` if it holds one not yet
        used, else read now."""
        v = self._counters.pop(key, None)
        return int(self.store.add(key, 0)) if v is None else v

    def read_heartbeats(self, force: bool = False) -> None:
        """Feed every process's heartbeat to the liveness tracker (at most once per interval)."""
        self.tick()
        if self.events is not None:
            self._read_nodes(force)
            return
        if not force and self._tick - self._last_read < float(self.ft["heartbeat_interval_s"]) / 2:
            return
        self._last_read = self._tick
        slots = sorted(set(self.members.ranks.values()) | set(self.members.spares))
        keys = [Keys.heartbeat(s) for s in slots]
        # multi_get blocks on a missing key (for the store's timeout): one all-of check first
        if self.store.check(keys):
            values = self.store.multi_get(keys)
        else:  # a key not there yet (a process that never beat): read the present ones
            values = [self.store.get(k) if self.store.check([k]) else None for k in keys]
        for s, k, v in zip(slots, keys, values):
            if v is None or self._beats_seen.get(s) == v:
                continue  # unchanged since the last read: nothing to unseal
            self._beats_seen[s] = v
            text = self.seal.open(k, v)
            if text is None:
                if s not in self._forged_beats:
                    self._forged_beats.add(s)
                    self.log(f"[coordinator] slot {s}: heartbeat without the job's secret ignored")
                continue
            self.live.observe(s, text)
        steps = [self.live.step.get(s, -1) for s in self.members.ranks.values()]
        if steps and max(steps) > self.job_step:
            self.job_step = max(steps)
            self.store.set(Keys.JOB_STEP, self.seal.wrap(Keys.JOB_STEP, str(self.job_step)))

    def _read_nodes(self, force: bool) -> None:
        """Under node agents: every node's record, once per half agent interval or at once when
        an agent bumped ``nodes/changed`` (a process exited; read with the loop's other counters)."""
        hint = self.counter(NODES_CHANGED)
        if not force and hint == self._nodes_hint and \
                self._tick - self._last_read < float(self.ft["agent_interval_s"]) / 2:
            return
        self._nodes_hint, self._last_read = hint, self._tick
        nodes = self.launcher.nodes
        got = reports.read(self.store, self.seal, {n: node_key(n) for n in nodes},
                           on_forged=lambda n: detect.forged(self, f"record of node {n}"))
        for node, text in got.items():
            self.live.observe_node(node, text)
        if self.live.max_step > self.job_step:
            self.job_step = self.live.max_step
            self.store.set(Keys.JOB_STEP, self.seal.wrap(Keys.JOB_STEP, str(self.job_step)))
        self._agree()

    def _agree(self) -> None:
        """The ranks' agreements under node agents (``deadpool.store.rounds``): once every node
        holding a rank of the generation reported its part, push the result to the agents. O(nodes)
        per read of the records."""
        g = self.gen
        if self._agreed[0] != g:
            self._agreed = (g, -1, -1)
            self._rank_nodes = sorted({self.launcher.node_of_slot[s]
                                       for s in self.members.ranks.values()})
        _, protected, decided = self._agreed
        repl = [self.live.repl.get(n) for n in self._rank_nodes]
        if repl and all(r is not None and r[0] == g for r in repl):
            step = min(r[1] for r in repl)
            if step > protected:
                self.events.push("protected", g=g, step=step)
                protected = step
        votes = [self.live.vote.get(n) for n in self._rank_nodes]
        if votes and all(v is not None and v[0] == g for v in votes) \
                and len({v[1] for v in votes}) == 1 and votes[0][1] > decided:
            decided = votes[0][1]
            self.events.push("interval", g=g, step=decided, k=max(v[2] for v in votes))
        self._agreed = (g, protected, decided)

    def suspects(self):
        """Slots whose process may have failed: every member's, or under node agents only those
        the records flag (O(nodes + flagged), not O(ranks))."""
        if self.events is None:
            return list(self.members.ranks.values())
        return self.live.suspects(self.launcher.slots_of_node)
