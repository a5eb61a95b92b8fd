"""What activation checkpointing costs in compute: forward + backward time per mode, one process.

    python experiments/bench_checkpointing.py [--model small] [--batch-size 4] [--seq-len 256]
        [--rounds 7] [--device cpu|cuda]

The single-process model (``deadpool.model``) with ``activation_checkpointing`` none, selective
and full, the same weights and batch; modes interleaved round by round (the first round is a
warm-up and dropped). Prints each mode's median time and its ratio to ``none``. Expectation:
``full`` re-runs each block's forward in backward, about a third of a forward + backward
(ratio ~1.3); ``selective`` recomputes one elementwise product per block (~1.0). The memory
side is ``python -m deadpool.memory --measured``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool.model import ACTIVATION_CHECKPOINTING, build_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(__file__).resolve().parents[1]
    mcfg = yaml.safe_load((root / "conf/model" / f"{args.model}.yaml").read_text())
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch_size, args.seq_len)
    x, y = (torch.randint(0, mcfg["vocab_size"], shape, generator=gen).to(args.device)
            for _ in range(2))
    models = {mode: build_model(mcfg, 0, device=args.device, activation_checkpointing=mode)
              for mode in ACTIVATION_CHECKPOINTING}
    times: dict[str, list[float]] = {mode: [] for mode in models}
    for _ in range(args.rounds):
        for mode, model in models.items():
            model.zero_grad(set_to_none=True)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(x, y).backward()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times[mode].append(time.perf_counter() - t0)
    base = statistics.median(times["none"][1:])
    print(f"model={args.model} tokens={args.batch_size} x {args.seq_len} device={args.device} "
          f"(median of {args.rounds - 1} rounds)")
    for mode, ts in times.items():
        med = statistics.median(ts[1:])
        print(f"  {mode:9s} {med * 1e3:8.1f} ms   x{med / base:.2f}")


if __name__ == "__main__":
    main()
