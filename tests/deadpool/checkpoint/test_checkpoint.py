"""Disk checkpoints: atomic rank directories, JSON headers, AsyncPersister, old-format loading."""

import json
import pickle
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from deadpool import checkpoint
from deadpool.checkpoint import persister as persister_mod
from deadpool.checkpoint import AsyncPersister, CheckpointWriteError
from deadpool.model import build_model, build_optimizer
from deadpool.snapshot import StateLayout, state_tensors

# dcp.save/load(no_dist=True) warn that they assume one process; deadpool.checkpoint filters this
# at import, but pytest resets warning filters per test
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TINY = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2, ffn_mult=2, max_seq_len=16)


def _trained_state():
    """A real rank's state (parameters + AdamW moments) after one optimizer step."""
    torch.manual_seed(0)
    model = build_model(TINY, 1)
    opt = build_optimizer(model, 1e-2, 0.0)
    loss = model(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
    loss.backward()
    opt.step()
    return state_tensors(model, opt)


def _flat_copy(tensors):
    """A private host copy of the state as the snapshot engine keeps it: one flat uint8 buffer."""
    layout = StateLayout(tensors)
    flat = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for v, (_, t) in zip(layout.views(flat), tensors):
        v.copy_(t.detach())
    return layout, flat


def _header(step):
    return {"step": step, "data_position": step, "generation": 2,
            "rng_cpu": checkpoint.encode_rng_state(torch.get_rng_state())}


def _fresh(layout):
    return layout.state_dict(torch.zeros(layout.nbytes, dtype=torch.uint8))


def _hidden(step_dir):
    return [p.name for p in step_dir.iterdir() if p.name.startswith(".")]


def test_header_round_trip_restores_the_rng_state(tmp_path):
    layout, flat = _flat_copy(_trained_state())
    rng = torch.get_rng_state()
    header = {"step": 3, "data_position": 3, "generation": 1,
              "rng_cpu": checkpoint.encode_rng_state(rng), "note": "kept as given"}
    d = checkpoint.save_rank_state(tmp_path, 3, 0, layout.state_dict(flat), header)
    assert json.loads((d / "header.json").read_text()) == header
    assert not (d / "rng.pt").exists()
    checkpoint.write_meta(tmp_path, 3, 1, "test")
    h = checkpoint.load_rank_state(checkpoint.latest_step_dir(tmp_path), 0, _fresh(layout))
    assert h == header
    restored = checkpoint.decode_rng_state(h["rng_cpu"])
    assert restored.dtype == torch.uint8 and torch.equal(restored, rng)
    torch.set_rng_state(restored)  # accepted as is


def test_a_header_that_is_not_json_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(TypeError, match="rng_cpu"):
        checkpoint.save_rank_state(tmp_path, 1, 0, {"x": torch.ones(2)},
                                   {"step": 1, "rng_cpu": torch.get_rng_state()})
    assert not (tmp_path / "step_1").exists()


def test_two_writers_of_the_same_rank_leave_one_complete_copy(tmp_path, monkeypatch):
    # Both writers finish their DCP files before either renames, so the rename collision (the
    # loser discards its copy) is exercised every time, not only when the scheduler allows.
    both_written = threading.Barrier(2, timeout=10)
    real_save = dcp.save

    def save_then_meet(*args, **kwargs):
        out = real_save(*args, **kwargs)
        both_written.wait()
        return out

    monkeypatch.setattr(dcp, "save", save_then_meet)
    states = [{"w": torch.full((64, 16), float(i)), "b": torch.arange(7) + 100 * i} for i in (1, 2)]
    errors = []

    def write(i):
        try:
            checkpoint.save_rank_state(tmp_path, 5, 0, states[i], {"step": 5, "writer": i})
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    checkpoint.write_meta(tmp_path, 5, 1, "test")
    step_dir = tmp_path / "step_5"
    assert checkpoint.is_complete(step_dir) and _hidden(step_dir) == []
    out = {"w": torch.zeros(64, 16), "b": torch.zeros(7, dtype=torch.int64)}
    h = checkpoint.load_rank_state(step_dir, 0, out)
    winner = states[h["writer"]]  # header and tensors come from the same writer
    assert torch.equal(out["w"], winner["w"]) and torch.equal(out["b"], winner["b"])
    # a later writer of the same (step, rank) leaves the complete copy alone
    checkpoint.save_rank_state(tmp_path, 5, 0, states[1 - h["writer"]], {"step": 5, "writer": 9})
    assert checkpoint.load_rank_state(step_dir, 0, out)["writer"] == h["writer"]


def test_an_incomplete_leftover_rank_dir_is_replaced(tmp_path):
    d = checkpoint.rank_dir(tmp_path, 2, 0)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"torn")  # a crash of the old in-place writer
    state = {"w": torch.randn(4, 4)}
    checkpoint.save_rank_state(tmp_path, 2, 0, state, {"step": 2})
    checkpoint.write_meta(tmp_path, 2, 1, "test")
    out = {"w": torch.zeros(4, 4)}
    assert checkpoint.load_rank_state(tmp_path / "step_2", 0, out) == {"step": 2}
    assert torch.equal(out["w"], state["w"]) and _hidden(tmp_path / "step_2") == []


