"""GPU check 3: NCCL generation cycle: build, use, abort from a watcher thread, rebuild; no leaks.

    python experiments/gpu/check_nccl_cycle.py OUT_DIR [--cycles 20] [--sleep-ms 500]
        [--abort-after-ms 100] [--missing-peer-cycles 3]

One process, one GPU. Each cycle ("generation" g) mirrors what a DeadPool rank does on NCCL:

1. a world-size-1 ``ProcessGroupNCCL`` in a fresh ``PrefixStore`` namespace ``gen{g}/`` of one
   TCPStore; the communicator is connected eagerly (timed: group creation);
2. collectives (all-reduce, broadcast, all-gather) checked for their values;
3. a collective left pending (queued behind a GPU sleep kernel) while the main thread waits on it
   by polling ``is_completed()`` (as ``deadpool.rank.comm.Communicator.wait`` does on NCCL); a watcher
   thread calls the group's ``abort()`` (timed: abort call; and how and when the main thread got
   out of its wait);
4. the group is dropped; GPU memory (``torch.cuda.memory_allocated/reserved``, ``mem_get_info``,
   nvidia-smi for this process) and open file descriptors / threads are recorded.

``--pending none`` aborts an idle group instead (the all-reduce already finished): the cost of
the teardown alone. Growth over the cycles is reported (last vs second cycle). With ``--missing-peer-cycles N`` it then
runs N cycles of a world-size-2 group whose peer never joins (the main thread blocks in the
communicator's set-up inside the first all-reduce; the watcher aborts): what a survivor sees when
a peer died during a rebuild. Results are written after every cycle, so a crash or a hang still
leaves what happened before it in OUT_DIR/check_nccl_cycle.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
import traceback
from collections import Counter
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import env_info, gpu_used_by_pid, write_json  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def fd_summary() -> dict:
    kinds: Counter = Counter()
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        fds += 1
        try:
            tgt = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if tgt.startswith("socket:"):
            kinds["socket"] += 1
        elif tgt.startswith("pipe:"):
            kinds["pipe"] += 1
        elif tgt.startswith("anon_inode:"):
            kinds[tgt] += 1
        elif tgt.startswith("/dev/nvidia"):
            kinds["/dev/nvidia*"] += 1
        elif tgt.startswith("/dev/shm"):
            kinds["/dev/shm"] += 1
        else:
            kinds["other"] += 1
    return {"fds": fds, "fd_kinds": dict(kinds), "threads": len(os.listdir("/proc/self/task"))}


def memory() -> dict:
    free, total = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "device_used_mib": (total - free) // 2**20, **gpu_used_by_pid()}


def new_group(store, g: int, size: int, timeout_s: float, nonblocking: bool = False):
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    if nonblocking:  # NCCL's non-blocking communicator (init and abort return at once)
        opts.config.blocking = 0
    return dist.ProcessGroupNCCL(dist.PrefixStore(f"gen{g}/", store), 0, size, opts)


def sleep_cycles_per_ms() -> float:
    """Clock cycles of ``torch.cuda._sleep`` per millisecond on this GPU (calibrated)."""
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(50_000_000)
    b.record()
    b.synchronize()
    return 50_000_000 / a.elapsed_time(b)


def run_bounded(fn, timeout_s: float):
    """Run fn in a daemon thread; return (finished, value_or_error)."""
    box = {}

    def run():
        try:
            box["v"] = fn()
        except BaseException as e:  # noqa: BLE001 - recorded
            box["e"] = f"{type(e).__name__}: {e}"[:400]

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return False, "still running"
    return True, box.get("e", box.get("v"))


def cycle(store, g: int, dev, args, cyc_per_ms: float) -> dict:
    rec: dict = {"gen": g}
    t0 = time.perf_counter()
    pg = new_group(store, g, 1, args.pg_timeout_s)
    rec["construct_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    if hasattr(pg, "eager_connect_single_device"):
        pg.eager_connect_single_device(dev)
        rec["connect"] = "eager_connect_single_device"
    else:  # the first collective creates the communicator
        w = pg.allreduce([torch.ones(1, device=dev)])
        w.wait()
        rec["connect"] = "first allreduce"
    torch.cuda.synchronize()
    rec["connect_s"] = time.perf_counter() - t1
    rec["create_s"] = time.perf_counter() - t0

    # collectives, checked
    t2 = time.perf_counter()
    x = torch.full((1 << 20,), float(g + 1), device=dev)
    pg.allreduce([x]).wait()
    y = torch.arange(1 << 16, device=dev, dtype=torch.float32)
    bopts = dist.BroadcastOptions()
    bopts.rootRank = 0
    pg.broadcast([y], bopts).wait()
    out = [torch.empty_like(y)]
    pg.allgather([out], [y]).wait()
    torch.cuda.synchronize()
    rec["collectives_ok"] = bool(torch.all(x == g + 1)) and bool(torch.equal(out[0], y))
    rec["collectives_s"] = time.perf_counter() - t2

    # a pending collective (queued behind a GPU sleep; with --pending none the all-reduce is
    # finished before the abort: the abort then costs only the teardown); the main thread polls
    # it; a watcher aborts the group
    z = torch.ones(1 << 20, device=dev)
    if args.pending == "sleep":
        torch.cuda._sleep(int(args.sleep_ms * cyc_per_ms))  # the all-reduce queues behind this
    work = pg.allreduce([z])
    if args.pending == "none":
        while not work.is_completed():
            time.sleep(0.0005)
    abort_info: dict = {}

    def watcher():
        time.sleep(args.abort_after_ms / 1e3)
        abort_info["t_start"] = time.perf_counter()
        try:
            pg.abort()
            abort_info["ok"] = True
        except Exception as e:  # noqa: BLE001 - recorded
            abort_info["error"] = f"{type(e).__name__}: {e}"[:300]
        abort_info["t_end"] = time.perf_counter()

    w_thread = threading.Thread(target=watcher, name=f"abort-watcher-g{g}", daemon=True)
    t_wait = time.perf_counter()
    w_thread.start()
    how = None
    t_done = None
    while True:
        try:
            if work.is_completed():
                t_done = time.perf_counter()
                how = "completed"
                try:
                    work.wait()
                except Exception as e:  # noqa: BLE001 - recorded
                    how = f"completed with error: {type(e).__name__}: {str(e)[:200]}"
                break
        except Exception as e:  # noqa: BLE001 - recorded
            how = f"is_completed raised: {type(e).__name__}: {str(e)[:200]}"
            break
        if "t_end" in abort_info:
            how = "left the wait after abort() returned (work not completed)"
            break
        if time.perf_counter() - t_wait > args.wait_bound_s:
            how = f"still waiting after {args.wait_bound_s} s"
            break
        time.sleep(0.0005)
    t_left = time.perf_counter()
    w_thread.join(args.wait_bound_s)
    rec["abort_call_s"] = (abort_info["t_end"] - abort_info["t_start"]) if "t_end" in abort_info else None
    rec["abort_error"] = abort_info.get("error")
    rec["main_left_wait"] = how
    rec["main_left_after_abort_start_s"] = (t_left - abort_info["t_start"]) if "t_start" in abort_info else None
    if t_done is not None and "t_end" in abort_info:
        # > 0: the work completed before abort() returned (the abort waited for it, or it was done)
        rec["abort_returned_after_work_done_s"] = abort_info["t_end"] - t_done
    rec["work_completed_flag"] = work.is_completed() if how and "raised" not in how else None
    # the GPU still runs the sleep kernel (an abort does not stop kernels already queued)
    fin, err = run_bounded(torch.cuda.synchronize, args.wait_bound_s)
    rec["device_sync_after_abort"] = "ok" if fin and err is None else f"{'hung' if not fin else err}"
    if not fin:
        raise RuntimeError("torch.cuda.synchronize() hung after the abort")
    t3 = time.perf_counter()
    del work, pg, x, y, z, out
    gc.collect()
    rec["drop_s"] = time.perf_counter() - t3
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    rec.update(memory())
    rec.update(fd_summary())
    return rec


def missing_peer_cycle(store, g: int, dev, args) -> dict:
    """World size 2, the peer never comes: the main thread blocks inside the first all-reduce
    (the communicator waits for rank 1); the watcher aborts."""
    rec: dict = {"gen": g, "world_size": 2, "nonblocking": args.missing_peer_nonblocking}
    pg = new_group(store, g, 2, args.pg_timeout_s, nonblocking=args.missing_peer_nonblocking)
    box: dict = {}
    t = torch.ones(1 << 10, device=dev)

    def main_like():
        t0 = time.perf_counter()
        try:
            w = pg.allreduce([t])
            box["posted_s"] = time.perf_counter() - t0
            while not w.is_completed():
                if box.get("aborted") and time.perf_counter() - box["aborted"] > args.wait_bound_s:
                    box["how"] = "work never completed after abort"
                    return
                time.sleep(0.001)
            w.wait()
            box["how"] = "completed (?)"
        except Exception as e:  # noqa: BLE001 - recorded
            box["how"] = f"raised {type(e).__name__}: {str(e)[:300]}"
        finally:
            box["t_left"] = time.perf_counter()

    th = threading.Thread(target=main_like, daemon=True)
    th.start()
    time.sleep(args.abort_after_ms / 1e3 + 0.4)
    t_abort = time.perf_counter()
    box["aborted"] = t_abort
    fin, err = run_bounded(pg.abort, args.wait_bound_s)
    rec["abort_call"] = "returned" if fin and err is None else ("hung" if not fin else err)
    rec["abort_call_s"] = time.perf_counter() - t_abort
    th.join(args.wait_bound_s)
    rec["main_thread"] = box.get("how", "still blocked")
    rec["posted_s"] = box.get("posted_s")
    rec["main_left_after_abort_s"] = (box["t_left"] - t_abort) if "t_left" in box else None
    if not th.is_alive() and fin:
        del pg, t
        gc.collect()
    else:
        rec["note"] = "group kept referenced: a thread is still inside it"
        _KEEP.append((pg, th))
    torch.cuda.empty_cache()
    rec.update(memory())
    rec.update(fd_summary())
    return rec


_KEEP: list = []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--sleep-ms", type=float, default=500.0, help="GPU sleep the pending op queues behind")
    ap.add_argument("--abort-after-ms", type=float, default=100.0)
    ap.add_argument("--wait-bound-s", type=float, default=15.0)
    ap.add_argument("--pg-timeout-s", type=float, default=60.0)
    ap.add_argument("--pending", choices=["sleep", "none"], default="sleep",
                    help="sleep: the aborted all-reduce is queued behind a GPU sleep; none: it is done")
    ap.add_argument("--missing-peer-cycles", type=int, default=0)
    ap.add_argument("--missing-peer-nonblocking", action="store_true",
                    help="missing-peer groups use NCCL's non-blocking communicator (config.blocking=0)")
    ap.add_argument("--name", default="check_nccl_cycle", help="output file stem")
    args = ap.parse_args()
    out_path = Path(args.out_dir) / f"{args.name}.json"
    res: dict = {"check": "NCCL generation cycle", "options": sys.argv[2:], "env": env_info(),
                 "nccl_env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL"))}}
    if not torch.cuda.is_available():
        res["skipped"] = "needs a CUDA device"
        write_json(out_path, res)
        print(res["skipped"])
        return
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.ones(1, device=dev)  # the CUDA context first, so cycle 0 is not charged for it
    cyc_per_ms = sleep_cycles_per_ms()
    res["sleep_cycles_per_ms"] = cyc_per_ms
    res["baseline"] = {**memory(), **fd_summary()}
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    res["api"] = {"abort": hasattr(dist.ProcessGroupNCCL, "abort"),
                  "shutdown": hasattr(dist.ProcessGroupNCCL, "shutdown"),
                  "eager_connect_single_device": hasattr(dist.ProcessGroupNCCL, "eager_connect_single_device")}
    res["cycles"] = []
    write_json(out_path, res)
    for g in range(args.cycles):
        try:
            rec = cycle(store, g, dev, args, cyc_per_ms)
        except Exception as e:  # noqa: BLE001 - recorded, then stop
            res["cycles"].append({"gen": g, "error": f"{type(e).__name__}: {e}"[:500],
                                  "traceback": traceback.format_exc()[-1500:]})
            write_json(out_path, res)
            print(f"cycle {g}: FAILED {e}", flush=True)
            break
        res["cycles"].append(rec)
        write_json(out_path, res)
        print(f"cycle {g}: create {rec['create_s'] * 1e3:.1f} ms, abort {rec['abort_call_s']}, "
              f"main: {rec['main_left_wait']}, alloc {rec['allocated']} reserved {rec['reserved']} "
              f"smi {rec['smi_pid_mib']} MiB, fds {rec['fds']}, threads {rec['threads']}", flush=True)
    ok = [c for c in res["cycles"] if "error" not in c]
    if len(ok) >= 3:
        first, last = ok[1], ok[-1]  # cycle 0 pays one-time set-up (NCCL's own init)
        res["growth_second_to_last"] = {
            k: last[k] - first[k] for k in ("allocated", "reserved", "device_used_mib", "fds", "threads")
            if isinstance(last.get(k), int) and isinstance(first.get(k), int)}
        if isinstance(last.get("smi_pid_mib"), int) and isinstance(first.get("smi_pid_mib"), int):
            res["growth_second_to_last"]["smi_pid_mib"] = last["smi_pid_mib"] - first["smi_pid_mib"]
        cs = sorted(c["create_s"] for c in ok[1:])
        ab = sorted(c["abort_call_s"] for c in ok if c.get("abort_call_s") is not None)
        res["create_s_median"] = cs[len(cs) // 2]
        res["create_s_first"] = ok[0]["create_s"]
        res["abort_call_s_median"] = ab[len(ab) // 2] if ab else None
        res["abort_call_s_max"] = ab[-1] if ab else None
        res["main_left_wait"] = dict(Counter(c["main_left_wait"] for c in ok))
    res["cycles_ok"] = len(ok)
    write_json(out_path, res)
    if args.missing_peer_cycles:
        res["missing_peer"] = []
        for k in range(args.missing_peer_cycles):
            try:
                rec = missing_peer_cycle(store, 1000 + k, dev, args)
            except Exception as e:  # noqa: BLE001 - recorded
                rec = {"gen": 1000 + k, "error": f"{type(e).__name__}: {e}"[:500]}
            res["missing_peer"].append(rec)
            write_json(out_path, res)
            print(f"missing-peer cycle {k}: {rec}", flush=True)
    print(f"wrote {out_path.name}", flush=True)
    sys.stdout.flush()
    os._exit(0)  # threads left inside an aborted group must not hold the exit up


if __name__ == "__main__":
    main()
