"""Presence connections (deadpool/agent/presence.py) on loopback: an agent's hello must carry the
job's secret, the end of its connection is news at once on the coordinator's side, and the
coordinator's end is news on the agent's; ``cut_off`` tells a host that answers from one that
does not."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from deadpool.agent.presence import PresenceClient, PresenceServer
from deadpool.store import auth

SECRET = auth.new_secret()


@pytest.fixture
def server():
    gone, forged = [], []
    s = PresenceServer("127.0.0.1", SECRET, gone.append, on_forged=lambda: forged.append(1))
    s.gone, s.forged = gone, forged
    s.start()
    yield s
    s.stop()


def wait_for(cond, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def agent_process(port: int, node: int) -> subprocess.Popen:
    """A process that says hello as ``node`` and holds its connection until killed."""
    code = ("import sys, time; from deadpool.agent.presence import PresenceClient; "
            f"PresenceClient('127.0.0.1', {port}, {node}, sys.argv[1]).connect(); "
            "print('up', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, SECRET], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    return p


def test_an_agent_process_killed_is_news_at_once_and_only_its_node(server):
    a, b = agent_process(server.port, 3), agent_process(server.port, 4)
    try:
        wait_for(lambda: server.nodes.get(3) == 1 and server.nodes.get(4) == 1)
        t0 = time.monotonic()
        a.kill()  # its kernel closes its sockets
        wait_for(lambda: server.gone == [3])
        assert time.monotonic() - t0 < 1.0
        time.sleep(0.2)
        assert server.gone == [3] and server.nodes[4] == 1
    finally:
        a.kill(), b.kill(), a.wait(), b.wait()


def test_a_hello_without_the_secret_speaks_for_no_node(server):
    c = PresenceClient("127.0.0.1", server.port, 3, auth.new_secret()).connect()
    wait_for(lambda: server.forged)
    c.sock.close()
    time.sleep(0.3)
    assert server.gone == [] and 3 not in server.nodes
    # a connection that never says who it is and ends: nobody's news either
    socket.create_connection(("127.0.0.1", server.port)).close()
    time.sleep(0.3)
    assert server.gone == []


def test_a_replayed_hello_does_not_pass_a_new_nonce(server):
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.recv(64)
    sock.sendall(auth.seal(SECRET, "5", context="presence/" + "0" * 32).encode() + b"\n")
    wait_for(lambda: server.forged)
    sock.close()
    time.sleep(0.2)
    assert server.gone == []


def test_the_coordinator_s_end_is_news_to_the_agent_and_its_own_close_is_not():
    s = PresenceServer("127.0.0.1", SECRET, lambda n: None)
    s.start()
    c = PresenceClient("127.0.0.1", s.port, 0, SECRET).connect()
    d = PresenceClient("127.0.0.1", s.port, 1, SECRET).connect()
    d.close()
    s.stop()  # closes every connection, as the coordinator's death would
    wait_for(c.coordinator_gone.is_set)
    time.sleep(0.2)
    assert not d.coordinator_gone.is_set()


def test_cut_off_only_when_the_coordinator_s_host_does_not_answer():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    c = PresenceClient("127.0.0.1", port, 0, SECRET)
    assert not c.cut_off()  # it answers (a stopped process's kernel still completes handshakes)
    listener.close()
    assert not c.cut_off()  # refused: the host answers, the process is gone


def test_cut_off_when_a_connection_gets_no_answer(monkeypatch):
    """(A host whose link is down: here the connect's time-out is stood in for; the test bed's
    tests/integration/test_multihost.py cuts a real link.)"""
    def no_answer(addr, timeout=None):
        raise TimeoutError("timed out")

    c = PresenceClient("127.0.0.1", 9, 0, SECRET)
    monkeypatch.setattr(socket, "create_connection", no_answer)
    assert c.cut_off()
    c.coordinator_gone.set()  # its stream ended: the coordinator died, nothing is cut off
    assert not c.cut_off()


def test_a_node_lost_by_presence_is_read_as_its_processes_exiting_on_the_coordinator_s_thread():
    from deadpool.control.liveness import NodeLiveness

    live = NodeLiveness(1.0, 10.0, 3.0, lambda s: s // 2)
    live.observe_node(1, '1 0 5 2 0 {"exit":{"3":0}}')  # slot 3 had already exited cleanly
    assert live.suspects(lambda n: [2 * n, 2 * n + 1]) == {3}
    t = threading.Thread(target=live.lose_node, args=(1, [2, 3]))  # the presence thread's call
    t.start(), t.join()
    assert live.suspects(lambda n: [2 * n, 2 * n + 1]) == {2, 3}
    assert live.exit_code(2) == -9 and live.exit_code(3) == 0 and live.exit_code(0) is None


def test_a_connection_that_never_says_who_it_is_is_dropped(server, monkeypatch):
    from deadpool.agent import presence

    monkeypatch.setattr(presence, "HELLO_TIMEOUT_S", 0.2)
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(3.0)
    assert sock.recv(64).endswith(b"\n")  # the nonce
    assert sock.recv(64) == b""  # then closed by the server, past the hello's time
    sock.close()
    assert server.gone == []
