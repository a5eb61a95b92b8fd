"""``python -m deadpool.data.prepare --input PATH... --out DIR``: text in, token shards out.

Reads text, JSONL and Parquet files (a directory: every file under it, sorted; ``corpus.py``),
tokenizes them with a user's Hugging Face ``tokenizer.json`` (``--tokenizer PATH``: kept byte
for byte, its special tokens framing each document as its own post-processor does, e.g. Llama
3's BOS), a byte-level BPE trained offline on the input (``--tokenizer bpe``, the default) or
bytes (``--tokenizer byte``); encodes every document followed by the end-of-document token,
over files in parallel (``--workers``; ``encode.py``), writes the token stream as
``train_NNNNN.bin`` shards of ``--shard-tokens`` tokens, moves its last ``--val-fraction`` into
``val_NNNNN.bin`` (held out: never trained on), and writes ``tokenizer.json`` and
``manifest.json`` (last; see ``manifest.py``) with every file's checksum.

Documents: a ``.jsonl`` line's ``--text-field`` ("text"), a ``.parquet`` row's
``--text-column`` ("text"), or in a text file each blank-line-separated paragraph (the default;
``--documents file``: the whole file). The end-of-document token's literal text inside a
document is read as a boundary. Same inputs and options, same bytes out, whatever ``--workers``.

The BPE's ``--vocab-size`` defaults to the vocabulary of ``--model`` (``conf/model/<name>.yaml``;
the training default, ``tiny``: 512), so the shards fit the model a bare ``deadpool.train``
builds. A BPE that learns fewer tokens than asked (too little text for more merges) is said
in a warning line, with what ``model.vocab_size`` then needs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from deadpool.data import manifest as mf
from deadpool.data.corpus import PrepareError, Reading, check_inputs, input_files, pieces
from deadpool.data.encode import encode_all
from deadpool.data.tokenizer import (EOS, MIN_BPE_VOCAB, byte_tokenizer, load_tokenizer, specials,
                                     train_bpe)

__all__ = ["PrepareError", "input_files", "pieces", "prepare", "main", "model_vocab_size"]
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # the runtime's configs (conf/model/)
DEFAULT_MODEL = "tiny"  # conf/train.yaml's default model group


def model_vocab_size(model: str = DEFAULT_MODEL) -> int:
    """``vocab_size`` of ``conf/model/<model>.yaml``, read as YAML (no Hydra composition)."""
    import yaml
    path = CONF_DIR / "model" / f"{model}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
        raise PrepareError(f"--model {model}: no conf/model/{model}.yaml (one of "
                           f"{', '.join(names)})")
    return int(yaml.safe_load(path.read_text())["vocab_size"])

class Progress:
    """One line on stderr, redrawn at most once a second (a new line each time when stderr is
    not a terminal, every 10 s)."""

    def __init__(self, what: str, total_bytes: int):
        self.what, self.total, self.done = what, max(total_bytes, 1), 0
        self.t0 = self.last = time.monotonic()
        self.tty = sys.stderr.isatty()

    def add(self, nbytes: int, final: bool = False) -> None:
        self.done += nbytes
        now = time.monotonic()
        if not final and now - self.last < (1.0 if self.tty else 10.0):
            return
        self.last = now
        frac = min(self.done / self.total, 1.0)
        rate = self.done / max(now - self.t0, 1e-9)
        bar = "#" * int(frac * 30)
        eta = "" if final else f"  ETA {(self.total - self.done) / max(rate, 1):.0f} s"
        line = (f"[prepare] {self.what:8s} [{bar:30s}] {self.done / 1e6:8.1f}/{self.total / 1e6:.1f} MB"
                f"  {rate / 1e6:6.1f} MB/s{eta}")
        print(("\r" + line) if self.tty else line, end="\n" if final or not self.tty else "",
              file=sys.stderr, flush=True)


# -- writing ------------------------------------------------------------------------------------
class ShardWriter:
    """Token ids appended to ``<prefix>_NNNNN.bin`` files of at most ``shard_tokens`` each."""

    def __init__(self, out: Path, prefix: str, dtype: str, shard_tokens: int):
        self.out, self.prefix, self.dtype, self.cap = out, prefix, np.dtype(dtype), shard_tokens
        self.shards: list[dict] = []
        self.f = None

    def _open(self) -> None:
        name = f"{self.prefix}_{len(self.shards):05d}.bin"
        self.f = open(self.out / name, "wb")
        self.shards.append({"file": name, "tokens": 0})

    def write(self, ids) -> None:
        arr = np.asarray(ids, dtype=self.dtype.newbyteorder("<"))
        while arr.size:
            if self.f is None or self.shards[-1]["tokens"] == self.cap:
                if self.f is not None:
                    self.f.close()
                self._open()
            room = self.cap - self.shards[-1]["tokens"]
            arr[:room].tofile(self.f)
            self.shards[-1]["tokens"] += min(room, arr.size)
            arr = arr[room:]

    def close(self) -> list[dict]:
        if self.f is not None:
            self.f.close()
        if not self.shards:  # an empty split still has one (empty) shard file
            self._open()
            self.f.close()
        return self.shards


def move_tail(out: Path, train: list[dict], val: ShardWriter, n: int, dtype: str) -> None:
    """Move the last ``n`` tokens of the train shards into ``val``, truncating (or removing)
    the train shards they came from."""
    itemsize = np.dtype(dtype).itemsize
    take, i = [], len(train) - 1  # (shard, first token moved), from the end
    while n > 0 and i >= 0:
        k = min(n, train[i]["tokens"])
        take.append((train[i], train[i]["tokens"] - k))
        n, i = n - k, i - 1
    for shard, start in reversed(take):
        data = np.fromfile(out / shard["file"], dtype=np.dtype(dtype).newbyteorder("<"),
                           offset=start * itemsize)
        val.write(data)
        os.truncate(out / shard["file"], start * itemsize)
        shard["tokens"] = start
    while len(train) > 1 and train[-1]["tokens"] == 0:
        (out / train.pop()["file"]).unlink()


def pick_dtype(vocab_size: int, dtype: str) -> str:
    if vocab_size > 1 << 32:
        raise PrepareError(f"a vocabulary of {vocab_size} tokens does not fit uint32 token ids")
    if dtype == "auto":
        return "uint16" if vocab_size <= 1 << 16 else "uint32"
    limit = 1 << (8 * mf.DTYPES[dtype])
    if vocab_size > limit:
        raise PrepareError(f"a vocabulary of {vocab_size} tokens does not fit {dtype} token ids "
                           f"(at most {limit}); use --dtype uint32")
    return dtype


def build_tokenizer(kind: str, files, reading: Reading, total: int, vocab_size: int, dtype: str,
                    eos_token: str | None, log):
    """``(tokenizer, specials, user file or None)`` for ``--tokenizer`` (bpe, byte or a path)."""
    if kind == "byte":
        tok = byte_tokenizer()
        return tok, specials(tok, EOS), None
    if kind != "bpe":
        try:
            tok, spec, path = load_tokenizer(kind, eos_token)
        except ValueError as e:
            raise PrepareError(str(e)) from None
        log(f"[prepare] tokenizer {path}: {tok.get_vocab_size()} tokens, documents end with "
            f"{spec.eos_token!r} (id {spec.eos_id})"
            + (f", begin with {spec.bos_token!r}" if spec.prefix else ""))
        return tok, spec, path
    if vocab_size < MIN_BPE_VOCAB:
        raise PrepareError(f"--vocab-size {vocab_size} is too small for a byte-level BPE (at "
                           f"least {MIN_BPE_VOCAB}: 256 bytes + the end-of-document token)")
    pick_dtype(vocab_size, dtype)  # fail before training, not after
    progress = Progress("read", total)

    def texts():
        for text, _, nbytes in pieces(files, reading):
            progress.add(nbytes)
            yield text
        progress.add(0, final=True)
    t0 = time.perf_counter()
    tok = train_bpe(texts(), vocab_size, show_progress=False)
    got = tok.get_vocab_size()
    log(f"[prepare] trained a {got}-token BPE in {time.perf_counter() - t0:.1f} s")
    if got < vocab_size:
        log(f"[prepare] warning: the BPE learnt {got} tokens, fewer than the {vocab_size} asked "
            "(--vocab-size): the input has too little text for more merges; model.vocab_size "
            f"must be at least {got} (a larger one trains, its extra rows unused)")
    return tok, specials(tok, EOS), None


def prepare(inputs, out, *, tokenizer: str = "bpe", vocab_size: int | None = None,
            val_fraction: float = 0.05, shard_tokens: int = 100_000_000, dtype: str = "auto",
            documents: str = "paragraph", text_field: str = "text", text_column: str = "text",
            workers: int = 1, eos_token: str | None = None, model: str = DEFAULT_MODEL,
            log=print) -> dict:
    """Write a prepared directory (module docstring); returns its manifest. On any error the
    files written so far are removed (the inputs are only read). ``vocab_size`` None: the
    vocabulary of ``conf/model/<model>.yaml``."""
    out = Path(out)
    if vocab_size is None and tokenizer == "bpe":
        vocab_size = model_vocab_size(model)
        log(f"[prepare] BPE vocabulary {vocab_size}: model={model}'s (--vocab-size to change)")
    if not 0 <= val_fraction < 1:
        raise PrepareError(f"--val-fraction {val_fraction} must be in [0, 1)")
    if shard_tokens < 1:
        raise PrepareError(f"--shard-tokens {shard_tokens} must be >= 1")
    if workers < 1:
        raise PrepareError(f"--workers {workers} must be >= 1")
    if (out / mf.MANIFEST).exists() or list(out.glob("*.bin")):
        raise PrepareError(f"--out {out} already holds prepared shards; remove them or pick "
                           "another directory")
    reading = Reading(documents, text_field, text_column)
    files = input_files(inputs)
    check_inputs(files, reading)
    total = sum(f.stat().st_size for f in files)
    if total == 0:
        raise PrepareError(f"the inputs ({len(files)} file(s)) are empty: no text to prepare")
    tok, spec, user_file = build_tokenizer(tokenizer, files, reading, total, vocab_size, dtype,
                                           eos_token, log)
    vocab = tok.get_vocab_size()
    dtype = pick_dtype(vocab, dtype)
    out.mkdir(parents=True, exist_ok=True)
    try:
        manifest = _write(out, files, reading, tok, spec, user_file, dtype, shard_tokens, total,
                          val_fraction, workers)
    except BaseException:
        for f in [*out.glob("train_*.bin"), *out.glob("val_*.bin"), out / "tokenizer.json"]:
            f.unlink(missing_ok=True)
        raise
    kind = tokenizer if user_file is None else "file"
    manifest.update(tokenizer=dict(manifest["tokenizer"], kind=kind), documents=documents)
    mf.write(out, manifest)
    tr, va = manifest["splits"]["train"], manifest["splits"]["val"]
    log(f"[prepare] {out}: {tr['tokens']:,} train tokens in {len(tr['shards'])} shard(s), "
        f"{va['tokens']:,} val tokens; vocabulary {vocab} ({dtype}), "
        f"{tr['documents'] + va['documents']} documents")
    return manifest


def _write(out: Path, files, reading: Reading, tok, spec, user_file, dtype: str,
           shard_tokens: int, total: int, val_fraction: float, workers: int) -> dict:
    """Shards, the validation split and tokenizer.json; returns the manifest (not yet written)."""
    train = ShardWriter(out, "train", dtype, shard_tokens)
    progress = Progress("encode", total)
    n_docs = encode_all(files, reading, tok, spec, train, dtype, workers, out / ".parts", progress)
    progress.add(0, final=True)
    shards = train.close()
    n_tokens = sum(s["tokens"] for s in shards)
    if n_docs == 0 or n_tokens <= n_docs:
        raise PrepareError(f"the inputs ({len(files)} file(s)) hold no text to prepare")
    val = ShardWriter(out, "val", dtype, shard_tokens)
    move_tail(out, shards, val, int(round(val_fraction * n_tokens)), dtype)
    if user_file is not None:  # the user's file itself: what the export hands back
        shutil.copyfile(user_file, out / "tokenizer.json")
    else:
        tok.save(str(out / "tokenizer.json"))
    eos = spec.eos_id
    manifest = {"format": mf.FORMAT, "version": mf.VERSION, "dtype": dtype,
                "vocab_size": tok.get_vocab_size(), "eos_id": eos,
                "tokenizer": {"file": "tokenizer.json", "xxh3": mf.file_xxh3(out / "tokenizer.json"),
                              "eos_token": spec.eos_token, "bos_token": spec.bos_token,
                              "source": None if user_file is None else str(user_file)},
                "splits": {}, "val_fraction": val_fraction,
                "sources": [{"path": str(f), "bytes": f.stat().st_size} for f in files]}
    for name, split in (("train", shards), ("val", val.close())):
        docs = 0
        for sh in split:
            sh["xxh3"] = mf.file_xxh3(out / sh["file"])
            docs += int(np.count_nonzero(np.fromfile(out / sh["file"], dtype=dtype) == eos))
        manifest["splits"][name] = {"tokens": sum(sh["tokens"] for sh in split),
                                    "documents": docs, "shards": split}
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deadpool.data.prepare",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", required=True, metavar="PATH",
                    help="text / .jsonl / .parquet files, or directories of them")
    ap.add_argument("--out", required=True, metavar="DIR", help="directory to write")
    ap.add_argument("--tokenizer", default="bpe", metavar="bpe|byte|PATH",
                    help="train a BPE, use bytes, or a Hugging Face tokenizer.json (or its directory)")
    ap.add_argument("--eos-token", default=None,
                    help="a PATH tokenizer's end-of-document token (default: its "
                         "tokenizer_config.json's eos_token, else a known one)")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="BPE vocabulary (bpe only; default: --model's vocab_size)")
    ap.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME",
                    help="the conf/model/NAME.yaml to fit the BPE's vocabulary to (default: tiny, "
                         "the training default: 512)")
    ap.add_argument("--val-fraction", type=float, default=0.05,
                    help="share of the token stream held out for validation (its end)")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard file")
    ap.add_argument("--dtype", choices=("auto", "uint16", "uint32"), default="auto")
    ap.add_argument("--documents", choices=("file", "paragraph"), default="paragraph",
                    help="what a document is in a plain-text file: each blank-line-separated "
                         "paragraph (default) or the whole file")
    ap.add_argument("--text-field", default="text", help="the .jsonl field holding a document")
    ap.add_argument("--text-column", default="text", help="the .parquet column holding a document")
    ap.add_argument("--workers", type=int, default=1,
                    help="processes encoding files in parallel (the output is the same)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        prepare(a.input, a.out, tokenizer=a.tokenizer, vocab_size=a.vocab_size,
                val_fraction=a.val_fraction, shard_tokens=a.shard_tokens, dtype=a.dtype,
                documents=a.documents, text_field=a.text_field, text_column=a.text_column,
                workers=a.workers, eos_token=a.eos_token, model=a.model)
    except PrepareError as e:
        print(f"[prepare] error: {e}", file=sys.stderr)
        return 2
    print(f"[prepare] done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
