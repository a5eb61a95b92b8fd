"""Silent data corruption and loss spikes: a rank finds them, the coordinator rolls the job back.

Silent data corruption (SDC). Data-parallel peers must hold the same parameters after the ZeRO
all-gather. The snapshot engine already hashes each snapshot's shared region (the parameters,
``Slot.crc[0]``, XXH3-64 in the copier thread), so at each snapshot every rank first compares the
checksum of its *previous* snapshot with its data-parallel peers': one all-reduce of ``2 x dp``
int64 over the job's own dp group (a few bytes, no store request), after the copier finished
hashing it (it had a whole step to). Comparing the previous snapshot and not the live state is
what makes a flip visible: with ZeRO the next all-gather overwrites a flipped copy of a peer's
shard, and the gradient computed from it is by then shared by every rank, so no checksum of the
live state could tell; the snapshot keeps the evidence. On a mismatch::

    a strict majority    the ranks off the majority are named; the job is aborted, they are
                         fenced and spares take their ranks (``detected_by: corruption``); every
                         survivor rolls back to its own snapshot of the disputed step (the
                         majority's copy: their parameters there are the agreed ones, and the
                         culprit's optimizer shard comes from its buddy's replica of that step)
    no majority (dp 2)   nobody is named; every rank rolls back to the newest snapshot its group
                         agreed on (or this generation's resume step) and remembers its own
                         checksum of the disputed step. When the replay reaches that snapshot
                         again, a rank whose re-run differs from its remembered checksum names
                         itself and is swapped out as above (the peers' re-runs agree then)

Spikes (``recovery.spike``): the rank that sees a non-finite or outlying loss / gradient norm
names no one; the job rolls back to the newest snapshot at or before that step, whose batch is
added to the skip list every rank reads from then on (``detected_by: spike``).

Reports go to the coordinator as sealed posted keys (``g<g>/integrity/<rank>``, one index per
generation: the coordinator's loop reads one key per turn while nothing is reported), and the
rank waits for the abort rather than snapshot over the evidence. The coordinator (``recovery.rollback``:
``poll``, ``restrict``, ``open_record``, called from ``Coordinator.recover``) caps every survivor's steps at
the resume step it chose, so ``plan.decide`` can only pick that step or an older one.

Partial: tensor-parallel replicated norm weights are not compared across tp (each tp rank's
parameters are hashed as one region); a corruption of this rank's own ZeRO shard of the
parameters is all-gathered to every peer and is invisible to any comparison (as with every
checksum scheme: only a re-run could see it); ``ft.replicate=full`` replicas of a named rank at
the disputed step are marked bad (they hold its corrupt parameters), so the plan takes an older
step.
"""

from __future__ import annotations

import json
import math
import time

import torch

from deadpool.recovery.spike import SpikeRule, add_skip, position
from deadpool.store import reports
from deadpool.store.protocol import Seal, wake_coordinator

SKIPS_KEY = "integrity/skips"  # the job's skip list (sealed JSON), rewritten by the coordinator


def report_key(generation: int, rank: int) -> str:
    return f"g{generation}/integrity/{rank}"


def judge(crcs: list[int | None]) -> tuple[bool, list[int] | None]:
    """``(agree, culprits)`` for the checksums of one data-parallel group (None: unknown, left
    out). ``culprits``: the indices off a strict majority, or None when there is none."""
    known = [c for c in crcs if c is not None]
    if len(set(known)) <= 1:
        return True, []
    top = max(set(known), key=known.count)
    if known.count(top) * 2 <= len(known):
        return False, None
    return False, [i for i, c in enumerate(crcs) if c is not None and c != top]


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


