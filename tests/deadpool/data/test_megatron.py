"""data=megatron: the project's writer lays out PREFIX.bin/.idx byte for byte as Megatron-LM's
MMapIndexedDataset (checked against the layout written out by hand here), the reader gives back
what was written, batches are data=tokens's for the same token stream (same stateless order),
and a bad prefix is refused before any process starts naming what is wrong."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from deadpool.data import build_data, check_data, megatron
from deadpool.data.prepare import prepare
from deadpool.data.tokens import TokenDataset

quiet = lambda *a, **k: None  # noqa: E731
DOCS = [[5, 6, 7], [1], [300, 301, 302, 303, 65535], [9, 9]]


def test_the_writer_follows_the_documented_layout_byte_by_byte(tmp_path):
    prefix = tmp_path / "corpus_text_document"
    megatron.write(prefix, DOCS, dtype="uint16")
    # the layout, written out independently of the module (Megatron-LM's indexed_dataset.py)
    want = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)  # uint16 is code 8
            + struct.pack("<Q", 4) + struct.pack("<Q", 5)  # 4 sequences, 5 document indices
            + struct.pack("<4i", 3, 1, 5, 2)  # lengths (int32)
            + struct.pack("<4q", 0, 6, 8, 18)  # byte offsets into .bin (int64)
            + struct.pack("<5q", 0, 1, 2, 3, 4))  # document indices (int64)
    assert (tmp_path / "corpus_text_document.idx").read_bytes() == want
    assert (tmp_path / "corpus_text_document.bin").read_bytes() == struct.pack(
        "<11H", *[t for d in DOCS for t in d])
    index = megatron.read_index(prefix)
    lengths, pointers, docs = index.arrays()
    assert index.dtype == "uint16" and index.num_tokens == 11
    assert lengths.tolist() == [3, 1, 5, 2] and pointers.tolist() == [0, 6, 8, 18]
    assert docs.tolist() == [0, 1, 2, 3, 4]
    for dtype, code in (("int32", 4), ("int64", 5), ("uint8", 1)):
        megatron.write(tmp_path / dtype, [[1, 2]], dtype=dtype)
        assert (tmp_path / f"{dtype}.idx").read_bytes()[17] == code


def test_read_back_equal_and_batches_are_the_tokens_order(tmp_path):
    text = tmp_path / "docs.txt"
    text.write_text("".join(f"Doc {i}: " + "words and more words " * (i % 5 + 1) + "\n\n"
                            for i in range(200)))
    tok_dir = tmp_path / "tok"
    m = prepare([text], tok_dir, tokenizer="byte", val_fraction=0.1, documents="paragraph",
                log=quiet)
    (train,), (val,) = m["splits"]["train"]["shards"], m["splits"]["val"]["shards"]
    stream = np.fromfile(tok_dir / train["file"], dtype="<u2")
    # the same stream as Megatron documents (cut at the end-of-document token)
    cuts = np.flatnonzero(stream == m["eos_id"]) + 1
    docs = [d for d in np.split(stream, cuts) if d.size]
    megatron.write(tmp_path / "train", docs)
    megatron.write(tmp_path / "val", [np.fromfile(tok_dir / val["file"], dtype="<u2")])
    kw = dict(seed=3, seq_len=16, batch_size=4, global_batches=2)
    a = TokenDataset(tok_dir, **kw)
    b = megatron.MegatronDataset(tmp_path / "train", val_path=tmp_path / "val", **kw)
    assert np.array_equal(b.train.shards[0], stream)  # read back equal
    assert b.train.num_samples == a.train.num_samples
    for step in (0, 1, 7, 500):  # 500: a later epoch
        for i in (0, 1):
            assert all(torch.equal(x, y) for x, y in zip(a.batch(step, i, 4, 16), b.batch(step, i, 4, 16)))
    assert all(torch.equal(x, y) for x, y in zip(a.eval_batch(2, 4, 16), b.eval_batch(2, 4, 16)))
    cfg = {"seed": 3, "seq_len": 16, "batch_size": 4, "parallel": {"dp": 2},
           "model": {"vocab_size": 512}, "eval_every_steps": 0,
           "data": {"name": "megatron", "path": str(tmp_path / "train")}}
    check_data(cfg)
    assert torch.equal(build_data(cfg).batch(3, 1, 4, 16)[0], a.batch(3, 1, 4, 16)[0])


def test_a_bad_prefix_is_refused_naming_it(tmp_path):
    cfg = {"seq_len": 4, "model": {"vocab_size": 65536}, "eval_every_steps": 0,
           "data": {"name": "megatron", "path": str(tmp_path / "c")}}
    megatron.write(tmp_path / "c", DOCS)
    check_data(cfg)
    with pytest.raises(ValueError, match=r"data.val_path=PREFIX"):
        check_data(dict(cfg, eval_every_steps=5))
    with pytest.raises(ValueError, match=r"fewer than one sequence of seq_len=20"):
        check_data(dict(cfg, seq_len=20))
    idx = (tmp_path / "c.idx").read_bytes()
    (tmp_path / "c.idx").unlink()
    with pytest.raises(ValueError, match=r"data.path=.*c.idx is missing"):
        check_data(cfg)
    (tmp_path / "c.idx").write_bytes(b"NOTMAGIC!" + idx[9:])
    with pytest.raises(ValueError, match="not a Megatron-LM MMapIndexedDataset v1 index"):
        check_data(cfg)
    (tmp_path / "c.idx").write_bytes(idx[:17] + bytes([7]) + idx[18:])
    with pytest.raises(ValueError, match=r"dtype code 7 \(float32\)"):
        check_data(cfg)
    (tmp_path / "c.idx").write_bytes(idx[:40])
    with pytest.raises(ValueError, match="truncated"):
        check_data(cfg)
    (tmp_path / "c.idx").write_bytes(idx)
    with open(tmp_path / "c.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match="the pair does not match"):
        check_data(cfg)


def test_a_token_id_past_the_vocabulary_is_refused_before_launch(tmp_path, monkeypatch):
    cfg = {"seq_len": 4, "model": {"vocab_size": 512}, "eval_every_steps": 0,
           "data": {"name": "megatron", "path": str(tmp_path / "c")}}
    megatron.write(tmp_path / "c", [[1, 2, 3, 4, 5], [6, 511, 8]], dtype="uint16")
    check_data(cfg)  # 511 < 512: fine
    megatron.write(tmp_path / "c", [[1, 2, 3, 4, 5], [6, 512, 8]], dtype="uint16")
    with pytest.raises(ValueError, match=r"token id 512 .* outside model.vocab_size=512"):
        check_data(cfg)
    # a dtype that cannot hold an id >= vocab_size is not read at all
    megatron.write(tmp_path / "u8", [[1, 2, 255, 4, 5]], dtype="uint8")
    monkeypatch.setattr(megatron, "check_ids", lambda *a, **k: pytest.fail("read a uint8 stream"))
    check_data({**cfg, "data": {"name": "megatron", "path": str(tmp_path / "u8")}})


def test_a_large_stream_is_checked_in_the_background_and_stops_the_job(tmp_path, monkeypatch):
    import threading

    from deadpool.data import start_verify
    megatron.write(tmp_path / "c", [list(range(100)), [7, 9000, 3] * 50], dtype="uint16")
    cfg = {"seq_len": 4, "model": {"vocab_size": 512}, "eval_every_steps": 0,
           "data": {"name": "megatron", "path": str(tmp_path / "c")}}
    monkeypatch.setattr(megatron, "SCAN_AT_LAUNCH_BYTES", 16)  # "large": past the launch budget
    monkeypatch.setattr(megatron, "CHUNK_TOKENS", 64)
    check_data(cfg)  # launch does not read it
    bad, done = [], threading.Event()
    v = start_verify(cfg, lambda why: (bad.append(why), done.set()), lambda *a, **k: None)
    assert v is not None and done.wait(30)
    assert "token id 9000" in bad[0] and "model.vocab_size=512" in bad[0] and v.error == bad[0]
    v.finish()
    megatron.write(tmp_path / "c", [list(range(100)), [7, 9, 3] * 50], dtype="uint16")
    v = start_verify(cfg, lambda why: pytest.fail(why), lambda *a, **k: None)
    v.finish(timeout_s=30)
    assert v.error is None and v.checked == 1
