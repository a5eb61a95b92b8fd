"""The node agent's parts without processes: the board, the agent's record and events, the
coordinator's reading of records (NodeLiveness) and the pushed event log."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from deadpool.agent.board import COORD_LOST, COORD_SEEN, JOB_DONE, NodeBoard
from deadpool.agent.client import BoardHeartbeat, NodeLink
from deadpool.agent.events import EventFollower, EventLog, WakeListener, event_key
from deadpool.agent.node import NODES_CHANGED, NodeAgent, node_key
from deadpool.control.liveness import NodeLiveness
from deadpool.rank.watchdog import Progress
from deadpool.store import auth
from deadpool.store.protocol import Keys, Plan, Seal, Source, wake_coordinator
from deadpool.store.wire import decode_plan, fetch_plan, publish_plan
from tests.deadpool.helpers import client, master_store

SECRET = auth.new_secret()
FT = {"heartbeat_timeout_s": 1.0, "heartbeat_hard_timeout_s": 10.0, "progress_timeout_s": 5.0,
      "coordinator_timeout_s": 4.0}


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_board_carries_beats_up_and_flags_down_between_two_mappings(tmp_path):
    agent_side = NodeBoard.create(tmp_path / "board", [6, 7])
    rank_side = NodeBoard.open(tmp_path / "board")
    assert [rank_side.slot_of(i) for i in range(2)] == [6, 7] and rank_side.index_of(7) == 1
    rank_side.write_beat(1, pid=4242, beat=3, progress=9, step=12, phase="allreduce")
    assert agent_side.read_beat(1) == (4242, 3, 9, 12, "allreduce")
    assert agent_side.read_beat(0)[1] == 0  # never beaten
    assert rank_side.abort_generation == -1 and rank_side.plan_generation == -1
    agent_side.announce_abort(2)
    agent_side.announce_abort(1)  # never goes back
    agent_side.publish_plan(3)
    agent_side.set_flag(JOB_DONE)
    agent_side.fence(0)
    assert rank_side.abort_generation == 2 and rank_side.plan_generation == 3
    assert rank_side.flag(JOB_DONE) and not rank_side.flag(COORD_LOST)
    assert rank_side.fenced(0) and not rank_side.fenced(1)
    with pytest.raises(IndexError):
        rank_side.read_beat(2)


def test_the_doorbell_wakes_the_agent_at_once_and_only_when_rung(tmp_path):
    from deadpool.agent.board import Doorbell, open_doorbell, ring

    assert open_doorbell(tmp_path) is None  # no agent yet: ringing is a no-op
    ring(None)
    bell = Doorbell(tmp_path)
    t0 = time.monotonic()
    assert not bell.wait(0.05) and time.monotonic() - t0 >= 0.05  # no writer open: no wake
    link_fd = open_doorbell(tmp_path)
    assert not bell.wait(0.05)  # a writer that has not rung: still no wake
    for _ in range(100_000):  # rings beyond the FIFO's capacity are dropped, not blocking
        ring(link_fd)
    assert bell.wait(1.0) and not bell.wait(0.01)  # every pending ring consumed by one wake
    threading.Timer(0.05, ring, args=(link_fd,)).start()
    t0 = time.monotonic()
    assert bell.wait(5.0) and time.monotonic() - t0 < 1.0
    os.close(link_fd)
    assert not bell.wait(0.05)  # the last rank gone: still no spurious wake (the agent's writer)
    bell.close()


def test_a_waiting_process_is_woken_by_its_agent_on_a_plan_or_flag_and_only_then(tmp_path):
    """A warm spare blocks on its waker (``NodeLink.sleep``) instead of reading the board every
    10 ms: the agent rings every local process's waker after a plan, ``done`` or ``stop``, and
    after it declares the coordinator lost; other events (an abort, a vote) ring none."""
    from deadpool.agent.board import Doorbell, waker_name

    master = master_store()
    store = auth.namespaced(client(master.port), SECRET)
    board = NodeBoard.create(tmp_path / "board", [0, 1])
    wakers = [Doorbell(tmp_path, waker_name(i)) for i in range(2)]  # as the agent's main does
    clock = Clock()
    agent = NodeAgent(3, board, store, Seal(SECRET), FT, tmp_path, clock=clock,
                      wake=lambda: [w.ring() for w in wakers])
    links = [NodeLink(tmp_path, i, seal=Seal(SECRET)) for i in range(2)]
    t0 = time.monotonic()
    assert not links[1].sleep(0.1) and time.monotonic() - t0 >= 0.1  # nothing rang
    seal = Seal(SECRET)
    store.set(Keys.plan(0), seal.wrap(Keys.plan(0), _plan(0, {0: 0}).to_json()))
    threading.Timer(0.05, agent.apply, args=({"kind": "plan", "g": 0},)).start()
    t0 = time.monotonic()
    assert links[1].sleep(5.0) and time.monotonic() - t0 < 1.0  # woken at the plan, not at 5 s
    assert links[1].plan_text(0) is not None  # the plan is on the board when the ring comes
    assert links[0].sleep(0.0) and not links[0].sleep(0.0)  # every process rung, once each
    agent.apply({"kind": "abort", "g": 0})
    agent.apply({"kind": "interval", "g": 0, "step": 16, "k": 2})
    assert not any(link.sleep(0.0) for link in links)  # the ranks poll these between waits
    for kind in ("done", "stop"):
        agent.apply({"kind": kind})
        assert all(link.sleep(0.0) for link in links), kind
    agent.check_coordinator()  # a beat seen at t = 100 (none yet): not lost
    clock.t += FT["coordinator_timeout_s"] + 1
    agent.check_coordinator(error=True)
    assert agent.coordinator_lost and all(link.sleep(0.0) for link in links)


def test_a_rank_s_step_is_on_the_board_as_it_enters_it_not_at_its_next_beat(tmp_path):
    """A process killed mid-step died in that step (a restart's ``failed_at_step``), though its
    heartbeat thread beats only twice per agent interval: the training thread writes the step
    word itself when the step changes (``Progress.on_step``), and only then."""
    from functools import partial

    board = NodeBoard.create(tmp_path / "board", [0, 1])
    link = NodeLink(tmp_path, 1, seal=Seal(SECRET))
    p = Progress()
    hb = BoardHeartbeat(link, 60.0, p)  # not started: no beat but the ones written here
    p.on_step = partial(link.board.set_step, link.index)
    p.set(9, "optimizer")
    hb.beat()
    p.set(10, "forward")  # entered step 10; no beat since
    assert board.read_beat(1)[3] == 10 and board.read_beat(0)[3] != 10
    calls = []
    p.on_step = calls.append
    p.set(10, "backward")
    with p.waiting():
        pass
    assert calls == []  # phases of the same step write nothing
    p.set(11, "forward")
    assert calls == [11]


def test_a_file_that_is_not_a_board_is_refused(tmp_path):
    (tmp_path / "x").write_bytes(b"\0" * 4096)
    with pytest.raises(ValueError, match="not a DeadPool node board"):
        NodeBoard.open(tmp_path / "x")


def _agent(tmp_path, store, slots=(0, 1), clock=None, killed=None):
    board = NodeBoard.create(tmp_path / "board", list(slots))
    return NodeAgent(3, board, store, Seal(SECRET), FT, tmp_path, clock=clock or Clock(),
                     kill=(killed.append if killed is not None else None)), board


def _plan(g, assignments, resume=5):
    return Plan(g, "train", assignments, resume, {r: Source("live", r) for r in assignments})


def test_agent_record_is_one_sealed_line_naming_only_what_is_wrong(tmp_path):
    master = master_store()
    store = auth.namespaced(client(master.port), SECRET)
    clock = Clock()
    agent, board = _agent(tmp_path, store, clock=clock)
    seal = Seal(SECRET)
    key = Keys.plan(0)
    store.set(key, seal.wrap(key, _plan(0, {0: 0, 1: 1}).to_json()))
    agent.apply({"kind": "plan", "g": 0})
    links = [NodeLink(tmp_path, i, seal=Seal(SECRET)) for i in range(2)]
    ps = [Progress() for _ in range(2)]
    hbs = [BoardHeartbeat(link, 0.05, p) for link, p in zip(links, ps)]
    for link, p in zip(links, ps):  # (the step word is the training thread's, as in Worker)
        p.on_step = lambda step, link=link: link.board.set_step(link.index, step)
        p.set(5, "forward")
    for hb in hbs:
        hb.beat()
    agent.tick()
    text = seal.unwrap(node_key(3), store.get(node_key(3)))
    assert text == "1 0 5 2 0"  # seq, plan, step, busy, stalled: a healthy node, no JSON
    clock.t += 0.6  # slot 1 stops beating (half the soft timeout: reported with its age)
    ps[0].set(5, "backward")
    hbs[0].beat()
    agent.tick()
    seq, plan, step, busy, stalled, detail = seal.unwrap(node_key(3), store.get(node_key(3))).split(" ", 5)
    assert (plan, busy, stalled) == ("0", "2", "0")
    assert json.loads(detail)["slow"] == {"1": [0.6, False]}
    clock.t += 5.5  # slot 0 keeps beating but its progress never moves: hung in backward
    hbs[0].beat()
    agent.tick()
    detail = json.loads(seal.unwrap(node_key(3), store.get(node_key(3))).split(" ", 5)[5])
    assert detail["own"] == [0, 1]  # (slot 1, silent in forward, has not progressed either)
    assert detail["slow"] == {"1": [6.1, False]}
    n0 = int(store.add(NODES_CHANGED, 0))
    agent.on_exit(1, -9)  # an exit is written at once and wakes the coordinator
    detail = json.loads(seal.unwrap(node_key(3), store.get(node_key(3))).split(" ", 5)[5])
    assert detail["exit"] == {"1": -9} and int(store.add(NODES_CHANGED, 0)) == n0 + 1
    assert store.check([Keys.COORD_WAKE])  # and the coordinator's loop is woken (after the hint)


def test_agent_applies_pushed_events_to_its_board_and_processes(tmp_path):
    master = master_store()
    store = auth.namespaced(client(master.port), SECRET)
    killed = []
    agent, board = _agent(tmp_path, store, slots=(4, 5), killed=killed)
    link = NodeLink(tmp_path, 1, seal=Seal(SECRET))
    seal = Seal(SECRET)
    p = _plan(2, {0: 5, 1: 9})
    store.set(Keys.plan(2), seal.wrap(Keys.plan(2), p.to_json()))
    assert link.plan_text(2) is None
    agent.apply({"kind": "plan", "g": 2})
    assert decode_plan(link.plan_text(2), None) == p and agent.assigned == {5}
    assert not link.aborted(2)
    agent.apply({"kind": "abort", "g": 2})
    assert link.aborted(2) and not link.aborted(3)
    agent.apply({"kind": "fence", "slots": [5, 17]})  # 17 is another node's
    assert killed == [5] and board.fenced(1) and not board.fenced(0)
    agent.apply({"kind": "fence", "slots": [5]})  # once
    assert killed == [5]
    agent.apply({"kind": "abort", "g": 3, "slots": [4, 5, 17]})  # an abort carrying its fence
    assert link.aborted(3) and killed == [5, 4] and board.fenced(0)
    agent.apply({"kind": "done"})
    assert link.done and not link.stopped


def test_agent_declares_the_coordinator_lost_when_its_heartbeat_stops(tmp_path):
    master = master_store()
    store = auth.namespaced(client(master.port), SECRET)
    clock = Clock()
    agent, board = _agent(tmp_path, store, clock=clock)
    seal = Seal(SECRET)
    store.set(Keys.COORD_HB, seal.wrap(Keys.COORD_HB, "1"))
    agent.check_coordinator()
    assert board.flag(COORD_SEEN) and not board.flag(COORD_LOST)
    clock.t += 3.0
    store.set(Keys.COORD_HB, "99")  # not sealed by the job: no news
    agent.check_coordinator()
    assert not board.flag(COORD_LOST)
    clock.t += 1.5
    agent.check_coordinator()
    assert board.flag(COORD_LOST)


def test_node_liveness_answers_from_records_only_and_ages_a_silent_node():
    clock = Clock()
    node_of = {0: 0, 1: 0, 2: 1, 3: 1}.get
    live = NodeLiveness(soft_s=1.0, hard_s=10.0, node_timeout_s=3.0, node_of=node_of, clock=clock)
    live.observe_node(0, "1 0 7 2 0")
    live.observe_node(1, "1 0 7 2 0")
    assert live.suspects(lambda n: []) == set() and live.max_step == 7
    assert live.hung() == ([], False)
    clock.t += 0.5
    live.observe_node(0, '2 0 8 2 0 {"slow":{"1":[0.6,true]}}')
    live.observe_node(1, "2 0 8 2 0")
    live.observe_node(1, "1 0 99 2 0")  # an older record again (a replay): no news
    assert live.max_step == 8
    assert live.suspects(lambda n: []) == {1}
    assert live.beat_age(1) == pytest.approx(0.6) and not live.beat_lost(1, lambda s: False)
    clock.t += 0.5
    assert live.beat_lost(1, lambda s: False)  # past the soft timeout and seen stopped
    live.observe_node(0, '3 0 8 2 0 {"exit":{"0":1}}')
    assert live.exit_code(0) == 1 and live.exit_code(1) is None and not live.stopped(1)
    clock.t += 2.0  # node 1 silent 2.5 s: suspect, not yet lost
    live.observe_node(0, "4 0 8 2 0")
    assert live.suspects(lambda n: {1: [2, 3]}.get(n, [])) >= {2, 3}
    assert not live.beat_lost(2, lambda s: False)
    clock.t += 1.0
    assert live.beat_lost(2, lambda s: False) and live.beat_lost(3, lambda s: False)
    assert not live.beat_lost(0, lambda s: False)


def test_node_liveness_sums_nodes_into_the_jobs_hung_and_stuck_verdicts():
    live = NodeLiveness(1.0, 10.0, 3.0, node_of=lambda s: s // 2, clock=Clock())
    live.observe_node(0, '1 0 7 2 2 {"own":[1]}')
    live.observe_node(1, "1 0 7 2 0")
    assert live.hung() == ([1], False)
    live.observe_node(0, "2 0 7 2 2")
    live.observe_node(1, "2 0 7 2 2")
    assert live.hung() == ([], True)  # everybody stalled in peer waits: the generation is stuck
    live.new_generation(1)  # a new plan: old counts do not count until agents applied it
    assert live.hung() == ([], False)


def test_events_are_followed_in_order_with_blocking_waits_and_forgeries_are_skipped():
    master = master_store()
    seal = Seal(SECRET)
    log = EventLog(auth.namespaced(client(master.port), SECRET), seal)
    forged = []
    opened = []

    def open_store():
        opened.append(1)
        return auth.namespaced(client(master.port), SECRET)

    follower = EventFollower(open_store, seal, wait_s=0.3, on_forged=forged.append)
    got = []

    def follow():
        for _ in range(3):
            got.append(follower.next())

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    # the follower's first wait times out (nothing pushed): it retries on a fresh client. Pushed
    # only once that happened (a second client), however slowly the thread got there
    deadline = time.monotonic() + 30
    while len(opened) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(opened) >= 2, "the follower's wait never timed out and retried"
    log.push("abort", g=0)
    auth.namespaced(client(master.port), SECRET).set(event_key(1), "forged")  # no secret
    time.sleep(0.2)
    log.push("plan", g=1)  # overwrites the forgery under the same key
    log.push("done")
    t.join(10)
    assert not t.is_alive()
    assert got == [{"kind": "abort", "g": 0}, {"kind": "plan", "g": 1}, {"kind": "done"}]
    assert forged and set(forged) == {1}


def test_the_coordinator_sleeps_until_woken_and_no_wake_up_is_lost():
    """The coordinator's loop waits on ``WakeListener`` (its own connection, blocked on
    ``coord/wake``) instead of turning every 10 ms: a wake-up ends the wait at once, a wait with
    none runs to its timeout, a wake-up set while the loop was busy (or before the listener
    connected) ends the next wait at once, and stop leaves no thread behind."""
    master = master_store()
    store = auth.namespaced(client(master.port), SECRET)
    other = auth.namespaced(client(master.port), SECRET)  # a writer: an agent, a rank
    wake_coordinator(other)  # before the listener started: not lost
    waker = WakeListener(lambda: auth.namespaced(client(master.port), SECRET)).start()
    t0 = time.monotonic()
    assert waker.wait(5.0) and time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    assert not waker.wait(0.3)  # nothing happened: the timeout (the loop's timed duties)
    assert time.monotonic() - t0 >= 0.29
    def later():
        time.sleep(0.2)
        wake_coordinator(other)
    threading.Thread(target=later, daemon=True).start()
    t0 = time.monotonic()
    assert waker.wait(5.0) and 0.15 < time.monotonic() - t0 < 1.5  # woken, not timed out
    wake_coordinator(other)  # while the loop is busy elsewhere: the next wait returns at once
    time.sleep(0.2)
    t0 = time.monotonic()
    assert waker.wait(5.0) and time.monotonic() - t0 < 0.5
    assert not waker.wait(0.2)  # the key was consumed: no spurious turn
    assert waker.wakeups == 3
    waker.stop(store)
    assert not waker._thread.is_alive()


def test_plans_go_out_as_deltas_and_a_reader_without_the_base_gets_the_full_form():
    master = master_store()
    store = auth.namespaced(client(master.port), SECRET)
    seal = Seal(SECRET)
    world = {r: r for r in range(64)}
    p0 = _plan(0, world)
    p1 = _plan(1, {**world, 7: 64})
    p1.sources[7] = Source("replica", 9, shared_from=6)
    publish_plan(store, seal, p0, None)  # the first plan: in full under both keys
    assert _form(seal, store, Keys.plan(0)) == _form(seal, store, Keys.plan_full(0)) == "full"
    small = publish_plan(store, seal, p1, p0)
    assert small < 400 and _form(seal, store, Keys.plan(1)) == "delta"
    assert fetch_plan(store, seal, 1, p0) == (p1, seal.unwrap(Keys.plan(1), store.get(Keys.plan(1))))
    plan, text = fetch_plan(store, seal, 1, None)  # a process holding no plan: the full form
    assert plan == p1 and json.loads(text)["form"] == "full"
    plan, _ = fetch_plan(store, seal, 1, _plan(0, {0: 5}))  # another base: the full form too
    assert plan == p1


def _form(seal, store, key) -> str:
    return json.loads(seal.unwrap(key, store.get(key)))["form"]


def test_reports_go_through_the_agent_one_sealed_key_per_node_and_kind(tmp_path):
    """A rank's reports (its status after an abort, a new generation's timings...) are files
    next to the board; the agent sends its node's on in one sealed key per generation and kind,
    rewritten as more arrive; the coordinator's ``NodeReports`` takes a report only from its
    rank's node and only what the job sealed."""
    from deadpool.store.protocol import RankStatus
    from deadpool.store.reports import NodeReports, index_of

    master = master_store()
    store = auth.namespaced(client(master.port), SECRET)
    seal = Seal(SECRET)
    agent, board = _agent(tmp_path, store, slots=(4, 5))
    links = [NodeLink(tmp_path, i, seal=Seal(SECRET)) for i in range(2)]
    node_of = {0: 3, 1: 3, 2: 7}.get  # ranks 0, 1 on this node (3), rank 2 on node 7
    keys = Keys(2)

    def key_of(n):
        return keys.node_report("status", n)

    def on_node(g=2, kind="status"):
        key = Keys(g).node_report(kind, 3)
        return json.loads(seal.unwrap(key, store.get(key)))

    forged = []
    reports = NodeReports(store, seal, key_of, [0, 1, 2], node_of, on_forged=forged.append)
    assert reports.poll() == {} and reports.missing == [0, 1, 2]
    links[1].report(2, "status", 1, RankStatus(1, 5, 7, [7], {0: [7]}).to_json())
    agent.check_rounds()  # (the agent's rounds thread, every few ms)
    assert list(on_node()) == ["1"]
    assert sorted(reports.poll()) == [1] and reports.missing == [0, 2]
    links[0].report(3, "timing", 0, '{"rank": 0}')  # another kind and generation: its own key
    agent.check_rounds()
    assert list(on_node()) == ["1"] and on_node(3, "timing") == {"0": '{"rank": 0}'}
    # a forged node-7 record, and node 3's sealed record claiming node 7's rank: neither is taken
    store.set(key_of(7), auth.seal(auth.new_secret(), json.dumps(
        {"2": RankStatus(2, 9, 99, [99], {}).to_json()}), context=key_of(7)))
    store.append(index_of(key_of(7)), ",7")  # (listed, as a writer posts it)
    links[0].report(2, "status", 0, RankStatus(0, 4, 7, [7], {1: [7]}).to_json())
    links[1].report(2, "status", 2, RankStatus(2, 5, 98, [98], {}).to_json())
    agent.check_rounds()
    assert sorted(on_node()) == ["0", "1", "2"]
    got = reports.poll()
    assert sorted(got) == [0, 1] and reports.missing == [2] and forged == [7]
    assert RankStatus.from_json(got[0]).replicas == {1: [7]}
    assert not list(tmp_path.glob("report-*"))  # each file goes once it is sent on
    # reports two generations behind the newest are dropped
    links[1].report(4, "first_step", 1, "123.5")
    agent.check_rounds()
    assert sorted(agent._reports) == [(3, "timing"), (4, "first_step")]


