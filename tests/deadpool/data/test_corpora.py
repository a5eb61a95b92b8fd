"""prepare with a user's tokenizer.json and JSONL / Parquet corpora: the tokens are the
tokenizer's own encoding (its BOS/EOS included), the file is handed back byte for byte (prepared
directory and export), every format and every ``--workers`` gives the same shards, and bad input
is refused naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from deadpool.data import check_data
from deadpool.data.prepare import PrepareError, main, prepare
from tests.deadpool.data.test_prepare import all_tokens

quiet = lambda *a, **k: None  # noqa: E731
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

DOCS = [f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 5 + 1)
        + ("ünïcödé ☃ 日本\n" if i % 3 == 0 else "") for i in range(60)]


def llama3_like(directory: Path, vocab_size: int = 400, extra_specials: int = 0) -> Path:
    """A byte-level BPE framed as Llama 3's: BOS added by the post-processor, EOS named only by
    tokenizer_config.json (and ``extra_specials`` reserved tokens, to enlarge the vocabulary)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [BOS, EOS] + [f"<|reserved_{i}|>" for i in range(extra_specials)]
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": {"content": EOS}}))
    return directory / "tokenizer.json"


def as_text(tmp_path: Path) -> Path:
    p = tmp_path / "plain"
    p.mkdir()
    for i, d in enumerate(DOCS):  # one document per file
        (p / f"{i:03d}.txt").write_text(d)
    return p


def as_jsonl(tmp_path: Path, field: str = "text", files: int = 3) -> Path:
    p = tmp_path / f"jsonl{files}"
    p.mkdir()
    per = -(-len(DOCS) // files)
    for k in range(files):
        with open(p / f"part{k}.jsonl", "w") as f:
            for d in DOCS[k * per:(k + 1) * per]:
                f.write(json.dumps({field: d, "id": 1}) + "\n")
    return p


def test_a_user_tokenizer_gives_its_own_encoding_and_is_kept_byte_for_byte(tmp_path):
    path = llama3_like(tmp_path / "tok")
    out = tmp_path / "out"
    m = prepare([as_text(tmp_path)], out, tokenizer=str(path), val_fraction=0.1,
                shard_tokens=500, log=quiet)
    tok = Tokenizer.from_file(str(path))
    eos, bos = tok.token_to_id(EOS), tok.token_to_id(BOS)
    want = [i for d in DOCS for i in tok.encode(d).ids + [eos]]  # tokenizers' own encoding
    assert want[0] == bos and all_tokens(out, m).tolist() == want
    assert m["eos_id"] == eos and m["vocab_size"] == tok.get_vocab_size()
    assert m["tokenizer"]["eos_token"] == EOS and m["tokenizer"]["bos_token"] == BOS
    assert (out / "tokenizer.json").read_bytes() == path.read_bytes()
    assert m["tokenizer"]["kind"] == "file"


def test_jsonl_parquet_and_plain_text_give_the_same_shards_with_any_workers(tmp_path):
    path = llama3_like(tmp_path / "tok")
    opts = dict(tokenizer=str(path), val_fraction=0.1, shard_tokens=700, log=quiet)
    ref = prepare([as_text(tmp_path)], tmp_path / "plain_out", **opts)
    outs = {"jsonl": prepare([as_jsonl(tmp_path, field="body")], tmp_path / "j1",
                             text_field="body", **opts),
            "jsonl_w2": prepare([as_jsonl(tmp_path, field="body", files=4)], tmp_path / "j2",
                                text_field="body", workers=2, **opts),
            "plain_w2": prepare([tmp_path / "plain"], tmp_path / "p2", workers=2, **opts)}
    pa = pytest.importorskip("pyarrow", reason="pyarrow (optional) not installed: Parquet untested")
    import pyarrow.parquet as pq
    pdir = tmp_path / "pq"
    pdir.mkdir()
    pq.write_table(pa.table({"id": list(range(30)), "content": DOCS[:30]}), pdir / "a.parquet",
                   row_group_size=7)
    pq.write_table(pa.table({"content": DOCS[30:]}), pdir / "b.parquet")
    outs["parquet_w2"] = prepare([pdir], tmp_path / "pq_out", text_column="content", workers=2,
                                 **opts)
    shards = lambda m: [(s["file"], s["tokens"], s["xxh3"])  # noqa: E731
                        for sp in ("train", "val") for s in m["splits"][sp]["shards"]]
    for name, m in outs.items():
        assert shards(m) == shards(ref), name
        assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == len(DOCS)


def test_bad_input_is_refused_naming_it(tmp_path):
    path = llama3_like(tmp_path / "tok")
    text = as_text(tmp_path)
    with pytest.raises(PrepareError, match="no such file"):
        prepare([text], tmp_path / "o1", tokenizer=str(tmp_path / "nope.json"), log=quiet)
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(PrepareError, match="not a Hugging Face tokenizer.json"):
        prepare([text], tmp_path / "o2", tokenizer=str(tmp_path / "junk.json"), log=quiet)
    with pytest.raises(PrepareError, match="'<nope>' is not in the tokenizer's vocabulary"):
        prepare([text], tmp_path / "o3", tokenizer=str(path), eos_token="<nope>", log=quiet)
    with pytest.raises(PrepareError, match=r"part0.jsonl:1: .*'text' field"):
        prepare([as_jsonl(tmp_path, field="body")], tmp_path / "o4", tokenizer="byte", log=quiet)
    pa = pytest.importorskip("pyarrow", reason="pyarrow (optional) not installed")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "c.parquet")
    with pytest.raises(PrepareError, match=r"c.parquet: no column 'text' .*columns are body"):
        prepare([tmp_path / "c.parquet"], tmp_path / "o5", tokenizer="byte", log=quiet)
    assert not (tmp_path / "o5").exists()  # refused before anything was written


