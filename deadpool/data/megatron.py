"""``data=megatron data.path=PREFIX``: Megatron-LM's indexed datasets, read in place.

Megatron-LM's ``preprocess_data.py`` writes ``PREFIX.bin`` (every sequence's tokens back to
back) and ``PREFIX.idx`` (the ``MMapIndexedDataset`` index), laid out, little-endian, as::

    offset  size       field
         0  9          magic  b"MMIDIDX\\x00\\x00"
         9  u64        version, 1
        17  u8         token dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                       6 float64, 7 float32, 8 uint16
        18  u64        S, the number of sequences
        26  u64        D, the number of document indices (documents + 1)
        34  S x i32    each sequence's length in tokens
            S x i64    each sequence's byte offset in PREFIX.bin
            D x i64    document indices: 0, then the index of the sequence after each document
           (S x i8     sequence modes: multimodal datasets only; not read here)

The token stream is ``PREFIX.bin`` read whole (its sequences are contiguous: the last pointer
plus the last length is the file's size, which launch checks). Samples and their order are
``data=tokens``'s (``tokens.py``): ``seq_len + 1`` tokens at multiples of ``seq_len``, drawn
through the seeded per-epoch permutation, a pure function of (seed, step, batch index); so a
run resumes, hot-swaps and changes width exactly as on prepared shards. Validation batches come
from ``data.val_path`` (another prefix), if given. ``write`` is the project's own writer
(tests, and a corpus prepared by hand): the same layout.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deadpool.data.tokens import Split, TokenDataset

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D: 34 bytes
CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32",
         8: "uint16"}
TOKEN_CODES = {c: d for c, d in CODES.items() if not d.startswith("float")}
SCAN_AT_LAUNCH_BYTES = 64 << 20  # a .bin up to this size has its ids checked before launch (~0.1 s)
CHUNK_TOKENS = 1 << 22           # ids checked per read (16 MB of int32)


@dataclass
class Index:
    """The header of ``PREFIX.idx`` (the arrays are read only when asked for)."""
    prefix: Path
    dtype: str
    num_sequences: int
    num_doc_indices: int

    @property
    def bin(self) -> Path:
        return Path(f"{self.prefix}.bin")

    @property
    def idx(self) -> Path:
        return Path(f"{self.prefix}.idx")

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(lengths int32, pointers int64, document indices int64), memory-mapped."""
        s, d = self.num_sequences, self.num_doc_indices
        lengths = np.memmap(self.idx, dtype="<i4", mode="r", offset=HEADER.size, shape=(s,)) \
            if s else np.zeros(0, "<i4")
        pointers = np.memmap(self.idx, dtype="<i8", mode="r", offset=HEADER.size + 4 * s,
                             shape=(s,)) if s else np.zeros(0, "<i8")
        docs = np.memmap(self.idx, dtype="<i8", mode="r", offset=HEADER.size + 12 * s,
                         shape=(d,)) if d else np.zeros(0, "<i8")
        return lengths, pointers, docs

    @property
    def num_tokens(self) -> int:
        return self.bin.stat().st_size // np.dtype(self.dtype).itemsize


def read_index(prefix, field: str = "data.path") -> Index:
    """``PREFIX.idx``'s header, checked against the layout and ``PREFIX.bin``'s size (reads the
    header and the last sequence's entry only: seconds for any size). ``ValueError`` naming
    ``field`` and what is wrong."""
    p = Path(str(prefix))
    idx, bin_ = Path(f"{p}.idx"), Path(f"{p}.bin")
    for f in (idx, bin_):
        if not f.is_file():
            raise ValueError(f"{field}={prefix}: {f} is missing (a Megatron-LM indexed dataset is "
                             "PREFIX.bin + PREFIX.idx; give the prefix, without the extension)")
    with open(idx, "rb") as fh:
        raw = fh.read(HEADER.size)
    if len(raw) < HEADER.size:
        raise ValueError(f"{field}={prefix}: {idx} is too short for an index header")
    magic, version, code, s, d = HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"{field}={prefix}: {idx} is not a Megatron-LM MMapIndexedDataset v1 index "
                         f"(magic {magic!r}, version {version})")
    if code not in TOKEN_CODES:
        raise ValueError(f"{field}={prefix}: {idx} has token dtype code {code} "
                         f"({CODES.get(code, 'unknown')}), not an integer token type")
    index = Index(p, TOKEN_CODES[code], s, d)
    need = HEADER.size + 12 * s + 8 * d
    if idx.stat().st_size < need:
        raise ValueError(f"{field}={prefix}: {idx} is {idx.stat().st_size} bytes, its header needs "
                         f"{need}: the file is truncated")
    item = np.dtype(index.dtype).itemsize
    lengths, pointers, _ = index.arrays()
    end = int(pointers[-1]) + int(lengths[-1]) * item if s else 0
    if bin_.stat().st_size != end or (s and int(pointers[0]) != 0):
        raise ValueError(f"{field}={prefix}: {bin_} is {bin_.stat().st_size} bytes, the index says "
                         f"its sequences end at byte {end}: the pair does not match")
    return index


