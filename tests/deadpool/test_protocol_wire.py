"""Plans on the wire, in full and as deltas (deadpool/store/wire.py): exact round trips over
random layouts and recoveries, a delta never decoded against the wrong membership, and the sizes
and costs at 16,384 ranks."""

import json
import random
import time

import pytest

from deadpool.rank.groups import all_groups
from deadpool.store.protocol import Keys, Plan, Source
from deadpool.store.wire import (BaseMismatch, WIRE_VERSION, decode_plan, encode_plan,
                                    membership_digest)
from deadpool.topology import ParallelDims

POLICY = "ring_over_nodes"


def keepable(dims: ParallelDims) -> list[str]:
    """The keys a recovery can keep (replication groups are always rebuilt)."""
    return [k for k in all_groups(dims, POLICY) if not k.startswith(("repl", "xfer"))]


def random_dims(rng: random.Random) -> ParallelDims:
    tp, dp, pp = rng.choice([1, 2, 4]), rng.randint(1, 5), rng.randint(1, 3)
    per_node = tp * (2 if (dp * pp) % 2 == 0 and rng.random() < 0.5 else 1)  # nodes hold whole tp groups
    return ParallelDims(dp=dp, tp=tp, pp=pp, ranks_per_node=per_node)


def random_source(rng: random.Random, r: int, ranks: list[int]) -> Source:
    kind = rng.choice(Source.KINDS)
    if kind in ("live", "local", "init"):
        return Source(kind, r)
    if kind == "disk":
        return Source("disk", r, dir=f"ckpt/step_{rng.randint(0, 99)}")
    return Source(kind, rng.choice(ranks),
                  shared_from=rng.choice([None, rng.choice(ranks)]),
                  owner=rng.choice([None, r, rng.choice(ranks)]))


def first_plan(world: int, generation: int = 0) -> Plan:
    return Plan(generation, "train", {r: r for r in range(world)}, resume_step=0,
                sources={r: Source("live", r) for r in range(world)}, t_written=time.time())


