"""A DeadPool process: a training rank, or a warm spare waiting to become one.

Every process starts the same way: import torch, connect to the coordinator's store, start a
heartbeat (heartbeat.py), build the model, optimizer, data and snapshot engine, and announce
itself warm. Then it follows the coordinator's plans, one per generation::

    plan g assigns me a rank  -> build the generation's communicator, restore per the plan
                                 (recovery.restore: receive a replica / roll back / keep live
                                 state), train
    failure declared in g     -> park the communicator, report what I can resume from
                                 (recovery.restore.report_status), wait for plan g+1
    plan g does not name me   -> (a spare) wait for plan g+1

Run as ``python -m deadpool.rank.worker --job <run_dir>/job.json --slot N``; the launcher does that.
"""

from __future__ import annotations

import time

T_EXEC = time.time()  # this module starts executing: the interpreter is up, torch not imported yet

import argparse
import faulthandler
import signal
import json
import os
import sys
import traceback
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from deadpool.agent.board import NODE_DIR_ENV
from deadpool.agent.client import BoardHeartbeat, NodeLink, report_crash
from deadpool.checkpoint import final, rank_state
from deadpool.errors import Aborted, CollectiveError, CoordinatorLost
from deadpool.model import stage_params
from deadpool.rank import nccl_env, netif
from deadpool.rank.comm import Communicator, resolve_backend
from deadpool.rank.faults import FaultInjector
from deadpool.rank.groups import layout_group_keys
from deadpool.rank.heartbeat import Heartbeat
from deadpool.rank.trainer import Trainer
from deadpool.rank.watchdog import Progress, build_phase
from deadpool.recovery import pause, restore
from deadpool.settings import layout_cfg
from deadpool.store import auth, reports
from deadpool.store.protocol import JOIN_GENERATION_ENV, Keys, Plan, RankTimings, Seal, now
from deadpool.store.wire import BaseMismatch, decode_plan, fetch_plan, plan_skipped
from deadpool.threads import wait_until
from deadpool.topology import ParallelDims, Topology


def connect(host: str, port: int, secret: str, timeout_s: float = 60.0):
    """A client of the coordinator's store, inside the job's namespace (deadpool/store/auth.py)."""
    return auth.open_store(host, port, secret, timeout_s)


