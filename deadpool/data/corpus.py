"""The documents of ``prepare``'s inputs: plain text, JSONL and Parquet files, read as pieces.

One reader per format, all yielding ``(text, ends_document, bytes_read)`` so the encoder never
holds more than one piece (about ``PIECE_BYTES`` of text, or one Parquet row batch) of a file:

    *.jsonl             one document per line, the string in ``text_field`` ("text")
    *.parquet           one document per row, the string column ``text_column`` ("text");
                        needs ``pyarrow`` (an optional dependency: a clear error without it)
    anything else       UTF-8 text: one document per file, or per blank-line-separated
                        paragraph (``documents="paragraph"``)

``check_inputs`` runs before any tokenizer is built or shard written: a missing or unreadable
file, a Parquet file without the column, a missing ``pyarrow``, refused naming the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

PIECE_BYTES = 1 << 20  # a long document is encoded in pieces of about this size, cut at newlines
PARQUET_BATCH_ROWS = 1024  # rows read from a Parquet file at once


class PrepareError(ValueError):
    """Bad input or options: the message says which and what to do."""


@dataclass(frozen=True)
class Reading:
    """How documents are found in the inputs (picklable: each worker process gets one)."""
    documents: str = "file"  # "file" | "paragraph": what a document is in a plain-text file
    text_field: str = "text"  # the JSONL field holding a document
    text_column: str = "text"  # the Parquet column holding a document


def input_files(paths) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
        elif p.exists():
            out.append(p)
        else:
            raise PrepareError(f"--input {p}: no such file or directory")
    if not out:
        raise PrepareError(f"--input {' '.join(map(str, paths))}: no files")
    for f in out:
        if not os.access(f, os.R_OK):
            raise PrepareError(f"--input {f}: not readable (permission denied)")
    return out


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError("reading .parquet files needs pyarrow (an optional dependency): "
                           "pip install pyarrow") from None
    return pq


def check_inputs(files, reading: Reading) -> None:
    """Every Parquet input has the text column (its schema only is read)."""
    for f in files:
        if f.suffix != ".parquet":
            continue
        pq = _pyarrow_parquet()
        try:
            names = pq.ParquetFile(f).schema_arrow.names
        except Exception as e:  # pyarrow raises several types for a file that is not Parquet
            raise PrepareError(f"{f}: not a readable Parquet file ({e})") from None
        if reading.text_column not in names:
            raise PrepareError(f"{f}: no column {reading.text_column!r} (--text-column); its "
                               f"columns are {', '.join(names)}")


def _lines(path: Path):
    try:
        with open(path, encoding="utf-8", newline="") as f:
            yield from f
    except UnicodeDecodeError as e:
        raise PrepareError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a read "
                           "block); convert it to UTF-8 first") from None
    except OSError as e:
        raise PrepareError(f"{path}: cannot read ({e.strerror or e})") from None


def _jsonl(path: Path, field: str):
    for n, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)[field]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise PrepareError(f"{path}:{n}: a .jsonl line must be an object with a {field!r} "
                               "field (--text-field)") from None
        if not isinstance(text, str):
            raise PrepareError(f"{path}:{n}: the {field!r} field is not a string")
        yield text, True, len(line.encode())


def _parquet(path: Path, column: str):
    pq = _pyarrow_parquet()
    f = pq.ParquetFile(path)
    total, rows = path.stat().st_size, max(f.metadata.num_rows, 1)
    for batch in f.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[column]):
        texts = batch.column(0).to_pylist()
        for text in texts:
            if text is None:  # a null row is an empty document: skipped, as a blank JSONL line
                continue
            if not isinstance(text, str):
                raise PrepareError(f"{path}: column {column!r} holds {type(text).__name__}, "
                                   "not strings")
            yield text, True, 0
        # progress in the file's bytes, spread over its rows (the compressed size is what is read)
        yield "", False, total * len(texts) // rows


def _text(path: Path, documents: str):
    buf, size, cut = [], 0, False  # cut: part of this document was already yielded
    for line in _lines(path):
        nbytes = len(line.encode())
        if documents == "paragraph" and not line.strip():
            # the separating lines count as read (progress), not as text
            yield ("".join(buf), True, size + nbytes) if buf or cut else ("", False, nbytes)
            buf, size, cut = [], 0, False
            continue  # the blank lines between paragraphs are the boundary, not text
        buf.append(line)
        size += nbytes
        if size >= PIECE_BYTES:
            yield "".join(buf), False, size
            buf, size, cut = [], 0, True
    if buf or cut:
        yield "".join(buf), True, size


def file_pieces(path: Path, reading: Reading):
    """``(text, ends_document, bytes_read)`` for every piece of every document of ``path``."""
    if path.suffix == ".jsonl":
        return _jsonl(path, reading.text_field)
    if path.suffix == ".parquet":
        return _parquet(path, reading.text_column)
    return _text(path, reading.documents)


def pieces(files, reading: Reading):
    """``file_pieces`` of every file, in order."""
    for path in files:
        yield from file_pieces(path, reading)
