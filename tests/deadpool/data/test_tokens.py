"""data=tokens: a batch is a pure function of (seed, step, index), the global batch does not
depend on the data-parallel width, epochs cover every sample once, and a bad directory is
refused before any process starts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deadpool.data import build_data
from deadpool.data.order import permute
from deadpool.data.prepare import prepare
from deadpool.data.tokens import TokenDataset
from deadpool.launch.job import validate
from deadpool.rank.trainer import batch_indices
from tests.conftest import compose_train

quiet = lambda *a, **k: None  # noqa: E731
SEQ, B = 16, 4


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    docs = d / "docs.txt"
    docs.write_text("".join(f"Document {i}: " + "some words here " * (i % 7 + 1) + "\n\n"
                            for i in range(300)))
    prepare([docs], d / "out", tokenizer="byte", shard_tokens=2000, val_fraction=0.1,
            documents="paragraph", log=quiet)
    return d / "out"


def dataset(path, seed=7, global_batches=4):
    return TokenDataset(path, seed=seed, seq_len=SEQ, batch_size=B, global_batches=global_batches)


@pytest.mark.parametrize("n", [1, 2, 5, 16, 17, 1000, 4097])
def test_each_epoch_is_a_permutation(n):
    for epoch in (0, 3):
        p = permute(np.arange(n), n, seed=11, epoch=epoch)
        assert sorted(p.tolist()) == list(range(n))
    if n > 16:  # different epochs and seeds give different orders
        assert not np.array_equal(permute(np.arange(n), n, 11, 0), permute(np.arange(n), n, 11, 1))
        assert not np.array_equal(permute(np.arange(n), n, 11, 0), permute(np.arange(n), n, 12, 0))


def test_a_batch_is_a_pure_function_of_seed_step_and_index(prepared):
    a, b = dataset(prepared), dataset(prepared)
    for step, i in [(0, 0), (3, 2), (250, 1)]:
        xa, ya = a.batch(step, i, B, SEQ)
        # another instance, asked in another order, after other batches
        b.batch(step + 1, i, B, SEQ)
        xb, yb = b.batch(step, i, B, SEQ)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])  # targets are the next tokens
    assert not torch.equal(a.batch(0, 0, B, SEQ)[0], a.batch(0, 1, B, SEQ)[0])
    assert not torch.equal(a.batch(0, 0, B, SEQ)[0], dataset(prepared, seed=8).batch(0, 0, B, SEQ)[0])


def test_samples_are_windows_of_the_train_stream(prepared):
    ds = dataset(prepared)
    stream = np.concatenate([np.asarray(s) for s in ds.train.shards])
    ids = ds.sample_ids(5, 3)
    x, y = ds.batch(5, 3, B, SEQ)
    # every sample lies inside one shard: find it in the concatenated stream by its shard offset
    for row, i in enumerate(ids):
        k = np.searchsorted(ds.train.first, i, side="right") - 1
        off = sum(len(s) for s in ds.train.shards[:k]) + (i - ds.train.first[k]) * SEQ
        assert x[row].tolist() == stream[off:off + SEQ].tolist()
        assert y[row, -1].item() == stream[off + SEQ]


def test_epochs_cover_every_sample_once(prepared):
    ds = dataset(prepared, global_batches=2)
    n, per_step = ds.train.num_samples, 2 * B
    steps = (3 * n) // per_step + 1
    seen = np.concatenate([ds.sample_ids(s, i) for s in range(steps) for i in range(2)])
    for epoch in range(3):
        assert sorted(seen[epoch * n:(epoch + 1) * n].tolist()) == list(range(n))
    assert not np.array_equal(seen[:n], seen[n:2 * n])  # a fresh order each epoch


def test_global_batch_is_the_same_at_any_data_parallel_width(prepared):
    """An elastic job at dp=3 (global_dp=4) draws the same sequences per step as dp=4: each rank
    computes the batch indices ``trainer.batch_indices`` gives it."""
    ds = dataset(prepared, global_batches=4)

    def global_batch(step, dp):
        rows = {}
        for rank in range(dp):
            for i in batch_indices(4, dp, rank):
                rows[i] = ds.batch(step, i, B, SEQ)[0]
        return torch.cat([rows[i] for i in range(4)])

    for step in (0, 7):
        ref = global_batch(step, 4)
        for dp in (1, 2, 3):
            assert torch.equal(global_batch(step, dp), ref)


def test_an_elastic_relaunch_config_builds_the_same_batches(tmp_path, prepared):
    """The relaunch after a shrink runs at parallel.dp=3 with global_dp=4 (job._relaunch_cfg):
    its data source numbers the global batch as the full-width job's did."""
    full = build_data(_cfg(tmp_path, prepared, "parallel=dp4", f"batch_size={B}"))
    narrow = build_data(_cfg(tmp_path, prepared, "parallel=dp4", "parallel.dp=3",
                             "parallel.global_dp=4", f"batch_size={B}"))
    for step, i in [(0, 3), (9, 1)]:
        assert torch.equal(full.batch(step, i, B, SEQ)[0], narrow.batch(step, i, B, SEQ)[0])


