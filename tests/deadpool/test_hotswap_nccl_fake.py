"""A hot swap over the NCCL path, on CPU: dp2 x tp2 x pp2 with ZeRO-1, and with ZeRO-2, one warm
spare, the gradient step one reduce-scatter per bucket group (``parallel.grad_reduce``), every
process a real ``Worker`` in a thread of this process, the coordinator a real ``Coordinator`` in
another, every training group a ``fake_nccl`` group (asynchronous works, abort completes with junk,
post after abort raises: what recovery depends on in torch's NCCL groups).

One rank vanishes mid-step (after its backward, before its gradient all-reduce): its thread stops
for good and its heartbeat with it, its launcher slot reads exited, so its peers' NCCL
collectives of that step never complete. The survivors must be aborted out of generation g, report
what they hold, rebuild generation g+1 with the spare in the dead rank's place, the spare must
receive the dead rank's state (parameters from its data-parallel peer, its ZeRO optimizer shard
from the replica its buddy holds), and training must continue to the end. Every rank's final
state must be ``torch.equal`` to a failure-free run of the same seed through the same harness;
the per-rank states are distinct (ZeRO shards, tensor and pipeline shards), so a state delivered
to the wrong rank fails the comparison.

What is not the production path: processes are threads (a SIGKILL is the rank's thread stopping
for good with its heartbeat, and its slot reported exited; its abort watcher and snapshot threads
live on, idle), there are no node agents (``launcher.agents=false``: workers poll the store, as
under torchrun), and the fence a dead slot gets is recorded by the fake launcher, not carried out. Real processes killed with SIGKILL are
in test_hotswap.py; real NCCL in experiments/gpu/check_nccl_multirank.py.
"""

from __future__ import annotations

import copy
import os
import sys
import threading
import traceback
import types

import pytest
import torch

import deadpool.rank.heartbeat as heartbeat_mod
from deadpool.control.coordinator import Coordinator
from deadpool.rank.faults import Fault, FaultInjector
from deadpool.rank.worker import Worker
from deadpool.store import auth
from tests.conftest import compose_train
from tests.deadpool import fake_nccl
from tests.deadpool.helpers import master_store
from tests.deadpool.recovery.helpers import FakeLauncher

pytestmark = pytest.mark.slow

DIMS = ["parallel=dp2_tp2_pp2", "parallel.zero=true"]
STEPS, KILL_STEP, VICTIM = 6, 3, 5  # rank 5: (pp 1, dp 0, tp 1); its dp peer is rank 7


class Vanished(BaseException):
    """Unwinds a vanished rank's thread once the test is over (never caught by the runtime)."""


class Job:
    """A coordinator and ``world + spares`` workers in threads over one TCPStore."""

    def __init__(self, tmp_path, monkeypatch, faults: list[dict], dims=DIMS):
        fake_nccl.install(monkeypatch)
        fake_nccl.allow_on_cpu(monkeypatch)
        self.over = threading.Event()
        self.vanished: set[int] = set()
        self.launcher = FakeLauncher()
        self.workers: dict[int, Worker] = {}
        job = self

        def act(injector, ev, step):  # a kill: this process stops as a whole, from now on
            if ev.kind is not Fault.KILL:
                return real_act(injector, ev, step)
            w = job.workers[injector.slot]
            w.heartbeat.stop()  # (a dead process beats no more)
            job.vanished.add(injector.slot)
            job.launcher.exited[injector.slot] = -9  # what the launcher's poll sees
            job.over.wait()
            raise Vanished()

        real_act = FaultInjector._act
        monkeypatch.setattr(FaultInjector, "_act", act)
        # a fence a live rank's heartbeat carries out would SIGKILL this whole test process:
        # recorded instead (the dead rank beats no more, so none may happen)
        self.fenced: list[int] = []
        monkeypatch.setattr(heartbeat_mod, "os", types.SimpleNamespace(
            kill=lambda pid, sig: self.fenced.append(sig), getpid=os.getpid))

        self.master = master_store()
        self.secret = auth.new_secret()
        events = ", ".join("{" + ", ".join(f"{k}: {v}" for k, v in f.items()) + "}"
                           for f in faults)
        cfg = compose_train(["model=tiny", *dims, f"num_steps={STEPS}", "log_every_steps=0",
                             "backend=nccl", "ft.num_spares=1", "ft.persist_interval_steps=0",
                             "launcher.agents=false", f"faults.events=[{events}]"], tmp_path)
        self.cfg = dict(cfg, _store={"host": "127.0.0.1", "port": self.master.port})
        self.world = 8
        self.logs: list[str] = []
        self.coord = Coordinator(copy.deepcopy(self.cfg), auth.namespaced(self.master, self.secret),
                                 self.launcher, log=self.logs.append, secret=self.secret)

    def run(self, timeout_s: float = 60.0) -> dict[int, dict[str, torch.Tensor]]:
        """Run the job to its end; returns every rank's final state (rank -> state dict)."""
        errors: dict[str, BaseException] = {}

        def work(slot):
            try:
                w = Worker(copy.deepcopy(self.cfg), slot, self.secret)
                assert w.backend == "nccl"
                self.workers[slot] = w
                w.run()
            except Vanished:
                pass
            except BaseException as e:  # a crashed process: it exits (the coordinator sees it)
                errors[f"slot {slot}"] = e
                self.launcher.exited[slot] = 1

        def coordinate():
            try:
                self.coord.run()
            except BaseException as e:  # surfaced below
                errors["coordinator"] = e

        coordinator = threading.Thread(target=coordinate, name="coordinator", daemon=True)
        workers = {s: threading.Thread(target=work, args=(s,), name=f"slot{s}", daemon=True)
                   for s in range(self.world + 1)}
        made = len(fake_nccl.KEEP)
        coordinator.start()
        for t in workers.values():
            t.start()
        try:
            coordinator.join(timeout_s)  # it ends once every rank's final record is in
            for slot, t in workers.items():
                if slot not in self.vanished:
                    t.join(timeout_s)
            hung = [t.name for s, t in [(-1, coordinator), *workers.items()]
                    if t.is_alive() and s not in self.vanished]
            assert not hung, (hung, hung_stacks(), self.logs, errors)
        finally:
            self.over.set()
            for w in self.workers.values():
                w.heartbeat.stopped.set()
        self.groups = fake_nccl.KEEP[made:]  # every NCCL group this job made
        for name, e in errors.items():
            raise AssertionError(f"{name} failed; coordinator log: {self.logs}") from e
        assert self.coord.outcome == "completed", (self.coord.message, self.logs)
        assert not self.fenced, "a live rank was fenced"
        finals = {}
        for slot in self.coord.members.ranks.values():
            tr = self.workers[slot].trainer
            assert tr.step == STEPS, (slot, tr.rank, tr.step)
            finals[tr.rank] = {k: v.clone() for k, v in tr.state_dict().items()}
        return finals


