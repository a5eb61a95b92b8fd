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

A file past ``PART_BYTES`` is read as several ``Part``s (``parts``), so that several workers
share it: JSONL and text cut at line starts near every ``PART_BYTES`` (a paragraph file after a
blank line, so a part starts a document), Parquet by row groups. The cuts depend on the file
alone, never on the number of workers, and one worker reads the same parts in turn: the output
is the same bytes for any ``--workers``. (Only a one-document-per-file text document is cut
mid-document: its pieces then also break at each cut, for every ``--workers`` alike.)
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

PIECE_BYTES = 1 << 20  # a long document is encoded in pieces of about this size, cut at newlines
PARQUET_BATCH_ROWS = 1024  # rows read from a Parquet file at once
PART_BYTES = 4 << 20  # a larger file is read as parts of about this size (workers share it)


class PrepareError(ValueError):
    """Bad input or options: the message says which and what to do."""


@dataclass(frozen=True)
class Reading:
    """How documents are found in the inputs (picklable: each worker process gets one)."""
    documents: str = "file"  # "file" | "paragraph": what a document is in a plain-text file
    text_field: str = "text"  # the JSONL field holding a document
    text_column: str = "text"  # the Parquet column holding a document


@dataclass(frozen=True)
class Part:
    """Bytes ``[start, end)`` of ``path`` (Parquet: row groups ``[start, end)``; ``end`` None: to
    the end). ``starts_document``: false only inside a one-document text file's later parts."""
    path: Path
    start: int = 0
    end: int | None = None
    starts_document: bool = True


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


def _lines(path: Path, start: int = 0, end: int | None = None):
    """The lines of bytes ``[start, end)`` (both at line starts), line endings kept."""
    left = None if end is None else end - start
    try:
        with open(path, "rb") as raw:
            raw.seek(start)
            with io.TextIOWrapper(raw, encoding="utf-8", newline="") as f:
                for line in f:
                    if left is not None:
                        if left <= 0:
                            return
                        left -= len(line.encode())
                    yield line
    except UnicodeDecodeError as e:
        raise PrepareError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a read "
                           "block); convert it to UTF-8 first") from None
    except OSError as e:
        raise PrepareError(f"{path}: cannot read ({e.strerror or e})") from None


def _jsonl(path: Path, field: str, start: int = 0, end: int | None = None):
    where = "" if start == 0 else f" (line n of the part at byte {start})"
    for n, line in enumerate(_lines(path, start, end), 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)[field]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise PrepareError(f"{path}:{n}{where}: a .jsonl line must be an object with a "
                               f"{field!r} field (--text-field)") from None
        if not isinstance(text, str):
            raise PrepareError(f"{path}:{n}{where}: the {field!r} field is not a string")
        yield text, True, len(line.encode())


def _parquet(path: Path, column: str, start: int = 0, end: int | None = None):
    pq = _pyarrow_parquet()
    f = pq.ParquetFile(path)
    total, rows = path.stat().st_size, max(f.metadata.num_rows, 1)
    groups = list(range(start, f.num_row_groups if end is None else end))
    for batch in f.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[column], row_groups=groups):
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


def _text(path: Path, documents: str, start: int = 0, end: int | None = None):
    buf, size, cut = [], 0, False  # cut: part of this document was already yielded
    for line in _lines(path, start, end):
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
    if buf or cut:  # a part that ends before the file does ends inside its document
        yield "".join(buf), end is None or end >= path.stat().st_size, size


def file_pieces(path: Path, reading: Reading, part: Part | None = None):
    """``(text, ends_document, bytes_read)`` for every piece of every document of ``path``
    (of ``part`` of it, when given)."""
    start, end = (0, None) if part is None else (part.start, part.end)
    if path.suffix == ".jsonl":
        return _jsonl(path, reading.text_field, start, end)
    if path.suffix == ".parquet":
        return _parquet(path, reading.text_column, start, end)
    return _text(path, reading.documents, start, end)


def parts(path: Path, reading: Reading, part_bytes: int | None = None) -> list[Part]:
    """``path`` as the parts its workers read (module docstring): one for a small file."""
    part_bytes = part_bytes or PART_BYTES
    size = path.stat().st_size
    if path.suffix == ".parquet":
        return _row_group_parts(path, size, part_bytes)
    if size <= part_bytes:
        return [Part(path)]
    paragraph = path.suffix != ".jsonl" and reading.documents == "paragraph"
    cuts, at = [0], 0
    with open(path, "rb") as f:
        for target in range(part_bytes, size, part_bytes):
            if at >= target:
                continue
            f.seek(target - 1)
            f.readline()  # to the start of the line after the one holding byte target - 1
            at = f.tell()
            while paragraph and at < size:  # on to just after a blank line
                line = f.readline()
                at = f.tell()
                if not line.decode("utf-8", "replace").strip():
                    break
            if at < size:
                cuts.append(at)
    ends = [*cuts[1:], size]
    return [Part(path, a, b, paragraph or path.suffix == ".jsonl" or a == 0)
            for a, b in zip(cuts, ends)]


def _row_group_parts(path: Path, size: int, part_bytes: int) -> list[Part]:
    f = _pyarrow_parquet().ParquetFile(path)
    n = f.num_row_groups
    per = max(1, n * part_bytes // max(size, 1))  # row groups per part, for about part_bytes each
    return [Part(path, a, min(a + per, n)) for a in range(0, n, per)] or [Part(path)]


def pieces(files, reading: Reading):
    """``file_pieces`` of every file, in order."""
    for path in files:
        yield from file_pieces(path, reading)
