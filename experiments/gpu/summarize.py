"""Key figures of a GPU-check results folder, as summary.json and a markdown table on stdout.

    python experiments/gpu/summarize.py RESULTS_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(d: Path, name: str) -> dict | None:
    f = d / f"{name}.json"
    return json.loads(f.read_text()) if f.exists() else None


def med(q: dict | None) -> float | None:
    return None if not q else q.get("median")


def snapshot_rows(res: dict | None) -> list[dict]:
    if not res or "ab" not in res:
        return []
    bw = res["bandwidth"]
    rows = []
    for r in res["ab"]:
        if "error" in r:
            rows.append({"batch_size": r["batch_size"], "accum": r.get("accum", 1), "error": r["error"]})
            continue
        rows.append({
            "batch_size": r["batch_size"], "accum": r.get("accum", 1),
            "loss_read": r.get("loss_read", "next"), "tokens_per_step": r["tokens_per_step"],
            "step_s_off": med(r["step_s_off"]), "step_s_on": med(r["step_s_on"]),
            "ratio_on_off": r["ratio_on_off_median"],
            "ratio_pairs_min_max": [r["ratio_per_block_pair"].get("min"), r["ratio_per_block_pair"].get("max")],
            "gpu_stall_ms_on": med(r["gpu_stall_ms_on"]),
            "training_thread_ms_on": med(r["training_thread_ms_per_step_on"]),
            "cpu_blocked_ms_on": med(r["cpu_blocked_ms_on"]),
            "loss_item_ms_on": med(r.get("loss_item_ms_on")),
            "peak_gpu_gib": r["peak_gpu_gib"],
        })
    return rows


def main() -> None:
    d = Path(sys.argv[1])
    env = load(d, "env") or {}
    out: dict = {"env": {k: env.get(k) for k in ("date_utc", "gpu", "driver", "torch", "torch_cuda",
                                                 "nccl", "cpu_count", "host_mem_total_gib")}}
    snap = load(d, "check_snapshot")
    if snap and "bandwidth" in snap:
        bw, host = snap["bandwidth"], snap.get("host_memory", {})
        out["snapshot"] = {
            "model": snap["model"]["name"], "params": snap["model"]["params"],
            "state_gib": snap["model"]["state_gib"],
            "raw_pinned_d2h_gbps": bw["raw_pinned_d2h_gbps"],
            "engine_d2h_gbps": bw.get("engine_snapshot", {}).get("median_gbps"),
            "engine_fraction_of_raw": bw.get("engine_snapshot", {}).get("fraction_of_raw_pinned"),
            "pageable_d2h_gbps": bw["d2h_pageable_torch"]["median_gbps"],
            "crc32_gbps": bw["crc32_gbps"],
            "host_slots": host.get("slots"),
            "host_requested_x_state": host.get("requested_x_state"),
            "host_pinned_allocated_x_state": host.get("pinned_allocated_bytes_x_state"),
            "host_memavailable_drop_x_state": host.get("memavailable_drop_x_state"),
            "pinned_alloc_s": host.get("pinned_alloc_s"),
            "ab": snapshot_rows(snap),
        }
    over = load(d, "check_snapshot_overlap")
    if over:
        out["snapshot_overlap"] = {"small_transfer_probe": over["bandwidth"].get("small_transfer_probe"),
                                   "ab": snapshot_rows(over)}
    for name in ("check_hotswap", "check_hotswap_nondeterministic"):
        h = load(d, name)
        if h:
            out[name] = {k: h.get(k) for k in ("command", "returncode", "bitwise_equal", "compare",
                                               "same_final_digest", "recovery", "gpu_processes", "wall_s")}
    for name in ("check_nccl_cycle", "check_nccl_cycle_variants"):
        n = load(d, name)
        if n:
            out[name] = {k: n.get(k) for k in ("options", "cycles_ok", "create_s_first", "create_s_median",
                                               "abort_call_s_median", "abort_call_s_max", "main_left_wait",
                                               "growth_second_to_last")}
            out[name]["baseline"] = {k: n["baseline"].get(k) for k in ("smi_pid_mib", "fds", "threads")}
            last = (n.get("cycles") or [{}])[-1]
            out[name]["last_cycle"] = {k: last.get(k) for k in ("smi_pid_mib", "allocated", "reserved",
                                                                "fds", "threads")}
            out[name]["missing_peer"] = [{k: m.get(k) for k in ("nonblocking", "abort_call", "abort_call_s",
                                                                "main_thread", "fds", "threads")}
                                         for m in n.get("missing_peer", [])]
    (d / "summary.json").write_text(json.dumps(out, indent=1))
    print(f"{out['env'].get('gpu')}, driver {out['env'].get('driver')}, torch {out['env'].get('torch')}, "
          f"{out['env'].get('date_utc')}\n")
    for key in ("snapshot", "snapshot_overlap"):
        rows = (out.get(key) or {}).get("ab", [])
        if rows:
            print("| batch x accum | loss read | step off (s) | step on (s) | on/off | GPU stall (ms) "
                  "| training thread (ms) |\n|---|---|---|---|---|---|---|")
            for r in rows:
                if "error" in r:
                    print(f"| {r['batch_size']} x {r['accum']} | {r['error']} |")
                    continue
                print(f"| {r['batch_size']} x {r['accum']} | {r['loss_read']} | {r['step_s_off']:.3f} | "
                      f"{r['step_s_on']:.3f} | {r['ratio_on_off']:.4f} | {r['gpu_stall_ms_on']:.1f} | "
                      f"{r['training_thread_ms_on']:.1f} |")
            print()


if __name__ == "__main__":
    main()
