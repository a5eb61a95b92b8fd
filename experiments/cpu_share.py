"""Where a running job's CPU goes: cores used per process and per thread over a window.

    python experiments/cpu_share.py [--after 30] [--for 20] [--match deadpool,ddp_reference]

Start a job (``python -m deadpool.train ...`` or the DDP reference under torchrun), then run this:
it waits ``--after`` seconds (start-up, warm-up), reads every matching process's and thread's CPU
time from ``/proc`` twice, ``--for`` seconds apart, and prints cores used per process (its five
busiest threads by name) and in all. On a small host the training ranks share the cores with the
job's other processes (coordinator, node agents, warm spares), so their share is the ranks' loss;
on a GPU node they run on host cores the GPUs leave idle. Linux only.
"""

from __future__ import annotations

import argparse
import os
import time

CLK = os.sysconf("SC_CLK_TCK")


def _cpu_times(match: list[str]) -> dict[tuple[int, int], tuple[str, str, int]]:
    """(pid, tid) -> (process, thread name, utime + stime in ticks) for matching processes."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            cmd = " ".join(a.decode(errors="replace") for a in argv if a)
            comm = open(f"/proc/{pid}/comm").read().strip()
            if not any(m in cmd or m in comm for m in match) or int(pid) == os.getpid():
                continue
            # a forked rank keeps its agent's command line: its process name says what it is
            words = [w for w in cmd.split() if not w.startswith("-")]
            who = comm if comm.startswith("dp-") else " ".join(words[1:2]) or comm
            for tid in os.listdir(f"/proc/{pid}/task"):
                stat = open(f"/proc/{pid}/task/{tid}/stat").read()
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2:].split()
                out[(int(pid), int(tid))] = (who, name, int(fields[11]) + int(fields[12]))
        except (OSError, ValueError):  # the process or thread ended meanwhile
            continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--after", type=float, default=30.0, help="seconds to wait first")
    ap.add_argument("--for", dest="window", type=float, default=20.0, help="window in seconds")
    ap.add_argument("--match", default="deadpool,ddp_reference,dp-slot",
                    help="comma-separated substrings of the command line or process name")
    args = ap.parse_args()
    match = args.match.split(",")
    time.sleep(args.after)
    a, t0 = _cpu_times(match), time.monotonic()
    time.sleep(args.window)
    b, dt = _cpu_times(match), time.monotonic() - t0
    procs: dict[tuple[int, str], list[tuple[float, str]]] = {}
    for key, (who, name, ticks) in b.items():
        if key in a:
            procs.setdefault((key[0], who), []).append(((ticks - a[key][2]) / CLK / dt, name))
    if not procs:
        raise SystemExit(f"no process matching {args.match!r} ran through the window")
    total = 0.0
    for (pid, who), threads in sorted(procs.items(), key=lambda kv: -sum(c for c, _ in kv[1])):
        cores = sum(c for c, _ in threads)
        total += cores
        busiest = ", ".join(f"{n} {c:.2f}" for c, n in sorted(threads, reverse=True)[:5]
                            if c >= 0.005)
        print(f"{pid:>8}  {who[:32]:32s} {cores:5.2f} cores  {busiest}")
    print(f"{'':>8}  {'all':32s} {total:5.2f} cores over {dt:.1f} s (host has {os.cpu_count()})")


if __name__ == "__main__":
    main()
