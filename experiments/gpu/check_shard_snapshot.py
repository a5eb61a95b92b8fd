"""GPU check 4a: the snapshot of one rank of a LLaMA-65B layout (what ZeRO-1 makes unique).

    python experiments/gpu/check_shard_snapshot.py OUT_DIR [--layout llama65b_a100_80g]
        [--model llama_65b] [--slots 2] [--rounds 3]

One rank of the layout (the worst pipeline stage, from ``deadpool.launch.memory.estimate``) holds its
stage's parameters (shared with its data-parallel peers) and its AdamW shard (unique). The state
is allocated on the GPU at those sizes (values are random: what is measured is bandwidth, not
training), handed to ``SnapshotEngine`` with the runtime's regions (``replicate=unique``), and
snapshotted ``--rounds`` times. Reported: state and region sizes, pinned-buffer allocation time,
the device-to-host copy time of a snapshot and its bandwidth, the CRC32 time of each region (the
copier thread's), bytes replicated per step (the unique region) vs the whole state, and host
memory of the local ring as a multiple of the state.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, env_info, write_json  # noqa: E402

import torch  # noqa: E402
import yaml  # noqa: E402

from deadpool.launch.memory import estimate  # noqa: E402
from deadpool.snapshot import SnapshotEngine, checksum  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--model", default="llama_65b")
    ap.add_argument("--layout", default="llama65b_a100_80g")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = yaml.safe_load((ROOT / "conf/model" / f"{args.model}.yaml").read_text())
    layout = yaml.safe_load((ROOT / "conf/parallel" / f"{args.layout}.yaml").read_text())
    est = estimate(model, layout, batch_size=8, seq_len=2048, microbatches=8)
    n = est["params_per_rank"]
    dp = int(layout["dp"])
    shard = -(-n // dp)
    dev = torch.device("cuda")
    params = torch.randn(shard * dp, device=dev)
    exp_avg, exp_avg_sq = torch.randn(shard, device=dev), torch.rand(shard, device=dev)
    step = torch.tensor(7.0)
    tensors = [("params", params), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("step", step)]
    t0 = time.perf_counter()
    eng = SnapshotEngine(tensors, num_local_slots=args.slots, device="cuda", num_shared=1,
                         replicate="unique")
    alloc_s = time.perf_counter() - t0
    state = eng.layout.nbytes
    unique = eng.bounds["unique"][1] - eng.bounds["unique"][0]
    copies, crc_shared, crc_unique = [], [], []
    for s in range(args.rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.snapshot(s + 1, {"step": s + 1})
        slot = eng._last_copy
        slot.cuda_event.synchronize()
        copies.append(time.perf_counter() - t0)
        eng.drain()  # the copier's CRC32 of both regions
        flat = slot.flat
        t0 = time.perf_counter()
        checksum(flat[:eng.bounds["unique"][0]])
        crc_shared.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        checksum(flat[eng.bounds["unique"][0]:])
        crc_unique.append(time.perf_counter() - t0)
    ok = torch.equal(eng.local_slot(args.rounds).flat[:64].view(torch.float32).cpu()[:16],
                     params[:16].cpu())
    copy_s = statistics.median(copies)
    res = {"check": "snapshot of one LLaMA-65B rank (ZeRO-1 regions)", "env": env_info(),
           "model": args.model, "layout": args.layout, "stage": est["stage"],
           "params_per_rank": n, "state_gb": state / 1e9, "unique_gb": unique / 1e9,
           "replicated_fraction": unique / state, "replicated_bytes_per_step": unique,
           "pinned_alloc_s": alloc_s, "slots": args.slots,
           "host_ring_multiple_of_state": sum(s.flat.numel() for s in eng.slots) / state,
           "copy_s_median": copy_s, "copy_gbps": state / copy_s / 1e9, "copies_s": copies,
           "crc_shared_s_median": statistics.median(crc_shared),
           "crc_unique_s_median": statistics.median(crc_unique),
           "crc_gbps": state / (statistics.median(crc_shared) + statistics.median(crc_unique)) / 1e9,
           "snapshot_matches_live": ok}
    write_json(args.out_dir / "check_shard_snapshot.json", res)
    print({k: v for k, v in res.items() if k != "env"}, flush=True)


if __name__ == "__main__":
    main()
