"""``prepare`` throughput, ``--workers 1`` vs ``N``, on the same generated JSONL corpus with a
user's tokenizer.json (a byte-level BPE trained once on the shipped corpus), laid out two ways:
as ``--files`` files and as one file of the same documents (which the workers share by parts,
``corpus.parts``). Writes ``experiments/results/data/prepare_throughput.json`` with the machine's
load average before and after; the outputs are compared byte for byte across ``--workers``.

    python experiments/bench_prepare.py [--files 8] [--docs-per-file 3000] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from deadpool.data.corpus import PART_BYTES
from deadpool.data.fables import generate
from deadpool.data.prepare import prepare
from deadpool.data.tokenizer import train_bpe

OUT = Path(__file__).resolve().parent / "results" / "data" / "prepare_throughput.json"


def write_corpus(directory: Path, paras: list[str], files: int, per_file: int, one_file: bool) -> int:
    directory.mkdir()
    out = None
    for k in range(files):
        if out is None or not one_file:
            out = open(directory / ("all.jsonl" if one_file else f"part_{k:03d}.jsonl"), "a")
        for i in range(per_file):
            out.write(json.dumps({"text": paras[(k * per_file + i) % len(paras)]}) + "\n")
        if not one_file:
            out.close()
    out.close()
    return sum(f.stat().st_size for f in directory.iterdir())


def measure(corpus: Path, tok: Path, workers: list[int], repeats: int, tmp: Path, nbytes: int) -> list[dict]:
    rows, first = [], None
    for w in workers:
        times = []
        for r in range(repeats):
            out = tmp / f"out_{corpus.name}_{w}_{r}"
            t0 = time.perf_counter()
            m = prepare([corpus], out, tokenizer=str(tok), workers=w, log=lambda *x: None)
            times.append(time.perf_counter() - t0)
            files = [s["file"] for sp in m["splits"].values() for s in sp["shards"]]
            if first is None:
                first = out, files
            assert all(filecmp.cmp(first[0] / f, out / f, shallow=False) for f in files)
        best = min(times)
        rows.append({"layout": corpus.name, "workers": w, "wall_s": [round(t, 3) for t in times],
                     "best_s": round(best, 3), "MB_per_s": round(nbytes / 1e6 / best, 2),
                     "tokens": m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--docs-per-file", type=int, default=3000)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    load_before = round(os.getloadavg()[0], 2)
    paras = [p for p in generate().split("\n\n") if p.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok = tmp / "tokenizer.json"
        train_bpe(paras, 8192).save(str(tok))
        rows = []
        for one_file in (False, True):
            corpus = tmp / ("one_file" if one_file else "many_files")
            nbytes = write_corpus(corpus, paras, a.files, a.docs_per_file, one_file)
            rows += measure(corpus, tok, a.workers, a.repeats, tmp, nbytes)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"input_MB": round(nbytes / 1e6, 2), "files": a.files,
                               "part_MB": PART_BYTES / 2**20, "cpu_cores": os.cpu_count(),
                               "machine": platform.machine(), "load_avg_1m_before": load_before,
                               "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
                               "note": "2-core machine shared with other jobs; outputs identical "
                                       "across --workers; layouts: the same documents in --files "
                                       "files (many_files) or in one file (one_file)",
                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