def test_write_meta_is_atomic_and_repeatable(tmp_path):
    for _ in range(3):
        checkpoint.write_meta(tmp_path, 7, 4, "periodic")
    assert json.loads((tmp_path / "step_7" / "meta.json").read_text()) == \
        {"step": 7, "world_size": 4, "reason": "periodic"}
    assert _hidden(tmp_path / "step_7") == []


def test_async_persister_writes_off_thread_and_refuses_while_busy(tmp_path, monkeypatch):
    tensors = _trained_state()
    layout, flat = _flat_copy(tensors)
    gate, on_upload_thread = threading.Event(), []
    real_install = persister_mod.install_rank

    def held_install(*args):
        on_upload_thread.append(threading.current_thread() is not threading.main_thread())
        assert gate.wait(10)
        return real_install(*args)

    monkeypatch.setattr(persister_mod, "install_rank", held_install)
    p = AsyncPersister(tmp_path, rank=0)
    header = _header(10)
    assert p.submit(10, layout.state_dict(flat), header, world_size=1) is True
    assert p.in_flight
    _, other = _flat_copy(tensors)
    assert p.submit(11, layout.state_dict(other), _header(11), world_size=1) is False
    assert p.skipped == 1 and p.last_step_written is None
    assert checkpoint.latest_complete_step(tmp_path) is None  # nothing complete yet
    assert p.wait(timeout=0.05) is False  # still held
    gate.set()
    assert p.wait() is True
    assert not p.in_flight and on_upload_thread == [True]
    assert p.last_step_written == 10 and p.last_write_s > 0
    assert checkpoint.latest_complete_step(tmp_path) == 10
    step_dir = checkpoint.latest_step_dir(tmp_path)
    assert json.loads((step_dir / "meta.json").read_text())["world_size"] == 1
    assert _hidden(step_dir) == []
    out = _fresh(layout)
    h = checkpoint.load_rank_state(step_dir, 0, out)
    assert h == header
    for (name, t), v in zip(tensors, out.values()):
        assert torch.equal(v, t.detach()), name
    # DCP wrote each view's own bytes, not the whole flat buffer it points into
    size = sum(f.stat().st_size for f in (step_dir / "rank_0").iterdir())
    assert size < 2 * layout.nbytes + 100_000
    # free again: the next period's state is accepted
    assert p.submit(12, layout.state_dict(other), _header(12), world_size=1) is True
    p.close()
    assert p.last_step_written == 12 and checkpoint.latest_complete_step(tmp_path) == 12


def test_async_persister_steps_count_only_when_every_rank_wrote(tmp_path):
    state = {"w": torch.randn(8, 8)}
    p0, p1 = AsyncPersister(tmp_path, rank=0), AsyncPersister(tmp_path, rank=1)
    assert p0.submit(4, dict(state), {"step": 4}, world_size=2)
    p0.wait()
    assert checkpoint.latest_complete_step(tmp_path) is None
    assert p1.submit(4, dict(state), {"step": 4}, world_size=2)
    p1.wait()
    assert checkpoint.latest_complete_step(tmp_path) == 4


def test_a_failed_write_surfaces_from_wait(tmp_path):
    root = tmp_path / "not_a_dir"
    root.write_text("a file where the checkpoint root should be")
    p = AsyncPersister(root, rank=3)
    assert p.submit(6, {"w": torch.ones(3)}, {"step": 6}, world_size=4) is True  # no raise here
    with pytest.raises(CheckpointWriteError, match=r"step 6 \(rank 3\) to .*not_a_dir/step_6/rank_3"):
        p.wait()
    assert p.wait() is True  # reported once
    assert p.last_step_written is None


def test_a_failed_synchronous_save_names_step_and_directory(tmp_path):
    root = tmp_path / "not_a_dir"
    root.write_text("x")
    with pytest.raises(CheckpointWriteError, match=r"step 2 \(rank 1\) to .*step_2/rank_1"):
        checkpoint.save_rank_state(root, 2, 1, {"w": torch.ones(3)}, {"step": 2})


