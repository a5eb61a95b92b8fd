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

Tensor-parallel peers must hold the same bits of the parameters each holds whole (the RMSNorm
weights, ``tensor.layers.tp_replicated``). A rank with tp > 1 also compares, in the same place
and on the same sync, the XXH3-64 of those elements of its previous snapshot's host copy (tiny)
with its tp peers': one all-reduce of ``2 x tp`` int64 over the job's own tp group. Only this
sees a corruption of one tp rank's norm weights that its dp peers share (a corrupt norm gradient
averaged over dp), and it is the only comparison at dp 1. It is judged like dp: a strict
majority names the ranks off it, no majority (tp 2) re-runs and the rank whose re-run differs
names itself. A rank's verdict joins both groups' (``verdict``: one report, a rank named by
either is a culprit). A rank named by a tp majority is resumed from the newest agreed snapshot,
not the disputed one: its dp peers may hold the same corrupt norms, or at dp 1 its buddy's
replica of the disputed step holds them. The coordinator acts on one rank's report (the lowest
rank's, ``rollback.poll``); ranks of other groups may have reported differently (a dp majority
beside a tp dispute): either way the job resumes from a snapshot every group agreed on or from
the majority's, and every reporting rank remembers its checksums, so a rank sent back before the
disputed step names itself when its re-run differs.

Spikes (``recovery.spike``): the rank that sees a non-finite or outlying loss / gradient norm
names no one; the job rolls back to the newest snapshot at or before that step, whose batch is
added to the skip list every rank reads from then on (``detected_by: spike``).

