"""deadpool.store.rounds under node agents: ranks write their replicated step and their snapshot-
interval vote on the board; each agent folds its node's into its sealed record, the coordinator
folds the nodes' (``Coordinator._agree``, run here on a stand-in) and pushes the results, which
the agents write back on their boards. No rank makes a store request."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from deadpool.agent.board import NodeBoard, pack, unpack
from deadpool.agent.client import NodeLink
from deadpool.agent.node import NodeAgent, node_key
from deadpool.control.coordinator import Coordinator
from deadpool.control.liveness import NodeLiveness
from deadpool.store import auth
from deadpool.store.protocol import Keys, Plan, Seal, Source
from deadpool.store.rounds import BoardRounds, StoreRounds
from tests.deadpool.helpers import client, master_store

SECRET = auth.new_secret()
FT = {"heartbeat_timeout_s": 1.0, "heartbeat_hard_timeout_s": 10.0, "progress_timeout_s": 5.0,
      "coordinator_timeout_s": 4.0}
G = 3
LEVELS = [1, 2, 4, 8]


def test_pack_keeps_generation_and_step_in_one_ordered_word():
    for g, s in [(0, -1), (0, 0), (3, 17), (2**20, 2**39 - 2)]:
        assert unpack(pack(g, s)) == (g, s)
    assert pack(1, 0) > pack(0, 10**9) and unpack(-1) == (-1, -1)


class Events:
    """The coordinator's event log, delivered at once to every agent (agent.events in order)."""

    def __init__(self, agents):
        self.agents, self.pushed = agents, []

    def push(self, kind, **data):
        self.pushed.append(dict(data, kind=kind))
        for a in self.agents:
            a.apply(dict(data, kind=kind))


def _job(tmp_path):
    """Two nodes of two ranks (slots 0-3), plan G applied by both agents; a coordinator stand-in
    with the real ``_agree`` and ``NodeLiveness``."""
    master = master_store()
    store = auth.namespaced(client(master.port), SECRET)
    seal = Seal(SECRET)
    plan = Plan(G, "train", {r: r for r in range(4)}, 0, {r: Source("live", r) for r in range(4)})
    store.set(Keys.plan(G), seal.wrap(Keys.plan(G), plan.to_json()))
    agents, rounds = [], []
    for node in (0, 1):
        where = tmp_path / f"node{node}"
        slots = [2 * node, 2 * node + 1]
        agent = NodeAgent(node, NodeBoard.create(where / "board", slots), store, seal, FT, where)
        agent.apply({"kind": "plan", "g": G})
        agents.append(agent)
        rounds += [BoardRounds(NodeLink(where, i, seal=Seal(SECRET)), G) for i in range(2)]
    live = NodeLiveness(1.0, 10.0, 3.0, lambda s: s // 2)
    coord = SimpleNamespace(gen=G, _agreed=(-1, -1, -1), _rank_nodes=[], live=live,
                            members=SimpleNamespace(ranks=plan.assignments),
                            launcher=SimpleNamespace(node_of_slot={s: s // 2 for s in range(4)}),
                            events=Events(agents), master=master)  # (keeps the store up)

    def read():  # the coordinator's _read_nodes: every node's sealed record, then _agree
        for a in agents:
            a.check_rounds()
        for node in (0, 1):
            live.observe_node(node, seal.unwrap(node_key(node), store.get(node_key(node))))
        Coordinator._agree(coord)
    return agents, rounds, coord, read


def test_a_step_is_protected_once_every_rank_of_every_node_replicated_it(tmp_path):
    agents, rounds, coord, read = _job(tmp_path)
    for r in rounds[:3]:
        assert not r.replicated(8)
    read()
    assert not any(r.protected(8) for r in rounds) and coord.events.pushed == []
    assert not rounds[3].replicated(8)  # (its own write cannot know the others')
    read()
    assert all(r.protected(8) and r.protected(4) and not r.protected(9) for r in rounds)
    assert coord.events.pushed == [{"g": G, "step": 8, "kind": "protected"}]
    read()  # nothing new: nothing pushed again
    assert len(coord.events.pushed) == 1
    # another generation's protection says nothing about this one
    assert not BoardRounds(NodeLink(tmp_path / "node0", 0, seal=Seal(SECRET)), G + 1).protected(8)


def test_every_rank_reads_the_widest_interval_voted_once_all_voted(tmp_path):
    agents, rounds, coord, read = _job(tmp_path)
    got = {}

    def decide(i):
        got[i] = rounds[i].decision(16, LEVELS, lambda: None)

    for i, k in enumerate([1, 4, 2, 1]):
        rounds[i].vote(16, k)
    waiters = [threading.Thread(target=decide, args=(i,)) for i in range(4)]
    for t in waiters:
        t.start()
    read()
    for t in waiters:
        t.join(timeout=5)
    assert got == {0: 4, 1: 4, 2: 4, 3: 4}
    assert coord.events.pushed == [{"g": G, "step": 16, "kind": "interval", "k": 4}]


def test_a_node_missing_one_rank_vote_holds_the_decision(tmp_path):
    agents, rounds, coord, read = _job(tmp_path)
    for i in range(3):
        rounds[i].vote(16, 2)
    rounds[3].vote(8, 8)  # still the last vote: the node's ranks disagree on the step
    read()
    assert coord.events.pushed == []


def test_store_rounds_count_every_rank():
    master = master_store()
    store = client(master.port)
    rounds = [StoreRounds(store, Keys(G), 3) for _ in range(3)]
    assert not rounds[0].replicated(4) and not rounds[1].replicated(4)
    assert rounds[2].replicated(4) and rounds[0].protected(4) and not rounds[0].protected(8)
    for r, k in zip(rounds, [1, 8, 2]):
        r.vote(16, k)
    assert rounds[0].decision(16, LEVELS, lambda: None) == 8
