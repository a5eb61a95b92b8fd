"""A writer lost while the ranks write the resume step to disk (``recovery.disk.write_state``: an
elastic regroup or a stop without spares) is named with what the coordinator knew of it, so that
a user, or a failed test's log, can tell an exit from a silent node from a hang."""

from __future__ import annotations

import pytest

from deadpool.control.liveness import NodeLiveness
from deadpool.errors import WriterLost
from deadpool.recovery import disk, plan
from deadpool.store import reports
from deadpool.store.protocol import Keys
from tests.deadpool.recovery.helpers import coordinator


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_an_exited_and_a_stopped_writer_are_named_with_their_evidence(tmp_path):
    coord = coordinator(tmp_path, ["ft.snapshot=false"])
    coord.live.clock = clock = Clock()
    for slot in range(4):
        coord.store.set(Keys.heartbeat(slot), "1 0 5 forward")
    coord.read_heartbeats()
    clock.t += 7.5  # no beat since: every writer 7.5 s silent
    keys = Keys(1)
    reports.post(coord.store, coord.seal, keys.checkpointed(0), "1")
    reports.post(coord.store, coord.seal, keys.checkpointed(1), "1")
    coord.launcher.exited[2] = -9
    coord.launcher.stopped.add(3)
    with pytest.raises(WriterLost) as e:
        disk.write_state(coord, 1, "checkpoint", plan.RecoveryDecision(6, {}, 0), "test",
                         timeout_s=5.0)
    text = str(e.value)
    assert "rank(s) [2, 3] (slot(s) [2, 3]) died, stopped or hung" in text, text
    assert "slot 2: killed by SIGKILL" in text, text
    # (its progress clock restarted when the write was planned)
    assert "slot 3: beat 7.5 s old, phase forward unchanged for 0.0 s" in text, text
    assert e.value.lost == {2: 2, 3: 3}


def test_a_node_record_names_its_age_and_what_it_flagged():
    clock = Clock()
    live = NodeLiveness(soft_s=1.0, hard_s=10.0, node_timeout_s=3.0, node_of=lambda s: s // 4,
                        clock=clock)
    assert live.evidence(5) == "its node's record never seen, beat never seen"
    live.observe_node(1, '1 0 5 4 1 {"slow": {"5": [0.5, true]}, "own": [6]}')
    clock.t += 3.5
    assert live.evidence(5) == "its node's record 3.5 s old, beat 4.0 s old, stopped"
    assert live.evidence(6) == "its node's record 3.5 s old, beat 3.5 s old, hung"
