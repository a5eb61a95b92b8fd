"""The NCCL path of the communicator and the trainer, on CPU: every rank trains in a thread over
``fake_nccl`` groups, which behave as torch 2.13's NCCL groups do where recovery depends on it
(post after abort raises, an aborted op completes with junk, a failed work's wait raises).
Multi-rank NCCL itself runs in experiments/gpu/check_nccl_multirank.py on a GPU machine."""

from __future__ import annotations

import threading
import time

import pytest

from deadpool.errors import Aborted, CollectiveError
from deadpool.launch.procs import local_rank
from deadpool.rank.comm import Communicator
from deadpool.rank.trainer import Trainer
from deadpool.store.protocol import Keys, Seal, announce_abort
from deadpool.topology import ParallelDims, Topology
from tests.conftest import compose_train
from tests.deadpool import fake_nccl
from tests.deadpool.helpers import client, master_store, run_threads


class Injector:
    """The trainer's fault hook: ``at(rank, step, phase)`` runs at every phase of every step."""

    def __init__(self, rank: int, at=None):
        self.rank, self.at = rank, at or (lambda rank, step, phase: None)

    def fire(self, step, phase):
        self.at(self.rank, step, phase)


class CountingStore:
    """A store client that counts the requests made from one thread (the training thread)."""

    def __init__(self, store):
        self.store, self.thread, self.requests = store, threading.current_thread(), 0

    def __getattr__(self, name):
        attr = getattr(self.store, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            if threading.current_thread() is self.thread:
                self.requests += 1
            return attr(*args, **kwargs)
        return call


def run(tmp_path, monkeypatch, dims: ParallelDims, steps: int, script=None, at=None,
        extra=(), master=None):
    """Train every rank of ``dims`` in a thread on fake NCCL; per rank returns
    ``(trainer, communicator, exception or None, store requests)``, plus the fake's events."""
    events = fake_nccl.install(monkeypatch, script)
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = compose_train(["model=tiny", f"parallel.dp={dims.dp}", f"parallel.tp={dims.tp}",
                         f"parallel.pp={dims.pp}", f"parallel.ranks_per_node={dims.ranks_per_node}",
                         f"num_steps={steps}", "log_every_steps=0",
                         "ft.persist_interval_steps=0", *extra], tmp_path)
    master = master or master_store()

    def rank_fn(r):
        store = CountingStore(client(master.port))
        tr = Trainer(cfg, r, Injector(r, at), tmp_path / f"rank{r}.jsonl")
        tr.build(dims, r)
        tr.rank = r
        # the rendezvous goes through a client of its own (as in the worker)
        comm = Communicator.build(Topology(dims, r, 0), store, "nccl", poll_s=0.01, timeout_s=60,
                                  store_factory=lambda: client(master.port))
        tr.snapshot_now()
        store.requests = 0
        err = None
        try:
            tr.train(comm)
        except Exception as e:  # checked by the test
            err = e
        comm.park()
        return tr, comm, err, store.requests

    return run_threads(rank_fn, dims.world_size, timeout_s=120), events, master


def test_the_training_thread_syncs_once_per_step_and_asks_the_store_nothing_per_collective(
        tmp_path, monkeypatch):
    """Stream-ordered collectives: host syncs and store requests per step are constant, not
    proportional to the collectives (4x the micro-batches: 4x the TP all-reduces and buckets)."""
    dims, steps = ParallelDims(dp=2, tp=2, ranks_per_node=4), 4
    seen = {}
    for m in (1, 4):
        res, events, _ = run(tmp_path / f"m{m}", monkeypatch, dims, steps,
                             extra=[f"parallel.microbatches={m}", "backend=nccl"])
        assert all(err is None and tr.step == steps for tr, _, err, _ in res)
        # the gradient step: one reduce-scatter per bucket group (parallel/data/reduce_scatter.py), no reduce
        assert all(tr.opt.reduce_scatter for tr, _, _, _ in res)
        posts = sum(sum(g.posts.values()) for _, c, _, _ in res for g in
                    (grp.pg for grp in c.groups.values()) if isinstance(g, fake_nccl.FakeNCCLGroup))
        seen[m] = ([req for _, _, _, req in res], sorted(events.syncs.values()), posts)
    assert seen[4][2] > 2 * seen[1][2]  # many more collectives...
    assert seen[4][0] == seen[1][0]  # ...and exactly the same store requests
    assert max(seen[1][0]) <= 2 * steps  # a few per step at most (the schedule's vote)
    # one host sync per step per rank, whatever the number of collectives (the fake counts every
    # way the host can block on the device: an event recorded, a work polled for completion,
    # waited on with a timeout or synchronised; a build that does any per collective fails)
    assert seen[1][1] == seen[4][1] == [steps] * dims.world_size


def test_a_collective_posted_on_an_aborted_group_raises_aborted_on_every_rank(
        tmp_path, monkeypatch):
    """The abort can land at any moment: the next post on an aborted NCCL group raises the
    backend's DistBackendError, which must become Aborted (a survivor must not exit)."""
    box = {}

    def at(rank, step, phase):
        if (rank, step, phase) == (0, 2, "forward"):
            comm = box["comm"]
            announce_abort(comm.store, Seal(None), Keys(0), "rank 3 died")
            # the watcher aborts this rank's groups; the TP all-reduce of this forward then
            # posts on an aborted group
            while not all(g.pg.aborted for n, g in comm.groups.items() if not n.startswith("repl")):
                time.sleep(0.005)

    orig = Communicator.build.__func__

    def build(cls, topo, *a, **k):
        c = orig(cls, topo, *a, **k)
        if topo.rank == 0:
            box["comm"] = c
        return c
    monkeypatch.setattr(Communicator, "build", classmethod(build))
    res, _, _ = run(tmp_path, monkeypatch, ParallelDims(dp=2, tp=2, ranks_per_node=4), 4, at=at)
    for tr, comm, err, _ in res:
        assert isinstance(err, Aborted), err
        # a rank still in step 1's host sync when the abort lands counts step 1 as not done
        # (sync raises: nothing completed after an abort is trusted); none got past step 2
        assert "rank 3 died" in str(err) and tr.step in (1, 2)
    assert any(tr.step == 2 for tr, _, _, _ in res)


class StallGather(fake_nccl.Script):
    """The second ZeRO all-gather never completes on either dp rank (a peer died inside it);
    rank 0 announces the abort once both ranks have posted it (else a rank still on its way
    would find its group aborted at the post, a different path), and each rank goes on waiting
    only once its watcher has aborted its group (the race in which the abort lands before the
    waiting rank looks)."""

    def __init__(self):
        self.master = None
        self.posted = set()

    def stall(self, prefix, rank, name, n):
        return name == "_allgather_base" and n == 2

    def on_stall(self, group):
        self.posted.add(group.rank)
        t0 = time.monotonic()
        if group.rank == 0:
            while len(self.posted) < 2 and time.monotonic() - t0 < 10:
                time.sleep(0.002)
            announce_abort(client(self.master.port), Seal(None), Keys(0), "rank 1 lost mid-gather")
        while not group.aborted and time.monotonic() - t0 < 10:
            time.sleep(0.002)


def test_a_gather_that_completes_because_of_the_abort_is_never_trusted(tmp_path, monkeypatch):
    """An aborted all-gather reports itself complete with junk in the parameters: the step must
    end Aborted with the live state marked torn (dirty), never as a clean step 2."""
    script = StallGather()
    script.master = master_store()
    res, _, _ = run(tmp_path, monkeypatch, ParallelDims(dp=2), 4, script=script,
                    master=script.master)
    for tr, comm, err, _ in res:
        assert isinstance(err, Aborted), err
        assert tr.dirty and tr.step == 1  # torn: only snapshots count for this rank
        assert tr.opt.flat_params.isnan().any()  # the junk the aborted gather left


class StallReduceScatter(StallGather):
    """The same, in the gradient step: step 2's first reduce-scatter (ZeRO-1's gradients are
    reduce-scattered in two bucket groups a step on NCCL) never completes on either dp rank."""

    def stall(self, prefix, rank, name, n):
        return name == "reduce_scatter" and n == 3


def test_a_reduce_scatter_cut_by_the_abort_releases_every_rank_with_its_state_clean(
        tmp_path, monkeypatch):
    """The reduce-scatter a dead peer never joins: the abort ends it (junk in the gradients,
    never used) and the step ends Aborted before the update, so the live state is step 1's,
    clean: what a survivor resumes from. gloo's reduce_scatter could not be released so."""
    script = StallReduceScatter()
    script.master = master_store()
    res, _, _ = run(tmp_path, monkeypatch, ParallelDims(dp=2), 4, script=script,
                    master=script.master, extra=["backend=nccl"])
    for tr, comm, err, _ in res:
        assert tr.opt.reduce_scatter and len(tr.opt.buckets.edges) == 4  # 2 groups of 2
        assert isinstance(err, Aborted) and "rank 1 lost" in str(err), err
        assert tr.step == 1 and not tr.dirty
        assert not tr.opt.flat_params.isnan().any()


class FailTP(fake_nccl.Script):
    """The third TP all-reduce of rank 1 (tp rank 1 of the first tp group) fails: NCCL reports a
    remote error on its work."""

    def fail(self, prefix, rank, name, n):
        if prefix == "g0/tp/pp0-dp0/" and rank == 1 and name == "allreduce" and n == 3:
            return "NCCL error: remote process exited or there was a network error"
        return None


def test_a_failed_wait_is_a_collective_error_reported_to_every_rank(tmp_path, monkeypatch):
    res, _, master = run(tmp_path, monkeypatch, ParallelDims(dp=2, tp=2, ranks_per_node=4), 4, script=FailTP())
    errs = {tr.rank: err for tr, _, err, _ in res}
    assert isinstance(errs[1], CollectiveError) and "remote process exited" in str(errs[1])
    assert client(master.port).check([Keys(0).error(1)])  # reported: everyone stops waiting
    for r in (0, 2, 3):
        assert isinstance(errs[r], Aborted), (r, errs[r])


def nccl_comm(monkeypatch, generation=0):
    fake_nccl.install(monkeypatch)
    master = master_store()
    comm = Communicator(Topology(ParallelDims(dp=2), 0, generation), client(master.port), "nccl",
                        poll_s=0.01, timeout_s=30)
    comm.groups = {n: fake_nccl.FakeNCCLGroup(None, n, 0, fake_nccl.Script()) for n in
                   ("dp", "tp", "pp_send_fwd", "repl_out")}
    return master, comm


class SlowAbort:
    def __init__(self):
        self.aborted = 0

    def abort(self):
        time.sleep(0.3)  # an NCCL abort takes ~1 s per communicator (H100)
        self.aborted += 1


def test_the_watcher_aborts_every_device_group_in_parallel_and_only_those(monkeypatch):
    master, comm = nccl_comm(monkeypatch, generation=3)
    comm.groups = {n: SlowAbort() for n in ("dp", "tp", "pp_send_fwd", "pp_recv_fwd", "repl_out")}
    watcher = comm.start_watcher()
    t0 = time.monotonic()
    client(master.port).set(Keys(3).abort, "rank 1 died")
    watcher.join(5.0)
    took = time.monotonic() - t0
    assert not watcher.is_alive()
    assert [g.aborted for g in comm.groups.values()] == [1, 1, 1, 1, 0]  # host groups stay
    assert took < 0.3 * 4 * 0.75  # in parallel: well under four serial aborts
    assert set(comm.abort_s) == {"dp", "tp", "pp_send_fwd", "pp_recv_fwd"}
    with pytest.raises(Aborted, match="rank 1 died"):
        comm.raise_if_aborted()
    comm.park()  # parking after the watcher aborts nothing twice
    time.sleep(0.1)
    assert comm.groups["dp"].aborted == 1


def test_park_returns_at_once_and_the_watcher_aborts_off_the_training_thread(monkeypatch):
    _, comm = nccl_comm(monkeypatch)
    comm.groups = {n: SlowAbort() for n in ("dp", "tp")}
    watcher = comm.start_watcher()
    t0 = time.monotonic()
    comm.park()
    assert time.monotonic() - t0 < 0.1
    watcher.join(2.0)
    assert not watcher.is_alive() and comm.groups["dp"].aborted == 1
    with pytest.raises(Aborted):
        comm.raise_if_aborted()


def test_a_build_aborted_midway_aborts_the_groups_it_made(monkeypatch):
    """Ranks 0 and 2 of dp2 x tp2 make their dp group, then wait for ranks 1 and 3, which never
    come; the abort during the build must abort the NCCL group already made (its threads and
    device memory would leak otherwise)."""
    fake_nccl.install(monkeypatch)
    master = master_store()
    dims = ParallelDims(dp=2, tp=2, ranks_per_node=4)
    made = {}
    orig_add = Communicator._add

    def add(self, store, name, *a, **k):
        made[self.topo.rank] = self
        return orig_add(self, store, name, *a, **k)
    monkeypatch.setattr(Communicator, "_add", add)
    threading.Timer(2.0, lambda: client(master.port).set(Keys(0).abort, "rank 1 gone")).start()

    def rank_fn(r):
        with pytest.raises(Aborted, match="rank 1 gone"):
            Communicator.build(Topology(dims, r, 0), client(master.port), "nccl", poll_s=0.01,
                               timeout_s=30, store_factory=lambda: client(master.port))

    run_threads(lambda i: rank_fn((0, 2)[i]), 2)  # ranks 1 and 3 never come
    for r in (0, 2):
        device = [g for n, g in made[r].groups.items() if not n.startswith("repl")]
        assert device and all(g.pg.aborted for g in device)


def test_local_ranks_map_processes_round_robin_onto_gpus():
    assert [local_rank(s, 4) for s in range(6)] == [0, 1, 2, 3, 0, 1]
    assert local_rank(5, 0) == 0


def test_a_process_with_too_many_stuck_helpers_stops_taking_ranks(monkeypatch):
    import deadpool.rank.abort as abort_mod

    stop = threading.Event()
    stuck = [threading.Thread(target=stop.wait, daemon=True) for _ in range(abort_mod.MAX_ABANDONED_HELPERS)]
    for t in stuck:
        t.start()
    monkeypatch.setattr(abort_mod, "_abandoned", list(stuck))
    master = master_store()
    try:
        with pytest.raises(RuntimeError, match="still stuck"):
            Communicator.build(Topology(ParallelDims(dp=1), 0, 0), client(master.port))
    finally:
        stop.set()
    for t in stuck:
        t.join(1.0)
    assert abort_mod.abandoned_helpers() == 0  # counted only while alive


def test_release_drops_the_parked_nccl_groups_once_their_aborts_are_done(monkeypatch):
    _, comm = nccl_comm(monkeypatch)
    comm.groups = {n: SlowAbort() for n in ("dp", "tp")}
    comm.group_keys = {"dp": "dp/x", "tp": "tp/x"}
    watcher = comm.start_watcher()
    comm.park()
    t = comm.release(keep={"tp/x"})
    assert set(comm.groups) == {"tp"}  # the kept one stays with the next generation
    t.join(5.0)
    watcher.join(5.0)
    assert not t.is_alive() and not watcher.is_alive()


def test_the_gpu_check_script_runs_its_dry_run_on_cpu(tmp_path):
    """experiments/gpu/check_nccl_multirank.py must be runnable as it stands on a GPU machine:
    its dry run checks the arguments, the per-process NCCL environments and the job configs."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "experiments" / "gpu" / "check_nccl_multirank.py"
    p = subprocess.run([sys.executable, str(script), str(tmp_path), "--dry-run"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    plan = json.loads((tmp_path / "check_nccl_multirank.json").read_text())
    assert plan["scenarios"] == ["S0", "S1", "S2", "S3", "S4"]
    assert plan["worker_env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert plan["S3"]["faults"][0]["phase"] == "allreduce"
    assert plan["S4"]["parallel"] == {"dp": 2, "tp": 2, "pp": 2}
    bad = subprocess.run([sys.executable, str(script), str(tmp_path), "--scenarios", "S9"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--scenarios" in bad.stderr


def test_the_throughput_check_composes_its_deadpool_arms_on_cpu(tmp_path):
    """experiments/gpu/check_throughput.py (GPU check 4) --dry-run: the DeadPool arms' overrides
    compose, one rank in bf16 with snapshots off and on, eager and compiled."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "experiments" / "gpu" / "check_throughput.py"
    p = subprocess.run([sys.executable, str(script), str(tmp_path), "--dry-run"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    plan = json.loads((tmp_path / "check_throughput.json").read_text())
    arm = {"snapshot": False, "compile": False, "precision": "bf16", "dp": 1}
    assert plan["composed"] == {
        "deadpool_off": arm, "deadpool_on": dict(arm, snapshot=True),
        "deadpool_off_compile": dict(arm, compile=True),
        "deadpool_on_compile": dict(arm, snapshot=True, compile=True)}
    assert 8e9 < plan["flops_per_token_approx"] < 1e10  # ~6 x 1.4 B + attention