class Guard:
    """A rank's side: arms the ``corrupt`` / ``spike`` faults, compares snapshot checksums,
    applies the spike rule and holds the skip list. Built by the trainer; ``start`` must be
    called at each generation's first step, ``at_snapshot`` before each snapshot of the loop and
    ``after_step`` once the step's loss is on the host."""

    def __init__(self, cfg: dict, injector):
        ft = cfg["ft"]
        spike = ft.get("spike") or {}
        self.rule = SpikeRule.from_cfg(spike)
        # a non-finite gradient norm already skips its step on every rank (skip_nonfinite_steps,
        # the state untouched): the rule sees the norm only where that is off
        self.rule_sees_norm = not bool(cfg.get("skip_nonfinite_steps", True))
        self.skips: list[int] = sorted({int(p) for p in spike.get("skip_batches") or []})
        self.compare = bool(ft.get("integrity_check", True))
        self.seal = getattr(injector, "seal", None) or Seal(None)  # the reports are sealed
        self.prev: int | None = None    # the previous snapshot of this generation (to compare)
        self.agreed: int | None = None  # newest step the group agreed on (or the resume step)
        self.disputed: dict[int, int] = {}  # step -> own shared checksum the peers disputed
        self.flip = self.spike = False  # armed faults (rank/faults.py: corrupt in the step, spike)
        self.check_s = 0.0              # time spent comparing (metrics: integrity_check_s)
        self.pending = None             # (all-reduce result, step): posted before the step's sync
        injector.on_flip = lambda: setattr(self, "flip", True)
        injector.on_spike = lambda: setattr(self, "spike", True)

    def position(self, step: int) -> int:
        return position(step, self.skips)

    def start(self, comm, step: int) -> None:
        """A generation starts at ``step`` (restored or live): nothing of it compared yet."""
        self.prev, self.agreed, self.pending = None, step, None
        if comm.store.check([SKIPS_KEY]):  # one request per rank and generation
            text = self.seal.open(SKIPS_KEY, comm.store.get(SKIPS_KEY))
            for p in json.loads(text) if text else []:
                self.skips = add_skip(self.skips, int(p))

    def apply_header(self, header: dict) -> None:
        self.skips = sorted({int(p) for p in header.get("skip_batches", [])} | set(self.skips))
        self.rule.reset()

    # -- silent data corruption --------------------------------------------------------------------
    def post_compare(self, tr, comm, snapshot_next: bool) -> None:
        """Before the step's host sync, when the step ends in a snapshot: post the dp all-reduce
        of the previous snapshot's checksum, so the step's one sync also completes it (on NCCL a
        sync of its own per snapshot would cost the host a stall). Every rank of a group calls
        it at the same steps."""
        t0 = time.perf_counter()
        self.pending = None
        if snapshot_next and self.compare and self.prev is not None and comm.has("dp"):
            self.pending = (*self._post(tr, comm, self.prev), self.prev)
        self.check_s = time.perf_counter() - t0

    def at_snapshot(self, tr, comm) -> None:
        """After the step's sync: judge the comparison ``post_compare`` posted; apply an armed
        flip to the state about to be snapshotted."""
        t0 = time.perf_counter()
        if self.pending is not None:
            (t, mine, step), self.pending = self.pending, None
            self._judge(tr, comm, step, mine, t.cpu().tolist())
        self.check_s += time.perf_counter() - t0
        if self.flip:
            self.flip = False
            flip_param_bit(tr.opt)
        self.prev = tr.step

    def _post(self, tr, comm, step: int) -> tuple[torch.Tensor, int | None]:
        ranks = comm.group_ranks["dp"]
        mine = own_crc(tr.engine, step)
        t = torch.zeros(len(ranks), 2, dtype=torch.int64)
        if mine is not None:
            t[ranks.index(comm.topo.rank)] = torch.tensor([1, _signed(mine)])
        t = t.to(tr.device)
        comm.allreduce(t, "dp")
        return t, mine

    def _judge(self, tr, comm, step: int, mine: int | None, rows: list) -> None:
        ranks = comm.group_ranks["dp"]
        crcs = [c if ok else None for ok, c in rows]
        agree, culprits = judge(crcs)
        if step in self.disputed:  # the replay of a disputed step: does it differ from itself?
            before = self.disputed.pop(step)
            if mine is not None and _signed(mine) != before:
                self._report(tr, comm, "corruption", step, culprits=[comm.topo.rank], cap=step,
                             why=f"its re-run of step {step} differs from its first run")
            if agree:
                self.agreed = step
                return
        if agree:
            self.agreed = step
            return
        if culprits is None:  # no majority: re-run both from the newest agreed snapshot
            if mine is not None:
                self.disputed[step] = _signed(mine)
            self._report(tr, comm, "corruption", step, culprits=[], cap=self.agreed,
                         why=f"data-parallel peers {ranks} disagree at step {step}, no majority")
        else:
            self._report(tr, comm, "corruption", step, culprits=[ranks[i] for i in culprits],
                         cap=step, why=f"parameters of ranks {[ranks[i] for i in culprits]} "
                                       f"differ from the majority of {ranks} at step {step}")

    # -- spikes --------------------------------------------------------------------------------------
    def after_step(self, tr, comm, s: int, loss: float | None, norm: float | None) -> None:
        """Step ``s`` is done (the live state is ``s + 1``): a spike rolls the job back to a
        snapshot at or before ``s`` and skips the batch ``s`` read."""
        if self.spike:
            self.spike, loss = False, float("nan")
        if norm is not None and not self.rule_sees_norm and not math.isfinite(norm):
            norm = None
        why = self.rule.bad(loss, norm)
        if why is not None:
            self._report(tr, comm, "spike", s, culprits=[], cap=s, why=why,
                         pos=self.position(s))

    def _report(self, tr, comm, kind: str, step: int, *, culprits, cap, why, pos=None) -> None:
        """Tell the coordinator, then wait for the abort (raises ``Aborted``): training on would
        snapshot over the steps the job must roll back to."""
        key = report_key(tr.generation, tr.rank)
        rec = {"kind": kind, "step": step, "culprits": culprits, "cap": cap, "why": why,
               "pos": pos, "rank": tr.rank, "t": time.time()}
        reports.post(comm.store, self.seal, key, json.dumps(rec))
        wake_coordinator(comm.store)
        print(f"[rank {tr.rank}] {kind} at step {step}: {why}", flush=True)
        tr.progress.set(tr.step, "integrity_wait")
        while True:
            comm.raise_if_aborted()
            time.sleep(0.002)


def own_crc(engine, step: int) -> int | None:
    """This rank's checksum of the parameters in its snapshot of ``step`` (once hashed), or
    None when that slot was reused or failed."""
    for slot in engine.slots:
        if slot.step == step:
            slot.copied.wait()
            return slot.crc[0] if slot.step == step else None
    return None


def flip_param_bit(opt) -> None:
    """Fault injection (``corrupt`` in the step): flip the lowest mantissa bit of one parameter
    element this rank holds as a copy of a peer's shard (its own shard is its master weights in
    fp32, which the all-gather would hand to every peer: no comparison could see that)."""
    flat = opt.flat_params
    lo, hi = opt.shard_range if opt.shard else (0, 0)
    i = 0 if lo > 0 or not opt.shard else hi  # the first element outside the owned shard
    if i >= opt.numel:
        i = 0
    with torch.no_grad():
        bits = flat[i:i + 1].view(torch.int16 if flat.element_size() == 2 else torch.int32)
        bits ^= 1