class Worker:
    def __init__(self, cfg: dict, slot: int, secret: str):
        self.cfg = cfg
        self.slot = slot
        self.ft = cfg["ft"]
        self.host, self.port = cfg["_store"]["host"], int(cfg["_store"]["port"])
        self.secret = secret
        self.seal = Seal(secret)
        self.store = self.open_store()
        self.progress = Progress()
        # started by a node agent: beats, plans, aborts and flags go through its board
        self.link = NodeLink.attach()
        self.plan_held: Plan | None = None  # the last plan read (the next comes as a delta on it)
        self._group_keys: list[str] | None = None
        if self.link is not None:  # the agent reads the board every agent interval: beating
            # twice per interval is as fresh as it can see (not every heartbeat_interval_s)
            every = max(float(self.ft["heartbeat_interval_s"]), float(self.ft["agent_interval_s"]) / 2)
            self.heartbeat = BoardHeartbeat(self.link, every, self.progress, float(
                self.ft["node_timeout_s"]) - float(self.ft["agent_interval_s"]))  # (agent/client.py)
            self.progress.on_step = partial(self.link.board.set_step, self.link.index)
        else:
            self.heartbeat = Heartbeat(lambda: self.open_store(timeout_s=2.0), slot,
                                       self.ft["heartbeat_interval_s"],
                                       float(self.ft["coordinator_timeout_s"]), self.progress,
                                       self.seal)
        self.heartbeat.start()
        self.lost = self.heartbeat.coordinator_lost
        self.dims = ParallelDims.from_config(cfg["parallel"])
        run_dir = Path(cfg["run_dir"])
        (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
        self.injector = FaultInjector(cfg["faults"]["events"], slot, self.store, seal=self.seal)
        self.trainer = Trainer(cfg, slot, self.injector, run_dir / "metrics" / f"slot{slot}.jsonl",
                               publish_progress=self._publish_progress,
                               progress=self.progress)
        self.injector.on_corrupt = lambda: self.trainer.engine.corrupt_replicas()
        self.run_dir = run_dir
        self.backend = resolve_backend(cfg["device"], cfg.get("backend", "auto"))
        self.has_state = False  # holds a rank's state (live step meaningful)
        self._idle_faults = any(e.phase == "idle" for e in self.injector.events)
        self._idle_build_store = None
        self.prev_comm: Communicator | None = None  # the last aborted generation's (groups kept)
        # every parked communicator stays referenced for the life of the process: its groups
        # may have ops in flight, and deleting such a group blocks (Communicator.park)
        self.parked: list[Communicator] = []
        # a job relaunched from disk (ft=checkpoint_restart) continues the generation numbers; a
        # process started to regrow a running job (recovery.elastic) waits from a later one and
        # joins as a warm spare (it never takes a plan for the job's start)
        joining = os.environ.get(JOIN_GENERATION_ENV)
        self.first_gen = int(joining if joining is not None else cfg.get("_first_generation", 0))
        self.joined_late = joining is not None
        # the layout of the current generation (Plan.layout, an in-place elastic job), relative
        # to the job's configured one
        self.layout: dict = {}
        self.configured = {"parallel": dict(cfg["parallel"]), "ft": dict(cfg["ft"])}
        self.t_imported = time.time()
        if slot >= self.dims.world_size:
            # a warm spare pre-builds a stage (rank 0's, undrawn) so that taking any rank later
            # costs only allocating that rank's tensors, not the first-use imports and set-up
            self.trainer.build(self.dims, 0, init=False)
        self.progress.set(-1, "idle")
        key = Keys.spare_ready(slot)  # join: only a process holding the job's secret can
        self.store.set(key, self.seal.wrap(key, repr(time.time())))

    def _publish_progress(self, line: str) -> None:
        self.store.set(Keys.PROGRESS, self.seal.wrap(Keys.PROGRESS, line))

    def _set_sealed(self, key: str, text: str) -> None:
        self.store.set(key, self.seal.wrap(key, text))

    def report(self, keys: Keys, kind: str, rank: int, text: str) -> None:
        """A per-rank report for the coordinator (``reports.send``)."""
        reports.send(self.store, self.seal, self.link, keys, kind, rank, text)

    def open_store(self, timeout_s: float = 60.0):
        return connect(self.host, self.port, self.secret, timeout_s)

    def _build_store(self):
        """A store client for a group rebuild: a rendezvous blocks its client, so it is not the
        main thread's; the last successful build's client is reused (no leak per generation)."""
        store, self._idle_build_store = self._idle_build_store, None
        return store or self.open_store()

    # -- plans ------------------------------------------------------------------------------------
    def wait_plan(self, generation: int) -> Plan | None:
        key = Keys.plan(generation)
        waited = t0 = time.monotonic()
        n = 0
        while True:
            if self.lost.is_set():
                raise CoordinatorLost("the coordinator stopped answering")
            if self.link is not None:
                text = self.link.plan_text(generation)
                if text is not None:
                    return self._take_plan(generation, text)
            elif self.store.check([key]) or (n % 10 == 9 and plan_skipped(self.store, self.seal,
                                                                           generation)):
                return self._take_plan(generation)  # (collected meanwhile: the newest plan)
            if generation == self.first_gen and \
                    time.monotonic() - t0 > float(self.ft["startup_timeout_s"]):
                raise RuntimeError(f"no plan from the coordinator within {self.ft['startup_timeout_s']}"
                                   " s: is the job secret right (DEADPOOL_JOB_SECRET[_FILE])?")
            n += 1
            if self._job_stopped(n):
                return None
            if self.trainer.rank is None and time.monotonic() - waited > 0.05:
                waited = time.monotonic()  # an idle spare: idle-phase faults key on the job's step
                step = self._job_step()
                if step is not None:
                    self.injector.fire(int(step), "idle")
            if self.link is not None:
                # the agent rings this process's waker after each plan and flag: block on it,
                # bounded for what nothing rings (the job's step, for an idle-phase fault)
                self.link.sleep(0.05 if self._idle_faults else 0.5)
            else:
                # one store round trip per 10 ms: an idle spare shares cores with training ranks
                time.sleep(0.01)

    def _take_plan(self, generation: int, text: str | None = None) -> Plan:
        """Decode plan ``generation`` (the wire text the node's agent handed over, or the store's)
        against the plan held; from the store's full form if that is not its base."""
        if self._group_keys is None:  # (the same keys as the node agent's: its layout's)
            self._group_keys = layout_group_keys(self.configured, self.layout)
        plan = None
        if text is not None:
            try:
                plan = decode_plan(text, self.plan_held, self._group_keys)
            except BaseMismatch:  # a delta on a plan this process does not hold
                pass
        if plan is None:
            plan, _ = fetch_plan(self.store, self.seal, generation, self.plan_held, self._group_keys)
        self.plan_held = plan
        return plan

    def starts_job(self, plan: Plan) -> bool:
        """``plan`` is the job's first for this process: it holds every rank's step-0 state (or
        loads ``ft.resume_from``)."""
        return plan.generation == self.first_gen and not self.joined_late

    def adopt_layout(self, plan: Plan) -> None:
        """Follow an in-place elastic reshape: from this plan on, the job runs at its layout.
        The rank this process held belongs to the old layout (its state comes back from the
        reshape's disk checkpoint, re-cut)."""
        if plan.layout == self.layout:
            return
        self.layout = plan.layout
        cfg = layout_cfg(self.configured, plan.layout)
        self.cfg["parallel"], self.cfg["ft"] = cfg["parallel"], cfg["ft"]  # the trainer's dict too
        self.ft = self.cfg["ft"]
        self.dims = ParallelDims.from_config(self.cfg["parallel"])
        self._group_keys = None
        self.trainer.rank, self.has_state = None, False

    def _job_step(self) -> int | None:
        if self.link is not None:
            return self.link.job_step
        if not self.store.check([Keys.JOB_STEP]):
            return None
        return self.seal.open(Keys.JOB_STEP, self.store.get(Keys.JOB_STEP))

    def _job_stopped(self, polls: int) -> bool:
        """``job/stop``: the board's flag, or (no agent) the store's every 10th poll."""
        if self.link is not None:
            return self.link.stopped
        return polls % 10 == 0 and self.seal.flag(self.store, Keys.JOB_STOP)

    def _job_done(self) -> bool:
        if self.link is not None:
            return self.link.done
        return self.seal.flag(self.store, Keys.JOB_DONE)

    def run(self) -> int:
        """Follow the coordinator's plans until the job ends; returns the exit code."""
        try:
            gen = self.first_gen
            plan = self.wait_plan(gen)
            while plan is not None:
                self.adopt_layout(plan)
                rank = plan.rank_of_slot(self.slot)
                if self.slot in plan.retire:  # migrated: stays until the spare trained a step
                    return pause.retire(self, plan)
                if plan.action == "stop":
                    return 0
                if rank is not None:
                    if plan.action in ("checkpoint", "checkpoint_and_stop"):
                        restore.stop_to_disk(self, plan, rank)  # checkpoint: the process stays
                        if plan.action == "checkpoint_and_stop":
                            return 0
                    elif self.run_generation(plan, rank):
                        return 0
                gen = plan.generation + 1
                self.progress.set(self.trainer.step, "wait_plan")
                plan = self.wait_plan(gen)
            return 0
        except Exception as e:
            # a store error means the coordinator is gone or going: wait for the heartbeat's verdict
            # (its reconnect attempts each take up to 2 s: allow for them)
            store_error = isinstance(e, dist.DistError)  # the store (coordinator) unreachable
            if isinstance(e, CoordinatorLost) or (store_error and self.lost.wait(
                    2 * float(self.ft["coordinator_timeout_s"]) + 5.0)):
                if not self.heartbeat.seen_coordinator:
                    raise RuntimeError("never heard from the coordinator in the job's namespace: "
                                       "is the job secret right (DEADPOOL_JOB_SECRET[_FILE])?") from e
                return self.save_and_exit()
            raise

    def run_generation(self, plan: Plan, rank: int) -> bool:
        """Returns True when the job finished; False when the generation was aborted.

        Every phase (group rebuild, state transfer, rollback, replication restart, training) can
        be aborted by the next failure; the rank then reports what it holds and waits for the
        next plan. Only a failure of this process itself (an exception that is not a
        communication failure) ends it.
        """
        tr, keys = self.trainer, Keys(plan.generation)
        timing = RankTimings(plan_seen=now())
        if plan.generation == self.first_gen:  # the process's own start-up (a relaunch's cost)
            timing.exec, timing.imported = T_EXEC, self.t_imported
        if tr.rank != rank:
            # a process starting the job holds every rank's step-0 state (init is a pure function
            # of the seed); a spare taking a rank later holds nothing of it yet
            self.has_state = self.starts_job(plan) and not self.ft["resume_from"]
        tr.rank, tr.generation = rank, plan.generation
        self.injector.set_rank(rank)
        topo = Topology(self.dims, rank, plan.generation, self.ft["buddy_policy"],
                        int(self.ft.get("replicas", 1)))
        comm = None
        try:
            self.progress.set(plan.resume_step, build_phase(
                stage_params(self.cfg["model"], self.dims.tp, self.dims.pp, topo.coords["pp"]),
                float(self.ft["progress_timeout_s"])))
            # a spare builds its rank's stage now, undrawn when its state will come by transfer
            mine = plan.sources.get(rank)
            fresh = self.starts_job(plan) or (mine is not None and mine.kind == "init")
            if tr.build(self.dims, rank, init=fresh):
                timing.built = now()
            self.progress.set(plan.resume_step, "rebuild")
            comm = Communicator.build(topo, self.store, self.backend, self.ft["collective_poll_s"],
                                      self.ft["pg_timeout_s"], repl_nice=int(self.ft["snapshot_nice"]),
                                      store_factory=self._build_store, lost=self.lost,
                                      fault_hook=self.injector.fire, step=plan.resume_step,
                                      seal=self.seal, previous=self.prev_comm,
                                      keep=set(plan.keep_groups),
                                      abort_probe=None if self.link is None else self.link.aborted,
                                      link=self.link)
            timing.groups_kept = len(comm.kept)
            if self.prev_comm is not None:  # its other groups may hold a dead peer's socket
                self.prev_comm.release(keep=set(comm.kept))
                self.prev_comm = None
            comm.progress = self.progress
            timing.rebuilt = now()
            restore.restore(self, plan, rank, comm, timing)
            # the rendezvous client is free again (an abandoned build or transfer keeps its own)
            self._idle_build_store = comm.build_store
            timing.ready = now()
            self.report(keys, "timing", rank, timing.to_json())
            if self.ft["snapshot"]:
                tr.engine.start_replication(comm, self.open_store, first_step=tr.step)
            self.injector.fire(tr.step, "repl_restart")
            def first_step():
                t = now()
                self.report(keys, "first_step", rank, repr(t))
                if timing.exec is not None:
                    self.log_startup(rank, timing, t)

            tr.train(comm, on_first_step=first_step)
            self._set_sealed(keys.finished(rank), "1")  # the report; the counter only wakes
            self.store.add(keys.finished_count, 1)
            # wait for the whole job: a late failure elsewhere may still roll this rank back
            self.progress.set(tr.step, "wait_done")
            wait_until(self._job_done, every_s=0.005,
                       between=comm.raise_if_aborted)
            self.write_final(rank)
            return True
        except (Aborted, CollectiveError):
            restore.report_status(self, plan, rank, comm)
            return False

    def save_and_exit(self) -> int:
        """The coordinator is gone. Write every consistent state this process holds, say how to
        resume, and exit (workers never outlive their coordinator).

        Written: this rank's local snapshots, and the replicas it holds, of the newest protected
        step it knows and anything newer. Every rank keeps its snapshot of the newest protected
        step (the snapshot engine's invariant), so some step is complete on disk for every rank unless a
        rank and its buddy were lost too; ``ft.resume_from`` picks the newest complete one.
        """
        tr, root = self.trainer, self.ft["checkpoint_dir"]
        tr.engine.stop_replication()
        if tr.rank is None or not self.has_state or tr.engine is None:
            print(f"[deadpool] slot {self.slot}: the coordinator is gone; holding no rank's state, "
                  "exiting", flush=True)
            return 3
        written = rank_state.write_held(tr, self.dims, root, "coordinator lost")
        print(f"[deadpool] rank {tr.rank}: the coordinator stopped answering; wrote steps {written} "
              f"to {root}. Resume with ft.resume_from={root}", flush=True)
        return 3

    def log_startup(self, rank: int, timing: RankTimings, first_step: float) -> None:
        """One line per rank (its slot log; rank 0's also on the console): where the seconds
        from the interpreter's start to the first step went. On a GPU a 1.4 B-parameter rank
        took about 70 s to start (experiments/results/gpu/2026-11-26-h200)."""
        marks = [("imports", timing.imported), ("build", timing.built), ("groups", timing.rebuilt),
                 ("state", timing.ready), ("first step", first_step)]
        phases = self.trainer.build_phases
        detail = {"build": " (" + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()) + ")"
                  } if phases else {}
        parts, last = [], timing.exec
        for name, t in marks:
            if t is not None:
                parts.append(f"{name} {t - last:.1f}{detail.get(name, '')}")
                last = t
        line = f"[rank {rank}] start-up {first_step - timing.exec:.1f} s: " + ", ".join(parts)
        print(line, flush=True)
        if rank == 0:
            self._publish_progress(line)

    def write_final(self, rank: int) -> None:
        t0 = time.perf_counter()
        tr = self.trainer
        if tr.engine.persister is not None:  # the process exits without destructors
            tr.engine.persister.close()
        out = self.run_dir / "final"  # a checkpoint root (checkpoint.final)

        def progressed():  # the coordinator waits while this moves (recovery.finish)
            self.progress.set(tr.step, "final")
        progressed()
        digest = tr.digest()  # of its whole state, where it lies (the checkpoint holds a part)
        written = final.write_final_state(
            out, tr.step, rank, tr.state_dict(), dict(tr.header(), digest=digest),
            shared_names=tr.shared_names(), layout=self.dims.layout,
            world_size=self.dims.world_size, on_progress=progressed,
            on_first_write=lambda: self.injector.fire(tr.step, "final"))
        self._set_sealed(Keys.final(rank), json.dumps({
            "digest": digest, "step": tr.step, "slot": self.slot, "written_bytes": written,
            "state_bytes": tr.engine.layout.nbytes,
            # what this rank sends its buddies per snapshot (snapshot.py's regions, x ft.replicas)
            "replicated_bytes": tr.engine.replicated_bytes,
            "model_params": sum(p.numel() for p in tr.params)}))
        print(f"[rank {rank}] final state digested, {written / 2**30:.3f} GiB of it written in "
              f"{time.perf_counter() - t0:.2f} s", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", required=True, help="job.json written by the launcher")
    ap.add_argument("--slot", type=int, help="launch slot of this process")
    ap.add_argument("--slot-from-env", action="store_true",
                    help="take the slot from SLURM_PROCID or RANK (srun / torchrun)")
    args = ap.parse_args(argv)
    if args.slot is None:
        env = os.environ.get("SLURM_PROCID", os.environ.get("RANK"))
        if not args.slot_from_env or env is None:
            ap.error("give --slot N, or --slot-from-env under srun / torchrun")
        args.slot = int(env)
    cfg = json.loads(Path(args.job).read_text())
    secret = auth.load_secret()  # from the environment or a 0600 file; never logged
    os.environ.update(netif.socket_env(cfg))  # (as its agent set it, or this host's: srun tasks)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps stacks
    faulthandler.enable(all_threads=True)  # a crash in C (SIGSEGV, SIGABRT...) leaves its stacks
    if os.environ.get(NODE_DIR_ENV):  # under a node agent, which answers the job's signals for
        for sig in (signal.SIGTERM, signal.SIGINT):  # its node (deadpool/launch/stop.py): a signal Slurm
            signal.signal(sig, signal.SIG_IGN)  # sends every process of a step must not end a rank
    torch.set_num_threads(int(cfg.get("torch_num_threads", 1)))
    if cfg.get("deterministic"):
        # bitwise-reproducible kernels; cuBLAS needs a fixed workspace for that (read when its
        # handle is created, so before any CUDA work)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if cfg["device"].startswith("cuda"):  # pragma: no cover - needs CUDA
        nccl_env.apply(bool(cfg.get("deterministic")))  # before any NCCL call (nccl_env.py)
        torch.cuda.set_device(int(os.environ.get("SLURM_LOCALID", os.environ.get("LOCAL_RANK", 0))))
    try:
        code = Worker(cfg, args.slot, secret).run()
    except Exception as e:  # a crashed rank: say why, tell the coordinator, leave
        traceback.print_exc()
        code = 1
        try:
            report_crash(args.slot, f"{type(e).__name__}: {e}"[:500], Seal(secret), lambda: connect(
                cfg["_store"]["host"], int(cfg["_store"]["port"]), secret, 5))  # (through its agent)
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    # groups with ops in flight block on destruction; leave without running destructors
    os._exit(code)


if __name__ == "__main__":
    main()
