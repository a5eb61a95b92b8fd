"""The training loop of one rank: step, snapshot, maybe persist.

``Trainer`` holds the rank's pipeline stage (its tensor-parallel shard of some layers), the ZeRO-1
optimizer, the data and the snapshot engine across generations; a generation's communicator is
passed to ``train``. They are built for the rank's (pp, dp, tp) coordinates by ``build`` (a spare
builds when it is given a rank; the time is part of the recovery breakdown). The loop reads top to
bottom::

    while steps left:  abort? -> micro-batches through the pipeline (1F1B: forward/backward, TP
                       all-reduces inside; gradient buckets reduced over dp as backward fills
                       them) -> wait for the last buckets -> global gradient norm, clip
                       -> wait for the snapshot copy -> AdamW on the shard at lr_at(step)
                       + all-gather params (a non-finite norm skips this) -> host sync
                       (NCCL: collectives were queued on the stream) -> snapshot (async)
                       -> maybe persist -> metrics

With ``parallel.overlap_param_gather`` the all-gather is only posted; the next forward's
pre-hooks wait for each bucket before its first use, and ``settle_params`` waits for the rest
before a snapshot, a checkpoint, an evaluation or the end of training (parallel/data/zero.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path

import torch

from deadpool import checkpoint
from deadpool.checkpoint import rank_state
from deadpool.data import build_data
from deadpool.export.hf_import import initial_weights
from deadpool.parallel.compile import compile_stage
from deadpool.parallel.data.reduce_scatter import use_reduce_scatter
from deadpool.parallel.data.zero import ZeroOptimizer
from deadpool.parallel.grad_norm import clip_, global_grad_norm
from deadpool.parallel.pipeline.schedule import host_scalar, run_1f1b
from deadpool.parallel.stage import build_stage
from deadpool.parallel.tensor.layers import tp_replicated
from deadpool.rank import precision
from deadpool.rank.comm import Communicator
from deadpool.rank.evaluate import evaluate
from deadpool.rank.faults import FaultInjector
from deadpool.rank.lr_schedule import lr_at
from deadpool.rank.mfu import Throughput, progress_lines
from deadpool.rank.straggler import ComputeClock
from deadpool.rank.strategies import decide_persist_interval, strategy_of
from deadpool.rank.tensorboard_log import board
from deadpool.rank.watchdog import Progress
from deadpool.recovery.integrity import Guard
from deadpool.recovery.pause import hold_at_pause
from deadpool.settings import num_microbatches
from deadpool.snapshot import SnapshotEngine, SnapshotSchedule
from deadpool.snapshot.layout import checksum
from deadpool.store.rounds import rounds_for
from deadpool.topology import ParallelDims


def batch_indices(global_dp: int, dp: int, dp_rank: int) -> list[int]:
    """The global batch indices data-parallel rank ``dp_rank`` of ``dp`` computes each step."""
    return [i for i in range(global_dp) if i % dp == dp_rank]


class Trainer:
    def __init__(self, cfg: dict, slot: int, injector: FaultInjector, metrics_path: Path,
                 publish_progress=None, progress: Progress | None = None):
        self.cfg = cfg
        self.slot = slot
        self.injector = injector
        self.device = cfg["device"]
        self.corpus = build_data(cfg)  # data=synthetic | tokens (deadpool/data)
        self.eval_every = int(cfg.get("eval_every_steps") or 0)
        self._val_loss: float | None = None  # this step's validation loss (last stage)
        self._batch_digests: dict[str, int] = {}  # this step's batches (see batch)
        self.board = board(cfg, slot)  # logging.tensorboard (else a no-op)
        self.throughput = Throughput(cfg)  # tokens/s/GPU, MFU, compiles (metrics)
        self.snapshots_on = bool(cfg["ft"]["snapshot"])
        # disk checkpoints every N steps; 'auto' (ft=checkpoint_restart): Young/Daly, decided
        # after a first measured checkpoint (see persist_due / _decide_interval)
        every = cfg["ft"]["persist_interval_steps"]
        self.persist_auto = every == "auto"
        self.persist_every = 0 if self.persist_auto else int(every or 0)
        self._ckpt_buf: torch.Tensor | None = None  # host staging copy for async checkpoints
        self._proposal: dict | None = None  # this rank's Young/Daly measurements (_decide_interval)
        self.microbatches = num_microbatches(cfg)
        # measurement aid (experiments/bench_runtime.py): snapshot only in alternate blocks of this
        # many steps, so on/off step times are compared inside one run; 0 = every interval
        self.ab_block = int(cfg["ft"]["snapshot_ab_block_steps"])
        ft = cfg["ft"]
        self.strategy = strategy_of(ft)
        # which steps are snapshotted (widened when the snapshot cycle outlasts the steps between)
        self.schedule = SnapshotSchedule(
            int(ft["snapshot_interval_steps"]), int(ft.get("max_snapshot_lag_steps", 8)),
            every=int(ft.get("snapshot_adapt_every_steps", 16)),
            adaptive=bool(ft.get("snapshot_adaptive", True)) and not self.ab_block,
            overhead_target=ft.get("snapshot_overhead_target"),
            probe_every=int(ft.get("snapshot_probe_every_steps", 64)))
        self._cycle_seen = -1  # the engine's done_step last fed to the schedule
        self.coords: dict | None = None  # what the stage and optimizer are built for
        self.dims: ParallelDims | None = None  # the layout they are built in
        self.drawn = False  # their values are the seed's initial state (else undrawn)
        self.stage = self.opt = self.engine = None
        self.params: list[torch.nn.Parameter] = []
        self.step = 0
        self._updating = False  # inside the optimizer step (see train and dirty)
        self.generation = 0
        self.rank: int | None = None
        self.dtype = precision.param_dtype(cfg)
        precision.apply_tf32(cfg)
        self.grad_clip = None if cfg.get("grad_clip") is None else float(cfg["grad_clip"])
        self.skip_nonfinite = bool(cfg.get("skip_nonfinite_steps", True))
        self.skipped_steps = 0  # steps whose update a non-finite gradient norm skipped (state)
        self.norm_runs: list[tuple[int, int]] = []  # what this rank counts of the norm (build)
        self.build_phases: dict[str, float] = {}
        self.metrics = open(metrics_path, "a", buffering=1)
        self.publish_progress = publish_progress or (lambda line: None)
        # where the training thread is (read by the heartbeat thread for the progress watchdog)
        self.progress = progress or Progress()
        self.guard = Guard(cfg, injector)  # corruption and spike checks, skipped batches
        self.clock = ComputeClock.of(cfg, self.progress)  # own compute per step (straggler.py)

    def build(self, dims: ParallelDims, rank: int, init: bool = True) -> float:
        """Build the stage, optimizer and snapshot engine of ``rank``'s coordinates (a no-op if
        already built for them). Returns the seconds it took (0 when nothing was built).
        ``init=False`` leaves the values undrawn: a spare's state arrives by transfer."""
        coords = dims.coords(rank)
        if coords == self.coords and dims == self.dims and (self.drawn or not init):
            return 0.0
        t0 = time.perf_counter()
        cfg, ft, v = self.cfg, self.cfg["ft"], dims.virtual_stages  # v: interleaved 1F1B chunks
        if self.engine is not None:
            self.engine.close()
        self.stage = build_stage(cfg["model"], cfg["seed"], pp_rank=coords["pp"], pp=dims.pp,
                                 tp_rank=coords["tp"], tp=dims.tp, device=self.device, init=init,
                                 activation_checkpointing=cfg.get("activation_checkpointing", "none"),
                                 weights=initial_weights(cfg["model"]) if init else None, virtual_stages=v)
        # bf16: the model (parameters and rotary tables) is cast before the optimizer copies
        # the fp32 master weights from it, as Megatron does (so a spare's and a peer's initial
        # master shard are the same function of the seed)
        self.stage = self.stage.to(self.dtype)
        compile_stage(self.stage, cfg, warm=not init and self.coords is None)  # compile=true
        self.params = list(self.stage.parameters())
        t_stage = time.perf_counter()
        par = cfg["parallel"]
        # Weight decay on matrices only (linear layers and the embedding), none on the RMSNorm
        # weights (1-D): decaying a norm gain pulls it toward 0, i.e. shrinks the activations,
        # which is not regularisation. The embedding is decayed, as in Megatron's and LLaMA's
        # recipes and nanoGPT's (every 2-D tensor): untied from the head, it is a matrix like
        # any other; the known cost, rows of rare tokens shrinking between their updates, is
        # the one those recipes accept.
        self.opt = ZeroOptimizer(self.params, dp_size=dims.dp, dp_rank=coords["dp"], lr=cfg["lr"],
                                 weight_decay=cfg["weight_decay"], shard=dims.optimizer_sharded,
                                 adamw=cfg.get("adamw", "fused"),
                                 bucket_bytes=int(float(par.get("bucket_mb", 25)) * 2**20),
                                 first_bucket_bytes=int(float(par.get("first_bucket_mb", 1)) * 2**20),
                                 decays=lambda p: p.ndim >= 2,
                                 grad_reduce_dtype=precision.grad_reduce_dtype(cfg),
                                 overlap_param_gather=bool(par.get("overlap_param_gather", False)),
                                 shard_grads=dims.zero >= 2,  # ZeRO-2 (parallel/data/grad_shard.py)
                                 reduce_scatter=use_reduce_scatter(  # NCCL: per bucket group
                                     par.get("grad_reduce"), cfg.get("backend"), cfg["device"],
                                     dims.zero))
        self.opt.hook_forward(self.stage)  # waits for each parameter bucket before first use
        # the global gradient norm counts a tensor-parallel-replicated parameter on tp rank 0 only
        once = {id(p) for n, p in self.stage.named_parameters()
                if coords["tp"] > 0 and tp_replicated(n)}
        self.norm_runs = self.opt.owned_runs(lambda p: id(p) not in once)
        state = self.opt.state_tensors()
        t_opt = time.perf_counter()
        # shared tensors (equal across the data-parallel group) first: see snapshot/layout.py.
        # With dp == 1 nothing is shared: every byte is unique to the rank. Under bf16 with ZeRO
        # the bf16 parameters are shared and the fp32 master shard is unique (parallel/data/zero.py).
        shared = [(n, t) for n, t, sh in state if sh and dims.dp > 1]
        unique = [(n, t) for n, t, sh in state if not (sh and dims.dp > 1)]
        self.engine = SnapshotEngine(
            shared + unique, num_local_slots=ft["num_local_slots"],
            chunk_bytes=int(ft["replication_chunk_mb"] * 2**20),
            device=self.device, fault_hook=self.injector.fire,
            background_nice=int(ft["snapshot_nice"]), verify=ft["replica_verify"],
            num_shared=len(shared), replicate=ft.get("replicate", "unique"),
            allocate_slots=self.snapshots_on,
            max_bytes_per_s=(float(ft["replication_max_mb_per_s"]) * 2**20
                             if ft.get("replication_max_mb_per_s") else None))
        if self.persist_every or self.persist_auto:
            self.engine.persister = checkpoint.AsyncPersister(ft["checkpoint_dir"],
                                                             nice=int(ft["snapshot_nice"]))
            self.engine.persist_world = dims.world_size
            self.engine.persister.layout = dims.layout
            self.engine.persister.unique_state(self.shared_names(), ft.get("keep_checkpoints", 2))
            if self.snapshots_on:
                self.engine.persist_every = self.persist_every  # written from snapshots
        self.coords = coords
        self.dims = dims
        self.drawn = init
        t1 = time.perf_counter()
        # where a build's seconds go (the worker logs them at start-up): the stage drawn on the
        # host and moved, the optimizer's master/moment buffers, the snapshot buffers (pinned)
        self.build_phases = {"stage": t_stage - t0, "optimizer": t_opt - t_stage,
                             "snapshot_buffers": t1 - t_opt}
        return t1 - t0

    # -- state ------------------------------------------------------------------------------------
    @property
    def dirty(self) -> bool:
        """The live state is torn and must not be resumed from: inside the optimizer step (the
        shard updated, the all-gather maybe cut by an abort), or, with overlap_param_gather, until
        the last parameter bucket arrived (next forward) and a host sync saw it complete."""
        return self._updating or (self.opt is not None and self.opt.param_gather_pending)

    def settle_params(self, comm) -> None:
        """Before anything but the forward reads the parameters (snapshot, checkpoint, evaluation,
        the end): wait for the overlapped all-gather (abortable) and, stream-ordered, confirm it
        with a host sync. A no-op when nothing is pending."""
        if self.opt.param_gather_pending:
            self.opt.wait_param_gather()
            comm.sync()
            self.opt.synced()

    def snapshot_due(self, step: int) -> bool:
        """Every rank snapshots the same steps: the agreed interval, and the persist steps."""
        return self.snapshots_on and (
            (self.schedule.due(step) and (not self.ab_block or (step // self.ab_block) % 2 == 0))
            or bool(self.engine.persist_every and step % self.engine.persist_every == 0))

    def header(self) -> dict:
        """JSON-serialisable metadata stored with every snapshot and checkpoint."""
        return {"step": self.step, "rank": self.rank, "skip_batches": self.guard.skips,
                "data_position": self.guard.position(self.step),
                "generation": self.generation,
                "skipped_steps": self.skipped_steps,
                "rng_cpu": checkpoint.encode_rng_state(torch.get_rng_state())}

    def apply_header(self, header: dict) -> None:
        """Called whenever the live state was just loaded (rollback, transfer, disk)."""
        self.step = int(header["step"])
        self.skipped_steps = int(header.get("skipped_steps", 0))
        self.guard.apply_header(header)
        self._updating = False
        if self.opt is not None:  # the buckets in flight belong to the replaced state
            self.opt.abandon_param_gather()
        if header.get("rng_cpu") is not None:
            torch.set_rng_state(checkpoint.decode_rng_state(header["rng_cpu"]))

    def snapshot_now(self) -> None:
        """Take (and finish copying) a local snapshot of the current step, e.g. after a restore."""
        self.engine.snapshot(self.step, self.header())
        self.engine.drain()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.engine.layout.state_dict_live(self.engine.tensors)

    def shared_names(self) -> list[str]:
        """Names of the state tensors a data-parallel peer holds identically (parameters)."""
        a, b = self.engine.bounds["shared"]
        return [e.name for e in self.engine.layout.entries if e.offset < b]

    def digest(self) -> str:
        h = hashlib.sha256()
        for t in self.engine.tensors:
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def batch(self, step: int, batches: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's inputs and targets of ``step``: the batches of data-parallel ranks
        ``batches`` (one, unless an elastic job runs narrower than its global batch)."""
        cfg = self.cfg
        pos = self.guard.position(step)  # the step's data position (batches a spike skipped)
        parts = [self.corpus.batch(pos, i, cfg["batch_size"], cfg["seq_len"]) for i in batches]
        # which sequences made the step (metrics: batch index -> XXH3 of its input tokens), so a
        # run can be checked to draw the same samples at another width or after a recovery
        self._batch_digests = {str(i): checksum(x.reshape(-1).view(torch.uint8)) for i, (x, _) in
                               zip(batches, parts)}
        if len(parts) == 1:
            return parts[0]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

    # -- the loop ---------------------------------------------------------------------------------
    def train(self, comm: Communicator, on_first_step=None) -> None:
        """Train until ``num_steps``. Raises ``Aborted`` / ``CollectiveError`` on a failure."""
        cfg = self.cfg
        dp_rank, dp = comm.topo.coords["dp"], comm.topo.dims.dp
        # the global batch is parallel.global_dp ranks' batches (default: dp). An elastic job that
        # lost a data-parallel replica keeps it: rank d computes the batches of every d' = d mod
        # dp, and the summed gradients are divided by global_dp (same sequences, same mean).
        global_dp = int(cfg["parallel"].get("global_dp") or dp)
        batches = batch_indices(global_dp, dp, dp_rank)
        self.opt.grad_div = global_dp
        self.schedule.start(rounds_for(comm, lambda: comm.store))
        self.guard.start(comm, self.step)
        if self.engine.persister is not None:
            self.engine.persister.rank = self.rank
        # without per-step snapshots to write from, the training thread persists itself
        persist = not self.engine.persist_every
        first = True
        at, fire = self.progress.set, self.injector.fire
        while self.step < cfg["num_steps"]:
            t0 = time.perf_counter()
            blocked0 = self.engine.blocked_s
            busy = self.engine.slows_step()  # snapshot work that can slow this step
            s = self.step
            comm.raise_if_aborted()
            hold_at_pause(self, comm)  # a migration: every rank holds at one step (recovery.pause)
            at(s, "forward")
            fire(s, "step_start")
            self.clock.begin(comm, getattr(self.injector, "delay_s", 0.0))  # (straggler.py)
            # gradients of an aborted step must not leak into its replay; gradient buckets are
            # reduced over dp from backward hooks as soon as they are complete
            self.opt.begin_step(comm, self.microbatches * len(batches))
            x, y = self.batch(s, batches)

            def phase(name, s=s):  # every micro-batch op of the schedule
                at(s, name)
                fire(s, name)

            loss = run_1f1b(self.stage, comm, x.to(self.device), y.to(self.device),
                            self.microbatches * len(batches), hook=phase,
                            loss_div=self.microbatches if len(batches) > 1 else None,
                            act_dtype=self.dtype)
            # parameters the forward did not read: their buckets must land before the step
            self.opt.wait_param_gather()
            fire(s, "mid_step")
            at(s, "allreduce")
            self.opt.reduce_grads(comm, on_posted=lambda: fire(s, "allreduce"))
            at(s, "optimizer")
            fire(s, "optimizer")
            lr, norm, skip = lr_at(s, cfg), None, False
            if self.grad_clip is not None:  # gradients only: the state is still step s's
                norm = global_grad_norm(self.opt.grad_shard, self.norm_runs, comm)
                skip = self.skip_nonfinite and not math.isfinite(norm)  # same bits on every rank
                clip_(self.opt.grad_shard, self.grad_clip, norm)
            self.engine.wait_copy()
            # from here until the step ends the live state is torn (the shard is updated, the
            # parameter all-gather may be cut by an abort): it must not be resumed from; with
            # overlap_param_gather until the next forward has received every bucket (dirty)
            self._updating = True
            if skip:
                self.skipped_steps += 1
            else:
                self.opt.step(comm, lr=lr, on_updated=lambda: fire(s, "param_gather"))
            # NCCL: the step's host sync (collectives were ordered on the stream); it raises
            # Aborted if the generation was aborted before the step was seen complete, so a
            # gather cut by an abort never counts as clean. gloo: nothing to wait for.
            self.guard.post_compare(self, comm, self.snapshot_due(self.step + 1))  # on the sync
            comm.sync()
            self.opt.synced()
            self.step += 1
            self._updating = False
            loss = None if loss is None else host_scalar(loss)
            self.guard.after_step(self, comm, s, loss, norm)  # a spike: roll back, skip
            took = self.snapshot_due(self.step)
            if took:
                self.settle_params(comm)  # the snapshot copies the parameters
                self.guard.at_snapshot(self, comm)  # peers compare the previous one
                self.engine.snapshot(self.step, self.header(), abort_check=comm.raise_if_aborted,
                                     on_block=lambda: at(self.step, "snapshot_backpressure"))
                if self.strategy.sync_snapshot:  # on the critical path: copied and replicated now
                    at(self.step, "snapshot_sync")
                    self.engine.wait_done(self.step, comm.raise_if_aborted)
            ckpt_s = None
            if persist and self.persist_due(self.step):
                t_ckpt = time.perf_counter()
                at(self.step, "checkpoint")
                self.settle_params(comm)
                self.persist(self.step, wait=self.persist_auto and not self.persist_every)
                ckpt_s = time.perf_counter() - t_ckpt
                if self.persist_auto and not self.persist_every:
                    self._decide_interval(comm, ckpt_s, t_ckpt - t0)
            self.schedule.end_of_step(self.step, comm.raise_if_aborted)
            dt = time.perf_counter() - t0
            self.clock.end(self.step)
            if self.eval_every and self.step % self.eval_every == 0:  # not in the step's time
                at(self.step, "eval")
                self.settle_params(comm)
                self._val_loss = evaluate(self, comm)  # validation loss (deadpool/rank/evaluate.py)
            cycle = None
            if self.engine.done_step != self._cycle_seen:
                self._cycle_seen, cycle = self.engine.done_step, self.engine.last_cycle_s
            self.schedule.observe(dt, busy, cycle, step=self.step,
                                  pending_s=self.engine.pending_cycle_s())
            self.record_metrics(comm, loss, dt, self.engine.blocked_s - blocked0, took, ckpt_s,
                                lr=lr, grad_norm=norm)
            if first and on_first_step is not None:
                on_first_step()
            first = False
        self.settle_params(comm)  # the final state is read once training returns

    def record_metrics(self, comm, loss: float | None, step_time_s: float, blocked_s: float,
                       snapshot: bool, checkpoint_s: float | None = None, lr: float | None = None,
                       grad_norm: float | None = None) -> None:
        """One metrics record per rank and step; the loss exists on the last pipeline stage (its
        data-parallel rank's micro-batch mean). ``lr``: the rate of the step just taken;
        ``grad_norm``: its global gradient norm before clipping (None without ``grad_clip``, or
        when not finite: strict JSON has no inf/nan);
        ``skipped_steps``: steps so far whose update a non-finite norm skipped. Rank (last
        stage, dp 0, tp 0) prints progress."""
        rec = {"step": self.step, "rank": self.rank, "slot": self.slot, "pid": os.getpid(),
               "generation": self.generation, "t": time.time(),
               "loss": None if loss is None else round(float(loss), 6), "step_time_s": step_time_s,
               "compute_s": self.clock.last_s,  # the step less its waits on peers (straggler.py)
               "lr": lr, "skipped_steps": self.skipped_steps,
               "grad_norm": grad_norm if grad_norm is None or math.isfinite(grad_norm) else None,
               "snapshot_copy_s": self.engine.last_copy_s, "snapshot_blocked_s": blocked_s,
               "replicate_s": self.engine.last_replicate_s, "snapshot": snapshot,
               # ZeRO-1's parameter all-gather of this step, on the critical path (parallel/data/zero.py)
               "param_gather_s": self.opt.last_gather_s,
               # steps since the newest snapshot this rank has copied and replicated; the job's
               # protection lag at a step is the largest over its ranks
               "protection_lag_steps": (self.step - self.engine.done_step
                                        if self.snapshots_on and self.engine.done_step >= 0 else None),
               "snapshot_interval": self.schedule.interval if self.snapshots_on else None,
               # a disk checkpoint taken by the training thread at this step: its time on the
               # critical path (async: the host copy, and waiting for the previous write)
               "checkpoint_s": checkpoint_s,
               # the Young/Daly probe's measurements and this rank's proposed interval (once)
               "checkpoint_interval_proposal": self._proposal,
               "val_loss": self._val_loss, "integrity_check_s": self.guard.check_s,
               "integrity_wait_s": self.guard.wait_s,  # of the check, waiting for its peers
               "batch_digests": self._batch_digests, "skipped_batches": self.guard.skips,
               **self.throughput.fields(step_time_s, comm.topo.dims.world_size)}
        self._proposal = self._val_loss = None  # recorded once, in their step
        self.metrics.write(json.dumps(rec) + "\n")
        dims = comm.topo.dims
        reporter = self.rank == dims.rank_of(dims.pp - 1, 0, 0)
        self.board.write(rec, reporter)
        every = int(self.cfg["log_every_steps"])
        for line in progress_lines(rec, self.cfg["num_steps"], every) if reporter else ():
            print(line, flush=True)  # val loss; every `every` steps the progress line
            self.publish_progress(line)

    # -- disk checkpoints without snapshots (ft=checkpoint_restart, or persist with snapshots off) --
    YOUNG_DALY_PROBE_STEP = 2  # 'auto': the first checkpoint, measured (step 1 includes warm-up)

    def persist_due(self, step: int) -> bool:
        if self.persist_every:
            return step % self.persist_every == 0
        return self.persist_auto and step == self.YOUNG_DALY_PROBE_STEP

    def persist(self, step: int, wait: bool = False) -> None:
        """This rank's live state to disk as the checkpoint of ``step`` (``rank_state.save_live``;
        ``ft.persist_async`` writes off this thread). ``wait``: until on disk (to measure it)."""
        ft = self.cfg["ft"]
        rank_state.save_live(self, ft["checkpoint_dir"], step, self.dims,
                             asynchronous=ft.get("persist_async", True), wait=wait)

    def _decide_interval(self, comm, ckpt_s: float, step_s: float) -> None:
        decide_persist_interval(self, comm, ckpt_s, step_s)  # Young/Daly (strategies.py)
