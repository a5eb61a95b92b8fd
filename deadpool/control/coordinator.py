"""The coordinator: owns the store, the membership table and every recovery decision.

It runs in the launcher's process, never in a training rank, so the ``TCPStore`` it hosts
survives any worker. Its loop (``run``) polls the failure signals (``recovery.detect``), prints
progress, completes recovery records, regrows an elastic job, and ends when every rank finished.

Recovery is a restartable protocol (``recover``, steps in ``deadpool.recovery``). On a failure in
generation g it sets ``g{g}/abort`` (everybody leaves whatever it waits on within one poll),
fences the dead process (SIGKILL), collects what every process that answers can resume from,
asks the planner for the newest step every rank can reach and where each rank's state comes
from, gives each rank without a process to a warm spare, and writes plan g+1. Every phase of g+1
(rebuild, transfer, rollback, replication restart, first step) is watched exactly like training:
a failure there aborts g+1 and the same procedure plans g+2 from what is left. Survivors keep
their processes throughout. Only when no copy of some rank's state exists in memory does it fall
back to the newest complete disk checkpoint; with no spare left it writes the consistent state to
disk and stops (``recovery.fallbacks``).

Coordinator loss is handled by the workers (rank/worker.py, ``save_and_exit``): the coordinator's
heartbeat key stops advancing, each worker writes the consistent states it holds with
torch.distributed.checkpoint and exits, saying how to resume. We chose that over a coordinator
restarted from a journal: the store lives in the coordinator's process, so a restart would also
have to move every worker to a new store and re-establish an in-flight generation; on an HPC
allocation the coordinator's host is the batch host, whose loss usually ends the allocation
anyway, and a resume from disk costs at most the steps since the last protected snapshot.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from dataclasses import dataclass

from deadpool.control.liveness import Liveness
from deadpool.control.observe import Observer
from deadpool.errors import JobFailed
from deadpool.policies import SPARE_POLICIES, make_policy
from deadpool.rank.groups import keepable_keys
from deadpool.rank.strategies import strategy_of
from deadpool.recovery import (detect, disk, elastic, fallbacks, finish, migrate, plan, preempt,
                               rollback, suspicion, timeline)
from deadpool.settings import layout_cfg
from deadpool.store import reports
from deadpool.store.protocol import Keys, Plan, RecoveryRecord, Seal, Source, announce_abort, finished_key
from deadpool.store.reports import Reports
from deadpool.store.wire import publish_plan
from deadpool.topology import ParallelDims

@dataclass
class Membership:
    """Who is who. ``ranks`` maps rank -> launch slot; ``spares`` are warm, unassigned slots."""

    ranks: dict[int, int]
    spares: list[int]
    generation: int = 0


class Coordinator(Observer):
    def __init__(self, cfg: dict, store, launcher, log=print, secret: str | None = None,
                 restart: RecoveryRecord | None = None, live=None, events=None, waker=None,
                 stopper=None):
        """``restart``: the record of the failure this job was relaunched for (ft=checkpoint_
        restart, ``job.run_job``); completed from the relaunched processes' start-up timings.
        ``live`` / ``events``: under node agents (``launcher.AgentLauncher``), the liveness read
        from the agents' records (``liveness.NodeLiveness``) and the pushed event log.
        ``waker``: under node agents, an unstarted ``agent.events.WakeListener``: the loop then
        sleeps until woken or its next timed duty instead of turning every 10 ms (see ``_run``).
        ``stopper``: a ``stop.Stopper``; a signal stops the job (``recovery.preempt``)."""
        self.seal = Seal(secret)
        self.strategy = strategy_of(cfg["ft"])
        self.store = store
        self.launcher = launcher
        self.log = log
        # the job at full width (a relaunched narrower job's config says how wide that was);
        # ``reshape`` sets cfg, ft and dims for the layout of the generations that follow
        self.configured = dict(cfg, parallel=dict(cfg["parallel"], dp=int(
            cfg.get("_full_dp") or cfg["parallel"]["dp"])), ft=dict(cfg["ft"], replicas=int(
                cfg.get("_full_replicas") or cfg["ft"].get("replicas", 1))))
        self.layout: dict = {}  # of the current generation (Plan.layout), empty as configured
        self._set_cfg(cfg)
        self.grow_at: float | None = cfg.get("_grow_at")  # an elastic job regrows then
        self.regrow = None  # an in-place regrow's joining processes (recovery.elastic.Regrow)
        n = self.dims.world_size
        self.members = Membership(ranks={r: r for r in range(n)},
                                  spares=list(range(n, n + int(self.ft["num_spares"]))),
                                  generation=int(cfg.get("_first_generation", 0)))
        self.spare_policy = make_policy(SPARE_POLICIES, self.ft["spare_policy"])
        self.events, self.waker = events, waker
        self.stopper, self.stop_record = stopper, None
        self.live = live or Liveness(float(self.ft["heartbeat_timeout_s"]),
                                     float(self.ft["heartbeat_hard_timeout_s"]),
                                     float(self.ft["progress_timeout_s"]))
        self._nodes_hint = -1
        # (generation, step pushed as protected, vote step decided) and the nodes holding its
        # ranks (``_agree``)
        self._agreed: tuple[int, int, int] = (-1, -1, -1)
        self._rank_nodes: list[int] = []
        self._last_plan: Plan | None = None  # the plan a delta is written against
        self.bad: set[tuple[int, int, int]] = set()  # (holder, owner, step) copies found corrupt
        self.recoveries = timeline.RecoveryLog(cfg, log)  # on disk as each completes
        self.pending: RecoveryRecord | None = restart  # the open record (recovery.timeline)
        self.abort_cause: str | None = None  # an abort with no rank failed: why (detect.failures)
        self.outcome = "running"
        self.message = ""
        self.finals: dict[int, dict] = {}  # rank -> final digest record, once the job is done
        self.job_step = -1  # newest step any rank reported
        self.fault_t = 0.0  # newest injected fault already attributed to a recovery
        self.errors_logged: set[tuple[int, int]] = set()
        self.error_hint = (-1, 0, False)  # (generation, num_errors seen, a sealed report behind it)
        self.forgeries: set[str] = set()  # kinds of unsealed messages already logged
        self.evidence: dict[int, str] = {}  # rank -> what was known of it when declared failed
        self._finished_hint = (-1, 0)  # (generation, num_finished) when the reports were read
        self._finished: tuple[int, Reports] | None = None
        self._garbage: list[str] = []  # keys of finished generations, deleted a few per loop
        self.record_reports = None  # the open record's per-rank reports (recovery.timeline)
        self.streak = 0  # recoveries since the job last completed a step
        self._last_progress: str | None = None
        self._progress_read = 0.0
        self._last_read = 0.0
        self._counters: dict[str, int] = {}  # this loop's wake-up counters (read_counters)
        self._counters_made: set[str] = set()
        self._beats_seen: dict[int, bytes] = {}  # slot -> the raw heartbeat value last read
        self._forged_beats: set[int] = set()
        self._tick = time.monotonic()
        self._beating = threading.Thread(target=self._beat, name="coordinator-heartbeat",
                                         daemon=True)
        self.migrations = migrate.Migrations(self)  # stragglers and drains (recovery.migrate)
        # liveness-only suspects whose fencing would lose a copy get a second look (detect)
        self.suspicion = suspicion.for_coordinator(self)

    # -- helpers ----------------------------------------------------------------------------------
    def _set_cfg(self, cfg: dict) -> None:
        self.cfg = cfg
        self.ft = cfg["ft"]
        self.dims = ParallelDims.from_config(cfg["parallel"])
        # what a buddy holds of each rank (all | unique | none); ranks replicate unless none
        self.replica_region = self.dims.replica_region(self.ft.get("replicate", "unique"))
        self.replicates = bool(self.ft["snapshot"]) and self.replica_region != "none" \
            and self.dims.world_size > 1  # one rank: nobody to hold its replica
        self._group_keys = None  # groups.keepable_keys of this layout, for plan deltas

    def reshape(self, layout: dict) -> None:
        """The generations from the next plan on run at ``layout`` (an in-place shrink or
        regrow, ``recovery.elastic``)."""
        self.layout = layout
        self._set_cfg(layout_cfg(self.configured, layout))

    @property
    def gen(self) -> int:
        return self.members.generation

    def announce_abort(self, reason: str, fence: list[int] = ()) -> None:
        """Abort the current generation: the sealed key, and under node agents a pushed event;
        then fence the processes of slots ``fence`` (under node agents in that same event)."""
        announce_abort(self.store, self.seal, Keys(self.gen), reason)
        if self.events is not None and fence:
            self.launcher.fence(list(fence), abort=self.gen)
            return
        if self.events is not None:
            self.events.push("abort", g=self.gen)
        if fence:
            self.launcher.fence(list(fence))

    def set_flag(self, key: str) -> None:
        """``job/done`` or ``job/stop`` (sealed; pushed to node agents)."""
        self.store.set(key, self.seal.wrap(key, "1"))
        if self.events is not None:
            self.events.push("done" if key == Keys.JOB_DONE else "stop")

    def generation_running(self, g: int) -> None:
        """Every rank of generation ``g`` took its first step (its recovery record completed):
        nothing refers back to older generations, so their keys are queued for deletion
        (``collect_garbage``), except the last plan before ``g``.

        Why this is safe: the statuses, error and bad-source reports of g-1 were read when plan g
        was made; its timings belong to a record already closed; its ranks parked its
        communicator (the abort watcher stops once parked) and started replication, the snapshot
        schedule and their groups in g's namespace (groups kept from g-1 use the store only to
        rendezvous, long done). A process still writing into g-1 (a rank declared dead, being
        fenced) only recreates a key or two. Plans are read by idle spares one after the other,
        every 10 ms: ``plan/<g-1>`` is kept for a spare still catching up, older ones go. Keys a
        generation writes per step (``repl_done/<step>``, the snapshot interval votes) stay until
        the generation ends (partial: they grow with the steps of a long generation)."""
        try:
            keys = self.store.list_keys()
        except Exception as e:  # a store that cannot list its keys: nothing is deleted
            if "list_keys" not in self.forgeries:
                self.forgeries.add("list_keys")
                self.log(f"[coordinator] keys of finished generations are not deleted: {e}")
            return
        self._garbage.extend(k for k in keys if finished_key(k, g))

    def collect_garbage(self, budget: int = 256) -> None:
        """Delete up to ``budget`` queued keys (a few per loop: the loop must keep ticking)."""
        while self._garbage and budget > 0:
            key = self._garbage.pop()
            budget -= 1
            try:
                self.store.delete_key(key)
            except Exception:
                pass

    def rank_reports(self, keys: Keys, kind: str, ranks, on_forged) -> reports.Reports:
        """The ranks' sealed reports of ``kind`` (status, timing, first_step, protected): under
        node agents from one key per node (``reports.NodeReports``), else one per rank.
        ``on_forged(who)`` names what failed its seal ("rank 3", "node 1")."""
        if self.events is None:
            return reports.Reports(self.store, self.seal, getattr(keys, kind), ranks,
                                   on_forged=lambda r: on_forged(f"rank {r}"), posted=True)
        node_of, slots = self.launcher.node_of_slot, self.members.ranks
        return reports.NodeReports(self.store, self.seal, lambda n: keys.node_report(kind, n),
                                   ranks, lambda r: node_of.get(slots.get(r)),
                                   on_forged=lambda n: on_forged(f"node {n}"))

    def lost(self, slot: int) -> bool:
        """The process of ``slot`` stopped beating (or stopped, where the launcher can tell)."""
        return self.live.beat_lost(slot, self.launcher.is_stopped)

    def write_plan(self, p: Plan) -> None:
        p.t_written = time.time()
        if self._group_keys is None:
            self._group_keys = keepable_keys(self.dims, self.ft["buddy_policy"])
        # a delta against the plan written before (which every process reading in order holds)
        publish_plan(self.store, self.seal, p, self._last_plan, self._group_keys)
        self._last_plan = p
        if self.events is not None:
            self.live.new_generation(p.generation)
            self.events.push("plan", g=p.generation)

    # -- startup ----------------------------------------------------------------------------------
    def wait_warm(self) -> None:
        """Every process must import torch, build its model and report warm (a join announcement
        sealed with the job's secret: a process without it is never counted)."""
        deadline = time.monotonic() + float(self.ft["startup_timeout_s"])
        waiting = set(self.members.ranks.values()) | set(self.members.spares)
        joined = Reports(self.store, self.seal, Keys.spare_ready, waiting, budget=64, on_forged=lambda s:
            self.log(f"[coordinator] slot {s}: join announcement without the job's secret refused"))
        while waiting:
            self.tick()
            preempt.before_start(self)
            waiting -= joined.poll_new().keys()
            for slot in sorted(waiting):
                if self.launcher.poll(slot) is not None:
                    raise JobFailed(f"process in slot {slot} exited during start-up:\n"
                                    + self.launcher.log_tail(slot))
            if time.monotonic() > deadline and (waiting := waiting - set(joined.settle())):
                raise JobFailed(f"slots {sorted(waiting)} not warm after {self.ft['startup_timeout_s']} s")
            if waiting:
                time.sleep(0.01)
        self.read_heartbeats(force=True)
        first = Plan(self.gen, "train", dict(self.members.ranks), resume_step=0,
                     sources={r: Source("live", r) for r in self.members.ranks})
        self.write_plan(first)
        if self.pending is not None:  # a relaunch: its cost runs until this plan's first step
            self.pending.update(generation=self.gen, t_plan=first.t_written,
                                start_s=first.t_written - self.pending.t_relaunch)

    # -- recovery (the steps are deadpool.recovery's; see its docstring) ---------------------------
    def recover(self, failed: dict[int, str], t_detect: float) -> None:
        """Plan generation g+1 after a failure in g, or end the job through a fallback."""
        g = self.gen
        keys = Keys(g)
        detect.abort_and_fence(self, failed)
        timeline.finish_pending(self, force=True)
        timeline.finish_pending(self, interrupted=True)  # still open: that recovery never completed
        if not self.strategy.recovers:
            fallbacks.no_recovery(self, failed, t_detect)
            return
        statuses = rollback.restrict(self, detect.collect_statuses(self, failed, keys))
        bad = detect.collect_bad_sources(self, keys)
        faults = detect.collect_faults(self, set(failed))
        decision = plan.decide(self, statuses)
        if decision.resume_step is None:  # (the message says how each failed rank was found)
            decision.reason += f" (failed in generation {g}: {detect.described(self, failed)})"
        rec = rollback.open_record(self, failed, faults, decision, t_detect, bad)
        lost = {d: self.members.ranks.pop(d) for d in failed}  # rank -> the slot it held
        if decision.resume_step is None:
            decision = disk.from_disk(self, decision, rec)
            if decision is None:
                return
        if fallbacks.stalled(self, decision, rec, t_detect):
            return
        assignments, need, spares_used = plan.assign_spares(self, lost)
        rec.spare_slot = timeline.one_or_list(spares_used)
        rec.sources = decision.described_sources()
        if len(assignments) < self.dims.world_size:
            fallbacks.no_spare(self, g + 1, decision, rec, set(failed), t_detect, statuses)
            return
        plan.swap_routes(self.cfg["faults"], decision.sources)
        keep = plan.groups_to_keep(self, statuses, need, g + 1)
        rec.groups_kept = len(keep)
        nxt = Plan(g + 1, "train", assignments, decision.resume_step, decision.sources,
                   reason=f"ranks {sorted(need)} given to slots {spares_used}", keep_groups=keep,
                   layout=self.layout)
        self.write_plan(nxt)
        self.members.ranks = dict(assignments)  # a copy: the plan stays the next delta's base
        self.members.generation = g + 1
        for slot in assignments.values():  # every process starts the new generation's clock
            self.live.reset_progress(slot)
        rec.update(plan_s=nxt.t_written - t_detect, t_plan=nxt.t_written, bytes_transferred=0)
        self.pending = rec
        srcs = ", ".join(f"rank {r} <- {v}" for r, v in rec.sources.items())
        self.log(f"[coordinator] gen {g + 1}: rank(s) {sorted(failed)} ({rec.detected_by}) -> "
                 f"spare slot(s) {spares_used}, resume at step {decision.resume_step} "
                 f"({decision.steps_recomputed} step(s) to recompute)" + (f"; {srcs}" if srcs else ""))

    # -- main loop --------------------------------------------------------------------------------
    def run(self) -> None:
        self._beating.start()
        if self.waker is not None:
            self.waker.start()
        try:
            self._run()
        finally:
            if self.waker is not None:
                self.waker.stop(self.store)
            if self.outcome == "running":
                self.outcome = "failed"

    def _run(self) -> None:
        """Without node agents the loop turns every 10 ms: a process exit is seen by polling
        the launcher, at the cost of the loop's store requests each turn. Under node agents,
        whatever needs an answer at once wakes it (an agent after a local process exited, a rank
        after a broken collective: ``protocol.wake_coordinator``), and it turns on its own only
        for its timed duties, every half agent interval: read the node records (liveness, the
        ranks' agreements), progress, garbage, an elastic regrow, the end of the job. Measured on
        2 cores with 4 ranks and 1 spare: the coordinator's process went from 0.047 cores (its
        loop 0.033, the store server 0.010) to 0.011."""
        self.wait_warm()
        poll = 0.01  # detection latency of a process exit; the store round trips it costs
        idle = float(self.ft["agent_interval_s"]) / 2  # under node agents, with nothing to wake it
        while True:
            found = detect.failures(self) or rollback.poll(self)  # or a corruption, a spike
            if preempt.due(self):  # a signal (walltime, preemption, Ctrl-C): write and stop
                break
            if found is not None:
                failed, t = found
                if not failed and not rollback.pending(self):
                    failed = detect.name_culprit(self, poll)
                with gc_paused():
                    self.recover(failed, t)
                if self.outcome != "running":
                    break
                continue
            timeline.finish_pending(self)
            if self.pending is None and self.migrations.poll(self):  # a planned swap
                continue
            self.collect_garbage()
            self._print_progress()
            if self.grow_at is not None and time.monotonic() >= self.grow_at \
                    and self.pending is None and elastic.regrow_ready(self):
                fallbacks.grow(self)
                if self.outcome != "running":
                    break
                continue
            if self._all_finished():
                self._print_progress(force=True)
                self.set_flag(Keys.JOB_DONE)
                self._collect_finals()
                self.outcome = "completed"
                break
            if self.waker is None:
                time.sleep(poll)
            else:
                self.waker.wait(idle)
        timeline.finish_pending(self, interrupted=self.outcome != "completed", force=True)
        self.set_flag(Keys.JOB_STOP)

    def _all_finished(self) -> bool:
        """Every rank of the generation sealed ``finished/<rank>``. The ``num_finished`` counter
        is only a wake-up hint (anyone reaching the store can bump it): the reports are read once
        it reaches the world size, and again whenever it moves after that."""
        keys = Keys(self.gen)
        n = self.counter(keys.finished_count)
        if n < self.dims.world_size or self._finished_hint == (self.gen, n):
            return False
        self._finished_hint = (self.gen, n)
        if self._finished is None or self._finished[0] != self.gen:
            self._finished = (self.gen, Reports(
                self.store, self.seal, keys.finished, range(self.dims.world_size),
                on_forged=lambda r: detect.forged(self, f"finish report of rank {r}")))
        done = self._finished[1]
        done.poll()
        if not done.complete:
            detect.forged(self, f"finish counter of generation {self.gen} ahead of the reports")
        return done.complete

    def _print_progress(self, force: bool = False) -> None:
        """Log the reporting rank's newest progress line (read at most every 0.1 s: it is for
        people; ``force`` at the end, so the last line is never missed)."""
        if not force and self._tick - self._progress_read < 0.1:
            return
        self._progress_read = self._tick
        if self.store.check([Keys.PROGRESS]):
            line = self.seal.open(Keys.PROGRESS, self.store.get(Keys.PROGRESS))
            if line is not None and line != self._last_progress:
                self._last_progress = line
                self.log(line)

    def _collect_finals(self) -> None:
        finish.collect_finals(self)  # waits on the writers' progress (recovery.finish)


@contextlib.contextmanager
def gc_paused():
    """No cyclic garbage collection while a recovery runs (torchtitan likewise turns automatic
    collection off in its training loop and collects at steps it chooses): decoding 16,384 statuses made the collector scan every object of the
    coordinator's process, ~0.1 s of the detection -> plan window at that size. Reference
    counting still frees everything acyclic; the collector runs again after the plan."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
