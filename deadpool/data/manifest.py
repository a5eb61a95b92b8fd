"""The manifest of a prepared token directory (``manifest.json``), and its checks.

A directory written by ``python -m deadpool.data.prepare`` holds::

    manifest.json      this file's dict (below), written last: its presence marks the directory done
    tokenizer.json     the Hugging Face ``tokenizers`` tokenizer the shards were encoded with
    train_00000.bin    token ids, little-endian ``dtype``, documents separated by ``eos_id``
    val_00000.bin      the held-out split (the last ``val_fraction`` of the token stream)

    {"format": "deadpool-tokens", "version": 1, "dtype": "uint16", "vocab_size": 512,
     "eos_id": 0, "tokenizer": {"kind": "bpe", "file": "tokenizer.json", "xxh3": "..."},
     "splits": {"train": {"tokens": N, "documents": D, "shards": [{"file", "tokens", "xxh3"}]},
                "val": {...}}, "sources": [{"path", "bytes"}], "val_fraction": 0.05}

Checksums are XXH3-64 (``xxhash``, as for snapshots) of each file's bytes. ``check_sizes`` reads
no shard: the launch makes it (with the manifest's other checks) before any process starts, and
every process when it opens the shards. The checksums are read while the job runs, once, on a
background thread of the launching process (``verify.py``); ``verify`` checks a directory whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import xxhash

MANIFEST = "manifest.json"
FORMAT, VERSION = "deadpool-tokens", 1
DTYPES = {"uint16": 2, "uint32": 4}


def file_xxh3(path: Path, chunk_bytes: int = 64 << 20) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def write(directory: Path, manifest: dict) -> None:
    tmp = Path(directory) / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(Path(directory) / MANIFEST)


def read(directory) -> dict:
    """The manifest of ``directory``; ``ValueError`` saying what is wrong if there is none."""
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"data.path={directory}: no such directory (write one with "
                         "python -m deadpool.data.prepare --input ... --out DIR)")
    try:
        m = json.loads((d / MANIFEST).read_text())
    except FileNotFoundError:
        raise ValueError(f"data.path={directory} has no {MANIFEST}: not a directory written by "
                         "python -m deadpool.data.prepare (or it did not finish)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"data.path={directory}: {MANIFEST} is not valid JSON ({e})") from None
    if m.get("format") != FORMAT or m.get("version") != VERSION:
        raise ValueError(f"data.path={directory}: {MANIFEST} is not a {FORMAT} v{VERSION} manifest")
    if m.get("dtype") not in DTYPES:
        raise ValueError(f"data.path={directory}: unknown token dtype {m.get('dtype')!r}")
    return m


def files(manifest: dict) -> list[tuple[str, int | None, str]]:
    """(file name, expected bytes or None, xxh3) of every file the manifest names."""
    size = DTYPES[manifest["dtype"]]
    out = [(manifest["tokenizer"]["file"], None, manifest["tokenizer"]["xxh3"])]
    for split in manifest["splits"].values():
        out += [(s["file"], s["tokens"] * size, s["xxh3"]) for s in split["shards"]]
    return out


def check_sizes(directory, manifest: dict) -> None:
    """Every shard exists with the size the manifest says (no reading)."""
    for name, nbytes, _ in files(manifest):
        p = Path(directory) / name
        if not p.exists():
            raise ValueError(f"data.path={directory}: {name} named by {MANIFEST} is missing")
        if nbytes is not None and p.stat().st_size != nbytes:
            raise ValueError(f"data.path={directory}: {name} is {p.stat().st_size} bytes, the "
                             f"manifest says {nbytes}: the file changed since it was prepared")


def verify(directory, manifest: dict, log=None) -> None:
    """``check_sizes``, then every file's checksum against the manifest's."""
    check_sizes(directory, manifest)
    for name, _, want in files(manifest):
        got = file_xxh3(Path(directory) / name)
        if got != want:
            raise ValueError(f"data.path={directory}: {name} is corrupted (xxh3 {got}, the manifest "
                             f"says {want}); prepare the directory again")
        if log is not None:
            log(name)
