"""Safetensors files written tensor by tensor, so an export never holds the whole model.

The format (huggingface/safetensors, ``docs``): an 8-byte little-endian header length, a JSON
header mapping each name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into
the data that follows, contiguous in order) and ``__metadata__``, padded with spaces to a
multiple of 8 bytes, then the raw little-endian bytes. The header needs every name, shape and
dtype before the first byte of data: ``write_stream`` takes that plan up front (the exporter
computes it on the meta device), then the tensors one at a time in the plan's order, each
checked against it and written out before the next is read.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable, Iterator

import torch

INDEX = "model.safetensors.index.json"
DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


def nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def shard_groups(plan: list[tuple[str, tuple, torch.dtype]], max_shard_bytes: int) -> list[list[int]]:
    """Indices into ``plan`` per file: in order, at most ``max_shard_bytes`` a file (a larger
    tensor gets a file of its own)."""
    groups, size = [[]], 0
    for i, (_, shape, dtype) in enumerate(plan):
        b = nbytes(shape, dtype)
        if groups[-1] and size + b > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += b
    return groups


def header_bytes(entries: list[tuple[str, tuple, torch.dtype]]) -> bytes:
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in entries:
        b = nbytes(shape, dtype)
        header[name] = {"dtype": DTYPES[dtype], "shape": [int(s) for s in shape],
                        "data_offsets": [off, off + b]}
        off += b
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_stream(plan: list[tuple[str, tuple, torch.dtype]],
                 tensors: Iterable[tuple[str, torch.Tensor]], out: Path,
                 max_shard_bytes: int) -> list[str]:
    """Write ``tensors`` (name, tensor: in ``plan``'s order, shapes and dtypes) to ``out`` as
    ``model.safetensors`` or shards with an index (as ``save_pretrained`` names them). Returns
    the file names. Holds one tensor at a time."""
    groups = shard_groups(plan, max_shard_bytes)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)])
    it: Iterator = iter(tensors)
    for fname, group in zip(names, groups):
        entries = [plan[i] for i in group]
        with open(out / fname, "wb") as f:
            f.write(header_bytes(entries))
            for name, shape, dtype in entries:
                got_name, t = next(it)
                if got_name != name or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                    raise ValueError(f"tensor {got_name} {tuple(t.shape)} {t.dtype} arrived where "
                                     f"the plan has {name} {tuple(shape)} {dtype}")
                f.write(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
                del t
    if next(it, None) is not None:
        raise ValueError("more tensors than the plan names")
    if len(groups) > 1:
        weight_map = {plan[i][0]: fname for fname, g in zip(names, groups) for i in g}
        total = sum(nbytes(s, d) for _, s, d in plan)
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                             "weight_map": weight_map}, indent=1))
    return names
