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

import argparse
import faulthandler
import signal
import json
import os
import pickle
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from deadpool import checkpoint
from deadpool.comm import Aborted, CollectiveError, Communicator
from deadpool.faults import FaultInjector
from deadpool.protocol import Keys, Plan, RankStatus, now
from deadpool.topology import ParallelDims, Topology
from deadpool.trainer import Trainer


def connect(host: str, port: int, timeout_s: float = 60.0):
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                         use_libuv=True)


class Heartbeat(threading.Thread):
    """Writes ``hb/<slot>`` every interval. Stops only with the process (or its SIGSTOP)."""

    def __init__(self, host, port, slot: int, interval_s: float):
        super().__init__(name="heartbeat", daemon=True)
        self.store = connect(host, port)
        self.slot = slot
        self.key = Keys.heartbeat(slot)
        self.interval_s = interval_s

    def run(self):
        fence = Keys.fence(self.slot)
        while True:
            self.store.set(self.key, repr(time.time()))
            # a process the coordinator declared dead must not come back (e.g. after SIGCONT)
            if self.store.check([fence]):
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(self.interval_s)


class Worker:
    def __init__(self, cfg: dict, slot: int):
        self.cfg = cfg
        self.slot = slot
        self.ft = cfg["ft"]
        self.host, self.port = cfg["_store"]["host"], int(cfg["_store"]["port"])
        self.store = connect(self.host, self.port)
        Heartbeat(self.host, self.port, slot, self.ft["heartbeat_interval_s"]).start()
        p = cfg["parallel"]
        self.dims = ParallelDims(p["dp"], p["tp"], p["pp"], p["ranks_per_node"])
        run_dir = Path(cfg["run_dir"])
        (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
        self.injector = FaultInjector(cfg["faults"]["events"], slot, self.store)
        self.trainer = Trainer(cfg, slot, self.injector, run_dir / "metrics" / f"slot{slot}.jsonl",
                               progress=lambda line: self.store.set(Keys.PROGRESS, line))
        self.run_dir = run_dir
        self.backend = "nccl" if cfg["device"].startswith("cuda") else "gloo"
        self.store.set(Keys.spare_ready(slot), repr(time.time()))

    # -- plans ------------------------------------------------------------------------------------
    def wait_plan(self, generation: int) -> Plan | None:
        key = Keys.plan(generation)
        while True:
            if self.store.check([key]):
                return Plan.from_json(self.store.get(key))
            if self.store.check([Keys.JOB_STOP]):
                return None
            time.sleep(0.005)

    def run(self) -> None:
        gen = 0
        plan = self.wait_plan(gen)
        while plan is not None:
            rank = plan.rank_of_slot(self.slot)
            if plan.action == "stop":
                return
            if rank is not None:
                if plan.action == "checkpoint_and_stop":
                    self.checkpoint_and_stop(plan, rank)
                    return
                done = self.run_generation(plan, rank)
                if done:
                    return
            gen = plan.generation + 1
            plan = self.wait_plan(gen)

    def run_generation(self, plan: Plan, rank: int) -> bool:
        """Returns True when the job finished; False when the generation was aborted."""
        tr, keys = self.trainer, Keys(plan.generation)
        timing = {"plan_seen": now()}
        tr.rank, tr.generation = rank, plan.generation
        self.injector.set_rank(rank)
        topo = Topology(self.dims, rank, plan.generation, self.ft["buddy_policy"])
        comm = None
        try:
            comm = Communicator.build(topo, self.store, self.backend, self.ft["collective_poll_s"],
                                      self.ft["pg_timeout_s"], repl_nice=int(self.ft["snapshot_nice"]))
            timing["rebuilt"] = now()
            self.restore(plan, rank, comm, timing)
            timing["ready"] = now()
            self.store.set(keys.timing(rank), json.dumps(timing))
            if self.ft["snapshot"]:
                tr.engine.start_replication(comm, lambda: connect(self.host, self.port),
                                            first_step=tr.step)
            tr.train(comm, on_first_step=lambda: self.store.set(keys.first_step(rank), repr(now())))
            self.store.add(keys.finished_count, 1)
            # wait for the whole job: a late failure elsewhere may still roll this rank back
            while not self.store.check([Keys.JOB_DONE]):
                comm.raise_if_aborted()
                time.sleep(0.005)
            self.write_final(rank)
            return True
        except (Aborted, CollectiveError):
            tr.engine.stop_replication()
            if comm is not None:
                comm.park()
            st = RankStatus(rank, self.slot, tr.step, tr.engine.local_steps(), tr.engine.replica_steps())
            self.store.set(keys.status(rank), st.to_json())
            return False

    def restore(self, plan: Plan, rank: int, comm: Communicator, timing: dict) -> None:
        tr = self.trainer
        S = plan.resume_step
        if plan.generation == 0:
            resume = self.ft["resume_from"]
            if resume:
                step_dir = checkpoint.latest_step_dir(resume)
                header = checkpoint.load_rank_state(step_dir, rank, tr.state_dict())
                tr.apply_header(header)
            tr.snapshot_now()
            timing["transferred"] = timing["rolled_back"] = now()
            return
        # survivors holding a dead rank's replica send it; the spare receives its state
        for owner, src in plan.sources.items():
            if src["kind"] == "replica" and src["holder"] == rank:
                tr.engine.send_replica(comm, owner, S, dst_rank=owner)
        src = plan.sources[rank]
        if src["kind"] == "replica":
            tr.apply_header(tr.engine.recv_state(comm, src["holder"], S))
            timing["bytes_received"] = tr.engine.layout.nbytes
        timing["transferred"] = now()
        if src["kind"] == "local":
            tr.apply_header(tr.engine.restore_local(S))
        elif src["kind"] == "live" and tr.step != S:
            raise RuntimeError(f"plan says live state at step {S} but rank is at {tr.step}")
        timing["rolled_back"] = now()
        tr.engine.truncate_after(S)  # snapshots of the abandoned timeline must never be resumed
        if S not in tr.engine.local_steps():
            tr.snapshot_now()  # replication restarts from the resume step's snapshot

    def checkpoint_and_stop(self, plan: Plan, rank: int) -> None:
        """No spare is left: write the state at the resume step to disk (DCP) and leave."""
        tr, S, root = self.trainer, plan.resume_step, self.ft["checkpoint_dir"]
        src = plan.sources[rank]
        if src["kind"] == "local":
            tr.apply_header(tr.engine.restore_local(S))
        checkpoint.save_rank_state(root, S, rank, tr.state_dict(), tr.header())
        for owner, s in plan.sources.items():
            if s["kind"] == "replica" and s["holder"] == rank:
                rep = tr.engine.replica(owner, S)
                checkpoint.save_rank_state(root, S, owner, tr.engine.layout.state_dict(rep.flat),
                                           pickle.loads(rep.header))
        self.store.add(Keys(plan.generation).checkpointed_count(), 1)

    def write_final(self, rank: int) -> None:
        tr = self.trainer
        out = self.run_dir / "final"
        out.mkdir(exist_ok=True)
        torch.save({k: v.detach().cpu().clone() for k, v in tr.state_dict().items()},
                   out / f"rank{rank}.pt")
        self.store.set(Keys.final(rank), json.dumps({
            "digest": tr.digest(), "step": tr.step, "slot": self.slot,
            "state_bytes": tr.engine.layout.nbytes,
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
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps stacks
    torch.set_num_threads(int(cfg.get("torch_num_threads", 1)))
    if cfg["device"].startswith("cuda"):  # pragma: no cover - needs CUDA
        torch.cuda.set_device(int(os.environ.get("SLURM_LOCALID", os.environ.get("LOCAL_RANK", 0))))
    code = 0
    try:
        Worker(cfg, args.slot).run()
    except Exception as e:  # a crashed rank: say why, tell the coordinator, leave
        traceback.print_exc()
        code = 1
        try:
            store = connect(cfg["_store"]["host"], int(cfg["_store"]["port"]), 5)
            store.set(Keys.crash(args.slot), f"{type(e).__name__}: {e}"[:500])
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    # groups with ops in flight block on destruction; leave without running destructors
    os._exit(code)


if __name__ == "__main__":
    main()
