import pytest

from deadpool.rank.faults import Fault, FaultEvent, FaultInjector, InjectedFault


def test_exception_fault_fires_once_at_its_rank_step_and_phase():
    inj = FaultInjector([{"rank": 1, "step": 3, "phase": "mid_step", "kind": "exception"}], slot=1)
    inj.set_rank(1)
    inj.fire(3, "step_start")
    inj.fire(2, "mid_step")
    with pytest.raises(InjectedFault):
        inj.fire(3, "mid_step")
    inj.fire(3, "mid_step")  # a replayed step after recovery does not fire again


def test_a_kill_reaches_its_rank_only(monkeypatch):
    import os
    import signal
    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))  # never really sent
    inj = FaultInjector([FaultEvent(1, 3, "mid_step", Fault.KILL)], slot=0)
    inj.set_rank(0)
    inj.fire(3, "mid_step")
    assert sent == []  # another rank's fault
    inj.set_rank(1)  # this process takes rank 1 (a spare): the fault is its now
    inj.fire(3, "mid_step")
    assert sent == [(os.getpid(), signal.SIGKILL)]


def test_bad_phase_is_rejected():
    with pytest.raises(ValueError, match="phase"):
        FaultEvent.from_cfg({"rank": 0, "step": 1, "phase": "lunch", "kind": "kill"})
    with pytest.raises(ValueError):
        FaultEvent.from_cfg({"rank": 0, "step": 1, "phase": "mid_step", "kind": "explode"})


def test_a_stop_agent_fault_stops_the_node_agent_and_not_the_process(monkeypatch):
    import os
    import signal

    from deadpool.agent.board import NODE_DIR_ENV
    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    ev = FaultEvent.from_cfg({"rank": 0, "step": 2, "phase": "mid_step", "kind": "stop_agent"})
    inj = FaultInjector([ev], slot=0)
    inj.set_rank(0)
    monkeypatch.delenv(NODE_DIR_ENV, raising=False)
    with pytest.raises(InjectedFault, match="needs node agents"):
        inj.fire(2, "mid_step")
    inj = FaultInjector([ev], slot=0)
    inj.set_rank(0)
    monkeypatch.setenv(NODE_DIR_ENV, "/nonexistent")
    inj.fire(2, "mid_step")
    assert sent == [(os.getppid(), signal.SIGSTOP)]


def test_a_stall_sleeps_its_thread_once_and_goes_on(monkeypatch):
    slept = []
    monkeypatch.setattr("deadpool.rank.faults.time.sleep", slept.append)
    inj = FaultInjector([{"rank": 1, "step": 3, "phase": "forward", "kind": "stall",
                          "delay_s": 5}], slot=1)
    inj.set_rank(1)
    for step in range(6):
        inj.fire(step, "forward")  # returns: the thread goes on (a hang never would)
    assert slept == [5.0]
