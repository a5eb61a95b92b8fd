"""The wire form of a ``Plan``: in full, or as a delta against the plan written before it.

At 16,384 ranks a plan in full is about 1 MB (every assignment, a source for every rank, every
group kept), yet a recovery changes little: one rank moves to a spare, a shrink drops a data-
parallel replica, and almost every rank's source is ``live`` (or ``local``) from itself. The
delta carries only that, so each process reads a few hundred bytes per generation::

    plan g-1 (held)                       delta g                          plan g (decoded)
    assignments {0:0, 1:1, .., 7:7}       assign  {set: {5: 8}}            {0:0, .., 5:8, .., 7:7}
    sources     live from self            sources {default: live,          live from self, but
                                                   except: {5: peer 1}}     5 <- peer 1
                                          keep    {except: [groups of 5]}  every group but 5's

Which pieces are relative to what:

- ``assignments`` are relative to the base plan: ranks whose slot changed or that were added,
  and ranks removed (a shrink).
- ``sources`` stand alone: a default kind that every assigned rank not listed takes from itself
  (``Source(kind, rank)``), ranks listed with their own source, and assigned ranks with none.
- ``keep_groups`` stand alone: the list, or (when shorter) its complement against the universe
  of keys it is drawn from, ``all_group_keys``, which encoder and decoder must both pass. The
  universe must be the keys a recovery can keep (``groups.all_groups`` without the ``repl/``
  groups, which ``groups.reusable_groups`` never keeps); against ``all_groups`` whole, the
  complement would list every replication group.
- Everything else (generation, action, resume step, reason, ``t_written``, and ``layout`` when
  the generation has one) is carried as is.

Membership is versioned: a delta names its base (the base plan's generation and a digest of its
assignments, ``membership_digest``) and the digest of the membership it produces. A decoder that
holds no plan, another generation, a plan with other assignments, or another group universe gets
``BaseMismatch`` and must read the full form instead (``Keys.plan_full``); it never decodes a
delta against the wrong membership. Round trips are exact: ``decode_plan(encode_plan(p, prev),
prev) == p`` for every field (dict order aside). ``decode_plan`` also reads ``Plan.to_json``'s
form (a plan written before wire forms existed) as a full plan.

The full form (wire 2) uses the same pieces against an empty base: assignments as runs of
consecutive ranks on consecutive slots (``[first rank, first slot, count]``) and sources with a
default, so a job's first plan (rank r on slot r, every rank ``live`` from itself) is a few
hundred bytes at any size instead of ~1 MB at 16,384 ranks: every node agent reads it at start-up
(2,048 of them at that size: 2 GB through the store in wire 1). Wire 1's full form is still read.

Keys: the coordinator must write each plan twice, both sealed, ``Keys.plan(g)`` as
``encode_plan(plan, previous plan written, keys)`` (the first plan of a job in full) and
``Keys.plan_full(g)`` as ``encode_plan(plan, None)``. A process that holds the plan written
before ``g`` (one waiting after it, a warm spare reading each plan in turn) reads the delta; one
that holds none (started later) or gets ``BaseMismatch`` reads the full form.
"""

from __future__ import annotations

import json
from array import array
from typing import Iterable

import xxhash

from deadpool.store.protocol import Keys, Plan, Source

WIRE_VERSION = 2
_READS = (1, 2)  # wire 1: the full form listed every assignment and source
# Source fields left out when None
_OPTIONAL = ("shared_from", "owner", "dir", "params_from", "crc", "shared_crc", "params_crc")


class BaseMismatch(ValueError):
    """A delta cannot be decoded against what this process holds (no plan, another generation,
    another membership, another group universe): the caller must read the full form."""


def membership_digest(assignments: dict[int, int]) -> str:
    """A 64-bit digest (hex) of a membership, ``rank -> slot`` in rank order: the version a delta
    is relative to."""
    flat = array("q")
    for r, s in sorted(assignments.items()):
        flat.append(r)
        flat.append(s)
    return xxhash.xxh3_64_hexdigest(flat.tobytes())


