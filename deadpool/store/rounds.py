"""Two agreements the ranks of a generation reach every few steps, through the store or through
their node agents.

    protected   the newest snapshot step every rank has replicated (its buddies hold it): older
                snapshots and replicas may go, and a snapshot slot may be reused (the engine's
                back-pressure waits on it)
    interval    the snapshot interval every rank adopts at a vote (``snapshot.schedule``: the
                widest any rank asked for)

Every rank replicates the same snapshot steps in the same order (a snapshot is exchanged with
its buddies, which take the same steps), so "every rank's newest replicated step is >= S" means
every rank replicated S: a minimum is all an agreement needs.

``StoreRounds`` (no node agent, e.g. ``launcher.agents=false``): per-step ``add`` counters in the
store, ``repl_done/<step>`` and the interval votes; O(ranks) requests per round, and a rank waiting
on one polls the store. The counters are not sealed (``auth.py``).

``BoardRounds`` (under a node agent): a rank writes its newest replicated step and its vote into
its word of the node's board, rings the agent's doorbell, and reads the results from the board's
header, with no store request.
The agent folds its ranks' words into its sealed node record (``agent.node``); the coordinator
folds the nodes' (``liveness.NodeLiveness``) and pushes each result as a sealed event, which every
agent writes on its board (``Coordinator._agree``). Per round: O(nodes) requests, all sealed.
"""

from __future__ import annotations

from deadpool.threads import wait_until


class StoreRounds:
    def __init__(self, store, keys, world: int):
        self.store, self.keys, self.world = store, keys, world

    def replicated(self, step: int) -> bool:
        """This rank finished replicating ``step``; True if that makes it protected."""
        return int(self.store.add(self.keys.repl_done(step), 1)) >= self.world

    def protected(self, step: int) -> bool:
        return int(self.store.add(self.keys.repl_done(step), 0)) >= self.world

    def vote(self, step: int, interval: int) -> None:
        self.store.add(self.keys.interval_vote(step, interval), 1)
        self.store.add(self.keys.interval_voters(step), 1)

    def decision(self, step: int, levels: list[int], abort_check) -> int:
        """The widest interval voted at ``step``, once every rank voted."""
        wait_until(lambda: int(self.store.add(self.keys.interval_voters(step), 0)) >= self.world,
                   every_s=0.001, between=abort_check)
        for k in reversed(levels):
            if int(self.store.add(self.keys.interval_vote(step, k), 0)) > 0:
                return k
        return levels[0]


class BoardRounds:
    def __init__(self, link, generation: int):
        self.link, self.board, self.index = link, link.board, link.index
        self.generation = generation

    def replicated(self, step: int) -> bool:
        self.board.set_replicated(self.index, self.generation, step)
        self.link.wake()
        return self.protected(step)

    def protected(self, step: int) -> bool:
        g, s = self.board.protected
        return g == self.generation and step <= s

    def vote(self, step: int, interval: int) -> None:
        self.board.set_vote(self.index, self.generation, step, interval)
        self.link.wake()

    def decision(self, step: int, levels: list[int], abort_check) -> int:
        """The decision of the vote at ``step``: the coordinator pushes it once every node's
        record carries every local rank's vote (the next vote comes only after this rank read
        this one, so the board still holds it)."""
        def decided() -> bool:
            g, s, _ = self.board.decision
            return g == self.generation and s == step
        wait_until(decided, every_s=0.001, between=abort_check)
        return self.board.decision[2]


def rounds_for(comm, store_factory):
    """The rounds of ``comm``'s generation: through the node's board when an agent started this
    process (``comm.link``), else through a store client from ``store_factory()``."""
    if getattr(comm, "link", None) is not None:
        return BoardRounds(comm.link, comm.topo.generation)
    return StoreRounds(store_factory(), comm.keys, comm.topo.dims.world_size)