Reports go to the coordinator as sealed posted keys (``g<g>/integrity/<rank>``, one index per
generation: the coordinator's loop reads one key per turn while nothing is reported), and the
rank waits for the abort rather than snapshot over the evidence. The coordinator (``recovery.rollback``:
``poll``, ``restrict``, ``open_record``, called from ``Coordinator.recover``) caps every survivor's steps at
the resume step it chose, so ``plan.decide`` can only pick that step or an older one.

Partial: compared are the shared region over dp (the parameters; the optimizer state too when
it is not sharded) and the tp-replicated norm weights over tp; a ZeRO optimizer shard (nothing
else holds it) and, at dp 1, the tp-sharded parameters have no peer to compare with; a
corruption of this rank's own ZeRO shard of the parameters is all-gathered to every peer and is
invisible to any comparison (as with every checksum scheme: only a re-run could see it);
``ft.replicate=full`` replicas of a named rank at the disputed step are marked bad (they hold
its corrupt parameters), so the plan takes an older step. The coordinator acts on one report;
ranks of different groups may report differently (above), which the tests cover in-process
(tests/deadpool/recovery/test_integrity_tp.py), not with processes.
"""

from __future__ import annotations

import json
import math
import time

import torch

from deadpool.parallel.tensor.layers import tp_replicated
from deadpool.recovery.spike import SpikeRule, add_skip, position
from deadpool.snapshot.layout import checksum
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


GROUP_WHAT = {"dp": "data-parallel peers", "tp": "tensor-parallel peers"}


def verdict(results: dict[str, tuple[list[int], list]], step: int):
    """One rank's verdict on its groups' comparisons of ``step``: ``results`` maps "dp" / "tp" to
    ``(group ranks, [checksum or None per member])``. Returns None when every group agrees, else
    ``(culprits, older, why)``: the global ranks named by any group's strict majority (a rank
    named by either is a culprit), ``older`` (the job must resume from the newest agreed
    snapshot rather than the disputed one: some group had no majority, or a tp group named a
    rank, whose snapshot of ``step`` may not be trusted: see ``Guard._judge``) and the reason."""
    named: set[int] = set()
    older, whys = False, []
    for group, (ranks, crcs) in results.items():
        agree, off = judge(crcs)
        if agree:
            continue
        what = GROUP_WHAT.get(group, f"{group} peers")
        if off is None:
            older = True
            whys.append(f"{what} {ranks} differ at step {step}, no majority")
            continue
        names = [ranks[i] for i in off]
        named.update(names)
        older = older or group != "dp"
        part = "tensor-parallel-replicated parameters" if group == "tp" else "parameters"
        whys.append(f"{what} {ranks} differ at step {step}: {part} of ranks {names} differ "
                    "from the majority")
    if not whys:
        return None
    return sorted(named), older, "; ".join(whys)


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
        self.disputed: dict[int, dict] = {}  # step -> own checksums ({"dp": .., "tp": ..}) disputed
        self.flip = self.spike = False  # armed faults (rank/faults.py: corrupt in the step, spike)
        self.check_s = 0.0              # time spent comparing (metrics: integrity_check_s)
        self.wait_s = 0.0               # of it, waiting for the peers' all-reduce (integrity_wait_s)
        self.pending = None             # ({group: (all-reduce result, own crc, work)}, step): posted
        self._runs = (None, [])         # (optimizer, its tp-replicated element ranges)
        # a corrupt fault's ``where`` (rank/faults.py): a copy of a peer's shard or a norm weight
        injector.on_flip = lambda: setattr(self, "flip",
                                           getattr(injector, "where", "") or FLIP_SHARD)
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
        sync of its own per snapshot would cost the host a stall; on gloo it runs on gloo's
        thread and ``at_snapshot`` waits for it: a wait here would hold this rank for its
        slowest peer, which the next step's collectives wait for anyway). Every rank of a group
        calls it at the same steps."""
        t0 = time.perf_counter()
        self.pending, self.wait_s = None, 0.0
        if snapshot_next and self.compare and self.prev is not None:
            posted = {}
            if comm.has("dp"):
                posted["dp"] = self._post(tr, comm, "dp", own_crc(tr.engine, self.prev))
            runs = self.replicated(tr) if comm.has("tp") else []
            if runs:  # the same on every tp peer: one stage's parameters
                posted["tp"] = self._post(tr, comm, "tp", own_tp_crc(tr.engine, self.prev, runs))
            self.pending = (posted, self.prev) if posted else None
        self.check_s = time.perf_counter() - t0

    def at_snapshot(self, tr, comm) -> None:
        """After the step's sync: judge the comparison ``post_compare`` posted; apply an armed
        flip to the state about to be snapshotted."""
        t0 = time.perf_counter()
        if self.pending is not None:
            (posted, step), self.pending = self.pending, None
            t1 = time.perf_counter()
            for _, _, work in posted.values():
                if work is not None:  # (the slowest peer's arrival: the wait the next step's
                    comm.wait(work)   # collectives would otherwise hold)
            self.wait_s += time.perf_counter() - t1
            self._judge(tr, comm, step, {g: (mine, t.cpu().tolist())
                                         for g, (t, mine, _) in posted.items()})
        self.check_s += time.perf_counter() - t0
        if self.flip:
            where, self.flip = self.flip, False
            flip_param_bit(tr.opt, where, self.replicated(tr))
        self.prev = tr.step

    def replicated(self, tr) -> list[tuple[int, int]]:
        """The element ranges of ``tr.opt.flat_params`` every tp rank holds whole (cached)."""
        if self._runs[0] is not tr.opt:
            self._runs = (tr.opt, replicated_runs(tr.stage, tr.opt))
        return self._runs[1]

    def _post(self, tr, comm, group: str, mine: int | None):
        """(the all-reduced rows, own checksum, the work still to wait for or None)"""
        ranks = comm.group_ranks[group]
        t = torch.zeros(len(ranks), 2, dtype=torch.int64)
        if mine is not None:
            t[ranks.index(comm.topo.rank)] = torch.tensor([1, _signed(mine)])
        t = t.to(tr.device)
        work = comm.allreduce(t, group, wait=False)
        if comm.stream_ordered:  # (NCCL: the stream waits, the step's sync completes it)
            comm.wait(work)
            work = None
        return t, mine, work

    def _judge(self, tr, comm, step: int, got: dict) -> None:
        """``got``: group -> (own checksum, all-reduced rows). One report at most."""
        mine = {g: _signed(m) for g, (m, _) in got.items() if m is not None}
        found = verdict({g: (comm.group_ranks[g], [c if ok else None for ok, c in rows])
                         for g, (_, rows) in got.items()}, step)
        if step in self.disputed:  # the replay of a disputed step: does it differ from itself?
            before = self.disputed.pop(step)
            if any(g in mine and mine[g] != c for g, c in before.items()):
                self._report(tr, comm, "corruption", step, culprits=[comm.topo.rank], cap=step,
                             why=f"its re-run of step {step} differs from its first run")
        if found is None:
            self.agreed = step
            return
        # remembered whatever the verdict: the coordinator acts on one rank's report, which may
        # send this rank back before ``step`` too (a re-run that differs then names it)
        self.disputed[step] = mine
        culprits, older, why = found
        # a data-parallel majority: resume from the disputed step (the majority's parameters, the
        # culprit's optimizer shard from its buddy). Otherwise from the newest agreed snapshot:
        # with no majority nobody knows which copy is right, and a rank a tp group names may
        # have its dp peers corrupt alike (a corrupt norm gradient is averaged over dp) or no dp
        # peer at all (its replica of ``step`` would hold its corrupt parameters)
        self._report(tr, comm, "corruption", step, culprits=culprits,
                     cap=self.agreed if older else step, why=why)

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
    slot = _copied(engine, step)
    return None if slot is None else slot.crc[0]


