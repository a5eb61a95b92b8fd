"""A crashed rank's report goes through its node agent (``agent.client.report_crash``): a file
next to the board, which the agent posts as ``crash/<slot>`` before it writes the exit, so the
coordinator, woken by the exit, finds the crash (``recovery.detect``: "exception", not "exit")
and the rank never opens a store connection on its way out."""

from __future__ import annotations

from deadpool.agent.board import NODE_DIR_ENV, NODE_INDEX_ENV
from deadpool.agent.client import report_crash
from deadpool.agent.node import node_key
from deadpool.store import auth, reports
from deadpool.store.protocol import Keys, Seal
from tests.deadpool.agent.test_agent import SECRET, _agent
from tests.deadpool.helpers import client, master_store


class Recording:
    """A store client noting the keys it sets, in order."""

    def __init__(self, store):
        self._store, self.set_keys = store, []

    def set(self, key, value):
        self.set_keys.append(key)
        return self._store.set(key, value)

    def __getattr__(self, name):
        return getattr(self._store, name)


def _no_store():
    raise AssertionError("a rank under a node agent opened a store client to report its crash")


def test_a_crash_report_goes_through_the_agent_and_is_posted_before_the_exit(tmp_path):
    master = master_store()
    store = Recording(auth.namespaced(client(master.port), SECRET))
    seal = Seal(SECRET)
    agent, board = _agent(tmp_path, store, slots=(4, 5))
    agent.assigned = {4, 5}
    agent.publish()
    env = {NODE_DIR_ENV: str(tmp_path), NODE_INDEX_ENV: "1", auth.SECRET_ENV: SECRET}
    report_crash(5, "RuntimeError: boom", seal, _no_store, environ=env)  # then os._exit
    assert not reports.listed(store, [Keys.crash(5)])  # nothing reached the store yet
    n = len(store.set_keys)
    agent.on_exit(5, 1)  # the agent's waiter sees the exit
    after = store.set_keys[n:]
    assert Keys.crash(5) in after and node_key(3) in after
    assert after.index(Keys.crash(5)) < after.index(node_key(3))  # crash first, then the exit
    # what the coordinator reads when it sees the exit (detect._crash_reports)
    found = reports.read_posted(store, seal, {1: Keys.crash(5), 0: Keys.crash(4)})
    assert found == {1: "RuntimeError: boom"}


def test_without_an_agent_the_crash_is_posted_on_a_fresh_client(tmp_path):
    master = master_store()
    store = auth.namespaced(client(master.port), SECRET)
    report_crash(7, "ValueError: x", Seal(SECRET), lambda: store, environ={})
    assert reports.read_posted(store, Seal(SECRET), {0: Keys.crash(7)}) == {0: "ValueError: x"}