def next_plan(rng: random.Random, prev: Plan, dims: ParallelDims, universe: list[str],
              next_slot: int) -> Plan:
    """A recovery after ``prev``: spares take failed ranks, a shrink drops ranks, a regrow adds
    some; sources live, local, mixed or none; keep_groups a subset of the universe (sorted, or
    in another order, or with a key outside it)."""
    ranks = sorted(prev.assignments)
    assign = dict(prev.assignments)
    scenario = rng.choice(["swap", "rollback", "shrink", "grow", "stop", "mixed"])
    failed = rng.sample(ranks, k=rng.randint(0, min(3, len(ranks))))
    for r in failed:
        assign[r] = next_slot
        next_slot += 1
    if scenario == "shrink" and len(ranks) > 1:
        for r in rng.sample(ranks, k=rng.randint(1, len(ranks) - 1)):
            del assign[r]
    if scenario == "grow":
        for r in range(max(ranks) + 1, max(ranks) + 1 + rng.randint(1, 4)):
            assign[r] = next_slot
            next_slot += 1
    live = sorted(assign)
    if scenario == "stop":
        sources = {}
    else:
        base = "local" if scenario == "rollback" else "live"
        sources = {r: Source(base, r) for r in live}
        for r in failed:
            if r in sources:
                sources[r] = random_source(rng, r, live)
        if scenario == "mixed":
            for r in rng.sample(live, k=rng.randint(0, len(live))):
                sources[r] = random_source(rng, r, live)
            for r in rng.sample(live, k=rng.randint(0, len(live) // 2)):
                sources.pop(r, None)  # assigned, no source
            sources[max(live) + 7] = Source("peer", live[0])  # a source for an unassigned rank
    keep = sorted(rng.sample(universe, k=rng.randint(0, len(universe))))
    style = rng.random()
    if style < 0.1:
        rng.shuffle(keep)
    elif style < 0.2:
        keep.append("tp/not-in-the-layout")
    elif style < 0.25 and keep:
        keep.append(keep[0])
    layout = rng.choice([{}, {}, {"dp": 3, "global_dp": 4, "replicas": rng.randint(1, 2)}])
    return Plan(prev.generation + rng.choice([1, 1, 2]),
                rng.choice(["train", "train", "checkpoint", "checkpoint_and_stop", "stop"]), assign,
                resume_step=rng.randint(0, 500), sources=sources,
                reason=rng.choice(["", "rank 3 exited (SIGKILL)", "shrink: ünïcode \"quoted\""]),
                t_written=rng.random() * 2e9, keep_groups=keep, layout=layout)


@pytest.mark.parametrize("seed", range(40))
def test_every_plan_round_trips_in_full_and_as_a_delta_along_a_chain(seed):
    rng = random.Random(seed)
    dims = random_dims(rng)
    universe = keepable(dims) if rng.random() < 0.8 else list(all_groups(dims, POLICY))
    held = plan = first_plan(dims.world_size, generation=rng.randint(0, 5))
    assert decode_plan(encode_plan(plan, None), None) == plan
    slot = dims.world_size
    for _ in range(8):  # a process reads every plan in order, decoding each against the last
        prev, plan = plan, next_plan(rng, plan, dims, universe, slot)
        slot = max(plan.assignments.values(), default=slot) + 1
        delta = encode_plan(plan, prev, universe)
        held = decode_plan(delta, held, universe)
        assert held == plan
        assert decode_plan(encode_plan(plan, None), None) == plan  # a late reader
        assert decode_plan(encode_plan(plan, prev), prev) == plan  # no universe: keep as a list


def test_a_plan_written_before_wire_forms_reads_as_full():
    plan = next_plan(random.Random(1), first_plan(8), ParallelDims(dp=2, tp=2, pp=2, ranks_per_node=2), [], 8)
    assert decode_plan(plan.to_json(), None) == plan
    assert decode_plan(plan.to_json().encode(), first_plan(4)) == plan


def test_a_delta_against_another_plan_than_the_one_held_is_refused():
    dims = ParallelDims(dp=4, tp=2, pp=2, ranks_per_node=2)
    universe = keepable(dims)
    prev = first_plan(dims.world_size, generation=3)
    plan = next_plan(random.Random(2), prev, dims, universe, dims.world_size)
    delta = encode_plan(plan, prev, universe)
    with pytest.raises(BaseMismatch, match="no plan is held"):
        decode_plan(delta, None, universe)
    older = first_plan(dims.world_size, generation=2)
    with pytest.raises(BaseMismatch, match=r"not the plan held \(2\)"):
        decode_plan(delta, older, universe)
    other = first_plan(dims.world_size, generation=3)
    other.assignments[5] = 99  # same generation, another membership
    with pytest.raises(BaseMismatch, match="another membership"):
        decode_plan(delta, other, universe)
    # the full form is what such a reader falls back to
    assert decode_plan(encode_plan(plan, None), other) == plan
    assert Keys.plan(4) == "plan/4" and Keys.plan_full(4) == "plan/4/full"


def test_a_complement_of_groups_needs_the_same_universe():
    dims = ParallelDims(dp=4, tp=2, pp=2, ranks_per_node=2)
    universe = keepable(dims)
    prev = first_plan(dims.world_size)
    plan = Plan(1, "train", dict(prev.assignments), 0, dict(prev.sources),
                keep_groups=sorted(universe)[1:])
    delta = encode_plan(plan, prev, universe)
    assert '"except"' in delta and decode_plan(delta, prev, universe) == plan
    with pytest.raises(BaseMismatch, match="no group keys"):
        decode_plan(delta, prev)
    with pytest.raises(BaseMismatch, match="another set of group keys"):
        decode_plan(delta, prev, universe[:-1])
    with pytest.raises(BaseMismatch, match="another set of group keys"):
        decode_plan(delta, prev, universe[:-1] + ["tp/other"])


def test_unknown_wire_versions_and_forms_are_refused():
    plan = first_plan(4)
    text = encode_plan(plan, None).replace(f'"wire":{WIRE_VERSION}', '"wire":99')
    with pytest.raises(ValueError, match="version 99"):
        decode_plan(text, None)
    with pytest.raises(ValueError, match="neither"):
        decode_plan(encode_plan(plan, None).replace('"full"', '"patch"'), None)


def test_membership_digest_depends_on_every_assignment_not_on_order():
    a = {r: r for r in range(64)}
    assert membership_digest(a) == membership_digest(dict(reversed(list(a.items()))))
    assert membership_digest(a) != membership_digest({**a, 63: 64})
    assert membership_digest(a) != membership_digest({r: r for r in range(63)})


# -- 16,384 ranks -----------------------------------------------------------------------------------
BIG = ParallelDims(dp=512, tp=8, pp=4, ranks_per_node=8)  # 512 * 8 * 4 = 16,384 ranks


def timed(f, *args, repeat=3):
    """The result and the best of ``repeat`` wall times (the machine's cores are shared)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        out = f(*args)
        best = min(best, time.perf_counter() - t)
    return out, best


def measure(name, plan, prev, universe):
    full, t_full = timed(encode_plan, plan, None, universe)
    delta, t_enc = timed(encode_plan, plan, prev, universe)
    got, t_dec = timed(decode_plan, delta, prev, universe)
    got_full, t_dec_full = timed(decode_plan, full, None, universe)
    assert got == plan and got_full == plan
    print(f"\n{name}: full {len(full):,} B, delta {len(delta):,} B; encode delta "
          f"{t_enc * 1e3:.1f} ms, decode delta {t_dec * 1e3:.1f} ms (full: encode "
          f"{t_full * 1e3:.1f} ms, decode {t_dec_full * 1e3:.1f} ms)")
    assert t_enc < 1.0 and t_dec < 1.0
    return full, delta


def test_at_16k_ranks_one_rank_swapped_to_a_spare_is_a_delta_of_a_few_hundred_bytes():
    groups = all_groups(BIG, POLICY)
    prev = first_plan(BIG.world_size, generation=7)
    failed, spare_slot = 9_301, BIG.world_size + 3
    assign = dict(prev.assignments)
    assign[failed] = spare_slot
    sources = {r: Source("live", r) for r in assign}
    sources[failed] = Source("replica", BIG.world_size - 1, shared_from=failed - BIG.tp)
    keep = sorted(k for k, ranks in groups.items() if failed not in ranks)
    plan = Plan(8, "train", assign, resume_step=1_234, sources=sources,
                reason=f"rank {failed} exited (SIGKILL)", t_written=time.time(), keep_groups=keep)
    full, delta = measure("16k, one rank to a spare (keep: every group but its own)",
                          plan, prev, groups)
    assert len(delta) < 2_000 and len(full) > 100 * len(delta)
    # against the universe a recovery keeps from (no replication groups), as groups_to_keep does
    universe = keepable(BIG)
    plan.keep_groups = sorted(k for k in universe if failed not in groups[k])
    full, delta = measure("16k, one rank to a spare (keep: keepable groups but its own)",
                          plan, prev, universe)
    assert len(delta) < 2_000 and len(full) > 100 * len(delta)


def test_at_16k_ranks_every_rank_rolling_back_locally_is_a_small_delta():
    prev = first_plan(BIG.world_size, generation=7)
    universe = keepable(BIG)
    plan = Plan(8, "train", dict(prev.assignments), resume_step=1_200,
                sources={r: Source("local", r) for r in prev.assignments},
                reason="every rank rolls back to step 1200", t_written=time.time(),
                keep_groups=[])  # NCCL: every group rebuilt
    full, delta = measure("16k, every rank rolls back locally", plan, prev, universe)
    assert len(delta) < 2_000 and len(full) < 2_000  # (wire 1's full form: ~1 MB)


def test_a_jobs_first_plan_in_full_is_a_few_hundred_bytes_at_16k_ranks():
    """Every node agent reads plan 0 in full at start-up: 2,048 of them at 16,384 ranks."""
    plan = first_plan(BIG.world_size, generation=0)
    text = encode_plan(plan, None)
    assert len(text) < 1_000, len(text)
    assert decode_plan(text, None) == plan
    swapped = Plan(1, "train", {**plan.assignments, 9_301: BIG.world_size + 3}, 5,
                   sources={r: Source("live", r) for r in plan.assignments}, keep_groups=[])
    assert decode_plan(encode_plan(swapped, None), None) == swapped  # three runs
    assert len(encode_plan(swapped, None)) < 1_000


def test_wire_1s_full_form_is_still_read():
    plan = next_plan(random.Random(3), first_plan(8), ParallelDims(dp=2, tp=2, pp=2,
                                                                   ranks_per_node=2), [], 8)
    old = {"wire": 1, "form": "full", **json.loads(plan.to_json())}  # every entry listed
    assert decode_plan(json.dumps(old), None) == plan
