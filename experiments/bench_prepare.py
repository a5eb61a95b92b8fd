"""``prepare`` throughput, ``--workers 1`` vs ``N``, on the same generated JSONL corpus with a
user's tokenizer.json (a byte-level BPE trained once on the shipped corpus): writes
``experiments/results/data/prepare_throughput.json``. The outputs are compared byte for byte.

    python experiments/bench_prepare.py [--files 8] [--docs-per-file 1500] [--workers 1 2]
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

from deadpool.data.fables import generate
from deadpool.data.prepare import prepare
from deadpool.data.tokenizer import train_bpe

OUT = Path(__file__).resolve().parent / "results" / "data" / "prepare_throughput.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--docs-per-file", type=int, default=1500)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    paras = [p for p in generate().split("\n\n") if p.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus"
        corpus.mkdir()
        for k in range(a.files):
            with open(corpus / f"part_{k:03d}.jsonl", "w") as f:
                for i in range(a.docs_per_file):
                    f.write(json.dumps({"text": paras[(k * a.docs_per_file + i) % len(paras)]}) + "\n")
        nbytes = sum(f.stat().st_size for f in corpus.iterdir())
        tok = tmp / "tokenizer.json"
        train_bpe(paras, 8192).save(str(tok))
        rows, first = [], None
        for w in a.workers:
            times = []
            for r in range(a.repeats):
                out = tmp / f"out_{w}_{r}"
                t0 = time.perf_counter()
                m = prepare([corpus], out, tokenizer=str(tok), workers=w, log=lambda *x: None)
                times.append(time.perf_counter() - t0)
                files = [s["file"] for sp in m["splits"].values() for s in sp["shards"]]
                if first is None:
                    first = out, files
                assert all(filecmp.cmp(first[0] / f, out / f, shallow=False) for f in files)
            best = min(times)
            rows.append({"workers": w, "wall_s": [round(t, 3) for t in times], "best_s": round(best, 3),
                         "MB_per_s": round(nbytes / 1e6 / best, 2),
                         "tokens": m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]})
            print(rows[-1])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"input_MB": round(nbytes / 1e6, 2), "files": a.files,
                               "cpu_cores": os.cpu_count(), "machine": platform.machine(),
                               "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
                               "note": "2-core machine shared with other jobs; outputs identical",
                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
