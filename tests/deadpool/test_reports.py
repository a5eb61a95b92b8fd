"""Reading per-rank reports (deadpool/store/reports.py): what a recovery's reads cost the store.

``TCPStore.check`` is all-of, so probing N mostly absent keys costs up to 2N-1 round trips; a
recovery reads crash, error, bad-copy, fault and status reports of every rank. Posted reports
(``reports.post``: the value, then its kind's index) are read in O(1) requests however many ranks
the job has. Each test counts the requests a read makes at two world sizes."""

from __future__ import annotations

import json

import torch.distributed as dist

from deadpool.recovery import detect
from deadpool.store import auth, reports
from deadpool.store.protocol import Keys, RankStatus, Seal
from tests.deadpool.recovery.helpers import coordinator

SECRET = auth.new_secret()
JOB = Seal(SECRET)


class Counting:
    """A store counting its requests (a multi-key request counts one)."""

    def __init__(self, store):
        self._store, self.requests = store, 0

    def __getattr__(self, name):
        fn = getattr(self._store, name)

        def call(*a, **k):
            self.requests += 1
            return fn(*a, **k)
        return call


def job(tmp_path, dp: int):
    store = Counting(dist.HashStore())
    coord = coordinator(tmp_path / f"dp{dp}", [f"parallel.dp={dp}"], secret=SECRET, store=store)
    return coord, store


def requests(store, fn):
    before = store.requests
    out = fn()
    return out, store.requests - before


def test_a_recoverys_sparse_reports_cost_a_few_requests_whatever_the_world_size(tmp_path):
    """One bad copy, one injected fault, one broken collective and one crash, among 64 and
    among 1,024 ranks: each is found with at most three requests (was 2N-1 each: the halving
    search over mostly absent keys)."""
    for dp in (64, 1024):
        coord, store = job(tmp_path, dp)
        keys = Keys(0)
        reports.post(store, JOB, keys.bad_source(dp - 3),
                     json.dumps({"holder": dp - 3, "owner": 5, "step": 9}))
        reports.post(store, JOB, Keys.fault(5), json.dumps({"t": 100.0, "kind": "kill"}))
        reports.post(store, JOB, keys.error(dp - 1), "connection closed by peer")
        reports.post(store, JOB, Keys.crash(5), "RuntimeError: boom")
        store.add(keys.num_errors, 1)
        bad, n_bad = requests(store, lambda: detect.collect_bad_sources(coord, keys))
        faults, n_faults = requests(store, lambda: detect.collect_faults(coord, {5}))
        broke, n_error = requests(store, lambda: detect._collective_error(coord, keys))
        crashed, n_crash = requests(store, lambda: detect._crash_reports(
            coord, {r: s for r, s in coord.members.ranks.items()}))
        assert [b["holder"] for b in bad] == [dp - 3] and list(faults) == [5] and broke
        assert crashed == {5: "RuntimeError: boom"}
        assert (n_bad, n_faults, n_crash) == (3, 3, 3), (dp, n_bad, n_faults, n_crash)
        assert n_error <= 4, (dp, n_error)  # (the counter, then the reports)
        reported, n_reported = requests(store, lambda: detect._bad_reported(coord))
        assert reported and n_reported == 3


def test_nobody_reported_costs_one_request(tmp_path):
    for dp in (64, 1024):
        coord, store = job(tmp_path, dp)
        found, n = requests(store, lambda: detect.collect_bad_sources(coord, Keys(0)))
        assert found == [] and n == 1, (dp, n)


def test_statuses_are_collected_in_requests_per_poll_not_per_rank(tmp_path):
    """The survivors' statuses after an abort (no node agents: one key per rank): a poll that
    finds nothing new costs one request, one that finds some three, at 64 and 1,024 ranks."""
    for dp in (64, 1024):
        coord, store = job(tmp_path, dp)
        keys = Keys(0)
        pending = coord.rank_reports(keys, "status", range(dp), lambda who: None)
        _, n_empty = requests(store, pending.poll)
        for r in range(0, dp, 2):
            reports.send(store, JOB, None, keys, "status", r, RankStatus(r, r, 7, [7], {}).to_json())
        got, n_half = requests(store, pending.poll)
        _, n_same = requests(store, pending.poll)
        assert len(got) == dp // 2 and len(pending.missing) == dp // 2
        assert (n_empty, n_half, n_same) == (1, 3, 1), (dp, n_empty, n_half, n_same)