def split(index: Index, seq_len: int) -> Split:
    """The whole token stream of ``index`` as one sample split."""
    return Split(Path("/"), {"shards": [{"file": str(index.bin.resolve()),
                                         "tokens": index.num_tokens}]}, index.dtype, seq_len)


class MegatronDataset(TokenDataset):
    """``data=tokens``'s batches and order over a Megatron-LM indexed dataset (module)."""

    def __init__(self, path, *, seed: int, seq_len: int, batch_size: int, global_batches: int,
                 val_path=None):
        self.path, self.manifest = Path(str(path)), None
        train = split(read_index(path), seq_len)
        val = split(read_index(val_path, "data.val_path"), seq_len) if val_path else None
        self._setup(train, val, seed, seq_len, batch_size, global_batches)


def check(path, *, vocab_size: int, seq_len: int, need_val: bool, val_path=None) -> None:
    """Before any process starts: both files of each prefix, the layout, sizes that agree, a
    sample of ``seq_len + 1`` tokens, a validation prefix when the job evaluates, and token ids
    below ``model.vocab_size``: free when the token dtype cannot hold a larger id, read here for
    a ``.bin`` up to ``SCAN_AT_LAUNCH_BYTES``; a larger one is read on the background thread
    while the job runs (``verify.BackgroundVerify``), which fails the job naming the id."""
    if path in (None, "", "???"):
        raise ValueError("data=megatron needs data.path=PREFIX (PREFIX.bin + PREFIX.idx, as "
                         "Megatron-LM's preprocess_data.py writes them)")
    if need_val and not val_path:
        raise ValueError("eval_every_steps > 0 with data=megatron needs data.val_path=PREFIX "
                         "(a held-out indexed dataset)")
    for field, p in (("data.path", path), ("data.val_path", val_path)):
        if p:
            index = read_index(p, field)
            if index.num_tokens < seq_len + 1:
                raise ValueError(f"{field}={p}: {index.num_tokens} tokens, fewer than one sequence "
                                 f"of seq_len={seq_len} + 1")
            if not ids_fit(index.dtype, vocab_size) and \
                    index.bin.stat().st_size <= SCAN_AT_LAUNCH_BYTES:
                check_ids(index, vocab_size, field)  # small: now (a large one: verify.py)


def ids_fit(dtype: str, vocab_size: int) -> bool:
    """True when no id the token dtype can hold reaches ``vocab_size`` (uint8 under 256, ...)
    and none can be negative: the stream then needs no reading."""
    info = np.iinfo(dtype)
    return info.min >= 0 and info.max < vocab_size


def check_ids(index: Index, vocab_size: int, field: str = "data.path", stop=None) -> None:
    """Every token id of ``index`` in ``[0, vocab_size)``, read in chunks of ``CHUNK_TOKENS``
    (``stop()`` true: return early). ``ValueError`` naming the prefix, the largest id and
    ``model.vocab_size``."""
    stream = np.memmap(index.bin, dtype=np.dtype(index.dtype).newbyteorder("<"), mode="r") \
        if index.num_tokens else np.zeros(0, index.dtype)
    for at in range(0, stream.size, CHUNK_TOKENS):
        if stop is not None and stop():
            return
        chunk = stream[at:at + CHUNK_TOKENS]
        hi, lo = int(chunk.max()), int(chunk.min())
        if hi >= vocab_size or lo < 0:
            bad = hi if hi >= vocab_size else lo
            raise ValueError(f"{field}={index.prefix}: token id {bad} (at or after token {at}) is "
                             f"outside model.vocab_size={vocab_size}: set model.vocab_size to the "
                             "tokenizer's vocabulary (at least the largest id + 1)")


def write(prefix, documents, dtype: str = "uint16") -> Index:
    """``PREFIX.bin`` and ``PREFIX.idx`` holding ``documents`` (sequences of token ids), one
    sequence per document, in the layout above."""
    codes = {d: c for c, d in CODES.items()}
    if dtype not in codes:
        raise ValueError(f"dtype {dtype!r}: one of {', '.join(codes)}")
    item = np.dtype(dtype).newbyteorder("<")
    lengths, pointers, at = [], [], 0
    with open(f"{prefix}.bin", "wb") as f:
        for doc in documents:
            arr = np.asarray(doc, dtype=item)
            arr.tofile(f)
            lengths.append(arr.size)
            pointers.append(at)
            at += arr.size * item.itemsize
    doc_idx = np.arange(len(lengths) + 1, dtype="<i8")  # one sequence per document
    with open(f"{prefix}.idx", "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, codes[dtype], len(lengths), doc_idx.size))
        f.write(np.asarray(lengths, dtype="<i4").tobytes())
        f.write(np.asarray(pointers, dtype="<i8").tobytes())
        f.write(doc_idx.tobytes())
    return read_index(prefix)
