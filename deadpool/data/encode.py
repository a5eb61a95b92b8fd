"""Encoding ``prepare``'s inputs into one token stream, over files in parallel (``--workers``).

Each part of a file is encoded on its own (``encode_part``): its documents' pieces, at most
``ENCODE_BATCH_BYTES`` of text at a time, framed by the tokenizer's specials
(``tokenizer.Specials``). With one worker the tokens go straight into the shard writer; with
``N > 1`` a pool of ``N`` processes encodes files into part files beside the output
(``.parts/NNNNN.bin``) and the parent streams each part, in file order, into the shards and
removes it. So the output is the same bytes whatever ``--workers`` is, and memory is bounded:
a worker holds one batch of text and its tokens, the parent one read block of a part.
Parallelism is over the files' parts (``corpus.parts``: a file past ``corpus.PART_BYTES`` is
several parts, cut where a document starts, Parquet by row groups), so one large file is
shared by the workers too; one worker encodes the same parts in turn.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from deadpool.data.corpus import Part, Reading, file_pieces, parts

ENCODE_BATCH_BYTES = 8 << 20  # text handed to the tokenizer at once
COPY_TOKENS = 16 << 20  # tokens moved from a part file into the shards at once


def encode_part(part: Part, reading: Reading, tok: Tokenizer, spec, write, progress) -> int:
    """Every document of ``part``, framed, into ``write(ids)``; ``progress(bytes)`` as it reads.
    Returns the number of documents it ends."""
    batch, firsts, lasts, n_docs, pending = [], [], [], 0, 0
    first = part.starts_document

    def flush():
        for enc, f, last in zip(tok.encode_batch(batch, add_special_tokens=False), firsts, lasts):
            ids = spec.frame(enc.ids, f, last)
            if ids:
                write(ids)
        batch.clear(), firsts.clear(), lasts.clear()
    for text, end, nbytes in file_pieces(part.path, reading, part):
        if text or end:
            batch.append(text)
            firsts.append(first)
            lasts.append(end)
            first = end
            n_docs += end
        progress(nbytes)
        pending += len(text)
        if pending >= ENCODE_BATCH_BYTES:  # encode_batch runs its batch on every core
            flush()
            pending = 0
    flush()
    return n_docs


# -- the worker processes -------------------------------------------------------------------------
_W: dict = {}


def _init(tok_json: str, spec, reading: Reading, dtype: str, counter) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism
    _W.update(tok=Tokenizer.from_str(tok_json), spec=spec, reading=reading,
              dtype=np.dtype(dtype).newbyteorder("<"), counter=counter)


def _progress(nbytes: int) -> None:
    if nbytes:
        with _W["counter"].get_lock():
            _W["counter"].value += nbytes


def _encode_part(job: tuple[Part, str]) -> tuple[int, int]:
    src, out = job
    n_tokens = 0
    with open(out, "wb") as f:
        def write(ids):
            nonlocal n_tokens
            np.asarray(ids, dtype=_W["dtype"]).tofile(f)
            n_tokens += len(ids)
        n_docs = encode_part(src, _W["reading"], _W["tok"], _W["spec"], write, _progress)
    return n_docs, n_tokens


def encode_all(files, reading: Reading, tok: Tokenizer, spec, sink, dtype: str, workers: int,
               scratch: Path, progress) -> int:
    """Every file's tokens into ``sink.write`` in file order; returns the number of documents.
    ``progress`` is a ``Progress``-like object (``add(nbytes)``)."""
    todo = [p for f in files for p in parts(Path(f), reading)]
    if workers <= 1 or len(todo) < 2:
        return sum(encode_part(p, reading, tok, spec, sink.write, progress.add) for p in todo)
    ctx = mp.get_context("spawn")  # no forked copy of the parent's tokenizer thread pool
    counter = ctx.Value("q", 0)
    scratch.mkdir(parents=True, exist_ok=True)
    jobs = [(p, str(scratch / f"{i:05d}.bin")) for i, p in enumerate(todo)]
    n_docs, seen = 0, 0
    itemtype = np.dtype(dtype).newbyteorder("<")
    try:
        with ctx.Pool(min(workers, len(jobs)), initializer=_init,
                      initargs=(tok.to_str(), spec, reading, dtype, counter)) as pool:
            results = pool.imap(_encode_part, jobs)  # in file order; later files run ahead
            for _, part in jobs:
                while True:
                    try:
                        docs, n_tokens = results.next(timeout=1.0)
                        break
                    except mp.TimeoutError:  # the progress line moves while a file encodes
                        now = counter.value
                        progress.add(now - seen)
                        seen = now
                n_docs += docs
                mm = np.memmap(part, dtype=itemtype, mode="r") if n_tokens else ()
                for i in range(0, n_tokens, COPY_TOKENS):
                    sink.write(np.asarray(mm[i:i + COPY_TOKENS]))
                del mm
                os.unlink(part)
                now = counter.value
                progress.add(now - seen)
                seen = now
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    progress.add(counter.value - seen)
    return n_docs
