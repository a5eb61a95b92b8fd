"""CUDA snapshot benchmark (needs a GPU): step-time ratio with snapshots on/off and D2H bandwidth.

    python experiments/bench_snapshot_cuda.py [--model gpt_1b] [--steps 30] [--batch-size 8] [--seq-len 1024]

Superseded by experiments/gpu/check_snapshot.py: this script synchronises the whole device
around each step, which waits for the side-stream copy too, so it measures snapshots serialised
with the step, not overlapped.

Single process, no replication: this isolates what the snapshot costs the GPU's critical path
(side-stream copies into pinned host memory overlapping forward/backward, and the wait before the
optimizer step). Steps alternate in blocks of 4 between snapshotting and not (in-run A/B).
Prints: pinned D2H bandwidth (GB/s), pageable D2H bandwidth, step-time ratio on/off (target
<= 1.01 for the largest model that fits), and the copy time per snapshot.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool.data import SyntheticCorpus  # noqa: E402
from deadpool.model import build_model, build_optimizer  # noqa: E402
from deadpool.snapshot import SnapshotEngine, state_tensors  # noqa: E402


def d2h_bandwidth(nbytes: int, pinned: bool) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize()
    return 5 * nbytes / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt_1b", help="conf/model/<name>.yaml")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--block", type=int, default=4)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    import yaml
    mcfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "conf/model" / f"{args.model}.yaml").read_text())
    model = build_model(mcfg, 0, device="cuda")
    opt = build_optimizer(model, 1e-4, 0.0)
    eng = SnapshotEngine(state_tensors(model, opt), device="cuda")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {args.model}: {n_params / 1e9:.2f} B params, snapshot {eng.layout.nbytes / 2**30:.2f} GiB")
    print(f"D2H bandwidth: pinned {d2h_bandwidth(1 << 30, True):.1f} GB/s, "
          f"pageable {d2h_bandwidth(1 << 30, False):.1f} GB/s")
    corpus = SyntheticCorpus(mcfg["vocab_size"], 0)
    on, off, copy = [], [], []
    took_prev = False
    for step in range(args.steps):
        x, y = corpus.batch(step, 0, args.batch_size, args.seq_len)
        x, y = x.cuda(), y.cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        eng.wait_copy()
        opt.step()
        opt.zero_grad(set_to_none=True)
        take = (step // args.block) % 2 == 0
        if take:
            eng.snapshot(step + 1, {"step": step + 1})
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if step >= args.block and step % args.block:
            (on if took_prev else off).append(dt)
        took_prev = take
        if take and eng.last_copy_s:
            copy.append(eng.last_copy_s)  # latest finished copy; never waited for here
    print(f"step time: snapshots on {statistics.median(on) * 1e3:.1f} ms, off "
          f"{statistics.median(off) * 1e3:.1f} ms -> ratio {statistics.median(on) / statistics.median(off):.3f} "
          f"(target <= 1.01)")
    print(f"copy + checksum per snapshot (background): median {statistics.median(copy) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