def hung_stacks() -> str:
    """The innermost frames of every thread (what a hung rank waits on)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f"{names.get(i)}: " + "".join(traceback.format_stack(f)[-3:])
                     for i, f in sys._current_frames().items())


@pytest.mark.parametrize("dims", [DIMS, ["parallel=dp2_tp2_pp2", "parallel.zero=2",
                                           "parallel.grad_reduce=reduce_scatter"]],
                         ids=["zero1", "zero2"])
def test_a_rank_vanishing_mid_step_is_hot_swapped_over_nccl_and_ends_bitwise_equal(
        tmp_path, monkeypatch, dims):
    faulty = Job(tmp_path / "faulty", monkeypatch,
                 [{"rank": VICTIM, "step": KILL_STEP, "phase": "mid_step", "kind": "kill"}], dims)
    got = faulty.run()
    # one recovery (g0 -> g1): the victim's slot fenced and replaced by the spare (slot 8); the
    # survivors kept their slots and rebuilt their groups
    assert faulty.vanished == {VICTIM} and faulty.launcher.killed == [VICTIM]
    assert faulty.coord.gen == 1, faulty.logs
    assert faulty.coord.members.ranks == {r: (8 if r == VICTIM else r) for r in range(8)}
    # the spare's state came over the wire: its ZeRO shard from the replica its buddy holds,
    # the parameters from its data-parallel peer (rank 7), not drawn or read from disk
    plan = [line for line in faulty.logs if line.startswith("[coordinator] gen 1:")]
    assert plan and f"rank {VICTIM} <- replica from rank" in plan[0], faulty.logs
    assert f"parameters from rank {VICTIM + 2}" in plan[0], plan

    reference = Job(tmp_path / "clean", monkeypatch, [], dims)
    want = reference.run()
    assert reference.coord.gen == 0 and not reference.vanished
    # generation g aborted on every rank (the watchers aborted its NCCL groups; the dead rank's
    # too, its watcher thread outliving the rank's in this emulation) and rebuilt whole as g + 1
    # (NCCL keeps no group across an abort), which ran to the end unaborted
    by_gen = {g: [x for x in faulty.groups if x.prefix.startswith(f"g{g}/")] for g in (0, 1)}
    assert len(faulty.groups) == len(by_gen[0]) + len(by_gen[1])
    assert len(by_gen[0]) == len(by_gen[1]) == len(reference.groups) > 0
    assert all(x.aborted for x in by_gen[0]) and not any(x.aborted for x in by_gen[1])
    # the gradient step went by reduce-scatter (one per bucket group), never by reduce
    dp_groups = [x for x in reference.groups if "/dp/" in x.prefix]
    assert dp_groups and all(x.posts["reduce_scatter"] > 0 for x in dp_groups), \
        [x.prefix for x in reference.groups]
    assert not any(x.posts["reduce"] for x in reference.groups + faulty.groups)
    assert sorted(got) == sorted(want) == list(range(8))
    # per-rank states distinct (ZeRO shards over dp, tp and pp shards): a state delivered to
    # the wrong rank cannot compare equal
    flat = {r: torch.cat([t.reshape(-1).float() for t in s.values()]) for r, s in want.items()}
    for a in range(8):
        for b in range(a + 1, 8):
            assert flat[a].shape != flat[b].shape or not torch.equal(flat[a], flat[b]), (a, b)
    for r in range(8):
        assert got[r].keys() == want[r].keys(), r
        for k in want[r]:
            assert torch.equal(got[r][k], want[r][k]), (r, k)
