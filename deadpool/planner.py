"""The hot-swap planner: from survivors' reports, decide the resume step and who restores what.

A pure function, so it is tested without processes. Inputs are the ``RankStatus`` of each
survivor and the set of dead ranks; the output says, for every rank, where its state at the resume
step comes from:

    live     the survivor is already at the resume step
    local    the survivor rolls back to its own snapshot of the resume step
    replica  the (new) rank receives the snapshot its old buddy holds

The resume step is the newest step that every rank can reach: a step in every survivor's local
ring (or live), and held as a verified replica for every dead rank. Recomputation is therefore at
most the steps since the newest complete replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from deadpool.protocol import RankStatus


@dataclass
class RecoveryDecision:
    resume_step: int | None            # None: nothing in memory covers every rank
    sources: dict[int, dict]
    steps_recomputed: int
    reason: str = ""


def plan_resume(statuses: dict[int, RankStatus], dead: set[int], buddy_of) -> RecoveryDecision:
    """``buddy_of(rank)`` names the rank that should hold ``rank``'s replica (preferred holder)."""
    candidates: list[set[int]] = []
    for r, st in statuses.items():
        steps = set(st.local_steps)
        if st.live_step is not None:
            steps.add(st.live_step)
        candidates.append(steps)
    holders: dict[int, dict[int, list[int]]] = {}
    for d in dead:
        held: dict[int, list[int]] = {}
        for r, st in statuses.items():
            for step in st.replicas.get(d, []):
                held.setdefault(step, []).append(r)
        holders[d] = held
        candidates.append(set(held))
    common = set.intersection(*candidates) if candidates else set()
    live_max = max((st.live_step or 0) for st in statuses.values()) if statuses else 0
    if not common:
        lost = [d for d in dead if not holders[d]]
        why = (f"no verified replica of rank(s) {lost} survives" if lost else
               "survivors' snapshots and the dead ranks' replicas share no step")
        return RecoveryDecision(None, {}, 0, why)
    S = max(common)
    sources: dict[int, dict] = {}
    for r, st in statuses.items():
        sources[r] = {"kind": "live" if st.live_step == S else "local", "holder": r}
    for d in dead:
        hs = holders[d][S]
        pref = buddy_of(d)
        sources[d] = {"kind": "replica", "holder": pref if pref in hs else min(hs)}
    return RecoveryDecision(S, sources, live_max - S)