def encode_plan(plan: Plan, prev: Plan | None,
                all_group_keys: Iterable[str] | None = None) -> str:
    """``plan`` as text: in full with ``prev=None``, else as a delta against ``prev`` (the plan
    written before it, which a decoder must hold). ``all_group_keys`` allows ``keep_groups`` as
    a complement; the decoder must then pass the same keys."""
    if prev is None:
        return _dumps({"wire": WIRE_VERSION, "form": "full", **_full_fields(plan)})
    return _dumps({
        "wire": WIRE_VERSION, "form": "delta",
        "generation": plan.generation,
        "base": {"generation": prev.generation, "membership": membership_digest(prev.assignments)},
        "membership": membership_digest(plan.assignments),
        "action": plan.action, "resume_step": plan.resume_step,
        "reason": plan.reason, "t_written": plan.t_written,
        "assign": _assign_delta(plan.assignments, prev.assignments),
        "sources": _sources_with_default(plan.sources, plan.assignments),
        "keep": _keep_form(plan.keep_groups, all_group_keys),
        **({"layout": plan.layout} if plan.layout else {}),
        **({"retire": plan.retire} if plan.retire else {}),
    })


def decode_plan(text: str | bytes, prev: Plan | None,
                all_group_keys: Iterable[str] | None = None) -> Plan:
    """The plan ``encode_plan`` wrote. A delta needs the plan it was made against as ``prev``
    (else ``BaseMismatch``); a full form ignores ``prev``."""
    d = json.loads(text)
    if "wire" not in d:  # Plan.to_json: a full plan
        return _plan_from_fields(d)
    if d["wire"] not in _READS:
        raise ValueError(f"plan wire version {d['wire']} is not supported (this reads {_READS})")
    form = d.pop("form")
    del d["wire"]
    if form == "full":
        return _plan_from_fields(d)
    if form != "delta":
        raise ValueError(f"plan wire form {form!r} is neither 'full' nor 'delta'")
    g, base = d["generation"], d["base"]
    if prev is None:
        raise BaseMismatch(f"plan {g} is a delta against plan {base['generation']} and no plan "
                           "is held: read the full form")
    if prev.generation != base["generation"]:
        raise BaseMismatch(f"plan {g} is a delta against plan {base['generation']}, "
                           f"not the plan held ({prev.generation}): read the full form")
    if membership_digest(prev.assignments) != base["membership"]:
        raise BaseMismatch(f"plan {g} is a delta against another membership of plan "
                           f"{prev.generation} than the one held: read the full form")
    assignments = dict(prev.assignments)
    for r in d["assign"]["drop"]:
        del assignments[r]
    for r, s in d["assign"]["set"].items():
        assignments[int(r)] = s
    if membership_digest(assignments) != d["membership"]:
        raise ValueError(f"plan {g}: the decoded membership does not match the one encoded")
    return Plan(g, d["action"], assignments, d["resume_step"],
                sources=_sources_from(d["sources"], assignments),
                reason=d["reason"], t_written=d["t_written"],
                keep_groups=_keep_from(d["keep"], all_group_keys, g), layout=d.get("layout", {}),
                retire=d.get("retire", []))


# -- pieces ----------------------------------------------------------------------------------------
def _dumps(d: dict) -> str:
    return json.dumps(d, separators=(",", ":"))


def _src(s: Source) -> dict:
    d = {"kind": s.kind, "holder": s.holder}
    for k in _OPTIONAL:
        v = getattr(s, k)
        if v is not None:
            d[k] = v
    return d


def _full_fields(plan: Plan) -> dict:
    return {"generation": plan.generation, "action": plan.action,
            "runs": _runs(plan.assignments),
            "resume_step": plan.resume_step,
            "sources": _sources_with_default(plan.sources, plan.assignments),
            "reason": plan.reason, "t_written": plan.t_written,
            "keep_groups": list(plan.keep_groups),
            **({"layout": plan.layout} if plan.layout else {}),
            **({"retire": plan.retire} if plan.retire else {})}


