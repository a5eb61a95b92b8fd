"""python -m deadpool.data.prepare: tokens round-trip to the text, the manifest's checksums
describe the files, and bad input is refused with a message that says what is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from deadpool.data import manifest as mf
from deadpool.data.fables import generate
from deadpool.data.prepare import PrepareError, prepare

ROOT = Path(__file__).resolve().parents[3]
quiet = lambda *a, **k: None  # noqa: E731

DOCS = ["The first document.\nIt has two lines, and ünïcödé: ☃ 日本.\n",
        "Second one:   spaces,\ttabs\r\nand a CRLF.",
        "x" * 3000 + "\n" + "a third, longer document " * 50]


def write_docs(tmp_path, docs=DOCS) -> list[Path]:
    paths = []
    for i, text in enumerate(docs):
        p = tmp_path / "in" / f"doc{i}.txt"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(text.encode())
        paths.append(p)
    return paths


def all_tokens(out: Path, m: dict) -> np.ndarray:
    parts = [np.fromfile(out / s["file"], dtype=m["dtype"])
             for split in ("train", "val") for s in m["splits"][split]["shards"]]
    return np.concatenate(parts)


def documents(out: Path, m: dict) -> list[str]:
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids, eos = all_tokens(out, m).tolist(), m["eos_id"]
    docs, cur = [], []
    for t in ids:
        if t == eos:
            docs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(t)
    assert not cur, "the stream ends with an end-of-document token"
    return docs


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_tokens_round_trip_to_the_documents_across_shards_and_the_split(tmp_path, kind):
    out = tmp_path / "out"
    m = prepare(write_docs(tmp_path), out, tokenizer=kind, vocab_size=300, shard_tokens=100,
                val_fraction=0.2, log=quiet)
    assert documents(out, m) == DOCS
    tr, va = m["splits"]["train"], m["splits"]["val"]
    assert len(tr["shards"]) > 1 and va["tokens"] > 0
    assert va["tokens"] == round(0.2 * (tr["tokens"] + va["tokens"]))
    assert tr["documents"] + va["documents"] == len(DOCS)
    if kind == "byte":  # ids are the UTF-8 bytes, 256 the boundary
        assert m["vocab_size"] == 257 and m["eos_id"] == 256
        assert all_tokens(out, m)[:10].tolist() == list(DOCS[0].encode()[:10])
    else:
        assert m["vocab_size"] <= 300 and all_tokens(out, m).size < sum(len(d.encode()) for d in DOCS)


def test_paragraphs_and_jsonl_lines_are_documents(tmp_path):
    (tmp_path / "a.txt").write_text("para one\nstill one\n\n\npara two\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "json doc"}) + "\n\n"
                                      + json.dumps({"text": "another"}) + "\n")
    out = tmp_path / "out"
    m = prepare([tmp_path / "a.txt", tmp_path / "b.jsonl"], out, tokenizer="byte",
                val_fraction=0.0, documents="paragraph", log=quiet)
    assert documents(out, m) == ["para one\nstill one\n", "para two\n", "json doc", "another"]


def test_same_input_same_bytes_and_the_manifest_checksums_the_files(tmp_path):
    inputs = write_docs(tmp_path)
    a = prepare(inputs, tmp_path / "a", vocab_size=280, shard_tokens=500, log=quiet)
    prepare(inputs, tmp_path / "b", vocab_size=280, shard_tokens=500, log=quiet)
    for name, nbytes, xxh in mf.files(a):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
        assert mf.file_xxh3(tmp_path / "a" / name) == xxh
        if nbytes is not None:
            assert (tmp_path / "a" / name).stat().st_size == nbytes
    mf.verify(tmp_path / "a", a)
    shard = tmp_path / "a" / a["splits"]["train"]["shards"][0]["file"]
    raw = bytearray(shard.read_bytes())
    raw[5] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="corrupted"):
        mf.verify(tmp_path / "a", a)


def test_clear_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(PrepareError, match="empty"):
        prepare([empty], tmp_path / "o1", log=quiet)
    with pytest.raises(PrepareError, match="no such file"):
        prepare([tmp_path / "missing.txt"], tmp_path / "o2", log=quiet)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(PrepareError, match="not UTF-8"):
        prepare([bad], tmp_path / "o3", tokenizer="byte", log=quiet)
    text = write_docs(tmp_path)
    with pytest.raises(PrepareError, match="does not fit uint16"):
        prepare(text, tmp_path / "o4", vocab_size=70000, dtype="uint16", log=quiet)
    with pytest.raises(PrepareError, match="too small"):
        prepare(text, tmp_path / "o5", vocab_size=100, log=quiet)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n\n")
    with pytest.raises(PrepareError, match="no text"):
        prepare([blank], tmp_path / "o6", documents="paragraph", log=quiet)
    prepare(text, tmp_path / "o7", tokenizer="byte", log=quiet)
    with pytest.raises(PrepareError, match="already holds"):
        prepare(text, tmp_path / "o7", tokenizer="byte", log=quiet)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file_is_named(tmp_path):
    p = tmp_path / "secret.txt"
    p.write_text("hidden")
    p.chmod(0)
    with pytest.raises(PrepareError, match="not readable"):
        prepare([p], tmp_path / "o", log=quiet)


def test_command_line_reports_progress_and_errors(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "deadpool.data.prepare", "--input", str(ROOT / "data" / "fables.txt"),
           "--out", str(tmp_path / "out"), "--vocab-size", "512", "--documents", "paragraph"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert "encode" in p.stderr and "MB/s" in p.stderr and "done in" in p.stderr
    assert (tmp_path / "out" / "manifest.json").exists()
    bad = [*cmd[:4], str(tmp_path / "nope"), "--out", str(tmp_path / "x")]
    p = subprocess.run(bad, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2 and "no such file" in p.stderr and "Traceback" not in p.stderr


def test_the_shipped_corpus_is_the_generators_output():
    assert (ROOT / "data" / "fables.txt").read_text(encoding="utf-8") == generate()


def test_a_failure_midway_leaves_no_partial_shards(tmp_path):
    good = tmp_path / "a.txt"
    good.write_text("fine text\n" * 50)
    bad = tmp_path / "b.txt"
    bad.write_bytes(b"ok so far \xff\xfe broken")
    out = tmp_path / "out"
    # byte tokenizer: nothing reads the input before encoding, so a.txt's shard is written first
    with pytest.raises(PrepareError, match="not UTF-8"):
        prepare([good, bad], out, tokenizer="byte", shard_tokens=64, log=quiet)
    assert list(out.iterdir()) == []
    assert good.read_text() == "fine text\n" * 50  # inputs untouched


def test_the_defaults_fit_the_default_model(tmp_path):
    """A bare ``prepare`` must write shards a bare ``deadpool.train`` (model=tiny) can train on:
    the BPE's vocabulary is the model's, a text file is documents by paragraph, and a BPE that
    learns fewer tokens than asked says so."""
    import yaml
    text = tmp_path / "fables.txt"
    text.write_text(generate()[:120_000])
    lines = []
    m = prepare([text], tmp_path / "out", log=lines.append)
    tiny = yaml.safe_load((ROOT / "conf" / "model" / "tiny.yaml").read_text())["vocab_size"]
    assert m["vocab_size"] == tiny == 512
    n_paragraphs = sum(1 for p in text.read_text().split("\n\n") if p.strip())
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == n_paragraphs > 100
    assert not any("warning" in ln for ln in lines)
    small = tmp_path / "small.txt"
    small.write_text("a tiny corpus, far too small for many merges.\n\nanother line.\n")
    lines = []
    m = prepare([small], tmp_path / "out_small", log=lines.append)
    got = m["vocab_size"]
    assert got < 512
    (warn,) = [ln for ln in lines if "warning" in ln]
    assert f"learnt {got} tokens, fewer than the 512 asked" in warn
    assert "model.vocab_size" in warn and m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == 2
