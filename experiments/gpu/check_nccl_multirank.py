"""GPU check 5: multi-rank NCCL on one GPU — groups, aborts that keep survivors, generations, and
hot-swaps on NCCL ending bitwise equal to a failure-free run.

    python experiments/gpu/check_nccl_multirank.py OUT_DIR [--scenarios S0,S1,S2,S3,S4]
        [--generations 20] [--steps 20] [--dry-run]

Several NCCL ranks share the GPU the way ``launcher.share_gpu=true`` runs them: each process has
its own ``NCCL_HOSTID`` (NCCL then treats the ranks as separate hosts and connects them over its
socket transport on loopback) and the runtime's NCCL environment (``deadpool.rank.nccl_env``). Socket
transport is slow: these are correctness and recovery-timing checks, never throughput.

S0  2 and 9 processes form a NCCL group and all-reduce correctly; the control (2 processes
    without ``NCCL_HOSTID``) is expected to fail ("Duplicate GPU detected").
S1  4 ranks + 1 spare, 3 groups per rank (world, and two 2-rank groups): rank 3 is SIGKILLed
    inside a stream of all-reduces; every survivor's watcher aborts its groups one after another
    (timed per group); the spare takes rank 3 in a fresh namespace and the all-reduce is right;
    then rank 2 is killed and the survivors abort their groups in parallel (a thread per group,
    as ``Communicator`` does); a 3-rank generation follows. No survivor may exit.
S2  4 processes, 20 generations of the real ``Communicator`` (dp2 x tp2 groups): build, use,
    park (abort); GPU memory, file descriptors and threads per generation (growth = last - 2nd).
S3  ``python -m deadpool.train``: dp4 + 1 spare, backend=nccl deterministic=true, rank 1 killed
    inside the gradient all-reduce; bitwise comparison with a failure-free run on NCCL.
S4  dp2 x tp2 x pp2 + 1 spare, a TP peer (rank 1) killed in forward; bitwise as S3.
S5  (only when named) as S4 on nodes of two ranks (``parallel.ranks_per_node=2``) with two
    spares (a node of their own), and a whole node lost at once (a ``kill_node`` fault: the
    node's agent and both its ranks SIGKILLed): one recovery of both ranks, swapped in as a
    block onto the spares' node, bitwise equal (``nccl_jobs.py``; about 2 min).

Results go to OUT_DIR/<name>.json (default check_nccl_multirank.json), rewritten after every
scenario (a timeout still leaves what ran); the jobs' run directories are temporary. Expected
times: S0-S2 about 3-5 min, S3-S4 about 4-6 min, S5 about 2 min; with a 10-minute limit per
command run them as separate commands (``--scenarios S0,S1,S2`` then ``--scenarios S3,S4 --name
check_nccl_multirank_jobs``). ``--dry-run`` (no GPU needed) checks the arguments, the
per-process environments and that the job configs compose (S5: its node layout), and writes
the same file with the plan.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, env_info, write_json  # noqa: E402
from nccl_jobs import JOBS, dry_run as job_dry_run, run_job  # noqa: E402

SCENARIOS = ("S0", "S1", "S2", "S3", "S4")  # the default set; S5 when named
KNOWN = SCENARIOS + ("S5",)
HERE = Path(__file__).resolve()


# -- process environments ---------------------------------------------------------------------
def proc_env(slot: int, share: bool = True) -> dict[str, str]:
    """A worker process's environment: the runtime's NCCL settings, plus (``share``) a host id of
    its own so that several NCCL ranks may share the GPU."""
    from deadpool.rank import nccl_env

    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    env.update(nccl_env.nccl_env(deterministic=False, environ=env)[0])
    if share:
        env.update(nccl_env.share_gpu_env(slot))
    else:
        for k in nccl_env.share_gpu_env(slot):
            env.pop(k, None)
    return env


def spawn(role: str, slot: int, port: int, extra: list[str], share: bool = True) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE), "--worker", role, "--slot", str(slot),
                             "--port", str(port), *extra], env=proc_env(slot, share),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def master_store():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=120), use_libuv=True)


def client(port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120),
                         use_libuv=True)


def nccl_group(store, prefix: str, rank: int, size: int):
    import torch
    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=120)
    pg = dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, size, opts)
    pg.allreduce([torch.zeros(1, device="cuda")]).wait()  # connect now (as Communicator does)
    torch.cuda.synchronize()
    return pg


def collect(procs: dict[int, subprocess.Popen], timeout_s: float) -> dict:
    out = {}
    deadline = time.monotonic() + timeout_s
    for slot, p in procs.items():
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out[slot] = {"rc": p.returncode, "tail": text[-1500:]}
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            text, _ = p.communicate()
            out[slot] = {"rc": "timeout", "tail": (text or "")[-1500:]}
    return out


def results(store, prefix: str, slots) -> dict:
    return {s: json.loads(store.get(f"{prefix}/result/{s}")) for s in slots
            if store.check([f"{prefix}/result/{s}"])}


# -- S0 -----------------------------------------------------------------------------------------
def worker_s0(store, slot: int, n: int, tag: str) -> dict:
    import torch

    t0 = time.perf_counter()
    pg = nccl_group(store, f"s0/{tag}/", slot, n)
    connect_s = time.perf_counter() - t0
    t = torch.full((1 << 20,), float(slot + 1), device="cuda")
    pg.allreduce([t]).wait()
    torch.cuda.synchronize()
    ok = bool(torch.all(t == n * (n + 1) / 2))
    t0 = time.perf_counter()
    for _ in range(10):
        pg.allreduce([t]).wait()
    torch.cuda.synchronize()
    return {"connect_s": connect_s, "correct": ok, "allreduce_4mib_ms": (time.perf_counter() - t0) * 100}


def run_s0(args) -> dict:
    out = {}
    for n, share, tag in ((2, True, "n2"), (9, True, "n9"), (2, False, "control")):
        master = master_store()
        procs = {s: spawn("S0", s, master.port, ["--n", str(n), "--tag", tag], share) for s in range(n)}
        ends = collect(procs, 60 if share else 40)
        res = results(master, f"s0/{tag}", range(n))
        out[tag] = {"processes": n, "own_host_ids": share, "exit": {s: e["rc"] for s, e in ends.items()},
                    "results": res,
                    "formed_and_correct": len(res) == n and all(r["correct"] for r in res.values())}
        if not share or len(res) < n:
            out[tag]["tails"] = {s: e["tail"][-600:] for s, e in ends.items()}
    out["control_failed_as_expected"] = not out["control"]["formed_and_correct"]
    return out


# -- S1 -----------------------------------------------------------------------------------------
def worker_s1(store, slot: int) -> dict:
    """Follow the parent's plans: ``s1/plan/g`` = JSON {slot: rank}, world size, parallel."""
    import torch

    rec = {"generations": []}
    kept = []
    g = 0
    while True:
        key = f"s1/plan/{g}"
        store.wait([key], timedelta(seconds=120))
        plan = json.loads(store.get(key))
        if plan.get("stop"):
            break
        rank = plan["ranks"].get(str(slot))
        if rank is None:
            g += 1
            continue
        n, parallel = plan["world"], plan["parallel"]
        groups = {"world": nccl_group(store, f"s1/g{g}/world/", rank, n)}
        if n == 4:  # two 2-rank groups per rank, as dp and tp groups of a dp2 x tp2 layout
            groups["a"] = nccl_group(store, f"s1/g{g}/a{rank // 2}/", rank % 2, 2)
            groups["b"] = nccl_group(store, f"s1/g{g}/b{rank % 2}/", rank // 2, 2)
        t = torch.full((1 << 20,), float(rank + 1), device="cuda")
        groups["world"].allreduce([t]).wait()
        torch.cuda.synchronize()
        gen = {"g": g, "rank": rank, "correct": bool(torch.all(t == n * (n + 1) / 2))}
        store.set(f"s1/g{g}/ready/{slot}", "1")
        if not plan.get("kill"):
            rec["generations"].append(gen)
            kept.append(groups)
            g += 1
            continue
        aborted = threading.Event()
        abort_s, t_abort = {}, {}

        def watch():
            store.wait([f"s1/g{g}/abort"], timedelta(seconds=120))
            t_abort["t"] = time.monotonic()
            aborted.set()

            def one(name, pg):
                t0 = time.monotonic()
                pg.abort()
                abort_s[name] = time.monotonic() - t0
            if parallel:
                ts = [threading.Thread(target=one, args=kv) for kv in groups.items()]
                for th in ts:
                    th.start()
                for th in ts:
                    th.join()
            else:
                for kv in groups.items():
                    one(*kv)
            t_abort["all_done"] = time.monotonic()

        w = threading.Thread(target=watch, daemon=True)
        w.start()
        big = torch.ones(1 << 24, device="cuda")  # 64 MiB: the kill lands inside one
        released = None
        while not aborted.is_set():
            try:
                groups["world"].allreduce([big]).wait()
            except Exception as e:  # posting on an aborted group
                gen["post_error"] = f"{type(e).__name__}: {e}"[:200]
                break
            ev = torch.cuda.Event()
            ev.record()
            while not ev.query() and not aborted.is_set():
                time.sleep(0.0005)
        ev = torch.cuda.Event()
        ev.record()  # behind the all-reduce the kill cut: done once the abort frees the stream
        t0 = time.monotonic()
        while not ev.query() and time.monotonic() - t0 < 30:
            time.sleep(0.001)
        released = ev.query()
        t_released = time.monotonic()
        w.join(60)
        gen.update(aborts_s=abort_s, parallel=parallel,
                   abort_total_s=t_abort.get("all_done", float("nan")) - t_abort.get("t", float("nan")),
                   stream_released=released,
                   stream_released_after_abort_s=t_released - t_abort.get("t", t_released))
        rec["generations"].append(gen)
        kept.append(groups)  # aborted groups stay referenced (as Worker.parked keeps them)
        g += 1
    return rec


def run_s1(args) -> dict:
    master = master_store()
    procs = {s: spawn("S1", s, master.port, []) for s in range(5)}
    plans = [  # (slot -> rank, world, kill slot, parallel aborts)
        ({0: 0, 1: 1, 2: 2, 3: 3}, 4, 3, False),
        ({0: 0, 1: 1, 2: 2, 4: 3}, 4, 2, True),
        ({0: 0, 1: 1, 4: 2}, 3, None, False),
    ]
    timeline = []
    for g, (ranks, world, kill, parallel) in enumerate(plans):
        master.set(f"s1/plan/{g}", json.dumps({"ranks": {str(s): r for s, r in ranks.items()},
                                                "world": world, "parallel": parallel,
                                                "kill": kill is not None}))
        master.wait([f"s1/g{g}/ready/{s}" for s in ranks], timedelta(seconds=120))
        if kill is not None:
            time.sleep(1.0)  # inside the stream of all-reduces
            t_kill = time.time()
            os.kill(procs[kill].pid, signal.SIGKILL)
            master.set(f"s1/g{g}/abort", f"slot {kill} killed")
            timeline.append({"g": g, "killed_slot": kill, "t": t_kill})
    master.set(f"s1/plan/{len(plans)}", json.dumps({"stop": True}))
    ends = collect(procs, 120)
    res = results(master, "s1", range(5))
    killed = {k for _, _, k, _ in plans if k is not None}
    survivors_alive = all(ends[s]["rc"] == 0 for s in range(5) if s not in killed)
    return {"plans": [{"ranks": r, "world": w, "killed_slot": k, "parallel_aborts": p}
                      for r, w, k, p in plans],
            "exit": {s: e["rc"] for s, e in ends.items()}, "results": res,
            "survivors_stayed_alive": survivors_alive,
            "tails": {s: e["tail"][-600:] for s, e in ends.items() if s not in killed and e["rc"] != 0}}


# -- S2 -----------------------------------------------------------------------------------------
def worker_s2(store, slot: int, generations: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from common import gpu_used_by_pid
    from deadpool.rank.comm import Communicator
    from deadpool.topology import ParallelDims, Topology

    dims = ParallelDims(dp=2, tp=2, ranks_per_node=4)
    port = int(os.environ["S2_PORT"])
    build_store = client(port)
    prev, rows = None, []
    for g in range(generations):
        t0 = time.perf_counter()
        comm = Communicator.build(Topology(dims, slot, g), store, "nccl", poll_s=0.01,
                                  timeout_s=120, store_factory=lambda: build_store)
        build_s = time.perf_counter() - t0
        if prev is not None:
            prev.release()
        t = torch.full((1 << 20,), 1.0, device="cuda")
        comm.allreduce(t, "dp")
        comm.allreduce(t, "tp")
        comm.sync()
        ok = bool(torch.all(t == 4.0))
        comm.park()
        comm._watcher.join(60)
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        rows.append({"g": g, "build_s": build_s, "correct": ok, "abort_s": dict(comm.abort_s),
                     "gpu_used_mib_this_pid": gpu_used_by_pid(os.getpid())["smi_pid_mib"],
                     "torch_reserved_mib": torch.cuda.memory_reserved() / 2**20,
                     "fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(),
                     "os_threads": len(os.listdir("/proc/self/task"))})
        prev = comm
    keys = ("gpu_used_mib_this_pid", "torch_reserved_mib", "fds", "os_threads")
    growth = {k: (rows[-1][k] - rows[1][k]) if len(rows) > 2 and rows[1][k] is not None
              and rows[-1][k] is not None else None for k in keys}
    return {"rows": rows, "growth_2nd_to_last": growth}


def run_s2(args) -> dict:
    master = master_store()
    os.environ["S2_PORT"] = str(master.port)
    procs = {s: spawn("S2", s, master.port, ["--generations", str(args.generations)]) for s in range(4)}
    ends = collect(procs, 240)
    res = results(master, "s2", range(4))
    return {"generations": args.generations, "exit": {s: e["rc"] for s, e in ends.items()},
            "results": res, "tails": {s: e["tail"][-600:] for s, e in ends.items() if e["rc"] != 0}}


# -- entry ------------------------------------------------------------------------------------
def dry_run(args, scenarios) -> dict:
    """What would run, checked without a GPU: environments and job configs."""
    from deadpool.rank import nccl_env

    plan = {"dry_run": True, "scenarios": scenarios, "env": env_info(),
            "worker_env": {k: v for k, v in proc_env(0).items()
                           if k.startswith(("NCCL_", "TORCH_NCCL_"))},
            "required": nccl_env.REQUIRED}
    hosts = {proc_env(s)["NCCL_HOSTID"] for s in range(10)}
    assert len(hosts) == 10, "every process needs its own NCCL_HOSTID"
    assert "NCCL_HOSTID" not in proc_env(0, share=False)
    for name in JOBS:
        if name in scenarios:
            plan[name] = job_dry_run(name, args.steps, Path(args.out_dir))
    return plan


def worker_main(args) -> None:
    import torch

    torch.cuda.set_device(0)
    store = client(args.port)
    if args.worker == "S0":
        res = worker_s0(store, args.slot, args.n, args.tag)
        store.set(f"s0/{args.tag}/result/{args.slot}", json.dumps(res))
    elif args.worker == "S1":
        store.set(f"s1/result/{args.slot}", json.dumps(worker_s1(store, args.slot)))
    elif args.worker == "S2":
        store.set(f"s2/result/{args.slot}", json.dumps(worker_s2(store, args.slot, args.generations)))
    sys.stdout.flush()
    os._exit(0)  # aborted groups: leave without destructors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", nargs="?")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--generations", type=int, default=20, help="S2: generations")
    ap.add_argument("--steps", type=int, default=20, help="S3/S4: training steps")
    ap.add_argument("--job-timeout-s", type=float, default=240.0,
                    help="S3/S4: per job (the failure-free reference run included)")
    ap.add_argument("--dry-run", action="store_true", help="check arguments and env; no GPU")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the job scenarios (S3-S5) on gloo, a smoke run without a GPU")
    ap.add_argument("--name", default="check_nccl_multirank", help="output file stem")
    ap.add_argument("--worker", choices=SCENARIOS[:3], help=argparse.SUPPRESS)
    ap.add_argument("--slot", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="n2", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args)
    if not args.out_dir:
        ap.error("OUT_DIR is required")
    scenarios = [s.strip().upper() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in scenarios if s not in KNOWN]
    if bad or not scenarios:
        ap.error(f"--scenarios must list some of {','.join(KNOWN)}, got {args.scenarios!r}")
    if args.generations < 3 or args.steps < 10:
        ap.error("--generations must be >= 3 and --steps >= 10")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / f"{args.name}.json"
    if args.dry_run:
        write_json(out_path, dry_run(args, scenarios))
        print(f"dry run ok: {out_path}")
        return
    import torch

    res = {"check": "multi-rank NCCL on one GPU", "env": env_info(), "scenarios": {}}
    if args.device == "cpu" and not set(scenarios) <= set(JOBS):
        ap.error("--device cpu runs the job scenarios only (S3, S4, S5)")
    if args.device == "cuda" and not torch.cuda.is_available():
        res["skipped"] = "needs a CUDA device (use --dry-run to check the set-up)"
        write_json(out_path, res)
        print(res["skipped"])
        return
    runners = {"S0": run_s0, "S1": run_s1, "S2": run_s2}
    for name in scenarios:
        t0 = time.perf_counter()
        print(f"=== {name}", flush=True)
        try:
            got = runners[name](args) if name in runners else run_job(name, args, out_dir)
        except Exception as e:  # recorded; the next scenario still runs
            got = {"error": f"{type(e).__name__}: {e}"}
        got["wall_s"] = time.perf_counter() - t0
        res["scenarios"][name] = got
        write_json(out_path, res)
        print(json.dumps({k: v for k, v in got.items() if k not in ("results", "tails", "stdout_tail",
                                                                     "per_rank")}, default=str)[:1500],
              flush=True)


if __name__ == "__main__":
    main()
