"""The coordinator's side of an integrity report (``recovery.integrity``): a rollback.

    poll         a rank's report of corruption or a loss spike in the current generation
    pending      a report is being acted on (the recovery needs no dead rank to be named)
    restrict     every survivor's steps capped at the report's resume step (``plan.decide``
                 then picks that step or an older one); a spike's batch joins the skip list
    open_record  the recovery's record says what was reported, at which step

The ranks' side (the checksum comparison, the spike rule, the report) is ``recovery.integrity``.
"""

from __future__ import annotations

import dataclasses
import json
import time

from deadpool.recovery import timeline
from deadpool.recovery.integrity import SKIPS_KEY, report_key
from deadpool.recovery.spike import add_skip
from deadpool.store import reports

POLL_S = 0.1  # the coordinator looks for a rank's report at most this often


def poll(coord) -> tuple[dict[int, str], float] | None:
    """A rank's report of corruption or a spike in the current generation: ``(failed, t)``
    (the named ranks, detected by ``corruption``; none for a spike or a dp-2 dispute), else
    None. One store request per ``POLL_S`` while nothing is reported (the loop turns every
    10 ms: a check per turn would be most of the coordinator's steady requests)."""
    now = time.monotonic()
    if now - getattr(coord, "integrity_polled", float("-inf")) < POLL_S:
        return None
    coord.integrity_polled = now
    listed = reports.peek(coord.store, reports.index_of(report_key(coord.gen, 0)))
    if not listed:  # the one request of a turn with nothing reported (no O(ranks) work either)
        return None
    names = {int(n) for n in listed.decode(errors="replace").split(",") if n.isdigit()}
    got = reports.read_posted(coord.store, coord.seal, {r: report_key(coord.gen, r) for r in
                                                        names if r in coord.members.ranks})
    if not got:
        return None
    ev = json.loads(got[min(got)])
    coord.integrity = ev
    coord.log(f"[coordinator] gen {coord.gen}: rank {ev['rank']} reports {ev['kind']} at step "
              f"{ev['step']}: {ev['why']}; rolling back to step {ev['cap']} or older")
    return {int(r): "corruption" for r in ev["culprits"]}, time.time()


def pending(coord) -> bool:
    """A report is being acted on (the recovery needs no dead rank to be named)."""
    return getattr(coord, "integrity", None) is not None


def restrict(coord, statuses: dict) -> dict:
    """Cap every survivor's steps at the report's resume step (``plan.decide`` then picks that
    step or an older one); a spike's batch joins the job's skip list (sealed, read by every rank
    at its next generation's start)."""
    ev = getattr(coord, "integrity", None)
    if ev is None:
        return statuses
    cap = ev["cap"]
    ev["live_max"] = max((st.live_step for st in statuses.values() if st.live_step is not None),
                         default=cap)
    out = {r: capped(st, cap) for r, st in statuses.items()}
    if ev["kind"] == "spike":
        coord.skips = add_skip(getattr(coord, "skips", []), int(ev["pos"]))
        coord.store.set(SKIPS_KEY, coord.seal.wrap(SKIPS_KEY, json.dumps(coord.skips)))
    if coord.ft.get("replicate") == "full":  # their replicas hold the named ranks' parameters
        for q, st in statuses.items():
            for c in ev["culprits"]:
                coord.bad.update((q, int(c), s) for s in st.replicas.get(int(c), []) if s >= ev["step"])
    return out


def capped(st, cap: int):
    """``st`` (a ``RankStatus``) without anything newer than ``cap``."""
    live = st.live_step if st.live_step is not None and st.live_step <= cap else None
    return dataclasses.replace(st, live_step=live,
                               local_steps=[s for s in st.local_steps if s <= cap],
                               replicas={o: [s for s in v if s <= cap]
                                         for o, v in st.replicas.items()})


def open_record(coord, failed, faults, decision, t_detect: float, bad):
    """``timeline.open_record``; for a report: ``detected_by`` its kind, ``failed_at_step`` the
    disputed (or spiking) step, the steps recomputed counted from the newest live step."""
    rec = timeline.open_record(coord, failed, faults, decision, t_detect, bad)
    ev = getattr(coord, "integrity", None)
    if ev is not None:
        _annotate(coord, ev, rec)
    return rec


def _annotate(coord, ev: dict, rec) -> None:
    coord.integrity = None
    rec.update(detected_by=ev["kind"], failed_at_step=ev["step"])
    if rec.resume_step is not None:
        rec.update(steps_recomputed=max(0, ev.get("live_max", ev["cap"]) - rec.resume_step))