def test_node_reports_poll_only_the_nodes_that_posted(tmp_path):
    """Under node agents a node's agent posts one key per kind for its ranks: 3 of 512 nodes
    answered, a poll costs three requests; none new, one."""
    store = Counting(dist.HashStore())
    keys = Keys(4)
    pending = reports.NodeReports(store, JOB, lambda n: keys.node_report("status", n),
                                  range(4096), lambda r: r // 8)
    for node in (3, 100, 511):
        reports.post(store, JOB, keys.node_report("status", node),
                     json.dumps({str(r): f"s{r}" for r in range(8 * node, 8 * node + 8)}))
    got, n = requests(store, pending.poll)
    assert sorted(got) == [r for node in (3, 100, 511) for r in range(8 * node, 8 * node + 8)]
    assert n == 3
    _, n = requests(store, pending.poll)
    assert n == 1


def test_node_reports_polls_cost_what_changed_not_the_ranks(tmp_path):
    """A recovery's status wait polls every 2 ms: at 16,384 ranks, asking each missing rank's
    node again on every poll was most of the coordinator's CPU. Each rank's node is asked once;
    a rank declared failed or a node's reports taken change only their own entries."""
    asked = []

    def node_of(r):
        asked.append(r)
        return r // 8

    keys = Keys(4)
    store = dist.HashStore()
    pending = reports.NodeReports(store, JOB, lambda n: keys.node_report("status", n),
                                  range(4096), node_of)
    for _ in range(20):
        pending.poll()
    reports.post(store, JOB, keys.node_report("status", 7),
                 json.dumps({str(r): f"s{r}" for r in range(56, 64)}))
    pending.forget([9, 10])
    for _ in range(20):
        pending.poll()
    assert sorted(pending.got) == list(range(56, 64))
    assert pending.missing == [r for r in range(4096) if r not in {9, 10, *range(56, 64)}]
    assert len(asked) == 4096, len(asked)


def test_a_forged_index_entry_or_value_steers_nothing(tmp_path):
    """A client without the secret lists absent keys, and a forged value, in the index: the
    real reports are still found (the list is probed), the forgery is refused and reported."""
    store = Counting(dist.HashStore())
    keys = Keys(0)
    store.append(reports.index_of(keys.error(0)), ",7,9,notarank")
    store.set(keys.error(9), auth.seal(auth.new_secret(), "forged", context=keys.error(9)))
    store.append(reports.index_of(keys.error(0)), ",9")
    reports.post(store, JOB, keys.error(3), "real")
    forged = []
    got = reports.read_posted(store, JOB, {r: keys.error(r) for r in range(16)},
                              on_forged=forged.append)
    assert got == {3: "real"} and forged == [9]
    reports.post(store, JOB, keys.error(9), "real 9")  # the real report overwrites the forgery
    assert reports.read_posted(store, JOB, {r: keys.error(r) for r in range(16)}) == \
        {3: "real", 9: "real 9"}


def test_a_start_up_wait_polls_within_its_budget_and_finds_every_join(tmp_path):
    """Join announcements are not posted (a process sets its key): the start-up wait's poll of
    N absent keys cost 2N-1 requests (32,767 a poll at 16,384 slots, which starved the writers).
    With a budget each poll costs at most that (and a multi_get), every key is still found, in any order, and a
    complete set is seen within O(log N) requests; ``settle`` reads the rest exactly."""
    store = Counting(dist.HashStore())
    n, budget = 1024, 16
    joined = reports.Reports(store, JOB, Keys.spare_ready, range(n), budget=budget)
    _, cost = requests(store, joined.poll)
    assert joined.got == {} and cost <= budget  # was 2n - 1 = 2047
    order = list(range(n))[::7] + [s for s in range(n) if s % 7]  # out of order, in two waves
    for s in order[: n // 2]:
        store.set(Keys.spare_ready(s), JOB.wrap(Keys.spare_ready(s), "1.0"))
    polls = 0
    while len(joined.got) < n // 2 and polls < 4 * n // budget:
        _, cost = requests(store, joined.poll)
        assert cost <= budget + 1  # (the probes, one multi_get of what they found)
        polls += 1
    assert set(joined.got) == set(order[: n // 2])  # every key probed within n / budget polls
    for s in order[n // 2:]:
        store.set(Keys.spare_ready(s), JOB.wrap(Keys.spare_ready(s), "1.0"))
    joined.poll()
    joined.poll()
    _, cost = requests(store, lambda: [joined.poll() for _ in range(8)])
    assert joined.complete and cost <= 8 * (budget + 1)
    late = reports.Reports(store, JOB, Keys.spare_ready, range(n + 1), budget=1)
    store.set(Keys.spare_ready(n), JOB.wrap(Keys.spare_ready(n), "1.0"))
    assert len(late.settle()) == n + 1 and late.complete  # one exact read names none missing


def test_a_rank_status_round_trips_every_field():
    """Its JSON is written field by field (no deep copy): a field added to ``RankStatus`` and
    not written fails here."""
    import dataclasses

    from deadpool.store.protocol import RankStatus

    st = RankStatus(5, 9, 12, [10, 12], {4: [12], 6: [10]}, groups={"dp/pp0-tp0": [3, 3]},
                    crcs={"own/12": [1, 2, 3]})
    assert set(json.loads(st.to_json())) == {f.name for f in dataclasses.fields(RankStatus)}
    assert RankStatus.from_json(st.to_json()) == st
