"""In-place elastic: shrink when no spare is left, and regrow, keeping the survivors' processes.

``ft.on_no_spare=elastic`` (and ``ft=elastic``) with ``ft.elastic_mode=in_place``, the default.
A shrink is a recovery without a spare, done in two generations by the same processes::

    gen g     rank 1 of dp4 dies, no spare left            ranks 0 1 2 3   (rank 1's shard is
                                                                            held by its buddy)
    gen g+1   "checkpoint": each process with a rank writes the state of the resume step S to
              ft.checkpoint_dir/step_S (its own, or the replica it holds of the dead rank), and
              waits; nothing exits
    gen g+2   "train" at dp3 (plan.layout), global batch kept (parallel.global_dp = 4): every
              survivor rebuilds its stage and groups at the new width and loads step S re-cut
              for its new ZeRO-1 shard (rank_state: the same loader a relaunch uses)

    old rank (dp, slot)      0 (0, s0)   1 (1, s1) dead   2 (2, s2)   3 (3, s3)
    new rank                 0 (s0)      -                1 (s2)      2 (s3)

A survivor keeps its tensor- and pipeline-parallel coordinates (its stage); only its data-
parallel index is compacted. In dp x tp x pp the whole data-parallel replica of a dead rank is
dropped: its live processes become warm spares of the narrower job (a later failure is hot-
swapped again). A regrow (``ft.elastic_regrow_after_s`` after the shrink, standing in for a
repaired node joining) asks the launcher for the processes the full width lacks, keeps training
while they import torch and build their stage, and only then regroups the same way: "checkpoint"
from live state, then "train" at full width with the new processes as the missing ranks.

The state crosses one disk checkpoint (what the relaunch path writes and reads too): exact re-cut
with the tested loader, and the checkpoint is complete on disk if anything else fails. What in
place saves against a relaunch is everything else: no process exits or starts at the shrink (no
interpreter, torch import, store connection, model build; on GPUs no CUDA context or NCCL
bootstrap), and the regrow's new processes start behind training. A process that dies while
the checkpoint is written is planned around from what the others reported
(``fallbacks._regroup_in_place``); a failure after it (in the rebuild or the load at the new
width) shrinks again, from that checkpoint. Partial: rank -> node placement after a shrink follows
the new rank numbers, not the slots' nodes (buddies may share a physical node until the next
regrow).
"""

from __future__ import annotations

import time
from pathlib import Path

from deadpool import checkpoint
from deadpool.policies import max_replicas
from deadpool.recovery.disk import from_disk, write_state
from deadpool.store.protocol import Keys, Plan, Source
from deadpool.store.reports import Reports
from deadpool.topology import ParallelDims


def layout_at(cfg: dict, dp: int) -> dict:
    """The layout of the configured job at data-parallel width ``dp`` (empty at full width):
    global batch kept, as many replicas per rank as the narrower job's nodes allow."""
    par = cfg["parallel"]
    if dp == int(par["dp"]):
        return {}
    dims = ParallelDims.from_config(dict(par, dp=dp))
    return {"dp": dp, "global_dp": int(par.get("global_dp") or par["dp"]),
            "replicas": min(int(cfg["ft"].get("replicas", 1)), max_replicas(dims))}


def renumber(old: ParallelDims, new: ParallelDims, ranks: dict[int, int],
             keep_dp: list[int]) -> tuple[dict[int, int], list[int]]:
    """A reshape's membership: each old rank in a kept data-parallel replica (``keep_dp``, in new
    order) takes the new rank of its stage in that replica's new index; the slots of the other
    old ranks come back as spares. Returns (new rank -> slot, spare slots)."""
    assignments, idle = {}, []
    for r, slot in sorted(ranks.items()):
        c = old.coords(r)
        if c["dp"] in keep_dp:
            assignments[new.rank_of(c["pp"], keep_dp.index(c["dp"]), c["tp"])] = slot
        else:
            idle.append(slot)
    return assignments, idle


def fill(new: ParallelDims, assignments: dict[int, int], spares: list[int]) -> tuple[dict, list]:
    """Give the ranks of ``new`` that have no slot yet to ``spares``, in order."""
    out, left = dict(assignments), list(spares)
    missing = [r for r in range(new.world_size) if r not in out]
    if len(missing) > len(left):
        raise RuntimeError(f"{len(missing)} rank(s) of the new layout need a process and only "
                           f"{len(left)} spare(s) are warm")
    out.update(zip(missing, left))
    return out, left[len(missing):]