def test_validation_batches_come_from_the_held_out_split(prepared):
    ds = dataset(prepared)
    x, y = ds.eval_batch(0, B, SEQ)
    val = np.concatenate([np.asarray(s) for s in ds.val.shards])
    assert x[0].tolist() == val[:SEQ].tolist()
    assert torch.equal(ds.eval_batch(1, B, SEQ)[0], ds.eval_batch(1, B, SEQ)[0])


def _cfg(tmp_path, path, *extra):
    return compose_train(["model=tiny", "parallel=dp2", "data=tokens", f"data.path={path}",
                          f"seq_len={SEQ}", *extra], tmp_path / "run")


def test_build_data_picks_the_source_by_config(tmp_path, prepared):
    assert type(build_data(_cfg(tmp_path, prepared))).__name__ == "TokenDataset"
    assert type(build_data(compose_train(["model=tiny"], tmp_path / "r"))).__name__ == "SyntheticCorpus"


def test_bad_data_is_refused_before_any_process_starts(tmp_path, prepared, monkeypatch):
    validate(_cfg(tmp_path, prepared, "eval_every_steps=5"))
    monkeypatch.chdir(prepared.parent)  # a relative path is made absolute for the processes
    cfg = _cfg(tmp_path, prepared.name)
    validate(cfg)
    assert cfg["data"]["path"] == str(prepared.resolve())
    with pytest.raises(ValueError, match="needs data.path"):
        validate(compose_train(["model=tiny", "data=tokens"], tmp_path / "run"))
    with pytest.raises(ValueError, match="no such directory"):
        validate(_cfg(tmp_path, tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="model.vocab_size"):
        validate(_cfg(tmp_path, prepared, "model.vocab_size=128", "model.n_heads=4"))
    with pytest.raises(ValueError, match=r"split \(\d+ tokens\) has no sequence of seq_len=4000"):
        validate(_cfg(tmp_path, prepared, "seq_len=4000", "model.max_seq_len=4096"))
    # a corrupted copy: one flipped byte in a shard of the right size
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(prepared, bad)
    shard = sorted(bad.glob("train_*.bin"))[1]
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0x40
    shard.write_bytes(bytes(raw))
    validate(_cfg(tmp_path, bad))  # launch reads no shard: the job's background check
    # catches it (tests/deadpool/data/test_verify.py)
    shard.write_bytes(bytes(raw[:-2]))  # truncated
    with pytest.raises(ValueError, match="changed since it was prepared"):
        validate(_cfg(tmp_path, bad))
    shard.unlink()
    with pytest.raises(ValueError, match="is missing"):
        validate(_cfg(tmp_path, bad))
