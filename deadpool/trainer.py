"""The training loop of one rank: step, snapshot, maybe persist.

``Trainer`` holds the model, optimizer, data and snapshot engine across generations; a
generation's communicator is passed to ``train``. The loop reads top to bottom::

    while steps left:  abort? -> forward/backward -> all-reduce grads -> wait for the snapshot copy
                       -> optimizer step -> snapshot (async) -> maybe persist -> metrics
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from pathlib import Path

import torch

from deadpool import checkpoint
from deadpool.comm import Communicator
from deadpool.data import SyntheticCorpus
from deadpool.faults import FaultInjector
from deadpool.model import build_model, build_optimizer
from deadpool.snapshot import SnapshotEngine, state_tensors
from deadpool.watchdog import Progress


class Trainer:
    def __init__(self, cfg: dict, slot: int, injector: FaultInjector, metrics_path: Path,
                 progress=None, position: Progress | None = None):
        self.cfg = cfg
        self.slot = slot
        self.injector = injector
        ft = cfg["ft"]
        self.device = cfg["device"]
        self.model = build_model(cfg["model"], cfg["seed"], self.device)
        self.opt = build_optimizer(self.model, cfg["lr"], cfg["weight_decay"])
        self.params = [p for p in self.model.parameters()]
        self.corpus = SyntheticCorpus(cfg["model"]["vocab_size"], cfg["seed"])
        self.engine = SnapshotEngine(
            state_tensors(self.model, self.opt), interval=ft["snapshot_interval_steps"],
            num_local_slots=ft["num_local_slots"], chunk_bytes=int(ft["replication_chunk_mb"] * 2**20),
            device=self.device, fault_hook=injector.fire,
            background_nice=int(ft["snapshot_nice"]), verify=ft["replica_verify"])
        self.snapshots_on = bool(ft["snapshot"])
        self.persist_every = int(ft["persist_interval_steps"] or 0)
        p = cfg["parallel"]
        if self.persist_every:
            self.engine.persister = checkpoint.AsyncPersister(ft["checkpoint_dir"],
                                                             nice=int(ft["snapshot_nice"]))
            self.engine.persist_world = p["dp"] * p["tp"] * p["pp"]
            if self.snapshots_on and self.persist_every % int(ft["snapshot_interval_steps"]) == 0:
                self.engine.persist_every = self.persist_every  # written from snapshots
        # measurement aid (experiments/bench_runtime.py): snapshot only in alternate blocks of this
        # many steps, so on/off step times are compared inside one run; 0 = every interval
        self.ab_block = int(ft["snapshot_ab_block_steps"])
        self.step = 0
        self.generation = 0
        self.rank: int | None = None
        self.metrics = open(metrics_path, "a", buffering=1)
        self.progress = progress or (lambda line: None)
        # where the training thread is (read by the heartbeat thread for the progress watchdog)
        self.position = position or Progress()

    # -- state ------------------------------------------------------------------------------------
    def header(self) -> dict:
        """JSON-serialisable metadata stored with every snapshot and checkpoint."""
        rng = torch.get_rng_state().numpy().tobytes()
        return {"step": self.step, "data_position": self.step, "generation": self.generation,
                "rng_cpu": base64.b64encode(rng).decode()}

    def apply_header(self, header: dict) -> None:
        self.step = int(header["step"])
        if header.get("rng_cpu") is not None:
            rng = bytearray(base64.b64decode(header["rng_cpu"]))
            torch.set_rng_state(torch.frombuffer(rng, dtype=torch.uint8).clone())

    def snapshot_now(self) -> None:
        """Take (and finish copying) a local snapshot of the current step, e.g. after a restore."""
        self.engine.snapshot(self.step, self.header())
        self.engine.drain()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t for n, t in state_tensors(self.model, self.opt)}

    def digest(self) -> str:
        h = hashlib.sha256()
        for _, t in state_tensors(self.model, self.opt):
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    # -- the loop ---------------------------------------------------------------------------------
    def train(self, comm: Communicator, on_first_step=None) -> None:
        """Train until ``num_steps``. Raises ``Aborted`` / ``CollectiveError`` on a failure."""
        cfg = self.cfg
        dp_rank = comm.topo.coords["dp"]
        interval = self.engine.interval
        if self.engine.persister is not None:
            self.engine.persister.rank = self.rank
        # without per-step snapshots to write from, the training thread persists itself
        persist = self.persist_every if not self.engine.persist_every else 0
        first = True
        at, fire = self.position.set, self.injector.fire
        while self.step < cfg["num_steps"]:
            t0 = time.perf_counter()
            blocked0 = self.engine.blocked_s
            s = self.step
            comm.raise_if_aborted()
            at(s, "forward")
            fire(s, "step_start")
            fire(s, "forward")
            # gradients of an aborted step must not leak into its replay
            self.opt.zero_grad(set_to_none=True)
            x, y = self.corpus.batch(s, dp_rank, cfg["batch_size"], cfg["seq_len"])
            loss = self.model(x.to(self.device), y.to(self.device))
            at(s, "backward")
            fire(s, "backward")
            loss.backward()
            fire(s, "mid_step")
            flat = torch.cat([p.grad.reshape(-1) for p in self.params])  # fresh buffer per step
            at(s, "allreduce")
            comm.allreduce_mean(flat, on_posted=lambda: fire(s, "allreduce"))
            off = 0
            for p in self.params:  # the averaged gradients are views of the reduced buffer
                p.grad = flat[off:off + p.numel()].view_as(p)
                off += p.numel()
            at(s, "optimizer")
            fire(s, "optimizer")
            self.engine.wait_copy()
            self.opt.step()
            self.step += 1
            took = self.snapshots_on and self.step % interval == 0 and (
                not self.ab_block or (self.step // self.ab_block) % 2 == 0)
            if took:
                self.engine.snapshot(self.step, self.header(), abort_check=comm.raise_if_aborted,
                                     on_block=lambda: at(self.step, "snapshot_backpressure"))
            if persist and self.step % persist == 0:
                self.persist(self.step)
            dt = time.perf_counter() - t0
            self.log(loss.item(), dt, self.engine.blocked_s - blocked0, took)
            if first and on_first_step is not None:
                on_first_step()
            first = False

    def log(self, loss: float, step_time_s: float, blocked_s: float, snapshot: bool) -> None:
        rec = {"step": self.step, "rank": self.rank, "slot": self.slot, "generation": self.generation,
               "loss": round(loss, 6), "step_time_s": step_time_s,
               "snapshot_copy_s": self.engine.last_copy_s, "snapshot_blocked_s": blocked_s,
               "replicate_s": self.engine.last_replicate_s, "snapshot": snapshot, "t": time.time()}
        self.metrics.write(json.dumps(rec) + "\n")
        every = int(self.cfg["log_every_steps"])
        if self.rank == 0 and every and (self.step % every == 0 or self.step == self.cfg["num_steps"]):
            line = (f"[rank 0] step {self.step:4d}/{self.cfg['num_steps']}  loss {loss:.4f}  "
                    f"step {step_time_s * 1e3:6.1f} ms  snapshot-blocked {blocked_s * 1e3:5.2f} ms")
            print(line, flush=True)
            self.progress(line)

    def persist(self, step: int) -> None:
        """Write this rank's live state to disk now (snapshots off: nothing else to write from)."""
        p = self.cfg["parallel"]
        checkpoint.save_rank_state(self.cfg["ft"]["checkpoint_dir"], step, self.rank,
                                   self.state_dict(), self.header())
        checkpoint.write_meta(self.cfg["ft"]["checkpoint_dir"], step, p["dp"] * p["tp"] * p["pp"],
                              "periodic")
