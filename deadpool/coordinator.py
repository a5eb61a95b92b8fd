"""The coordinator: owns the store, the membership table and every recovery decision.

It runs in the launcher's process, never in a training rank, so the ``TCPStore`` it hosts
survives any worker. Its loop polls three failure signals::

    process exit        (the launcher owns the process)         -> detected_by="exit"
    heartbeat staleness (a hung or unreachable process)         -> detected_by="heartbeat"
    a rank's report     (its step raised, or a collective broke) -> detected_by="exception" /
                                                                    "collective_error"

On a failure in generation g it: sets ``g{g}/abort`` (survivors leave collectives within one poll),
fences the dead process (SIGKILL), collects survivors' reports, asks the planner for the resume
step, gives each dead rank's coordinates to a warm spare, and writes plan g+1. Survivors keep their
processes; only groups are rebuilt. With no spare left it writes plan ``checkpoint_and_stop``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from deadpool import checkpoint
from deadpool.planner import plan_resume
from deadpool.policies import SPARE_POLICIES, make_policy
from deadpool.protocol import Keys, Plan, RankStatus
from deadpool.topology import ParallelDims, Topology


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
    def __init__(self, cfg: dict, store, launcher, log=print):
        self.cfg = cfg
        self.ft = cfg["ft"]
        self.store = store
        self.launcher = launcher
        self.log = log
        p = cfg["parallel"]
        self.dims = ParallelDims(p["dp"], p["tp"], p["pp"], p["ranks_per_node"])
        n = self.dims.world_size
        self.members = Membership(ranks={r: r for r in range(n)},
                                  spares=list(range(n, n + int(self.ft["num_spares"]))))
        self.spare_policy = make_policy(SPARE_POLICIES, self.ft["spare_policy"])
        self.recoveries: list[dict] = []
        self.pending: dict | None = None
        self.outcome = "running"
        self.message = ""
        self.finals: dict[int, dict] = {}  # rank -> final digest record, once the job is done
        self._last_progress: str | None = None

    # -- helpers ----------------------------------------------------------------------------------
    @property
    def gen(self) -> int:
        return self.members.generation

    def _heartbeat_age(self, slot: int) -> float | None:
        key = Keys.heartbeat(slot)
        if not self.store.check([key]):
            return None
        return time.time() - float(self.store.get(key))

    def _heartbeat_lost(self, slot: int) -> bool:
        """Soft and hard heartbeat timeouts (as NVIDIA's in-process restart has them).

        Past the soft timeout a process is only suspect: on a loaded host a healthy process's
        heartbeat thread can be late. It is declared lost when the launcher confirms it is
        stopped (a SIGSTOPped / hung-in-kernel local process), or past the hard timeout.
        """
        age = self._heartbeat_age(slot)
        if age is None or age <= float(self.ft["heartbeat_timeout_s"]):
            return False
        return age > float(self.ft["heartbeat_hard_timeout_s"]) or self.launcher.is_stopped(slot)

    def _write_plan(self, plan: Plan) -> None:
        plan.t_written = time.time()
        self.store.set(Keys.plan(plan.generation), plan.to_json())

    # -- startup ----------------------------------------------------------------------------------
    def wait_warm(self) -> None:
        """Every process must import torch, build its model and report warm."""
        deadline = time.time() + float(self.ft["startup_timeout_s"])
        waiting = set(self.members.ranks.values()) | set(self.members.spares)
        while waiting:
            for slot in list(waiting):
                if self.store.check([Keys.spare_ready(slot)]):
                    waiting.discard(slot)
                elif self.launcher.poll(slot) is not None:
                    raise JobFailed(f"process in slot {slot} exited during start-up:\n"
                                    + self.launcher.log_tail(slot))
            if time.time() > deadline:
                raise JobFailed(f"slots {sorted(waiting)} not warm after {self.ft['startup_timeout_s']} s")
            time.sleep(0.01)
        self._write_plan(Plan(0, "train", dict(self.members.ranks), resume_step=0,
                              sources={r: {"kind": "live", "holder": r} for r in self.members.ranks}))

    # -- detection --------------------------------------------------------------------------------
    def detect(self) -> tuple[dict[int, str], float] | None:
        """Failed ranks of the current generation with how each was seen, or None."""
        failed: dict[int, str] = {}
        keys = Keys(self.gen)
        for rank, slot in self.members.ranks.items():
            if self.launcher.poll(slot) is not None:
                crashed = self.store.check([Keys.crash(slot)])
                failed[rank] = "exception" if crashed else "exit"
                continue
            if self._heartbeat_lost(slot):
                failed[rank] = "heartbeat"
        if not failed and int(self.store.add(keys.num_errors, 0)) > 0:
            for rank, slot in self.members.ranks.items():
                if self.store.check([Keys.crash(slot)]):
                    failed[rank] = "exception"
            if not failed:
                return {}, time.time()  # a collective broke; culprit not yet known
        self._check_spares()
        return (failed, time.time()) if failed else None

    def _check_spares(self) -> None:
        for slot in list(self.members.spares):
            if self.launcher.poll(slot) is not None or self._heartbeat_lost(slot):
                self.log(f"[coordinator] warm spare in slot {slot} lost; pool now "
                         f"{len(self.members.spares) - 1}")
                self.launcher.kill(slot)
                self.members.spares.remove(slot)

    # -- recovery ---------------------------------------------------------------------------------
    def recover(self, failed: dict[int, str], t_detect: float) -> None:
        g = self.gen
        keys = Keys(g)
        if not self.store.check([keys.abort]):
            self.store.set(keys.abort, f"ranks {sorted(failed)} failed")
        self._finish_pending(force=True)
        self._finish_pending(interrupted=True)  # still open: that recovery never completed
        for rank in failed:
            self.launcher.kill(self.members.ranks[rank])
        statuses = self._collect_statuses(failed, keys)
        dead = set(failed)
        faults = {}
        for d in dead:
            slot = self.members.ranks[d]
            if self.store.check([Keys.fault(slot)]):
                faults[d] = json.loads(self.store.get(Keys.fault(slot)))
        topo = Topology(self.dims, 0, g, self.ft["buddy_policy"])
        decision = plan_resume(statuses, dead, topo.buddy)
        t_kill = min([f["t"] for f in faults.values()] or [t_detect])
        rec = {
            "generation": g + 1, "failed_rank": _one_or_list(sorted(dead)),
            "failed_slot": _one_or_list([self.members.ranks[d] for d in sorted(dead)]),
            "fault": (next(iter(faults.values()))["kind"] if faults else "unknown"),
            "detected_by": failed[min(dead)] if dead else "collective_error",
            "resume_step": decision.resume_step,
            "steps_recomputed": decision.steps_recomputed,
            "detect_s": t_detect - t_kill, "t_kill": t_kill, "t_detect": t_detect,
        }
        for d in dead:
            del self.members.ranks[d]
        if decision.resume_step is None:
            self.outcome, self.message = "unrecoverable", decision.reason
            self.log(f"[coordinator] cannot recover from memory: {decision.reason}. "
                     f"Restart from the last disk checkpoint (ft.persist_interval_steps).")
            self._write_plan(Plan(g + 1, "stop", {}, -1, reason=decision.reason))
            self.members.generation = g + 1
            rec["outcome"] = "unrecoverable"
            self.recoveries.append(rec)
            return
        assignments = dict(self.members.ranks)
        spares_used = []
        for d in sorted(dead):
            if not self.members.spares:
                break
            spare = self.spare_policy(d, [{"slot": s, "node": None} for s in self.members.spares],
                                      self.dims.ranks_per_node)["slot"]
            self.members.spares.remove(spare)
            assignments[d] = spare
            spares_used.append(spare)
        rec["spare_slot"] = _one_or_list(spares_used)
        if len(assignments) < self.dims.world_size:
            # no spare left: persist the consistent state from memory, then stop cleanly
            plan = Plan(g + 1, self.ft["on_no_spare"], dict(self.members.ranks), decision.resume_step,
                        decision.sources, reason="no warm spare left")
            self._write_plan(plan)
            self.members.generation = g + 1
            self._wait_checkpoint(plan)
            rec.update(outcome="checkpoint_and_stop", plan_s=plan.t_written - t_detect)
            self.recoveries.append(rec)
            return
        plan = Plan(g + 1, "train", assignments, decision.resume_step, decision.sources,
                    reason=f"ranks {sorted(dead)} replaced by slots {spares_used}")
        self._write_plan(plan)
        self.members.ranks = assignments
        self.members.generation = g + 1
        rec["plan_s"] = plan.t_written - t_detect
        rec["t_plan"] = plan.t_written
        rec["bytes_transferred"] = 0
        self.pending = rec
        self.log(f"[coordinator] gen {g + 1}: rank(s) {sorted(dead)} ({rec['detected_by']}) -> "
                 f"spare slot(s) {spares_used}, resume at step {decision.resume_step} "
                 f"({decision.steps_recomputed} step(s) to recompute)")

    def _collect_statuses(self, failed: dict[int, str], keys: Keys) -> dict[int, RankStatus]:
        deadline = time.time() + float(self.ft["status_timeout_s"])
        statuses: dict[int, RankStatus] = {}
        while True:
            for rank, slot in self.members.ranks.items():
                if rank in failed or rank in statuses:
                    continue
                if self.store.check([keys.status(rank)]):
                    statuses[rank] = RankStatus.from_json(self.store.get(keys.status(rank)))
                elif self.launcher.poll(slot) is not None:
                    failed[rank] = "exit"
                    self.launcher.kill(slot)
            if len(statuses) + len(failed) >= len(self.members.ranks):
                return statuses
            if time.time() > deadline:
                for rank, slot in self.members.ranks.items():
                    if rank not in failed and rank not in statuses:
                        failed[rank] = "heartbeat" if self._heartbeat_lost(slot) else "no_status"
                        self.launcher.kill(slot)
                return statuses
            time.sleep(0.002)

    def _wait_checkpoint(self, plan: Plan) -> None:
        key = Keys(plan.generation).checkpointed_count()
        deadline = time.time() + 300
        while int(self.store.add(key, 0)) < len(plan.assignments) and time.time() < deadline:
            time.sleep(0.01)
        checkpoint.write_meta(self.ft["checkpoint_dir"], plan.resume_step, self.dims.world_size,
                              plan.reason)
        self.outcome = "checkpoint_and_stop"
        self.message = (f"a rank failed and no warm spare is left: state of step {plan.resume_step} "
                        f"written to {self.ft['checkpoint_dir']}/step_{plan.resume_step}; resume with "
                        f"ft.resume_from={self.ft['checkpoint_dir']} and more ft.num_spares")
        self.log(f"[coordinator] {self.message}")

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
        if not (interrupted or force) and self.ft["snapshot"] \
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
            rec["first_step_s"] = max(firsts) - t_ready
            rec["kill_to_training_s"] = t_ready - tk
            rec["kill_to_first_step_s"] = max(firsts) - tk
            prot = [float(self.store.get(keys.protected(r))) for r in ranks
                    if self.store.check([keys.protected(r)])]
            rec["kill_to_protected_s"] = (max(prot) - tk) if len(prot) == len(ranks) else None
            rec["bytes_transferred"] = sum(t.get("bytes_received", 0) for t in timings)
            rec["outcome"] = "hot-swapped" if rec.get("spare_slot") not in (None, []) else \
                "regrouped (no rank lost)"
        self.recoveries.append(rec)
        self.pending = None

    # -- main loop --------------------------------------------------------------------------------
    def run(self) -> None:
        self.wait_warm()
        poll = 0.005
        while True:
            found = self.detect()
            if found is not None:
                failed, t = found
                if not failed:
                    # a collective error without a known culprit: give exit/heartbeat a moment
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
            for r, slot in self.members.ranks.items():
                if r not in self.finals and self.store.check([Keys.final(r)]):
                    self.finals[r] = json.loads(self.store.get(Keys.final(r)))
                elif r not in self.finals and self.launcher.poll(slot) not in (None, 0):
                    raise JobFailed(f"rank {r} failed while writing its final state:\n"
                                    + self.launcher.log_tail(slot))
            time.sleep(0.01)
