"""A rank's reports reach its node agent through its mailbox on the board (no file, no system
call on either side) when the report fits and the agent took the one before; else through a
file next to the board, as before. Either way sealed, in order, each once."""

from __future__ import annotations

import json

from deadpool.agent.board import HEADER_WORDS, MAILBOX_BYTES, SLOT_WORDS, NodeBoard
from deadpool.agent.client import NodeLink
from deadpool.store import auth
from deadpool.store.protocol import Keys, Seal
from tests.deadpool.agent.test_agent import SECRET, _agent
from tests.deadpool.helpers import client, master_store


def _node(tmp_path):
    master = master_store()
    store = auth.namespaced(client(master.port), SECRET)
    agent, board = _agent(tmp_path, store, slots=(4, 5))
    return master, store, agent, board, NodeLink(tmp_path, 1, seal=Seal(SECRET))


def _sent(store, g=2, kind="status"):
    key = Keys(g).node_report(kind, 3)
    return json.loads(Seal(SECRET).unwrap(key, store.get(key)))


def _files(tmp_path):
    return sorted(p.name for p in tmp_path.glob("report-*"))


def test_reports_taken_as_they_come_never_touch_a_file(tmp_path):
    master, store, agent, board, link = _node(tmp_path)  # noqa: F841 (the server lives)
    for rank in range(5):
        link.report(2, "status", rank, f'{{"rank": {rank}}}')
        assert _files(tmp_path) == []  # in the mailbox
        agent.check_rounds()
    assert sorted(_sent(store)) == ["0", "1", "2", "3", "4"]
    assert board.reports(1) == 5 and agent._reports_read[1] == 5


def test_a_report_is_a_file_while_the_mailbox_holds_an_untaken_one_or_when_it_is_too_big(tmp_path):
    master, store, agent, board, link = _node(tmp_path)  # noqa: F841
    link.report(2, "status", 0, "first")  # the mailbox
    link.report(2, "status", 1, "second")  # the first is not taken yet: a file
    assert _files(tmp_path) == ["report-1-2.txt"]
    agent.check_rounds()
    assert _sent(store) == {"0": "first", "1": "second"} and _files(tmp_path) == []
    big = "x" * MAILBOX_BYTES
    link.report(2, "status", 2, big)  # does not fit: a file
    assert _files(tmp_path) == ["report-1-3.txt"]
    link.report(2, "status", 3, "after")  # the mailbox is free (report 1 was taken)
    assert _files(tmp_path) == ["report-1-3.txt"]
    agent.check_rounds()
    assert _sent(store)["2"] == big and _sent(store)["3"] == "after"


def test_a_report_not_yet_whole_is_taken_at_the_next_check(tmp_path):
    """A reader may see the report's number before its bytes (stores seen out of program order,
    aarch64): its CRC says so, and the agent leaves it, and every later one, for the next check."""
    master, store, agent, board, link = _node(tmp_path)  # noqa: F841
    link.report(2, "status", 0, "whole")
    head = (8 * (HEADER_WORDS + SLOT_WORDS * board.num_slots) + MAILBOX_BYTES * 1) // 8
    crc = board.words[head + 2]
    board.words[head + 2] = crc ^ 1  # as if the CRC word were not seen yet
    agent.check_rounds()
    assert agent._reports_read.get(1, 0) == 0 and not store.check([Keys(2).node_report("status", 3)])
    assert board.take_report(1, 1) == (True, None)
    board.words[head + 2] = crc
    agent.check_rounds()
    assert _sent(store) == {"0": "whole"} and agent._reports_read[1] == 1


def test_a_mailbox_report_without_the_jobs_seal_is_dropped(tmp_path):
    master, store, agent, board, link = _node(tmp_path)  # noqa: F841
    forged = []
    agent.on_forged = forged.append
    assert board.put_report(0, 1, b"2 status 0\nforged")
    board.set_reports(0, 1)
    link.report(2, "status", 1, "real")
    agent.check_rounds()
    assert _sent(store) == {"1": "real"} and forged == ["report-0-1.txt"]


def test_a_new_board_has_its_mailboxes_free_and_in_memory(tmp_path):
    board = NodeBoard.create(tmp_path / "board", [7, 8, 9])
    assert all(board.take_report(i, 1) == (False, None) for i in range(3))
    assert board.put_report(2, 1, b"r") and board.take_report(2, 1) == (True, b"r")
    assert not board.put_report(2, 2, b"s")  # report 1 not taken yet
    board.set_taken(2, 1)
    assert board.put_report(2, 2, b"s") and board.take_report(2, 2) == (True, b"s")


def test_a_sealed_report_without_its_header_line_is_dropped_and_the_next_is_taken(tmp_path):
    master, store, agent, board, link = _node(tmp_path)  # noqa: F841
    seal = Seal(SECRET)
    assert board.put_report(0, 1, seal.wrap("node-file/report-0-1.txt", "no header").encode())
    board.set_reports(0, 1)
    link.report(2, "status", 1, "real\nwith a second line")
    agent.check_rounds()
    assert _sent(store) == {"1": "real\nwith a second line"} and agent._reports_read[0] == 1
