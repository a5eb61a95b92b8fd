"""A node agent that must not go deaf, stall its record behind a store read, trust files another
user could plant, or leave a lagging reader stuck (issue 36, items 3, 4, 5, 9, 11)."""

from __future__ import annotations

import json
import os
import stat
import threading

import pytest

from deadpool.agent.board import COORD_LOST, NodeBoard
from deadpool.agent.client import NodeLink
from deadpool.agent.node import KEEP_PLAN_FILES, NodeAgent, node_key, report_file
from deadpool.store import auth
from deadpool.store.protocol import Keys, Plan, Seal, Source
from deadpool.store.wire import publish_plan
from tests.deadpool.helpers import client, master_store

SECRET = auth.new_secret()
FT = {"heartbeat_timeout_s": 1.0, "heartbeat_hard_timeout_s": 10.0, "progress_timeout_s": 5.0,
      "coordinator_timeout_s": 4.0, "node_timeout_s": 3.0}


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Stalling:
    """A store client whose reads never answer (a coordinator stopped mid-request); writes pass."""

    def __init__(self, store):
        self.store, self.release = store, threading.Event()

    def get(self, key):
        self.release.wait()
        return self.store.get(key)

    def check(self, keys):
        self.release.wait()
        return self.store.check(keys)

    def __getattr__(self, name):
        return getattr(self.store, name)


def _store():
    master = master_store()
    return master, auth.namespaced(client(master.port), SECRET)


def _plan(g, assignments, resume=5):
    return Plan(g, "train", assignments, resume, {r: Source("live", r) for r in assignments})


def _agent(where, store, slots=(0, 1), clock=None, **kw):
    where.mkdir(parents=True, exist_ok=True)
    board = NodeBoard.create(where / "board", list(slots))
    return NodeAgent(3, board, store, Seal(SECRET), FT, where, clock=clock or Clock(), **kw), board


# -- item 4: one liveness signal, no store read on the record's path -------------------------------
def test_a_tick_never_waits_on_a_store_read_and_notices_a_stalled_coordinator_on_its_clock(tmp_path):
    """The record (and the board beat its ranks fence on) goes out every tick even while every
    store read hangs; the coordinator's silence is judged on the agent's clock, so a stalled
    coordinator is seen at ``coordinator_timeout_s``, not when a 60 s read gives up."""
    master, store = _store()  # noqa: F841 (the server lives as long as the test)
    stalling = Stalling(store)
    clock = Clock()
    agent, board = _agent(tmp_path, stalling, clock=clock)
    seal = Seal(SECRET)
    try:
        beats = []
        for _ in range(3):
            t = threading.Thread(target=agent.tick, daemon=True)
            t.start()
            t.join(2.0)
            assert not t.is_alive(), "a tick waited on a store read"
            beats.append(board.agent_beat)
            clock.t += 0.25
        assert seal.unwrap(node_key(3), store.get(node_key(3))).split()[0] == "3"
        assert beats == sorted(set(beats)) and beats[0] >= 1  # the board beats with the record
        clock.t += FT["coordinator_timeout_s"]
        t = threading.Thread(target=agent.tick, daemon=True)
        t.start()
        t.join(2.0)
        assert not t.is_alive() and board.flag(COORD_LOST)
    finally:
        stalling.release.set()


def test_the_board_beat_is_the_record_s_a_deaf_agent_stops_both(tmp_path):
    """Its ranks fence themselves when the board beat stops (``BoardHeartbeat``), the
    coordinator declares the node lost when its record stops: both come from one tick, so
    they stop together."""
    master, store = _store()  # noqa: F841 (the server lives as long as the test)
    agent, board = _agent(tmp_path, store)
    seal = Seal(SECRET)
    agent.tick()
    beat, seq = board.agent_beat, seal.unwrap(node_key(3), store.get(node_key(3))).split()[0]
    assert beat >= 1 and seq == "1"
    agent.go_deaf("test")
    agent.tick()
    agent.on_exit(0, -9)
    assert board.agent_beat == beat
    assert seal.unwrap(node_key(3), store.get(node_key(3))).split()[0] == seq