def test_a_tokenizer_larger_than_the_model_is_refused_at_launch(tmp_path):
    path = llama3_like(tmp_path / "tok", vocab_size=1000, extra_specials=300)
    assert main(["--input", str(as_text(tmp_path)), "--out", str(tmp_path / "out"),
                 "--tokenizer", str(path), "--val-fraction", "0.1"]) == 0
    cfg = {"model": {"vocab_size": 512}, "seq_len": 16, "eval_every_steps": 0,
           "data": {"name": "tokens", "path": str(tmp_path / "out")}}
    with pytest.raises(ValueError, match=r"more than model.vocab_size=512"):
        check_data(cfg)
    cfg["model"]["vocab_size"] = 768
    check_data(cfg)


def test_the_export_hands_back_the_users_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from deadpool.export import copy_tokenizer
    path = llama3_like(tmp_path / "tok")
    prepare([as_text(tmp_path)], tmp_path / "out", tokenizer=str(path), log=quiet)
    cfg = {"model": {"max_seq_len": 64}, "data": {"name": "tokens", "path": str(tmp_path / "out")}}
    hf = tmp_path / "hf"
    hf.mkdir()
    eos, bos = copy_tokenizer(cfg, hf, quiet)
    assert (hf / "tokenizer.json").read_bytes() == path.read_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    assert (tok.eos_token, tok.bos_token) == (EOS, BOS) and tok.eos_token_id == eos
    assert tok.bos_token_id == bos != eos
    from deadpool.export.llama import hf_config  # config.json names the tokenizer's own BOS
    c = hf_config({"vocab_size": 512, "d_model": 32, "n_layers": 1, "n_heads": 2,
                   "ffn_mult": 4, "max_seq_len": 64}, torch.bfloat16, eos, bos)
    assert (c["bos_token_id"], c["eos_token_id"]) == (bos, eos)
    assert tok(DOCS[3])["input_ids"] == Tokenizer.from_file(str(path)).encode(DOCS[3]).ids


def test_one_large_file_is_shared_by_the_workers_with_the_same_bytes_out(tmp_path, monkeypatch):
    """A file past corpus.PART_BYTES is several parts (JSONL and text cut at line starts, a
    paragraph file after a blank line, Parquet by row groups) that 2 workers share, with the
    same shards as 1 worker and, where a part starts a document, as the file read whole."""
    import multiprocessing

    pa = pytest.importorskip("pyarrow", reason="pyarrow (optional) not installed")
    import pyarrow.parquet as pq

    from deadpool.data import corpus, encode
    path = llama3_like(tmp_path / "tok")
    big = tmp_path / "big"
    big.mkdir()
    with open(big / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in DOCS * 3)
    (big / "b.txt").write_text("\n\n".join(DOCS * 3))  # paragraphs
    pq.write_table(pa.table({"text": DOCS * 3}), big / "c.parquet", row_group_size=10)
    files = [big / "a.jsonl", big / "b.txt", big / "c.parquet"]
    pools = []
    real = multiprocessing.get_context

    class Spy:  # the parent's pool: how many processes it starts
        def __init__(self, method):
            self.ctx = real(method)

        def __getattr__(self, name):
            return getattr(self.ctx, name)

        def Pool(self, n, *a, **k):  # noqa: N802
            pools.append(n)
            return self.ctx.Pool(n, *a, **k)
    monkeypatch.setattr(encode.mp, "get_context", Spy)
    shards = lambda m: [(s["file"], s["tokens"], s["xxh3"])  # noqa: E731
                        for sp in ("train", "val") for s in m["splits"][sp]["shards"]]
    opts = dict(tokenizer=str(path), val_fraction=0.1, shard_tokens=900, log=quiet)
    whole = {d: prepare(files if d == "paragraph" else [big / "b.txt"], tmp_path / f"whole_{d}",
                        documents=d, **opts) for d in ("paragraph", "file")}
    monkeypatch.setattr(corpus, "PART_BYTES", 2000)  # each file becomes several parts
    for f in files:
        assert len(corpus.parts(f, corpus.Reading())) > 4, f.name
    for d, inputs in (("paragraph", files), ("file", [big / "b.txt"])):
        one = prepare(inputs, tmp_path / f"w1_{d}", workers=1, documents=d, **opts)
        del pools[:]
        two = prepare(inputs, tmp_path / f"w2_{d}", workers=2, documents=d, **opts)
        assert pools == [2], d
        assert shards(one) == shards(two), d  # bitwise, whatever --workers
        n_docs = one["splits"]["train"]["documents"] + one["splits"]["val"]["documents"]
        if d == "paragraph":  # every part starts a document: as if each file were read whole
            assert shards(one) == shards(whole[d]) and n_docs == 9 * len(DOCS)
        else:
            assert n_docs == 1
