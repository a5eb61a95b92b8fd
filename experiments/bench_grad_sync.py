"""Gradient sync on gloo, side by side: DDP's all-reduce against ZeRO-1's two ways of summing each
bucket on its owner (gloo's ``reduce``, DeadPool's uneven all-to-all), each followed by the
parameter all-gather.

    python experiments/bench_grad_sync.py [--ranks 4] [--numel 1180000] [--iters 60]

The default buffer is the overhead benchmark's model (4.7 MB of fp32 gradients), in one bucket
per shard as ``ZeroOptimizer`` cuts it (DDP: its 1 MB first bucket and the rest). Every
iteration runs each variant once after a barrier, in turn, so a drift of the host hits all alike;
printed: the median over iterations (the first 10 dropped) of rank 0's wall time and of its
process CPU time, and each variant's ratio to DDP's all-reduce. On a host whose cores are all
busy training, the CPU time is what the other ranks lose.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, port: int, numel: int, iters: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    pg = dist.distributed_c10d._get_default_group()
    shard = numel // world
    numel = shard * world
    grads, params = torch.randn(numel), torch.randn(numel)
    inbox, nothing = torch.empty(world * shard), torch.empty(0)
    first = min(numel, (1 << 20) // 4)  # DDP's first bucket: 1 MB

    def buckets():  # one per shard, the last first (backward's order)
        return [(i, grads[i * shard:(i + 1) * shard]) for i in reversed(range(world))]

    def gather():  # as ZeroOptimizer.step does
        pg._allgather_base(params, params[rank * shard:(rank + 1) * shard].clone()).wait()

    def ddp():
        works = [dist.all_reduce(grads[numel - first:], async_op=True),
                 dist.all_reduce(grads[:numel - first], async_op=True)]
        for w in works:
            w.wait()

    def reduce_then_gather():
        for w in [dist.reduce(b, dst=i, async_op=True) for i, b in buckets()]:
            w.wait()
        gather()

    def all_to_all_then_gather():
        works = []
        for i, b in buckets():
            mine = i == rank
            works.append(pg.alltoall_base(inbox if mine else nothing, b,
                                          [shard] * world if mine else [0] * world,
                                          [shard if r == i else 0 for r in range(world)],
                                          dist.AllToAllOptions()))
        for w in works:
            w.wait()
        inbox.view(world, shard).sum(0)
        gather()

    variants = {"DDP all-reduce": ddp, "ZeRO-1, reduce + all-gather": reduce_then_gather,
                "ZeRO-1, all-to-all + all-gather": all_to_all_then_gather}
    wall = {k: [] for k in variants}
    cpu = {k: [] for k in variants}
    for _ in range(iters):
        for name, fn in variants.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    if rank == 0:
        out.put({k: (statistics.median(wall[k][10:]), statistics.median(cpu[k][10:]))
                 for k in variants})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--numel", type=int, default=1_180_000, help="fp32 gradient elements")
    ap.add_argument("--iters", type=int, default=60)
    args = ap.parse_args()
    if args.iters <= 10:
        ap.error("--iters must exceed the 10 warm-up iterations it drops")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_worker, args=(args.ranks, port, args.numel, args.iters, out),
                       nprocs=args.ranks, start_method="spawn")
    res = out.get()
    base_wall, base_cpu = res["DDP all-reduce"]
    print(f"{args.ranks} gloo ranks, {args.numel * 4 / 1e6:.1f} MB of fp32 gradients, "
          f"median of {args.iters - 10} iterations (rank 0):")
    for name, (w, c) in res.items():
        print(f"  {name:32s} {w * 1e3:6.2f} ms ({w / base_wall:.2f}x)   CPU {c * 1e3:6.2f} ms "
              f"({c / base_cpu:.2f}x)")


if __name__ == "__main__":
    main()