def _copied(engine, step: int):
    """The snapshot slot of ``step`` once its copier is done with it, or None when there is none
    or it was reused meanwhile."""
    for slot in engine.slots:
        if slot.step == step:
            slot.copied.wait()
            return slot if slot.step == step else None
    return None


def own_tp_crc(engine, step: int, runs: list[tuple[int, int]]) -> int | None:
    """This rank's checksum of the tensor-parallel-replicated elements (``runs`` of the flat
    parameters) in its snapshot of ``step`` (host copy, once copied), or None as ``own_crc``."""
    slot = _copied(engine, step)
    if slot is None:
        return None
    e = next(e for e in engine.layout.entries if e.name == "params")
    size = e.dtype.itemsize
    return checksum(torch.cat([slot.flat[e.offset + a * size:e.offset + b * size] for a, b in runs]))


def replicated_runs(stage, opt) -> list[tuple[int, int]]:
    """``[(a, b), ...]``: the element ranges of ``opt.flat_params`` held by parameters every tp
    rank holds whole (``tensor.layers.tp_replicated``: the norms), adjacent ones merged."""
    at = {id(p): off for p, off in zip(opt.params, opt.offsets)}
    runs: list[tuple[int, int]] = []
    for a, b in sorted((at[id(p)], at[id(p)] + p.numel()) for n, p in stage.named_parameters()
                       if tp_replicated(n) and id(p) in at):
        if runs and runs[-1][1] == a:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((a, b))
    return runs


FLIP_SHARD, FLIP_TP = "shard_copy", "tp_replicated"  # a ``corrupt`` fault's ``where``


def flip_param_bit(opt, where: str = FLIP_SHARD, runs=()) -> None:
    """Fault injection (``corrupt`` in the step): flip the lowest mantissa bit of one parameter
    element. ``shard_copy``: one this rank holds as a copy of a peer's shard (its own shard is
    its master weights in fp32, which the all-gather would hand to every peer: no comparison
    could see that). ``tp_replicated``: one of a tp-replicated parameter (``runs``, a norm), out
    of the owned shard when it can be (at dp 1 its master weight: the flip stays), which only
    its tensor-parallel peers can tell from theirs."""
    flat = opt.flat_params
    lo, hi = opt.shard_range if opt.shard else (0, 0)
    if where == FLIP_TP:
        if not runs:
            raise ValueError("corrupt where=tp_replicated: this stage has no replicated parameter")
        i = next((j for a, b in runs for j in (a, max(a, hi)) if j < b and not lo <= j < hi),
                 runs[0][0])
    else:
        i = 0 if lo > 0 or not opt.shard else hi  # the first element outside the owned shard
        if i >= opt.numel:
            i = 0
    with torch.no_grad():
        bits = flat[i:i + 1].view(torch.int16 if flat.element_size() == 2 else torch.int32)
        bits ^= 1
