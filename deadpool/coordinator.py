"""The coordinator: owns the store, the membership table and every recovery decision.

It runs in the launcher's process, never in a training rank, so the ``TCPStore`` it hosts
survives any worker. Its loop polls these failure signals::

    process exit        (the launcher owns the process)            -> detected_by="exit"
    heartbeat staleness (a stopped or unreachable process)         -> detected_by="heartbeat"
    progress staleness  (a hung training thread, heartbeat alive)  -> detected_by="progress"
    a rank's report     (its step raised, or a collective broke)   -> detected_by="exception" /
                                                                      "collective_error"

Recovery is a restartable protocol. On a failure in generation g it sets ``g{g}/abort``
(everybody leaves whatever it waits on within one poll), fences the dead process (SIGKILL),
collects what every process that answers can resume from, asks the planner for the newest step
every rank can reach and where each rank's state comes from, gives each rank without a process
to a warm spare, and writes plan g+1. Every phase of g+1 (rebuild, transfer, rollback,
replication restart, first step) is watched exactly like training: a failure there aborts g+1 and
the same procedure plans g+2 from what is left. Survivors keep their processes throughout. Only
when no copy of some rank's state exists in memory does it fall back to the newest complete disk
checkpoint; with no spare left it writes the consistent state to disk and stops.

Coordinator loss is handled by the workers (worker.py, ``save_and_exit``): the coordinator's
heartbeat key stops advancing, each worker writes the consistent states it holds with
torch.distributed.checkpoint and exits, saying how to resume. We chose that over a coordinator
restarted from a journal: the store lives in the coordinator's process, so a restart would also
have to move every worker to a new store and re-establish an in-flight generation; on an HPC
allocation the coordinator's host is the batch host, whose loss usually ends the allocation
anyway, and a resume from disk costs at most the steps since the last protected snapshot.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

from deadpool import checkpoint
from deadpool.comm import rank_groups, resolve_backend, reusable_groups
from deadpool.planner import plan_resume
from deadpool.policies import SPARE_POLICIES, make_policy
from deadpool.auth import AuthError
from deadpool.protocol import Keys, Plan, RankStatus, Seal
from deadpool.strategies import strategy_of
from deadpool.topology import ParallelDims, Topology
from deadpool.watchdog import Liveness


class JobFailed(RuntimeError):
    pass


def _one_or_list(xs: list):
    return xs[0] if len(xs) == 1 else xs


@dataclass
class Membership:
    """Who is who. ``ranks`` maps rank -> launch slot; ``spares`` are warm, unassigned slots."""

    ranks: dict[int, int]
    spares: list[int]
    generation: int = 0


class Coordinator:
    def __init__(self, cfg: dict, store, launcher, log=print, secret: str | None = None,
                 restart: dict | None = None):
        """``restart``: the record of the failure this job was relaunched for (ft=checkpoint_
        restart, ``job.run_job``); completed from the relaunched processes' start-up timings."""
        self.cfg = cfg
        self.seal = Seal(secret)
        self.ft = cfg["ft"]
        self.strategy = strategy_of(self.ft)
        self.store = store
        self.launcher = launcher
        self.log = log
        p = cfg["parallel"]
        self.dims = ParallelDims(p["dp"], p["tp"], p["pp"], p["ranks_per_node"])
        # what ranks hold (see snapshot.py's regions): a ZeRO-1 shard no peer has; replicas of
        # the whole state or of the shard only; no replicas when peers hold everything
        self.sharded = bool(p.get("zero", True)) and self.dims.dp > 1
        self.replica_has_shared = self.ft.get("replicate", "unique") == "full" or self.dims.dp == 1
        self.replicates = bool(self.ft["snapshot"]) and (self.sharded or self.replica_has_shared)
        n = self.dims.world_size
        self.members = Membership(ranks={r: r for r in range(n)},
                                  spares=list(range(n, n + int(self.ft["num_spares"]))),
                                  generation=int(cfg.get("_first_generation", 0)))
        self.spare_policy = make_policy(SPARE_POLICIES, self.ft["spare_policy"])
        self.live = Liveness(float(self.ft["heartbeat_timeout_s"]),
                             float(self.ft["heartbeat_hard_timeout_s"]),
                             float(self.ft["progress_timeout_s"]))
        self.bad: set[tuple[int, int, int]] = set()  # (holder, owner, step) copies found corrupt
        self.recoveries: list[dict] = []
        self.pending: dict | None = restart
        self.outcome = "running"
        self.message = ""
        self.finals: dict[int, dict] = {}  # rank -> final digest record, once the job is done
        self._last_progress: str | None = None
        self._last_read = 0.0
        self._job_step = -1
        self._fault_t = 0.0  # newest injected fault already attributed to a recovery
        self._errors_logged: set[tuple[int, int]] = set()
        self._streak = 0  # recoveries since the job last completed a step
        self._tick = time.monotonic()
        self._beating = threading.Thread(target=self._beat, name="coordinator-heartbeat",
                                         daemon=True)

    # -- helpers ----------------------------------------------------------------------------------
    @property
    def gen(self) -> int:
        return self.members.generation

    def _beat(self) -> None:
        """``coord/hb`` advances while the main loop turns: workers that see it stop (the
        coordinator died or hangs) save their state and exit."""
        n = 0
        interval = float(self.ft["heartbeat_interval_s"])
        while self.outcome == "running":
            if time.monotonic() - self._tick < float(self.ft["coordinator_timeout_s"]) / 2:
                n += 1
                try:
                    self.store.set(Keys.COORD_HB, str(n))
                except Exception:
                    pass
            time.sleep(interval)

    def _read_heartbeats(self, force: bool = False) -> None:
        """Feed every process's heartbeat to the liveness tracker (at most once per interval)."""
        self._tick = time.monotonic()
        if not force and self._tick - self._last_read < float(self.ft["heartbeat_interval_s"]) / 2:
            return
        self._last_read = self._tick
        slots = sorted(set(self.members.ranks.values()) | set(self.members.spares))
        keys = [Keys.heartbeat(s) for s in slots]
        try:
            values = self.store.multi_get(keys)
        except Exception:  # a key not there yet (cannot happen after wait_warm): read one by one
            values = [self.store.get(k) if self.store.check([k]) else None for k in keys]
        for s, v in zip(slots, values):
            self.live.observe(s, v)
        steps = [self.live.step.get(s, -1) for s in self.members.ranks.values()]
        if steps and max(steps) > self._job_step:
            self._job_step = max(steps)
            self.store.set(Keys.JOB_STEP, str(self._job_step))

    def _lost(self, slot: int) -> bool:
        return self.live.beat_lost(slot, self.launcher.is_stopped)

    def _write_plan(self, plan: Plan) -> None:
        plan.t_written = time.time()
        key = Keys.plan(plan.generation)
        self.store.set(key, self.seal.wrap(key, plan.to_json()))

    # -- startup ----------------------------------------------------------------------------------
    def wait_warm(self) -> None:
        """Every process must import torch, build its model and report warm."""
        deadline = time.time() + float(self.ft["startup_timeout_s"])
        waiting = set(self.members.ranks.values()) | set(self.members.spares)
        while waiting:
            self._tick = time.monotonic()
            for slot in list(waiting):
                if self._joined(slot):
                    waiting.discard(slot)
                elif self.launcher.poll(slot) is not None:
                    raise JobFailed(f"process in slot {slot} exited during start-up:\n"
                                    + self.launcher.log_tail(slot))
            if time.time() > deadline:
                raise JobFailed(f"slots {sorted(waiting)} not warm after {self.ft['startup_timeout_s']} s")
            time.sleep(0.01)
        self._read_heartbeats(force=True)
        plan = Plan(self.gen, "train", dict(self.members.ranks), resume_step=0,
                    sources={r: {"kind": "live", "holder": r} for r in self.members.ranks})
        self._write_plan(plan)
        if self.pending is not None:  # a relaunch: its cost runs until this plan's first step
            self.pending.update(generation=self.gen, t_plan=plan.t_written,
                                start_s=plan.t_written - self.pending["t_relaunch"])

    def _joined(self, slot: int) -> bool:
        """The process of ``slot`` announced itself with the job's secret."""
        key = Keys.spare_ready(slot)
        if not self.store.check([key]):
            return False
        try:
            self.seal.unwrap(key, self.store.get(key))
            return True
        except AuthError:
            self.log(f"[coordinator] slot {slot}: join announcement without the job's secret refused")
            self.store.delete_key(key)
            return False

    # -- detection --------------------------------------------------------------------------------
    def detect(self) -> tuple[dict[int, str], float] | None:
        """Failed ranks of the current generation with how each was seen, or None.

        ``({}, t)`` means the generation must be aborted although no rank is known dead (a
        collective broke, or every rank is stuck waiting on the others)."""
        self._read_heartbeats()
        failed: dict[int, str] = {}
        keys = Keys(self.gen)
        for rank, slot in self.members.ranks.items():
            if self.launcher.poll(slot) is not None:
                crashed = self.store.check([Keys.crash(slot)])
                failed[rank] = "exception" if crashed else "exit"
            elif self._lost(slot):
                failed[rank] = "heartbeat"
        by_slot = {s: r for r, s in self.members.ranks.items()}
        hung, stuck = self.live.hung(list(by_slot))
        for slot in hung:
            failed.setdefault(by_slot[slot], "progress")
        if not failed and int(self.store.add(keys.num_errors, 0)) > 0:
            for rank, slot in self.members.ranks.items():
                if self.store.check([Keys.crash(slot)]):
                    failed[rank] = "exception"
            if not failed:
                self._log_errors(keys)
                return {}, time.time()  # a collective broke; culprit not yet known
        self._check_spares()
        if not failed and stuck:
            self.log(f"[coordinator] gen {self.gen}: no rank progressed for "
                     f"{self.ft['progress_timeout_s']} s, all waiting on each other; regrouping")
            return {}, time.time()
        return (failed, time.time()) if failed else None

    def _log_errors(self, keys: Keys) -> None:
        for rank in self.members.ranks:
            if (keys.g, rank) not in self._errors_logged and self.store.check([keys.error(rank)]):
                self._errors_logged.add((keys.g, rank))
                self.log(f"[coordinator] gen {self.gen}: rank {rank} reports: "
                         f"{self.store.get(keys.error(rank)).decode()[:300]}")

    def _bad_reported(self) -> bool:
        """A receiver reported a corrupt copy: the cause is known, nobody needs to be named."""
        keys = Keys(self.gen)
        return any(self.store.check([keys.bad_source(r)]) for r in self.members.ranks)

    def _check_spares(self) -> None:
        for slot in list(self.members.spares):
            if self.launcher.poll(slot) is not None or self._lost(slot):
                self.log(f"[coordinator] warm spare in slot {slot} lost; pool now "
                         f"{len(self.members.spares) - 1}")
                self.launcher.kill(slot)
                self.members.spares.remove(slot)

    # -- recovery ---------------------------------------------------------------------------------
    def recover(self, failed: dict[int, str], t_detect: float) -> None:
        g = self.gen
        keys = Keys(g)
        if not self.store.check([keys.abort]):
            self.store.set(keys.abort, self.seal.wrap(keys.abort, f"ranks {sorted(failed)} failed"))
        self._finish_pending(force=True)
        self._finish_pending(interrupted=True)  # still open: that recovery never completed
        for rank in failed:
            self.launcher.kill(self.members.ranks[rank])
        if not self.strategy.recovers:  # ft=none: the failure ends the job
            rec = {"generation": g + 1, "failed_rank": _one_or_list(sorted(failed)),
                   "detected_by": failed[min(failed)] if failed else "collective_error",
                   "detect_s": None, "t_detect": t_detect}
            if self.strategy.restarts:
                self._restart(g, rec, failed)
                return
            self._stop(g + 1, rec, f"rank(s) {sorted(failed)} failed and ft.strategy="
                                   f"{self.strategy.name} recovers nothing")
            return
        statuses = self._collect_statuses(failed, keys)
        bad = self._collect_bad_sources(keys)
        dead = set(failed)
        faults = {}  # injected faults behind this recovery (dead ranks first, then survivors')
        for rank, slot in sorted(self.members.ranks.items(), key=lambda rs: rs[0] not in dead):
            if self.store.check([Keys.fault(slot)]):
                f = json.loads(self.store.get(Keys.fault(slot)))
                if f["t"] > self._fault_t and (rank in dead or not faults):
                    faults[rank] = f
        self._fault_t = max([self._fault_t] + [f["t"] for f in faults.values()])
        topo = Topology(self.dims, 0, g, self.ft["buddy_policy"])
        decision = plan_resume(statuses, list(range(self.dims.world_size)), self.dims.state_peers,
                               topo.buddy, tuple(self.ft["state_sources"]), self.bad,
                               sharded=self.sharded, replica_has_shared=self.replica_has_shared)
        t_kill = min([f["t"] for f in faults.values()] or [t_detect])
        t_kill = min(t_kill, t_detect)
        rec = {
            "generation": g + 1, "failed_rank": _one_or_list(sorted(dead)),
            "failed_slot": _one_or_list([self.members.ranks[d] for d in sorted(dead)]),
            "fault": (next(iter(faults.values()))["kind"] if faults else "unknown"),
            "detected_by": failed[min(dead)] if dead else "collective_error",
            "resume_step": decision.resume_step,
            "steps_recomputed": decision.steps_recomputed,
            "detect_s": t_detect - t_kill, "t_kill": t_kill, "t_detect": t_detect,
        }
        if bad:
            rec["bad_sources"] = bad
        for d in dead:
            del self.members.ranks[d]
        if decision.resume_step is None:
            decision = self._disk_fallback(decision, rec)
            if decision is None:
                return
        self._streak += 1
        if self._streak > int(self.ft["max_recoveries_without_progress"]):
            reason = (f"{self._streak} recoveries in a row without a completed step "
                      f"(ft.max_recoveries_without_progress); last cause: {rec['detected_by']}")
            if any(s["kind"] == "disk" for s in decision.sources.values()):
                self._stop(g + 1, rec, reason)
                return
            self._checkpoint_and_stop(g + 1, decision, rec, reason, t_detect)
            return
        need = [r for r in range(self.dims.world_size) if r not in self.members.ranks]
        assignments = dict(self.members.ranks)
        spares_used = []
        for d in need:
            if not self.members.spares:
                break
            spare = self.spare_policy(d, [{"slot": s, "node": None} for s in self.members.spares],
                                      self.dims.ranks_per_node)["slot"]
            self.members.spares.remove(spare)
            assignments[d] = spare
            spares_used.append(spare)
        rec["spare_slot"] = _one_or_list(spares_used)
        rec["sources"] = {str(r): f"{s['kind']} from rank {s['holder']}" + (
            f" + parameters from rank {s['shared_from']}" if "shared_from" in s else "")
            for r, s in sorted(decision.sources.items()) if s["kind"] != "live"}
        if len(assignments) < self.dims.world_size:
            if any(s["kind"] == "disk" for s in decision.sources.values()):
                self._stop(g + 1, rec, f"{decision.reason}; no warm spare left to restart from "
                                       f"the disk checkpoint at step {decision.resume_step}")
                return
            self._no_spare(g + 1, decision, rec, dead, t_detect)
            return
        swap = self.cfg["faults"].get("swap_routes")
        if swap and all(int(r) in decision.sources for r in swap):  # fault injection (see conf)
            a, b = (int(r) for r in swap)
            src = decision.sources
            src[a], src[b] = dict(src[b], owner=b), dict(src[a], owner=a)
        keep = self._reusable_groups(statuses, need, g + 1)
        rec["groups_kept"] = len(keep)
        plan = Plan(g + 1, "train", assignments, decision.resume_step, decision.sources,
                    reason=f"ranks {sorted(need)} given to slots {spares_used}", keep_groups=keep)
        self._write_plan(plan)
        self.members.ranks = assignments
        self.members.generation = g + 1
        for slot in assignments.values():  # every process starts the new generation's clock
            self.live.reset_progress(slot)
        rec["plan_s"] = plan.t_written - t_detect
        rec["t_plan"] = plan.t_written
        rec["bytes_transferred"] = 0
        self.pending = rec
        srcs = ", ".join(f"rank {r} <- {v}" for r, v in rec["sources"].items())
        self.log(f"[coordinator] gen {g + 1}: rank(s) {sorted(dead)} ({rec['detected_by']}) -> "
                 f"spare slot(s) {spares_used}, resume at step {decision.resume_step} "
                 f"({decision.steps_recomputed} step(s) to recompute)" + (f"; {srcs}" if srcs else ""))

    def _checkpoint_and_stop(self, generation: int, decision, rec: dict, reason: str,
                             t_detect: float) -> None:
        """Persist the consistent state from memory (the processes left write it), then stop."""
        plan = Plan(generation, "checkpoint_and_stop", dict(self.members.ranks),
                    decision.resume_step, decision.sources, reason=reason)
        self._write_plan(plan)
        self.members.generation = generation
        self._wait_checkpoint(plan)
        rec.update(outcome="checkpoint_and_stop", plan_s=plan.t_written - t_detect)
        self.recoveries.append(rec)

    def _no_spare(self, generation: int, decision, rec: dict, dead: set[int], t_detect: float):
        """A rank has no process and no spare is left: the consistent state (every rank's, from
        memory) goes to disk, then ``ft.on_no_spare``: ``elastic`` - ``job.run_job`` relaunches
        the job without the dead ranks' data-parallel replicas (the smallest unit containing them;
        global batch kept, ``parallel.global_dp``); ``checkpoint_restart`` - it relaunches every
        process at the same width; ``checkpoint_and_stop`` - the job stops there."""
        action = self.ft["on_no_spare"]
        dropped = sorted({self.dims.coords(d)["dp"] for d in dead})
        if action == "elastic" and self.dims.dp - len(dropped) < 1:
            self.log(f"[coordinator] elastic: no data-parallel replica would be left; stopping")
            action = "checkpoint_and_stop"
        self._checkpoint_and_stop(generation, decision, rec, "no warm spare left", t_detect)
        if action == "checkpoint_and_stop" or self.outcome != "checkpoint_and_stop":
            return
        rec.pop("outcome", None)
        if action == "elastic":
            rec.update(fallback="shrink", dropped_dp=dropped, dp=self.dims.dp - len(dropped))
            self.outcome = "shrink"
            self.message = (f"no warm spare left: continuing without data-parallel replica(s) "
                            f"{dropped} (dp {self.dims.dp} -> {rec['dp']}) from step "
                            f"{decision.resume_step}")
        else:
            rec.update(fallback="restart", failed_at_step=self._job_step)
            self.outcome = "restart"
            self.message = (f"no warm spare left: relaunching every process from step "
                            f"{decision.resume_step}")
        self.log(f"[coordinator] {self.message}")

    def _grow(self) -> None:
        """An elastic job below its full width regrows once a replacement is available
        (``ft.elastic_regrow_after_s`` after the shrink, standing in for a repaired node joining):
        a planned regroup writes the consistent state, and ``job.run_job`` relaunches at full
        width."""
        g, t = self.gen, time.time()
        keys = Keys(g)
        self.store.set(keys.abort, self.seal.wrap(keys.abort, "regrow"))
        self._finish_pending(force=True)
        self._finish_pending(interrupted=True)
        failed: dict[int, str] = {}
        statuses = self._collect_statuses(failed, keys)
        if failed:  # somebody died meanwhile: an ordinary recovery
            self.recover(failed, t)
            return
        topo = Topology(self.dims, 0, g, self.ft["buddy_policy"])
        decision = plan_resume(statuses, list(range(self.dims.world_size)), self.dims.state_peers,
                               topo.buddy, tuple(self.ft["state_sources"]), self.bad,
                               sharded=self.sharded, replica_has_shared=self.replica_has_shared)
        rec = {"generation": g + 1, "failed_rank": None, "detected_by": "regrow", "fault": "none",
               "t_kill": t, "t_detect": t, "detect_s": 0.0, "resume_step": decision.resume_step,
               "steps_recomputed": decision.steps_recomputed}
        self._checkpoint_and_stop(g + 1, decision, rec, "regrow", t)
        if self.outcome == "checkpoint_and_stop":
            rec.pop("outcome", None)
            rec.update(fallback="grow", dp=int(self.cfg["_full_dp"]))
            self.outcome, self.message = "grow", f"regrowing to dp={self.cfg['_full_dp']}"
            self.log(f"[coordinator] {self.message} from step {decision.resume_step}")

    def _disk_fallback(self, decision, rec):
        """No consistent copy of some rank in memory: restart every rank from the newest
        complete disk checkpoint, if there is one (else stop, saying which ranks were lost)."""
        roots = [r for r in (self.ft["checkpoint_dir"], self.ft["resume_from"]) if r]
        step_dir = None
        for root in roots:
            try:
                d = checkpoint.latest_step_dir(root)
            except (FileNotFoundError, OSError):
                continue
            if step_dir is None or int(d.name.split("_")[1]) > int(step_dir.name.split("_")[1]):
                step_dir = d
        if step_dir is None:
            self._stop(self.gen + 1, rec, f"{decision.reason}, and there is no complete disk "
                       f"checkpoint under {roots} (ft.persist_interval_steps)")
            return None
        S = int(step_dir.name.split("_")[1])
        self.log(f"[coordinator] {decision.reason}; falling back to the disk checkpoint of step {S}")
        decision.resume_step, decision.steps_recomputed = S, max(0, self._job_step - S)
        decision.reason = f"{decision.reason}; restarted from disk ({step_dir})"
        decision.sources = {r: {"kind": "disk", "holder": r, "dir": str(step_dir)}
                            for r in range(self.dims.world_size)}
        rec.update(resume_step=S, steps_recomputed=decision.steps_recomputed, fallback="disk")
        return decision

    def _restart(self, g: int, rec: dict, failed: dict[int, str]) -> None:
        """ft=checkpoint_restart: the job ends here; ``job.run_job`` tears every process down and
        relaunches the job from the newest complete checkpoint (the record says which)."""
        faults = [json.loads(self.store.get(Keys.fault(slot)))
                  for r, slot in self.members.ranks.items()
                  if r in failed and self.store.check([Keys.fault(slot)])]
        t_kill = min([f["t"] for f in faults] + [rec["t_detect"]])
        step = checkpoint.latest_complete_step(self.ft["checkpoint_dir"]) or 0
        rec.update(fault=faults[0]["kind"] if faults else "unknown", t_kill=t_kill,
                   detect_s=rec["t_detect"] - t_kill, failed_at_step=self._job_step,
                   resume_step=step, steps_recomputed=max(0, self._job_step - step),
                   fallback="restart")
        self.outcome = "restart"
        self.message = (f"rank(s) {sorted(failed)} failed: relaunching every process from the "
                        f"checkpoint of step {step}" if step else
                        f"rank(s) {sorted(failed)} failed before any complete checkpoint: "
                        "relaunching every process from step 0")
        self.log(f"[coordinator] {self.message}")
        self._write_plan(Plan(g + 1, "stop", {}, -1, reason=self.message))
        self.members.generation = g + 1
        self.recoveries.append(rec)

    def _stop(self, generation: int, rec: dict, reason: str) -> None:
        self.outcome, self.message = "unrecoverable", reason
        self.log(f"[coordinator] cannot recover: {reason}")
        self._write_plan(Plan(generation, "stop", {}, -1, reason=reason))
        self.members.generation = generation
        rec["outcome"] = "unrecoverable"
        self.recoveries.append(rec)

    def _collect_statuses(self, failed: dict[int, str], keys: Keys) -> dict[int, RankStatus]:
        """Wait for every process of the aborted generation to report; whoever dies, stops or
        stays silent past ``status_timeout_s`` is declared failed and fenced."""
        deadline = time.time() + float(self.ft["status_timeout_s"])
        statuses: dict[int, RankStatus] = {}
        while True:
            self._read_heartbeats()
            for rank, slot in self.members.ranks.items():
                if rank in failed or rank in statuses:
                    continue
                if self.store.check([keys.status(rank)]):
                    statuses[rank] = RankStatus.from_json(self.store.get(keys.status(rank)))
                elif self.launcher.poll(slot) is not None:
                    failed[rank] = "exit"
                    self.launcher.kill(slot)
                elif self._lost(slot):
                    failed[rank] = "heartbeat"
                    self.launcher.kill(slot)
            # Every rank that has not answered also stopped beating (soft timeout): silent to the
            # abort and no heartbeat are two independent signals, so they are lost now rather than
            # at the hard timeout. It matters under srun, where no process handle shows an exit.
            silent = [r for r in self.members.ranks if r not in failed and r not in statuses]
            if silent and all((self.live.beat_age(self.members.ranks[r]) or 0.0) > self.live.soft_s
                              for r in silent):
                for rank in silent:
                    failed[rank] = "heartbeat"
                    self.launcher.kill(self.members.ranks[rank])
            if len(statuses) + len(failed) >= len(self.members.ranks):
                return statuses
            if time.time() > deadline:
                for rank, slot in self.members.ranks.items():
                    if rank not in failed and rank not in statuses:
                        failed[rank] = "no_status"
                        self.launcher.kill(slot)
                return statuses
            time.sleep(0.002)

    def _collect_bad_sources(self, keys: Keys) -> list[dict]:
        """Copies that receivers found corrupt in the aborted generation: never used again."""
        found = []
        for rank in range(self.dims.world_size):
            if self.store.check([keys.bad_source(rank)]):
                b = json.loads(self.store.get(keys.bad_source(rank)))
                self.bad.add((int(b["holder"]), int(b["owner"]), int(b["step"])))
                found.append(b)
                self.log(f"[coordinator] copy of rank {b['owner']}'s state at step {b['step']} held "
                         f"by rank {b['holder']} failed its CRC check; it will not be used")
        return found

    def _wait_checkpoint(self, plan: Plan) -> None:
        key = Keys(plan.generation).checkpointed_count()
        deadline = time.time() + 300
        while int(self.store.add(key, 0)) < len(plan.assignments) and time.time() < deadline:
            self._tick = time.monotonic()
            time.sleep(0.01)
        checkpoint.write_meta(self.ft["checkpoint_dir"], plan.resume_step, self.dims.world_size,
                              plan.reason, layout={"dp": self.dims.dp, "tp": self.dims.tp,
                                                   "pp": self.dims.pp})
        self.outcome = "checkpoint_and_stop"
        self.message = (f"stopping ({plan.reason}): state of step {plan.resume_step} "
                        f"written to {self.ft['checkpoint_dir']}/step_{plan.resume_step}; resume with "
                        f"ft.resume_from={self.ft['checkpoint_dir']}"
                        + (" and more ft.num_spares" if "spare" in plan.reason else ""))
        if self.ft["on_no_spare"] == "checkpoint_and_stop" or "spare" not in plan.reason:
            self.log(f"[coordinator] {self.message}")  # (else the job goes on: said by the caller)

    def _reusable_groups(self, statuses, replaced, generation: int) -> list[str]:
        """``ft.rebuild=affected``: groups survivors may keep (``comm.reusable_groups``); on NCCL
        every group is rebuilt (the abort watcher has aborted them to free the streams)."""
        backend = resolve_backend(self.cfg["device"], self.cfg.get("backend", "auto"))
        if self.ft.get("rebuild", "affected") != "affected" or backend != "gloo":
            return []
        members = {}
        for r in range(self.dims.world_size):
            topo = Topology(self.dims, r, generation, self.ft["buddy_policy"])
            for _, key, ranks, _ in rank_groups(topo):
                members[key] = ranks
        counts = {r: st.groups for r, st in statuses.items()}
        return reusable_groups(counts, members, set(replaced))

    def _finish_pending(self, interrupted: bool = False, force: bool = False) -> None:
        """Fill the open recovery record from the ranks' timing keys once they are all there."""
        rec = self.pending
        if rec is None:
            return
        keys = Keys(rec["generation"])
        ranks = list(self.members.ranks) if not interrupted else []
        timings = []
        for r in ranks:
            if not self.store.check([keys.timing(r)]):
                return
            timings.append(json.loads(self.store.get(keys.timing(r))))
        firsts = []
        for r in ranks:
            if not self.store.check([keys.first_step(r)]):
                return
            firsts.append(float(self.store.get(keys.first_step(r))))
        if not (interrupted or force) and self.replicates \
                and int(self.store.add(keys.protected_count, 0)) < len(ranks):
            return
        if interrupted:
            rec["outcome"] = "interrupted by another failure"
        else:
            tp, tk = rec["t_plan"], rec["t_kill"]
            t_ready = max(t["ready"] for t in timings)
            rec["rebuild_s"] = max(t["rebuilt"] for t in timings) - tp
            rec["transfer_s"] = max(t["transferred"] - t["rebuilt"] for t in timings)
            rec["rollback_s"] = max(t["rolled_back"] - t["transferred"] for t in timings)
            built = [t["built"] - t["plan_seen"] for t in timings if "built" in t]
            rec["build_s"] = max(built) if built else 0.0  # a spare building its rank's stage
            rec["first_step_s"] = max(firsts) - t_ready
            rec["kill_to_training_s"] = t_ready - tk
            rec["kill_to_first_step_s"] = max(firsts) - tk
            first = self._chain_start(rec)
            if first is not rec:  # a cascade: time from the first fault of the chain
                rec["first_kill_to_first_step_s"] = max(firsts) - first["t_kill"]
            prot = [float(self.store.get(keys.protected(r))) for r in ranks
                    if self.store.check([keys.protected(r)])]
            rec["kill_to_protected_s"] = (max(prot) - tk) if len(prot) == len(ranks) else None
            rec["bytes_transferred"] = sum(t.get("bytes_received", 0) for t in timings)
            rec["outcome"] = "hot-swapped" if rec.get("spare_slot") not in (None, []) else \
                "regrouped (no rank lost)"
            if rec.get("fallback") == "disk":
                rec["outcome"] = "restarted from disk"
            if rec.get("fallback") in ("restart", "shrink", "grow"):  # the whole job relaunched
                rec["outcome"] = {"restart": "relaunched from checkpoint",
                                  "shrink": f"shrunk to dp={rec.get('dp')}",
                                  "grow": f"regrown to dp={rec.get('dp')}"}[rec["fallback"]]
                rec["load_s"] = rec.pop("rollback_s")  # the checkpoint load
                # interpreter start -> module running, and importing torch + deadpool
                rec["exec_s"] = max(t["exec"] for t in timings) - rec["t_relaunch"]
                rec["imports_s"] = max(t["imported"] - t["exec"] for t in timings)
        self.recoveries.append(rec)
        self.pending = None
        if not interrupted:
            self._streak = 0  # every rank completed a step: the job progresses again

    def _chain_start(self, rec: dict) -> dict:
        """The first recovery of an uninterrupted chain of interrupted ones ending at ``rec``."""
        first = rec
        for r in reversed(self.recoveries):
            if r.get("outcome") != "interrupted by another failure":
                break
            first = r
        return first

    # -- main loop --------------------------------------------------------------------------------
    def run(self) -> None:
        self._beating.start()
        try:
            self._run()
        finally:
            if self.outcome == "running":
                self.outcome = "failed"

    def _run(self) -> None:
        self.wait_warm()
        poll = 0.01  # detection latency of a process exit; the store round trips it costs
        while True:
            found = self.detect()
            if found is not None:
                failed, t = found
                if not failed and not self._bad_reported():
                    # no culprit known yet: give exit/heartbeat/progress a moment to name one
                    deadline = time.time() + float(self.ft["heartbeat_timeout_s"]) * 1.5
                    while time.time() < deadline:
                        found = self.detect()
                        if found and found[0]:
                            break
                        time.sleep(poll)
                    # nobody provably dead: recover() declares failed whoever does not report
                    failed = found[0] if found else {}
                self.recover(failed, t)
                if self.outcome != "running":
                    break
                continue
            self._finish_pending()
            self._print_progress()
            if self.cfg.get("_grow_at") is not None and time.time() >= self.cfg["_grow_at"] \
                    and self.pending is None:
                self._grow()
                if self.outcome != "running":
                    break
                continue
            keys = Keys(self.gen)
            if int(self.store.add(keys.finished_count, 0)) >= self.dims.world_size:
                self.store.set(Keys.JOB_DONE, "1")
                self._collect_finals()
                self.outcome = "completed"
                break
            time.sleep(poll)
        self._finish_pending(interrupted=self.outcome != "completed", force=True)
        self.store.set(Keys.JOB_STOP, "1")

    def _print_progress(self) -> None:
        if self.store.check([Keys.PROGRESS]):
            line = self.store.get(Keys.PROGRESS).decode()
            if line != self._last_progress:
                self._last_progress = line
                self.log(line)

    def _collect_finals(self) -> None:
        deadline = time.time() + 120
        while len(self.finals) < self.dims.world_size and time.time() < deadline:
            self._tick = time.monotonic()
            for r, slot in self.members.ranks.items():
                if r not in self.finals and self.store.check([Keys.final(r)]):
                    self.finals[r] = json.loads(self.store.get(Keys.final(r)))
                elif r not in self.finals and self.launcher.poll(slot) not in (None, 0):
                    raise JobFailed(f"rank {r} failed while writing its final state:\n"
                                    + self.launcher.log_tail(slot))
            time.sleep(0.01)