def test_a_disk_plan_or_an_in_place_reshape_is_a_small_delta_at_16k_ranks():
    from deadpool.store.wire import decode_plan, encode_plan

    n = 16384
    world = {r: r for r in range(n)}
    prev = _plan(4, world)
    disk = Plan(5, "train", world, 120,
                {r: Source("disk", r, dir="run/checkpoints/step_120") for r in world})
    text = encode_plan(disk, prev)
    assert len(text) < 1000, len(text)
    assert decode_plan(text, prev) == disk
    half = {r: r for r in range(n // 2)}  # a reshape to half the width, every rank from disk
    reshape = Plan(6, "train", half, 120,
                   {r: Source("disk", r, dir="run/checkpoints/step_120") for r in half},
                   layout={"dp": 1})
    text = encode_plan(reshape, disk)
    assert decode_plan(text, disk) == reshape
    assert len(text) < 100_000  # the dropped half is listed once, as ranks; no source per rank
    mixed = dict(disk.sources)
    mixed[7] = Source("disk", 7, dir="elsewhere")
    odd = Plan(7, "train", world, 120, mixed)
    assert decode_plan(encode_plan(odd, disk), disk) == odd


# -- item 3: the events thread survives any failure, retries, and escalates ------------------------
def test_a_failing_event_is_retried_and_a_forged_delta_falls_back_to_the_full_plan(tmp_path):
    from deadpool.agent.loops import EventApplier

    master, store = _store()  # noqa: F841 (the server lives as long as the test)
    seal = Seal(SECRET)
    agent, board = _agent(tmp_path, store, slots=(4, 5))
    p0 = _plan(0, {0: 4, 1: 5})
    publish_plan(store, seal, p0, None)
    logs = []
    apply = EventApplier(agent, lambda: store, give_up_s=5.0, log=logs.append, pause=lambda s: None)
    assert apply({"kind": "plan", "g": 0}) and board.plan_generation == 0
    p1 = _plan(1, {0: 4, 1: 5}, resume=7)
    publish_plan(store, seal, p1, p0)
    store.set(Keys.plan(1), "forged")  # the delta overwritten by a client without the secret
    assert apply({"kind": "plan", "g": 1})  # the sealed full form is read instead
    assert agent.plan == p1 and board.plan_generation == 1
    # an event that fails (no store at first) is retried, not dropped
    flaky = iter([None, store])
    agent.store = None
    retry = EventApplier(agent, lambda: next(flaky) or _raise(), give_up_s=5.0, log=logs.append,
                         pause=lambda s: None)
    assert retry({"kind": "fence", "slots": [5]}) and board.fenced(1)


def _raise():
    raise ConnectionError("store unreachable")


def test_an_event_that_keeps_failing_makes_the_node_go_silent_not_deaf(tmp_path):
    """A node that cannot apply the coordinator's events must not keep its record fresh: past
    the retry window the agent goes deaf on purpose (no record, no board beat), so the job
    declares the node lost and its ranks fence themselves."""
    from deadpool.agent.loops import EventApplier

    master, store = _store()  # noqa: F841 (the server lives as long as the test)
    clock = Clock()
    agent, board = _agent(tmp_path, store, clock=clock)
    deaf = []

    def pause(s):
        clock.t += s

    def broken(ev, fetched=None):
        raise OSError(28, "No space left on device")

    agent.apply = broken
    apply = EventApplier(agent, lambda: store, give_up_s=2.0, log=lambda m: None, pause=pause,
                         clock=clock, on_deaf=deaf.append)
    assert not apply({"kind": "abort", "g": 0})
    assert agent.deaf and deaf and "No space left" in deaf[0]
    beat = board.agent_beat
    agent.tick()
    assert board.agent_beat == beat


# -- item 9: lagging readers ------------------------------------------------------------------------
def test_a_reader_behind_the_agent_s_kept_plan_files_gets_the_newest(tmp_path):
    master, store = _store()  # noqa: F841 (the server lives as long as the test)
    seal = Seal(SECRET)
    agent, board = _agent(tmp_path, store, slots=(0,))
    link = NodeLink(tmp_path, 0, seal=seal)
    prev = None
    for g in range(KEEP_PLAN_FILES + 2):
        p = _plan(g, {0: 0}, resume=g)
        publish_plan(store, seal, p, prev)
        prev_of_newest, prev = prev, p
        agent.apply({"kind": "plan", "g": g})
    text = link.plan_text(0)  # dropped long ago: the newest the agent holds, not a crash
    assert text is not None
    from deadpool.store.wire import decode_plan
    assert decode_plan(text, prev_of_newest).generation == KEEP_PLAN_FILES + 1


def test_a_reader_without_agents_whose_plan_was_collected_jumps_to_the_newest():
    from deadpool.store.wire import fetch_plan, newest_plan

    master, store = _store()  # noqa: F841 (the server lives as long as the test)
    seal = Seal(SECRET)
    prev = None
    for g in range(4):
        p = _plan(g, {0: 0, 1: 1}, resume=g)
        publish_plan(store, seal, p, prev)
        prev = p
    for g in (0, 1):  # the coordinator collected them (finished_key)
        store.delete_key(Keys.plan(g))
        store.delete_key(Keys.plan_full(g))
    assert newest_plan(store, seal) == 3
    plan, _ = fetch_plan(store, seal, 1, None)
    assert plan.generation == 3 and plan == prev


# -- item 5: the node's directory and its files ----------------------------------------------------
def test_the_node_directory_refuses_a_parent_it_does_not_own_alone(tmp_path):
    from deadpool.agent.shm import UnsafeNodeDir, make_node_dir

    parent = tmp_path / "deadpool-x"
    parent.mkdir(mode=0o777)
    os.chmod(parent, 0o777)  # made first by someone else, or left open
    with pytest.raises(UnsafeNodeDir, match="0777"):
        make_node_dir(parent / "node0")
    os.chmod(parent, 0o700)
    if os.getuid() == 0:
        os.chown(parent, 4321, 4321)
        with pytest.raises(UnsafeNodeDir, match="owned by uid 4321"):
            make_node_dir(parent / "node0")
        os.chown(parent, 0, 0)
    elsewhere = tmp_path / "theirs"
    elsewhere.mkdir(mode=0o700)
    link = tmp_path / "deadpool-y"
    link.symlink_to(elsewhere)
    with pytest.raises(UnsafeNodeDir, match="symbolic link"):
        make_node_dir(link / "node0")
    # a node0 symlink inside our own parent: replaced, never followed, no crash
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    (parent / "node0").symlink_to(victim)
    where = make_node_dir(parent / "node0")
    assert where.is_dir() and not where.is_symlink() and (victim / "keep").exists()
    assert stat.S_IMODE(os.lstat(where).st_mode) == 0o700
    fresh = make_node_dir(tmp_path / "new-parent" / "node1")  # made here: 0700, ours
    assert stat.S_IMODE(os.lstat(fresh.parent).st_mode) == 0o700


def test_plan_and_report_files_on_the_node_are_sealed(tmp_path):
    master, store = _store()  # noqa: F841 (the server lives as long as the test)
    seal = Seal(SECRET)
    agent, board = _agent(tmp_path, store, slots=(4, 5))
    link = NodeLink(tmp_path, 1, seal=seal)
    publish_plan(store, seal, _plan(0, {0: 4, 1: 5}), None)
    agent.apply({"kind": "plan", "g": 0})
    assert link.plan_text(0) is not None
    raw = (tmp_path / "plan-0.wire").read_text()
    assert raw.startswith("s1:")  # sealed on the node too
    (tmp_path / "plan-0.wire").write_text(json.dumps({"wire": 1, "form": "full"}))  # forged
    with pytest.raises(auth.AuthError):
        link.plan_text(0)
    # a forged report file: counted on the board but never sent on
    report_file(tmp_path, 0, 1).write_text(json.dumps(
        {"g": 0, "kind": "status", "rank": 0, "text": "forged"}))
    board.set_reports(0, 1)
    link.report(0, "status", 1, "real")
    agent.check_rounds()
    key = Keys(0).node_report("status", 3)
    assert json.loads(seal.unwrap(key, store.get(key))) == {"1": "real"}


# -- item 11: a (value, step) pair on the board is read whole ---------------------------------------
class _Interleaving:
    """The agent's words, with a reader running after every single word written."""

    def __init__(self, words, after):
        self.words, self.after = words, after

    def __getitem__(self, i):
        return self.words[i]

    def __setitem__(self, i, v):
        self.words[i] = v
        self.after()


def test_a_decision_or_vote_is_never_read_half_written(tmp_path):
    agent_side = NodeBoard.create(tmp_path / "board", [0])
    rank_side = NodeBoard.open(tmp_path / "board")
    agent_side.set_decision(1, 10, 2)
    rank_side.set_vote(0, 1, 10, 2)
    seen = []
    agent_side.words = _Interleaving(agent_side.words, lambda: seen.append(rank_side.decision))
    agent_side.set_decision(1, 20, 4)
    assert set(seen) <= {(1, 10, 2), (1, 20, 4)}, seen
    seen.clear()
    rank_side.words = _Interleaving(rank_side.words, lambda: seen.append(agent_side.vote(0)))
    rank_side.set_vote(0, 1, 20, 4)
    assert set(seen) <= {(1, 10, 2), (1, 20, 4)}, seen


def test_a_record_the_store_does_not_take_stops_the_beat_unless_the_coordinator_is_silent_too(
        tmp_path):
    """The writer thread is stuck (its records never taken): while the coordinator's heartbeat
    still advances, the job is about to declare the node lost, so the board beat stops (its
    processes fence themselves); when the coordinator is silent too (stopped), the beat goes on
    and the processes take the coordinator-loss path instead."""
    master, store = _store()  # noqa: F841
    seal = Seal(SECRET)
    clock = Clock()
    agent, board = _agent(tmp_path, store, clock=clock)
    agent._writer = True  # records handed over to a writer that never writes them
    hb = 0

    def coordinator_beats():
        nonlocal hb
        hb += 1
        store.set(Keys.COORD_HB, seal.wrap(Keys.COORD_HB, str(hb)))
        agent.check_coordinator()

    for _ in range(12):  # 3 s: the coordinator beats, the node's record is never taken
        coordinator_beats()
        agent.tick()
        clock.t += 0.25
    beat = board.agent_beat
    agent.tick()
    assert board.agent_beat == beat, "the board beat went on without the record"
    stopped, sbeat = _agent(tmp_path / "stopped", store, clock=clock)
    stopped._writer = True
    for _ in range(12):  # both silent: a stopped coordinator
        stopped.tick()
        clock.t += 0.25
    assert sbeat.agent_beat >= 12