def reshape(coord, generation: int, decision, rec, dp: int, keep_dp: list[int],
            t_detect: float) -> None:
    """Plan ``generation`` ("checkpoint": the state of the resume step to disk, every process
    staying), wait for it, then plan ``generation + 1`` ("train") at width ``dp`` with the kept
    data-parallel replicas renumbered and warm spares filling what is left. When the decision
    already reads every rank from a complete disk checkpoint (a failure inside a reshape left no
    copy in memory: ``disk.from_disk``), nothing is written and ``generation`` trains."""

    old = coord.dims
    on_disk = {s.dir for s in decision.sources.values() if s.kind == "disk"}
    if on_disk:
        (step_dir,) = on_disk
        train_gen, checkpoint_s = generation, 0.0
    else:
        t0 = time.monotonic()  # (the plan's t_written is a wall-clock stamp for the records)
        p = write_state(coord, generation, "checkpoint", decision, f"regroup at dp={dp}")
        step_dir = str(Path(coord.ft["checkpoint_dir"]) / f"step_{p.resume_step}")
        train_gen, checkpoint_s = generation + 1, time.monotonic() - t0
    if not on_disk and not checkpoint.is_complete(step_dir):  # never plan from an incomplete step
        coord.log(f"[coordinator] {step_dir} is not a complete checkpoint; falling back to the "
                  "newest complete one")
        decision.reason = f"{decision.reason}; {step_dir} incomplete"
        decision.resume_step = None
        if from_disk(coord, decision, rec) is None:
            return
        (step_dir,) = {s.dir for s in decision.sources.values()}
    layout = layout_at(coord.configured, dp)
    coord.reshape(layout)
    assignments, idle = renumber(old, coord.dims, coord.members.ranks, keep_dp)
    assignments, left = fill(coord.dims, assignments, idle + coord.members.spares)
    nxt = Plan(train_gen, "train", assignments, decision.resume_step,
               {r: Source("disk", r, dir=step_dir) for r in assignments},
               reason=f"in-place regroup at dp={dp}", layout=layout)
    coord.write_plan(nxt)
    coord.members.ranks = dict(assignments)  # a copy: the plan stays the next delta's base
    coord.members.spares = left
    coord.members.generation = train_gen
    for slot in assignments.values():
        coord.live.reset_progress(slot)
    rec.update(generation=train_gen, t_plan=nxt.t_written, plan_s=nxt.t_written - t_detect,
               checkpoint_s=checkpoint_s, elastic="in_place", dp=dp)
    coord.pending = rec


class Regrow:
    """An in-place regrow under way: the processes the full width lacks are started (they join
    as warm spares, exactly like a job's first processes), training goes on meanwhile, and
    ``ready`` turns true once every one of them announced itself warm. A joiner that dies while
    it warms up is replaced by a new process (``MAX_STARTS`` starts per missing process); when
    those run out, the joiners still warming up are fenced (none is left behind) and ``ready``
    raises: the job stays at its width."""

    MAX_STARTS = 3

    def __init__(self, coord):
        self.coord = coord
        full = ParallelDims.from_config(coord.configured["parallel"])
        need = full.world_size - coord.dims.world_size - len(coord.members.spares)
        self.slots = coord.launcher.add_slots(need, coord.gen + 1) if need > 0 else []
        self.starts_left = max(0, need) * (self.MAX_STARTS - 1)
        self._watch()
        if self.slots:
            coord.log(f"[coordinator] regrow: started {len(self.slots)} process(es) in slot(s) "
                      f"{self.slots}; training goes on while they warm up")

    def _watch(self) -> None:
        coord = self.coord
        self.joined = Reports(coord.store, coord.seal, Keys.spare_ready, list(self.slots),
                              on_forged=lambda s: coord.log(
                                  f"[coordinator] slot {s}: join announcement without the job's "
                                  "secret refused"))

    def ready(self) -> bool:
        self.joined.poll()
        dead = [s for s in self.joined.missing if self.coord.launcher.poll(s) is not None]
        if dead:
            self._replace(dead)
            return False
        return self.joined.complete

    def _replace(self, dead: list[int]) -> None:
        coord = self.coord
        tails = "\n".join(coord.launcher.log_tail(s) for s in dead)
        self.slots = [s for s in self.slots if s not in dead]
        if len(dead) > self.starts_left:
            warming = [s for s in self.slots if s not in self.joined.got]
            if warming:
                coord.launcher.fence(warming)
            raise RuntimeError(f"process(es) started to regrow the job (slot(s) {dead}) exited "
                               f"during start-up, {self.MAX_STARTS} starts each used up; the "
                               f"others warming up ({warming}) were fenced:\n{tails}")
        self.starts_left -= len(dead)
        new = coord.launcher.add_slots(len(dead), coord.gen + 1)
        coord.log(f"[coordinator] regrow: slot(s) {dead} exited during start-up; started "
                  f"slot(s) {new} in their place")
        self.slots += new
        self._watch()


def regrow_ready(coord) -> bool:
    """The coordinator may regrow now (``Coordinator._run``): in place, the processes the full
    width lacks are started first and the job trains on while they warm up: True once they
    joined as spares (at once for a relaunch)."""
    if coord.ft.get("elastic_mode", "in_place") != "in_place":
        return True
    try:
        if coord.regrow is None:
            coord.regrow = Regrow(coord)
        if not coord.regrow.ready():
            return False
    except (NotImplementedError, RuntimeError) as e:
        coord.log(f"[coordinator] cannot regrow: {e}; the job stays at dp={coord.dims.dp}")
        coord.grow_at, coord.regrow = None, None
        return False
    coord.members.spares += coord.regrow.slots
    coord.regrow = None
    full = ParallelDims.from_config(coord.configured["parallel"]).world_size
    # (a failure while they warmed up may have taken a process more: start the rest)
    return coord.dims.world_size + len(coord.members.spares) >= full