def _plan_from_fields(d: dict) -> Plan:
    if "runs" in d:  # wire 2
        d["assignments"] = _from_runs(d.pop("runs"))
        d["sources"] = _sources_from(d["sources"], d["assignments"])
        return Plan(**d)
    d["assignments"] = {int(r): s for r, s in d["assignments"].items()}  # wire 1, Plan.to_json
    d["sources"] = {int(r): Source(**s) for r, s in d["sources"].items()}
    return Plan(**d)


def _runs(assignments: dict[int, int]) -> list[list[int]]:
    """``rank -> slot`` as ``[first rank, first slot, count]`` runs, in the dict's order (a
    decoder rebuilds the same order)."""
    runs: list[list[int]] = []
    for r, s in assignments.items():
        last = runs[-1] if runs else None
        if last is not None and r == last[0] + last[2] and s == last[1] + last[2]:
            last[2] += 1
        else:
            runs.append([r, s, 1])
    return runs


def _from_runs(runs: list[list[int]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for r, s, n in runs:
        if n < 1:
            raise ValueError(f"plan assignment run {[r, s, n]} is empty")
        out.update(zip(range(r, r + n), range(s, s + n)))
    return out


def _assign_delta(new: dict[int, int], old: dict[int, int]) -> dict:
    return {"set": {str(r): s for r, s in new.items() if old.get(r) != s},
            "drop": [r for r in old if r not in new]}


def _self_kind(r: int, s: Source) -> tuple[str, str | None] | None:
    """``(kind, dir)`` if ``s`` is ``Source(kind, r, dir=dir)`` with nothing else set (a
    default's form: every rank of a disk plan, or of an in-place reshape, reads the same
    checkpoint directory, so ``dir`` is part of the default, not listed per rank)."""
    if s.holder == r and s.shared_from is None and s.owner is None:
        return s.kind, s.dir
    return None


def _default_form(default: tuple[str, str | None]) -> str | dict:
    kind, where = default
    return kind if where is None else {"kind": kind, "dir": where}  # (a bare kind: as before dirs)


def _sources_with_default(sources: dict[int, Source], assignments: dict[int, int]) -> dict:
    """The (kind, directory) most assigned ranks take from themselves becomes the default, when
    it names more ranks than it would have to list as having no source."""
    counts: dict[tuple, int] = {}
    missing = 0
    for r in assignments:
        s = sources.get(r)
        if s is None:
            missing += 1
        else:
            k = _self_kind(r, s)
            if k is not None:
                counts[k] = counts.get(k, 0) + 1
    default = max(counts, key=counts.get, default=None)
    if default is not None and counts[default] <= missing:
        default = None
    if default is None:
        return {"default": None, "none": [], "except": {str(r): _src(s) for r, s in sources.items()}}
    return {"default": _default_form(default),
            "none": [r for r in assignments if r not in sources],
            "except": {str(r): _src(s) for r, s in sources.items()
                       if r not in assignments or _self_kind(r, s) != default}}


def _sources_from(d: dict, assignments: dict[int, int]) -> dict[int, Source]:
    out: dict[int, Source] = {}
    default = d["default"]
    if default is not None:
        kind, where = (default, None) if isinstance(default, str) else (default["kind"],
                                                                          default["dir"])
        skip = set(d["none"])
        skip.update(int(r) for r in d["except"])
        for r in assignments:
            if r not in skip:
                out[r] = Source(kind, r, dir=where)
    for r, s in d["except"].items():
        out[int(r)] = Source(**s)
    return out


def _universe(all_group_keys: Iterable[str]) -> tuple[list[str], str]:
    keys = sorted(set(all_group_keys))
    return keys, xxhash.xxh3_64_hexdigest("\n".join(keys).encode())


def _keep_form(keep: list[str], all_group_keys: Iterable[str] | None) -> dict:
    """The list, or its complement against the universe when that is shorter; the complement
    rebuilds the keys in sorted order, so it is only used for a sorted list without repeats."""
    if all_group_keys is not None and keep == sorted(set(keep)):
        universe, digest = _universe(all_group_keys)
        kept = set(keep)
        if len(keep) > len(universe) - len(kept) and kept.issubset(universe):
            return {"except": [k for k in universe if k not in kept],
                    "of": {"n": len(universe), "digest": digest}}
    return {"list": list(keep)}


def _keep_from(d: dict, all_group_keys: Iterable[str] | None, g: int) -> list[str]:
    if "list" in d:
        return d["list"]
    if all_group_keys is None:
        raise BaseMismatch(f"plan {g} lists the groups kept as a complement and no group keys "
                           "were given to decode it: read the full form")
    universe, digest = _universe(all_group_keys)
    if (len(universe), digest) != (d["of"]["n"], d["of"]["digest"]):
        raise BaseMismatch(f"plan {g} lists the groups kept against another set of group keys "
                           f"({d['of']['n']} keys) than the one given ({len(universe)}): "
                           "read the full form")
    dropped = set(d["except"])
    return [k for k in universe if k not in dropped]


# -- the store side ----------------------------------------------------------------------------------
def publish_plan(store, seal, plan: Plan, prev: Plan | None,
                 all_group_keys: Iterable[str] | None = None) -> int:
    """Write ``plan`` sealed: in full under ``Keys.plan_full`` (for a process that holds no plan),
    then as a delta against ``prev`` under ``Keys.plan`` (what processes reading in order fetch),
    then its generation under ``Keys.PLAN_NEWEST`` (a reader whose plan was collected jumps
    there: ``fetch_plan``). Returns the bytes of the form processes read."""
    full = Keys.plan_full(plan.generation)
    store.set(full, seal.wrap(full, encode_plan(plan, None)))
    key = Keys.plan(plan.generation)
    text = encode_plan(plan, prev, all_group_keys)
    store.set(key, seal.wrap(key, text))
    store.set(Keys.PLAN_NEWEST, seal.wrap(Keys.PLAN_NEWEST, str(plan.generation)))
    return len(text)


def newest_plan(store, seal) -> int | None:
    """The generation of the newest plan written (sealed by the job), None before the first."""
    if not store.check([Keys.PLAN_NEWEST]):
        return None
    text = seal.open(Keys.PLAN_NEWEST, store.get(Keys.PLAN_NEWEST))
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


def plan_skipped(store, seal, generation: int) -> bool:
    """Plan ``generation`` will never be read: a newer one is written and this one was
    collected (``protocol.finished_key``: the coordinator keeps one plan behind the one
    running). A reader waiting for it must take the newest instead (``fetch_plan`` does)."""
    newest = newest_plan(store, seal)
    return newest is not None and newest > generation and not store.check([Keys.plan(generation)])


def fetch_plan(store, seal, generation: int, prev: Plan | None,
               all_group_keys: Iterable[str] | None = None, decode=None) -> tuple[Plan, str]:
    """Plan ``generation`` and the text it was decoded from: the delta against ``prev`` when
    that is the plan it was made against, else the full form. A reader whose plan was collected
    meanwhile (two generations behind) gets the newest plan in full instead: a spare needs only
    the newest, and every rank's state comes from what the newest names. A delta that fails its
    seal (overwritten by a client without the secret) is read from the full form. Raises
    ``auth.AuthError`` if neither form is the job's. (``decode``: ``decode_plan`` or a stand-in
    with its signature.)"""
    decode = decode or decode_plan
    if not store.check([Keys.plan(generation)]):  # written, then collected: the newest instead
        newest = newest_plan(store, seal)
        if newest is not None and newest > generation:
            generation, prev = newest, None
    key = Keys.plan(generation)
    text = seal.open(key, store.get(key))  # (the job's first plan is in full here too)
    if text is not None:
        try:
            return decode(text, prev, all_group_keys), text
        except BaseMismatch:
            pass
    full = Keys.plan_full(generation)
    text = seal.unwrap(full, store.get(full))
    return decode(text, None), text