def test_a_failed_write_surfaces_from_the_next_submit(tmp_path):
    root = tmp_path / "not_a_dir"
    root.write_text("x")
    p = AsyncPersister(root, rank=0)
    assert p.submit(8, {"w": torch.ones(3)}, {"step": 8}, world_size=1) is True
    deadline = time.monotonic() + 60
    while p.in_flight:
        assert time.monotonic() < deadline, "the failed write never finished"
        threading.Event().wait(0.005)
    with pytest.raises(CheckpointWriteError, match="step 8") as info:
        p.submit(9, {"w": torch.ones(3)}, {"step": 9}, world_size=1)
    assert isinstance(info.value.__cause__, NotADirectoryError)
    assert "NotADirectoryError" in str(info.value)
    # the persister is usable again once the root is fixed
    root.unlink()
    assert p.submit(9, {"w": torch.ones(3)}, {"step": 9}, world_size=1) is True
    p.close()
    assert checkpoint.latest_complete_step(root) == 9


def _write_old_format(root, step, state, rng_payload):
    d = checkpoint.rank_dir(root, step, 0)
    d.mkdir(parents=True)
    dcp.save(state, checkpoint_id=str(d), no_dist=True)
    (d / "header.json").write_text(json.dumps({"step": step}))
    torch.save(rng_payload, d / "rng.pt")
    checkpoint.write_meta(root, step, 1, "periodic")
    return root / f"step_{step}"


def test_an_old_checkpoint_with_rng_pt_loads_into_the_json_form(tmp_path):
    state = {"w": torch.randn(5)}
    rng = torch.get_rng_state()
    step_dir = _write_old_format(tmp_path, 3, state, {"rng_cpu": rng})
    out = {"w": torch.zeros(5)}
    h = checkpoint.load_rank_state(step_dir, 0, out)
    assert h["step"] == 3 and isinstance(h["rng_cpu"], str)
    assert torch.equal(checkpoint.decode_rng_state(h["rng_cpu"]), rng)
    assert torch.equal(out["w"], state["w"])


class _NotATensor:
    pass


def test_old_rng_pt_is_loaded_with_weights_only(tmp_path):
    step_dir = _write_old_format(tmp_path, 3, {"w": torch.ones(2)}, {"rng_cpu": _NotATensor()})
    with pytest.raises(pickle.UnpicklingError, match="[Ww]eights only"):
        checkpoint.load_rank_state(step_dir, 0, {"w": torch.zeros(2)})


_ran = []


def _pwned():
    _ran.append(True)


class _Evil:
    def __reduce__(self):
        return _pwned, ()


def test_dcp_metadata_is_not_unpickled_blindly(tmp_path):
    state = {"w": torch.randn(3)}
    checkpoint.save_rank_state(tmp_path, 1, 0, state, {"step": 1})
    checkpoint.write_meta(tmp_path, 1, 1, "test")
    out = {"w": torch.zeros(3)}
    checkpoint.load_rank_state(tmp_path / "step_1", 0, out)  # the real metadata passes
    assert torch.equal(out["w"], state["w"])
    (tmp_path / "step_1" / "rank_0" / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(Exception, match="_pwned.*refusing"):  # DCP reports it as AssertionError
        checkpoint.load_rank_state(tmp_path / "step_1", 0, out)
    assert _ran == []


def test_incomplete_steps_are_ignored(tmp_path):
    state = {"w": torch.ones(2)}
    for r in (0, 1):
        checkpoint.save_rank_state(tmp_path, 2, r, state, {"step": 2})
    checkpoint.write_meta(tmp_path, 2, 2, "periodic")
    checkpoint.save_rank_state(tmp_path, 4, 0, state, {"step": 4})  # rank 1 never finished
    checkpoint.write_meta(tmp_path, 4, 2, "periodic")
    checkpoint.save_rank_state(tmp_path, 6, 0, state, {"step": 6})  # no meta.json yet
    (tmp_path / "step_6" / "rank_1").mkdir()                        # nor rank 1's header
    (tmp_path / "step_8").mkdir()
    (tmp_path / "step_8" / "meta.json").write_text("{torn")        # unreadable meta
    (tmp_path / "step_9.old").mkdir()                               # not a step directory
    assert checkpoint.latest_complete_step(tmp_path) == 2
    assert checkpoint.latest_step_dir(tmp_path).name == "step_2"
    with pytest.raises(FileNotFoundError, match="incomplete"):
        checkpoint.latest_step_dir(tmp_path / "step_4")
    assert checkpoint.latest_complete_step(tmp_path / "missing") is None
    with pytest.raises(FileNotFoundError, match="no complete"):
        checkpoint.latest_step_dir(tmp_path / "missing")
