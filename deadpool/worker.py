"""A DeadPool process: a training rank, or a warm spare waiting to become one.

Every process starts the same way: import torch, connect to the coordinator's store, start a
heartbeat, build the model, optimizer, data and snapshot engine, and announce itself warm. Then it
follows the coordinator's plans, one per generation::

    plan g assigns me a rank  -> build the generation's communicator, restore per the plan
                                 (receive a replica / roll back / keep live state), train
    failure declared in g     -> park the communicator, report what I can resume from,
                                 wait for plan g+1
    plan g does not name me   -> (a spare) wait for plan g+1

Run as ``python -m deadpool.worker --job <run_dir>/job.json --slot N``; the launcher does that.
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
import threading
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from deadpool import auth, checkpoint
from deadpool.comm import Aborted, CollectiveError, Communicator, CoordinatorLost, resolve_backend
from deadpool.faults import FaultInjector
from deadpool.protocol import Keys, Plan, RankStatus, Seal, now
from deadpool.snapshot import CorruptState, StateLayout, decode_header
from deadpool.topology import ParallelDims, Topology
from deadpool.trainer import Trainer
from deadpool.watchdog import Progress


def connect(host: str, port: int, secret: str, timeout_s: float = 60.0):
    """A client of the coordinator's store, inside the job's namespace (deadpool/auth.py)."""
    return auth.open_store(host, port, secret, timeout_s)


class Heartbeat(threading.Thread):
    """Writes ``hb/<slot>`` (beat count + the training thread's progress, see watchdog.py) every
    interval, honours fences, and watches the coordinator's own heartbeat.

    Store errors never stop it: it reconnects on the next beat. If the coordinator's heartbeat
    has not advanced (or the store has been unreachable) for ``coordinator_timeout_s`` on this
    process's own clock, it sets ``coordinator_lost``; the training thread then saves what it
    holds and exits (see ``Worker.save_and_exit``).
    """

    def __init__(self, open_store, slot: int, interval_s: float, coordinator_timeout_s: float,
                 position: Progress, seal: Seal):
        super().__init__(name="heartbeat", daemon=True)
        self.open_store = open_store
        self.slot = slot
        self.key = Keys.heartbeat(slot)
        self.interval_s = interval_s
        self.coordinator_timeout_s = coordinator_timeout_s
        self.position = position
        self.seal = seal
        self.coordinator_lost = threading.Event()
        self.seen_coordinator = False
        self.store = open_store()
        self.beat()  # the coordinator reads every process's heartbeat from the start

    def beat(self, n: int = 0) -> None:
        self.store.set(self.key, f"{n} {self.position.encode()}")

    def run(self):
        fence = Keys.fence(self.slot)
        n, last_coord, t_coord = 0, None, time.monotonic()
        while True:
            n += 1
            try:
                if self.store is None:
                    self.store = self.open_store()
                self.beat(n)
                # a process the coordinator declared dead must not come back (e.g. after SIGCONT);
                # checked every 4th beat: store round trips share the cores with training
                if n % 4 == 1 and self.store.check([fence]) and self._sealed(fence):
                    os.kill(os.getpid(), signal.SIGKILL)
                # once the coordinator's key exists it always does: one round trip, not two
                coord = (self.store.get(Keys.COORD_HB)
                         if last_coord is not None or self.store.check([Keys.COORD_HB]) else None)
                if coord != last_coord:
                    last_coord, t_coord = coord, time.monotonic()
                    self.seen_coordinator = True
            except Exception:  # a store hiccup, or the coordinator is gone: retry next beat
                self.store = None
            if time.monotonic() - t_coord > self.coordinator_timeout_s:
                self.coordinator_lost.set()
            time.sleep(self.interval_s)

    def _sealed(self, key: str) -> bool:
        try:
            self.seal.unwrap(key, self.store.get(key))
            return True
        except auth.AuthError:
            return False


class Worker:
    def __init__(self, cfg: dict, slot: int, secret: str):
        self.cfg = cfg
        self.slot = slot
        self.ft = cfg["ft"]
        self.host, self.port = cfg["_store"]["host"], int(cfg["_store"]["port"])
        self.secret = secret
        self.seal = Seal(secret)
        self.store = self.open_store()
        self.position = Progress()
        self.heartbeat = Heartbeat(lambda: self.open_store(timeout_s=2.0), slot,
                                   self.ft["heartbeat_interval_s"],
                                   float(self.ft["coordinator_timeout_s"]), self.position, self.seal)
        self.heartbeat.start()
        self.lost = self.heartbeat.coordinator_lost
        p = cfg["parallel"]
        self.dims = ParallelDims(p["dp"], p["tp"], p["pp"], p["ranks_per_node"])
        run_dir = Path(cfg["run_dir"])
        (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
        self.injector = FaultInjector(cfg["faults"]["events"], slot, self.store)
        self.trainer = Trainer(cfg, slot, self.injector, run_dir / "metrics" / f"slot{slot}.jsonl",
                               progress=lambda line: self.store.set(Keys.PROGRESS, line),
                               position=self.position)
        self.injector.on_corrupt = lambda: self.trainer.engine.corrupt_replicas()
        self.run_dir = run_dir
        self.backend = resolve_backend(cfg["device"], cfg.get("backend", "auto"))
        self.has_state = False  # holds a rank's state (live step meaningful)
        self._idle_build_store = None
        self.prev_comm: Communicator | None = None  # the last aborted generation's (groups kept)
        # a job relaunched from disk (ft=checkpoint_restart) continues the generation numbers
        self.first_gen = int(cfg.get("_first_generation", 0))
        self.t_imported = time.time()
        if slot >= self.dims.world_size:
            # a warm spare pre-builds a stage (rank 0's, undrawn) so that taking any rank later
            # costs only allocating that rank's tensors, not the first-use imports and set-up
            self.trainer.build(self.dims, 0, init=False)
        self.position.set(-1, "idle")
        key = Keys.spare_ready(slot)  # join: only a process holding the job's secret can
        self.store.set(key, self.seal.wrap(key, repr(time.time())))

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
            if self.store.check([key]):
                return Plan.from_json(self.seal.unwrap(key, self.store.get(key)))
            if generation == self.first_gen and \
                    time.monotonic() - t0 > float(self.ft["startup_timeout_s"]):
                raise RuntimeError(f"no plan from the coordinator within {self.ft['startup_timeout_s']}"
                                   " s: is the job secret right (DEADPOOL_JOB_SECRET[_FILE])?")
            n += 1
            if n % 10 == 0 and self.store.check([Keys.JOB_STOP]):
                return None
            if self.trainer.rank is None and time.monotonic() - waited > 0.05:
                waited = time.monotonic()  # an idle spare: idle-phase faults key on the job's step
                if self.store.check([Keys.JOB_STEP]):
                    self.injector.fire(int(self.store.get(Keys.JOB_STEP)), "idle")
            # one store round trip per 10 ms: an idle spare shares cores with training ranks
            # (TCPStore.wait with a timeout would block instead, but a timed-out wait leaves the
            # client's socket expecting a reply it no longer reads)
            time.sleep(0.01)

    def run(self) -> int:
        """Follow the coordinator's plans until the job ends; returns the exit code."""
        try:
            gen = self.first_gen
            plan = self.wait_plan(gen)
            while plan is not None:
                rank = plan.rank_of_slot(self.slot)
                if plan.action == "stop":
                    return 0
                if rank is not None:
                    if plan.action == "checkpoint_and_stop":
                        self.checkpoint_and_stop(plan, rank)
                        return 0
                    if self.run_generation(plan, rank):
                        return 0
                gen = plan.generation + 1
                self.position.set(self.trainer.step, "wait_plan")
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
        timing = {"plan_seen": now()}
        if plan.generation == self.first_gen:  # the process's own start-up (a relaunch's cost)
            timing.update(exec=T_EXEC, imported=self.t_imported)
        if tr.rank != rank:
            # a process starting the job holds every rank's step-0 state (init is a pure function
            # of the seed); a spare taking a rank later holds nothing of it yet
            self.has_state = plan.generation == self.first_gen and not self.ft["resume_from"]
        tr.rank, tr.generation = rank, plan.generation
        self.injector.set_rank(rank)
        topo = Topology(self.dims, rank, plan.generation, self.ft["buddy_policy"])
        comm = None
        try:
            self.position.set(plan.resume_step, "build")
            # a spare builds its rank's stage now, undrawn when its state will come by transfer
            fresh = plan.generation == self.first_gen or \
                plan.sources.get(rank, {}).get("kind") == "init"
            built_s = tr.build(self.dims, rank, init=fresh)
            if built_s:
                timing["built"] = now()
            self.position.set(plan.resume_step, "rebuild")
            comm = Communicator.build(topo, self.store, self.backend, self.ft["collective_poll_s"],
                                      self.ft["pg_timeout_s"], repl_nice=int(self.ft["snapshot_nice"]),
                                      store_factory=self._build_store, lost=self.lost,
                                      fault_hook=self.injector.fire, step=plan.resume_step,
                                      seal=self.seal, previous=self.prev_comm,
                                      keep=set(plan.keep_groups))
            timing["groups_kept"] = len(comm.kept)
            if self.prev_comm is not None:  # its other groups may hold a dead peer's socket
                self.prev_comm.release(keep=set(comm.kept))
                self.prev_comm = None
            comm.position = self.position
            timing["rebuilt"] = now()
            self.restore(plan, rank, comm, timing)
            # the rendezvous client is free again (an abandoned build or transfer keeps its own)
            self._idle_build_store = comm.build_store
            timing["ready"] = now()
            self.store.set(keys.timing(rank), json.dumps(timing))
            if self.ft["snapshot"]:
                tr.engine.start_replication(comm, self.open_store, first_step=tr.step)
            self.injector.fire(tr.step, "repl_restart")
            tr.train(comm, on_first_step=lambda: self.store.set(keys.first_step(rank), repr(now())))
            self.store.add(keys.finished_count, 1)
            # wait for the whole job: a late failure elsewhere may still roll this rank back
            self.position.set(tr.step, "wait_done")
            while not self.store.check([Keys.JOB_DONE]):
                comm.raise_if_aborted()
                time.sleep(0.005)
            self.write_final(rank)
            return True
        except (Aborted, CollectiveError):
            if tr.engine is not None:
                tr.engine.stop_replication()
            if comm is not None:
                comm.park()
            self.prev_comm = comm
            self.position.set(tr.step, "status")
            self.injector.fire(plan.resume_step, "status")
            # a rank cut inside its optimizer step holds a torn live state: only its snapshots count
            live = tr.step if self.has_state and not tr.dirty else None
            eng = tr.engine
            st = RankStatus(rank, self.slot, live,
                            eng.local_steps() if self.has_state and eng is not None else [],
                            eng.replica_steps() if eng is not None else {},
                            comm.group_counts() if comm is not None else {})
            self.store.set(keys.status(rank), st.to_json())
            return False

    def restore(self, plan: Plan, rank: int, comm: Communicator, timing: dict) -> None:
        """Bring this rank to ``plan.resume_step`` from the source the plan names."""
        tr = self.trainer
        S = plan.resume_step
        if plan.generation == self.first_gen:
            resume = self.ft["resume_from"]
            timing["transferred"] = now()
            if resume:
                self.load_disk(checkpoint.latest_step_dir(resume), rank)
            timing["rolled_back"] = now()  # the checkpoint load
            self.has_state = True
            if self.ft["snapshot"]:
                tr.snapshot_now()
            return
        sends, recvs = self.transfers(plan, rank)
        mine = plan.sources[rank]
        if sends or recvs:
            self.position.set(S, "transfer")
            try:
                got = comm.run_abortable(lambda: tr.engine.transfer(comm, sends, recvs, S),
                                         "state transfer")
            except CorruptState as e:
                self._report_corrupt(plan, rank, comm, e)
            if got is not None:
                tr.apply_header(tr.engine.install(S, *got))
                self.has_state = True
                timing["bytes_received"] = sum(tr.engine.region(got[0], r).numel()
                                               for _, _, r in recvs)
        timing["transferred"] = now()
        self.position.set(S, "rollback")
        self.injector.fire(S, "rollback")
        if mine["kind"] == "local":
            try:
                tr.apply_header(tr.engine.restore_local(S, rank))
            except CorruptState as e:
                self._report_corrupt(plan, rank, comm, e)
        elif mine["kind"] == "disk":
            self.load_disk(checkpoint.latest_step_dir(mine["dir"]), rank)
            self.has_state = True
        elif mine["kind"] == "init":  # drawn from the seed by build(): the state of step 0
            tr.apply_header({"step": 0})
            self.has_state = True
        elif mine["kind"] == "live" and tr.step != S:
            raise RuntimeError(f"plan says live state at step {S} but rank is at {tr.step}")
        timing["rolled_back"] = now()
        tr.engine.truncate_after(S)  # snapshots of the abandoned timeline must never be resumed
        if S not in tr.engine.local_steps():
            tr.snapshot_now()  # replication restarts from the resume step's snapshot

    def transfers(self, plan: Plan, rank: int):
        """This rank's part of the plan's state transfers: what it sends (its own state to a
        peer, a replica it holds, or its parameters to a rank restored from a sharded replica)
        and which pieces it receives, as ``engine.transfer`` takes them."""
        tr, S, eng = self.trainer, plan.resume_step, self.trainer.engine
        live = tr.step if self.has_state and not tr.dirty else None
        sharded_repl = eng.repl_region  # what a replica holds: all | unique
        sends = []
        for dst, src in sorted(plan.sources.items()):
            if src["kind"] not in ("peer", "replica"):
                continue
            whole = src["kind"] == "peer" or "shared_from" not in src
            region = "all" if whole and (src["kind"] == "peer" or sharded_repl == "all") else "unique"
            if src["holder"] == rank:  # ("owner" differs from dst only under faults.swap_routes)
                sends.append((dst, region, eng.outgoing(src["kind"], src.get("owner", dst), S, live,
                                                        tr.header, region)))
            if src.get("shared_from") == rank:
                sends.append((dst, "shared", eng.outgoing("peer", dst, S, live, tr.header, "shared")))
        mine, recvs = plan.sources[rank], []
        if mine["kind"] == "peer":
            recvs.append((mine["holder"], mine["holder"], "all"))  # its own state: bad = (q, q, S)
        elif mine["kind"] == "replica":
            region = "unique" if "shared_from" in mine else "all"
            recvs.append((mine["holder"], rank, region))
            if "shared_from" in mine:
                q = mine["shared_from"]
                recvs.append((q, q, "shared"))
        return sends, recvs

    def load_disk(self, step_dir: Path, rank: int) -> None:
        """Load ``rank``'s state from a checkpoint step directory. A rank written from a sharded
        replica holds only its unique tensors; its parameters come from a data-parallel peer's
        directory of the same step (``shared_from`` in its header)."""
        tr = self.trainer
        layout = checkpoint.read_meta(step_dir).get("layout")
        if layout is not None and int(layout["dp"]) != self.dims.dp:
            self.load_resharded(step_dir, rank, layout)
            return
        header = checkpoint.read_header(step_dir, rank)
        if header.get("shared_from") is None:
            tr.apply_header(checkpoint.load_rank_state(step_dir, rank, tr.state_dict()))
            return
        state, shared = tr.state_dict(), set(tr.shared_names())
        for q in header["shared_from"]:
            if checkpoint.rank_complete(step_dir, q) and \
                    checkpoint.read_header(step_dir, q).get("shared_from") is None:
                checkpoint.load_rank_state(step_dir, q, {k: v for k, v in state.items() if k in shared})
                break
        else:
            raise RuntimeError(f"{step_dir}: rank {rank}'s parameters are in none of "
                               f"{header['shared_from']}")
        tr.apply_header(checkpoint.load_rank_state(
            step_dir, rank, {k: v for k, v in state.items() if k not in shared}))

    def load_resharded(self, step_dir: Path, rank: int, layout: dict) -> None:
        """Load a checkpoint written at another data-parallel width (an elastic job that shrank
        or regrows): this stage's state from every old data-parallel rank, re-cut for this
        rank's shard (``zero.reshard_state``)."""
        from deadpool.parallel.data.zero import reshard_state

        tr, c = self.trainer, self.dims.coords(rank)
        if (int(layout["tp"]), int(layout["pp"])) != (self.dims.tp, self.dims.pp):
            raise ValueError(f"{step_dir} was written at tp={layout['tp']}, pp={layout['pp']}; "
                             f"only the data-parallel width may change (tp={self.dims.tp}, "
                             f"pp={self.dims.pp})")
        old = ParallelDims(int(layout["dp"]), self.dims.tp, self.dims.pp, self.dims.tp)
        states, header = [], None
        for d in range(old.dp):
            st, hdr = checkpoint.read_rank_state(step_dir, old.rank_of(c["pp"], d, c["tp"]))
            states.append(st)
            header = header or hdr
        new = reshard_state(states, tr.opt.numel, self.dims.dp, c["dp"], tr.opt.shard)
        for name, t in tr.state_dict().items():
            t.copy_(new[name].reshape(t.shape))
        tr.apply_header(header)

    def write_replica(self, root, step: int, owner: int, flat, header: bytes) -> None:
        """Write a held replica of ``owner`` (whose stage may differ from this rank's: its layout
        travels in the header) to disk; a sharded replica (unique region only) names the
        data-parallel peers whose directories hold its parameters."""
        eng = self.trainer.engine
        hdr = decode_header(header)
        layout = StateLayout.from_desc(hdr["layout"])
        if eng.repl_region == "all":
            checkpoint.save_rank_state(root, step, owner, layout.state_dict(flat), hdr)
            return
        split = hdr["layout"]["split"]
        full = torch.zeros(max(layout.nbytes, split + flat.numel()), dtype=torch.uint8)
        full[split:split + flat.numel()].copy_(flat)
        state = {e.name: v for e, v in zip(layout.entries, layout.views(full)) if e.offset >= split}
        hdr["shared_from"] = [q for q in self.dims.state_peers(owner) if q != owner]
        checkpoint.save_rank_state(root, step, owner, state, hdr)

    def _report_corrupt(self, plan: Plan, rank: int, comm: Communicator, e: CorruptState):
        """Tell the planner which copy failed its CRC (never used again), then regroup."""
        self.store.set(Keys(plan.generation).bad_source(rank), json.dumps(
            {"holder": e.holder, "owner": e.owner, "step": e.step}))
        comm.report_error(str(e))
        raise CollectiveError(str(e)) from None

    def checkpoint_and_stop(self, plan: Plan, rank: int) -> None:
        """No spare is left: write the state at the resume step to disk (DCP) and leave.

        Each rank writes its own state; the holder named by the plan writes a dead rank's (from
        its replica, or its own state when it is a data-parallel peer)."""
        tr, S, root = self.trainer, plan.resume_step, self.ft["checkpoint_dir"]
        self.position.set(S, "checkpoint")
        src = plan.sources[rank]
        if src["kind"] == "local":
            tr.apply_header(tr.engine.restore_local(S, rank))
        if src["kind"] in ("live", "local"):  # else this process holds nothing: its holder writes it
            checkpoint.save_rank_state(root, S, rank, tr.state_dict(), tr.header())
        for owner, s in plan.sources.items():
            if s["holder"] == rank and s["kind"] == "peer":
                flat, header, _ = tr.engine.outgoing("peer", owner, S, tr.step, tr.header)
                checkpoint.save_rank_state(root, S, owner, tr.engine.layout.state_dict(flat),
                                           decode_header(header))
            elif s["holder"] == rank and s["kind"] == "replica":
                rep = tr.engine.replica(owner, S)
                self.write_replica(root, S, owner, rep.flat, rep.header)
        self.store.add(Keys(plan.generation).checkpointed_count(), 1)

    def save_and_exit(self) -> int:
        """The coordinator is gone. Write every consistent state this process holds, say how to
        resume, and exit (workers never outlive their coordinator).

        Written: this rank's local snapshots, and the replicas it holds, of the newest protected
        step it knows and anything newer. Every rank keeps its snapshot of the newest protected
        step (snapshot.py's invariant), so some step is complete on disk for every rank unless a
        rank and its buddy were lost too; ``ft.resume_from`` picks the newest complete one.
        """
        tr, root = self.trainer, self.ft["checkpoint_dir"]
        tr.engine.stop_replication()
        if tr.rank is None or not self.has_state or tr.engine is None:
            print(f"[deadpool] slot {self.slot}: the coordinator is gone; holding no rank's state, "
                  "exiting", flush=True)
            return 3
        floor = tr.engine.protected_floor()
        world = self.dims.world_size
        written = []
        for step in tr.engine.local_steps():
            if step >= floor:
                slot = tr.engine.local_slot(step)
                checkpoint.save_rank_state(root, step, tr.rank, tr.engine.layout.state_dict(slot.flat),
                                           decode_header(slot.header))
                checkpoint.write_meta(root, step, world, "coordinator lost")
                written.append(step)
        for owner, steps in tr.engine.replica_steps().items():
            for step in steps:
                rep = tr.engine.replica(owner, step)
                if step >= floor and tr.engine.verify_replica(rep.flat, rep.crc):
                    self.write_replica(root, step, owner, rep.flat, rep.header)
                    checkpoint.write_meta(root, step, world, "coordinator lost")
        print(f"[deadpool] rank {tr.rank}: the coordinator stopped answering; wrote steps {written} "
              f"to {root}. Resume with ft.resume_from={root}", flush=True)
        return 3

    def write_final(self, rank: int) -> None:
        tr = self.trainer
        if tr.engine.persister is not None:  # the process exits without destructors
            tr.engine.persister.close()
        out = self.run_dir / "final"
        out.mkdir(exist_ok=True)
        torch.save({k: v.detach().cpu().clone() for k, v in tr.state_dict().items()},
                   out / f"rank{rank}.pt")
        self.store.set(Keys.final(rank), json.dumps({
            "digest": tr.digest(), "step": tr.step, "slot": self.slot,
            "state_bytes": tr.engine.layout.nbytes,
            # what this rank sends its buddy per snapshot (snapshot.py's regions)
            "replicated_bytes": 0 if tr.engine.repl_region == "none" else
            tr.engine.bounds[tr.engine.repl_region][1] - tr.engine.bounds[tr.engine.repl_region][0],
            "model_params": sum(p.numel() for p in tr.params)}))


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
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps stacks
    torch.set_num_threads(int(cfg.get("torch_num_threads", 1)))
    if cfg.get("deterministic"):
        # bitwise-reproducible kernels; cuBLAS needs a fixed workspace for that (read when its
        # handle is created, so before any CUDA work)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if cfg["device"].startswith("cuda"):  # pragma: no cover - needs CUDA
        torch.cuda.set_device(int(os.environ.get("SLURM_LOCALID", os.environ.get("LOCAL_RANK", 0))))
    code = 0
    try:
        code = Worker(cfg, args.slot, secret).run()
    except Exception as e:  # a crashed rank: say why, tell the coordinator, leave
        traceback.print_exc()
        code = 1
        try:
            store = connect(cfg["_store"]["host"], int(cfg["_store"]["port"]), secret, 5)
            store.set(Keys.crash(args.slot), f"{type(e).__name__}: {e}"[:500])
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    # groups with ops in flight block on destruction; leave without running destructors
    os._exit(code)


if __name__ == "__main__":
    main()