def test_an_agent_follows_an_in_place_width_change_and_reads_the_next_plans_as_deltas(tmp_path):
    """Plans may list the kept groups as their complement against the layout's group keys. An
    agent given those keys as a function of the layout (as ``deadpool.agent`` does) takes the
    new width's keys with the reshape's plan and decodes the next delta; one holding the
    configured width's keys would read every later plan in full."""
    from functools import partial

    from deadpool.rank.groups import layout_group_keys
    from deadpool.recovery.elastic import layout_at
    from tests.conftest import compose_train

    class Recording:  # the store, noting which keys the agent reads
        def __init__(self, store):
            self.store, self.got = store, []

        def get(self, key):
            self.got.append(key)
            return self.store.get(key)

        def __getattr__(self, name):
            return getattr(self.store, name)

    cfg = compose_train(["model=tiny", "parallel=dp2_tp2_pp2"], tmp_path)
    keys = partial(layout_group_keys, cfg)
    narrow = layout_at(cfg, 1)  # dp2 x tp2 x pp2 -> dp1: the groups of data-parallel index 1 go
    assert set(keys(narrow)) != set(keys({}))
    master = master_store()
    store = auth.namespaced(client(master.port), SECRET)
    seal = Seal(SECRET)
    p0 = _plan(0, {r: r for r in range(8)})
    p1 = Plan(1, "train", {r: r for r in range(4)}, 5, {r: Source("live", r) for r in range(4)},
              layout=narrow)
    keep = keys(narrow)[1:]  # all but one: on the wire as a one-key complement
    p2 = Plan(2, "train", {0: 0, 1: 1, 2: 8, 3: 3}, 7, {r: Source("live", r) for r in range(4)},
              keep_groups=keep, layout=narrow)
    publish_plan(store, seal, p0, None, keys({}))
    publish_plan(store, seal, p1, p0, keys(narrow))
    publish_plan(store, seal, p2, p1, keys(narrow))
    assert '"except"' in seal.unwrap(Keys.plan(2), store.get(Keys.plan(2)))

    def agent(group_keys, where):
        where.mkdir()
        rec = Recording(store)
        board = NodeBoard.create(where / "board", [0])
        return NodeAgent(0, board, rec, seal, FT, where, group_keys=group_keys), rec

    follows, rec = agent(keys, tmp_path / "follows")
    fixed, rec_fixed = agent(keys({}), tmp_path / "fixed")
    for a in (follows, fixed):
        for g in (0, 1, 2):
            a.apply({"kind": "plan", "g": g})
        assert a.plan == p2
    assert Keys.plan_full(2) not in rec.got  # the delta, decoded at the new width
    assert Keys.plan_full(2) in rec_fixed.got  # the configured width's keys: the full form
