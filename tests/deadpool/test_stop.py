"""deadpool.launch.stop: a signal asks for a stop, a second one kills the job's processes and unwinds
the coordinator; a node agent's request counts only when sealed with the job's secret."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from deadpool.launch.stop import REQUEST_HINT, REQUEST_KEY, HardStop, Stopper, request
from deadpool.store import auth
from deadpool.store.protocol import Seal
from tests.deadpool.helpers import master_store


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs in the main thread at its next bytecode


def test_a_first_signal_asks_a_second_kills_the_jobs_processes_and_unwinds():
    before = signal.getsignal(signal.SIGTERM)
    st = Stopper().install()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        st.launcher = SimpleNamespace(procs={0: sleeper})
        st.waker = SimpleNamespace(woken=threading.Event())
        _deliver(signal.SIGUSR1)
        assert (st.why, st.signum) == ("SIGUSR1", signal.SIGUSR1)
        assert st.waker.woken.is_set()  # the coordinator's loop turns at once
        assert sleeper.poll() is None  # the first signal kills nothing
        st.running = True  # inside Coordinator.run
        with pytest.raises(HardStop, match="SIGUSR1, then SIGTERM: stopped at once"):
            _deliver(signal.SIGTERM)
        assert sleeper.wait(timeout=5) == -signal.SIGKILL
        assert not st.running and st.why == "SIGUSR1"
        _deliver(signal.SIGINT)  # outside the loop: kills again, raises nothing
    finally:
        sleeper.kill()
        st.restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_agents_request_counts_only_sealed(monkeypatch):
    monkeypatch.setattr("deadpool.launch.stop.POLL_S", 0.0)  # every call reads the hint
    store, secret, logs = master_store(), auth.new_secret(), []
    coord = SimpleNamespace(store=store, seal=Seal(secret), forgeries=set(), log=logs.append,
                            counter=lambda key: int(store.add(key, 0)))
    st = Stopper()
    st.poll_agents(coord)
    assert st.why is None
    store.set(REQUEST_KEY, json.dumps({"signal": "SIGTERM", "node": 1}))  # no seal: a stranger's
    store.add(REQUEST_HINT, 1)
    st.poll_agents(coord)
    assert st.why is None and any("without the job's secret" in line for line in logs)
    request(store, Seal(secret), "SIGTERM", 1)
    st.poll_agents(coord)
    assert (st.why, st.signum) == ("SIGTERM to node 1's agent", signal.SIGTERM)
    request(store, Seal(secret), "SIGUSR1", 0)  # the first request stands
    st.poll_agents(coord)
    assert st.why == "SIGTERM to node 1's agent"
