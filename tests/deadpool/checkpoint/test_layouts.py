"""One step directory, one parallel layout (issue 36, item 1).

A job that changes its data-parallel width (an elastic shrink or regrow) can write the same step
twice, at two layouts: a shrink's checkpoint at dp4, then the dp3 job's own checkpoint of that
step after a second failure, a periodic persist, a regrow, ``write_held``. Every rank directory
records the layout it was written at; a step complete at one layout is never rewritten at
another (it is the same step's state: the loader re-cuts it), an incomplete one is replaced
whole, and meta.json only ever describes shards written at its layout. Each rank's state here is
distinct (rank and layout in every value), so a shard taken from the wrong writer fails
``torch.equal``."""

import json
import time

import pytest
import torch

from deadpool import checkpoint
from deadpool.checkpoint import AsyncPersister

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

S = 7


def _layout(dp):
    return {"dp": dp, "tp": 1, "pp": 1}


def _state(rank, dp):
    """Rank ``rank``'s ZeRO shard at width ``dp``: distinct per rank and per layout."""
    return {"params": torch.full((8,), 100.0 * dp + rank), "exp_avg": torch.full((8 // dp,), -float(rank))}


def _save(root, rank, dp):
    checkpoint.save_rank_state(root, S, rank, _state(rank, dp), {"step": S, "rank": rank},
                               layout=_layout(dp), world_size=dp)


def _written(step_dir, rank):
    state, _ = checkpoint.read_rank_state(step_dir, rank)
    return state


def _ranks(step_dir):
    return sorted(int(p.name.split("_")[1]) for p in step_dir.iterdir() if p.name.startswith("rank_"))


def test_a_step_complete_at_one_layout_is_never_relabelled_by_another(tmp_path):
    """dp4 wrote step S completely (a shrink's checkpoint); the dp3 job writes S again (a second
    failure before it protected a newer step). Old code skipped the dp3 rank directories and
    rewrote meta.json as dp3: a dp2 load then re-cut three dp4 quarter-shards."""
    for r in range(4):
        _save(tmp_path, r, 4)
    checkpoint.write_meta(tmp_path, S, 4, "checkpoint", layout=_layout(4))
    for r in range(3):
        _save(tmp_path, r, 3)
    checkpoint.write_meta(tmp_path, S, 3, "checkpoint", layout=_layout(3))
    step_dir = tmp_path / f"step_{S}"
    meta = checkpoint.read_meta(step_dir)
    assert (meta["world_size"], meta["layout"]["dp"]) == (4, 4), meta
    assert checkpoint.is_complete(step_dir) and _ranks(step_dir) == [0, 1, 2, 3]
    for r in range(4):
        assert all(torch.equal(v, _state(r, 4)[k]) for k, v in _written(step_dir, r).items())


def test_an_incomplete_step_of_another_layout_is_replaced_whole(tmp_path):
    """dp4's write of step S stopped after ranks 0 and 1 (no meta); dp3 then writes S: every
    rank directory holds dp3's state, rank 3's dp4 leftover is gone, and meta says dp3."""
    _save(tmp_path, 0, 4)
    _save(tmp_path, 1, 4)
    _save(tmp_path, 3, 4)
    step_dir = tmp_path / f"step_{S}"
    _save(tmp_path, 0, 3)
    checkpoint.write_meta(tmp_path, S, 3, "periodic", layout=_layout(3))
    # rank 0 is done, ranks 1 and 2 not yet: the dp4 shard of rank 1 must not count as dp3's
    assert not checkpoint.is_complete(step_dir)
    _save(tmp_path, 1, 3)
    _save(tmp_path, 2, 3)
    checkpoint.write_meta(tmp_path, S, 3, "periodic", layout=_layout(3))
    assert checkpoint.is_complete(step_dir)
    assert _ranks(step_dir) == [0, 1, 2]
    assert checkpoint.read_meta(step_dir)["layout"]["dp"] == 3
    for r in range(3):
        assert all(torch.equal(v, _state(r, 3)[k]) for k, v in _written(step_dir, r).items())


def test_meta_of_another_layout_over_complete_shards_never_makes_them_complete(tmp_path):
    """Shards of dp4 complete but its meta never written (the coordinator stopped first); a dp3
    writer's meta must not turn three of those quarter-shards into a complete dp3 step."""
    for r in range(4):
        _save(tmp_path, r, 4)
    checkpoint.write_meta(tmp_path, S, 3, "checkpoint", layout=_layout(3))
    step_dir = tmp_path / f"step_{S}"
    assert not checkpoint.is_complete(step_dir)
    assert checkpoint.latest_complete_step(tmp_path) is None
    with pytest.raises(FileNotFoundError):
        checkpoint.latest_step_dir(tmp_path)


def test_the_asynchronous_persister_keeps_a_step_complete_at_another_layout(tmp_path):
    """A periodic persist at dp3 of a step a dp4 shrink already wrote completely leaves it as it
    was (old code: skipped the shards, relabelled meta dp3)."""
    for r in range(4):
        _save(tmp_path, r, 4)
    checkpoint.write_meta(tmp_path, S, 4, "checkpoint", layout=_layout(4))
    for r in range(3):
        p = AsyncPersister(tmp_path, r)
        p.layout = _layout(3)
        assert p.submit(S, _state(r, 3), {"step": S}, 3)
        p.close()
    step_dir = tmp_path / f"step_{S}"
    meta = checkpoint.read_meta(step_dir)
    assert meta["layout"]["dp"] == 4 and checkpoint.is_complete(step_dir)
    assert all(torch.equal(v, _state(1, 4)[k]) for k, v in _written(step_dir, 1).items())
    assert not [p.name for p in step_dir.iterdir() if p.name.startswith(".")]
