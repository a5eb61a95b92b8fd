"""GPU check 1: the snapshot engine on CUDA costs the training step nothing (target ratio <= 1.005).

    python experiments/gpu/check_snapshot.py OUT_DIR [--model gpt_1b] [--batch-sizes 8,16]
        [--seq-len 1024] [--rounds 6] [--block 4] [--slots 3]

One process, one GPU, a LLaMA-shaped model (conf/model/<name>.yaml) trained with AdamW under
bf16 autocast; no replication (this isolates what the snapshot costs the GPU's critical path).
Writes OUT_DIR/check_snapshot.json with:

- raw device-to-host bandwidth: one cudaMemcpyAsync of 2 GiB into pinned memory (through
  torch's copy_ and, when CuPy is present, through cudaMemcpyAsync called directly), timed with
  CUDA events; pageable D2H and pinned H2D for reference;
- the engine's own D2H bandwidth: a whole snapshot (one copy per state tensor on the side stream)
  with the GPU otherwise idle, as a fraction of the raw pinned figure;
- host memory of the snapshot buffers (pinned slots) as a multiple of the state size: requested,
  what the pinned allocator reserved, and the drop of MemAvailable;
- CRC32 throughput of the copier thread (it checksums every snapshot on the CPU);
- per batch size, an in-run A/B: blocks of ``block`` steps alternate snapshots on / off; the
  first step of each block is dropped (it overlaps the other mode). Per step: wall time between
  main-stream synchronisations, the GPU stall in ``wait_copy`` (CUDA events around the wait:
  the main stream waiting for the side-stream copy), the CPU time the training thread spent
  blocked (``engine.blocked_s``) and issuing the copies (``snapshot()``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, env_info, meminfo, proc_status, write_json  # noqa: E402

import torch  # noqa: E402

from deadpool.data import SyntheticCorpus  # noqa: E402
from deadpool.model import build_model, build_optimizer  # noqa: E402
from deadpool.snapshot import SnapshotEngine, state_tensors  # noqa: E402


def _q(xs: list[float]) -> dict:
    if not xs:
        return {}
    s = sorted(xs)
    q = statistics.quantiles(s, n=4) if len(s) > 1 else [s[0]] * 3
    return {"median": statistics.median(s), "p25": q[0], "p75": q[2], "min": s[0], "max": s[-1],
            "n": len(s)}


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def bandwidths(nbytes: int, reps: int) -> dict:
    """Raw copy bandwidths (GB/s, 1e9 bytes), median over ``reps`` after 2 warm-ups."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(7)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(0)  # fault the pages in
    stream = torch.cuda.Stream()
    out = {"bytes": nbytes}

    def timed(fn) -> list[float]:
        ts = []
        with torch.cuda.stream(stream):
            for i in range(reps + 2):
                a, b = _events()
                a.record(stream)
                fn()
                b.record(stream)
                b.synchronize()
                if i >= 2:
                    ts.append(a.elapsed_time(b) / 1e3)
        return ts

    def gbps(ts):
        return {"median_gbps": nbytes / statistics.median(ts) / 1e9, "best_gbps": nbytes / min(ts) / 1e9}

    out["d2h_pinned_torch"] = gbps(timed(lambda: pinned.copy_(src, non_blocking=True)))
    try:  # cudaMemcpyAsync itself, on the same stream and buffers
        import cupy

        rt = cupy.cuda.runtime
        out["d2h_pinned_cudaMemcpyAsync"] = gbps(timed(lambda: rt.memcpyAsync(
            pinned.data_ptr(), src.data_ptr(), nbytes, rt.memcpyDeviceToHost, stream.cuda_stream)))
    except Exception as e:  # noqa: BLE001 - CuPy absent or broken: torch's copy_ is the reference
        out["d2h_pinned_cudaMemcpyAsync"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    out["h2d_pinned_torch"] = gbps(timed(lambda: src.copy_(pinned, non_blocking=True)))
    t = []
    for i in range(min(reps, 4) + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pageable.copy_(src)
        torch.cuda.synchronize()
        if i:
            t.append(time.perf_counter() - t0)
    out["d2h_pageable_torch"] = gbps(t)
    raw = out["d2h_pinned_cudaMemcpyAsync"].get("median_gbps") or out["d2h_pinned_torch"]["median_gbps"]
    out["raw_pinned_d2h_gbps"] = raw
    # small transfers on the default stream while a large D2H copy runs on another stream: do
    # they queue behind it (one copy engine per direction)?
    small = torch.ones(1, device="cuda")
    small_h = torch.empty(1).pin_memory()
    probe = {}
    for label, busy in (("idle", False), ("during_big_d2h", True)):
        reads, h2d, pin_reads = [], [], []
        for _ in range(3):
            torch.cuda.synchronize()
            if busy:
                with torch.cuda.stream(stream):
                    pinned.copy_(src, non_blocking=True)
            t0 = time.perf_counter()
            small.item()  # pageable D2H + sync of the default stream (a loss.item())
            reads.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            small.copy_(small_h, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            h2d.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            small_h.copy_(small, non_blocking=True)  # a read into pinned memory instead
            torch.cuda.current_stream().synchronize()
            pin_reads.append(time.perf_counter() - t0)
            stream.synchronize()
        probe[label] = {"item_ms": statistics.median(reads) * 1e3,
                        "small_h2d_ms": statistics.median(h2d) * 1e3,
                        "small_pinned_d2h_ms": statistics.median(pin_reads) * 1e3}
    probe["big_d2h_ms"] = nbytes / out["d2h_pinned_torch"]["median_gbps"] / 1e6
    out["small_transfer_probe"] = probe
    # CRC32 as the copier thread computes it (zlib over the pinned buffer)
    n = min(nbytes, 1 << 30)
    view = pinned[:n].numpy()
    t0 = time.perf_counter()
    zlib.crc32(view)
    out["crc32_gbps"] = n / (time.perf_counter() - t0) / 1e9
    del src, pinned, pageable
    torch.cuda.empty_cache()
    return out


def host_mem_reading() -> dict:
    r = {"MemAvailable": meminfo().get("MemAvailable"), **proc_status()}
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is not None:
        try:
            s = stats()
            r["host_alloc"] = {k: v for k, v in s.items()
                               if "bytes" in k and (k.endswith(".current") or "." not in k)}
        except Exception as e:  # noqa: BLE001
            r["host_alloc"] = {"error": str(e)[:200]}
    return r


def ab_run(model, opt, eng, corpus, vocab: int, bs: int, seq: int, rounds: int, block: int,
           warmup_blocks: int = 2, accum: int = 1, loss_read: str = "next") -> dict:
    """``accum`` micro-batches of ``bs`` per optimizer step. ``loss_read``: when the loss is read
    on the host: ``item`` after the snapshot is issued, inside the step (as the runtime's trainer
    logs it); ``next`` the same, timed into the next step (the first version of this check);
    ``deferred`` only after the run (no device-to-host transfer on the main stream meanwhile)."""
    batches = []
    for i in range(4):
        x, y = corpus.batch(1000 + i, 0, bs, seq)
        batches.append((x.cuda(), y.cuda()))
    losses = []
    main = torch.cuda.current_stream()
    torch.cuda.reset_peak_memory_stats()
    rows = []
    n_steps = (warmup_blocks + 2 * rounds) * block
    torch.cuda.synchronize()
    t_prev = time.perf_counter()
    for i in range(n_steps):
        blk = i // block
        take = blk % 2 == 0
        blocked0 = eng.blocked_s
        for m in range(accum):
            x, y = batches[(i * accum + m) % len(batches)]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y)
            (loss / accum if accum > 1 else loss).backward()
        a, b = _events()
        a.record()
        eng.wait_copy()
        b.record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        issue = 0.0
        if take:
            t0 = time.perf_counter()
            eng.snapshot(i + 1, {"step": i + 1})
            issue = time.perf_counter() - t0
        read = 0.0
        if loss_read == "item":
            t0 = time.perf_counter()
            loss_v = loss.item()
            read = time.perf_counter() - t0
        main.synchronize()
        t = time.perf_counter()
        rows.append({"i": i, "take": take, "dt": t - t_prev, "stall": a.elapsed_time(b) / 1e3,
                     "blocked": eng.blocked_s - blocked0, "issue": issue, "loss_read": read})
        if loss_read == "next":
            rows[-1]["loss"] = float(loss.detach())  # charged to the next step's time
        elif loss_read == "item":
            rows[-1]["loss"] = loss_v
        else:
            losses.append(loss.detach())
        t_prev = t
    for r, v in zip(rows, torch.stack(losses).tolist() if losses else []):
        r["loss"] = v
    keep = [r for r in rows if r["i"] >= warmup_blocks * block and r["i"] % block]
    on = [r for r in keep if r["take"]]
    off = [r for r in keep if not r["take"]]
    med_on = statistics.median(r["dt"] for r in on)
    med_off = statistics.median(r["dt"] for r in off)
    # pair each on-block with the off-block after it: a ratio per pair shows the spread
    pairs = []
    for k in range(warmup_blocks, warmup_blocks + 2 * rounds, 2):
        b_on = [r["dt"] for r in keep if r["i"] // block == k]
        b_off = [r["dt"] for r in keep if r["i"] // block == k + 1]
        if b_on and b_off:
            pairs.append(statistics.median(b_on) / statistics.median(b_off))
    return {
        "batch_size": bs, "accum": accum, "loss_read": loss_read, "seq_len": seq,
        "tokens_per_step": bs * seq * accum,
        "steps_total": n_steps, "samples_on": len(on), "samples_off": len(off),
        "step_s_on": _q([r["dt"] for r in on]), "step_s_off": _q([r["dt"] for r in off]),
        "ratio_on_off_median": med_on / med_off,
        "ratio_per_block_pair": _q(pairs),
        "gpu_stall_ms_on": _q([r["stall"] * 1e3 for r in on]),
        "gpu_stall_ms_off": _q([r["stall"] * 1e3 for r in off]),
        "cpu_blocked_ms_on": _q([r["blocked"] * 1e3 for r in on]),
        "cpu_issue_ms_on": _q([r["issue"] * 1e3 for r in on]),
        "loss_item_ms_on": _q([r["loss_read"] * 1e3 for r in on]),
        "loss_item_ms_off": _q([r["loss_read"] * 1e3 for r in off]),
        "training_thread_ms_per_step_on": _q([(r["blocked"] + r["issue"]) * 1e3 for r in on]),
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
        "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
        "steps": [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--model", default="gpt_1b", help="conf/model/<name>.yaml")
    ap.add_argument("--batch-sizes", default="8,16")
    ap.add_argument("--configs", default=None,
                    help="A/B runs as BS:ACCUM:LOSS_READ,... (LOSS_READ: item|next|deferred); "
                         "default: each of --batch-sizes as BS:1:next")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=6, help="on/off block pairs per batch size")
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--slots", type=int, default=3, help="local snapshot ring (ft.num_local_slots)")
    ap.add_argument("--bw-bytes", type=int, default=2 << 30)
    ap.add_argument("--name", default="check_snapshot", help="output file stem")
    args = ap.parse_args()
    out_path = Path(args.out_dir) / f"{args.name}.json"
    res: dict = {"check": "snapshot engine on CUDA", "options": sys.argv[2:], "env": env_info()}
    if not torch.cuda.is_available():
        res["skipped"] = "needs a CUDA device"
        write_json(out_path, res)
        print(res["skipped"])
        return
    import yaml

    t0 = time.perf_counter()
    res["bandwidth"] = bandwidths(args.bw_bytes, 8)
    print(f"bandwidth: {res['bandwidth']}", flush=True)
    write_json(out_path, res)

    mcfg = yaml.safe_load((ROOT / "conf/model" / f"{args.model}.yaml").read_text())
    model = build_model(mcfg, 0, device="cuda")
    opt = build_optimizer(model, 1e-4, 0.0)  # m, v on the GPU; AdamW's step counters on the CPU
    tensors = state_tensors(model, opt)
    n_params = sum(p.numel() for p in model.parameters())
    torch.cuda.synchronize()
    before = host_mem_reading()
    t_alloc = time.perf_counter()
    eng = SnapshotEngine(tensors, device="cuda", num_local_slots=args.slots)
    t_alloc = time.perf_counter() - t_alloc
    after = host_mem_reading()
    nbytes = eng.layout.nbytes
    state_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
    host = {"state_bytes": state_bytes, "layout_bytes": nbytes, "slots": args.slots,
            "pinned_alloc_s": t_alloc, "before": before, "after": after,
            "requested_bytes": sum(s.flat.numel() for s in eng.slots)}
    host["requested_x_state"] = host["requested_bytes"] / state_bytes
    if before.get("MemAvailable") and after.get("MemAvailable"):
        host["memavailable_drop_bytes"] = before["MemAvailable"] - after["MemAvailable"]
        host["memavailable_drop_x_state"] = host["memavailable_drop_bytes"] / state_bytes
    ha, hb = after.get("host_alloc") or {}, before.get("host_alloc") or {}
    for k in ("reserved_bytes.current", "allocated_bytes.current"):
        if k in ha:
            host[f"pinned_{k.split('.')[0]}_delta"] = ha[k] - hb.get(k, 0)
            host[f"pinned_{k.split('.')[0]}_x_state"] = (ha[k] - hb.get(k, 0)) / state_bytes
    res["model"] = {"name": args.model, "params": n_params, "config": mcfg,
                    "state_tensors": len(tensors), "state_gib": state_bytes / 2**30,
                    "gpu_allocated_gib": torch.cuda.memory_allocated() / 2**30}
    res["host_memory"] = host
    print(f"model {args.model}: {n_params / 1e9:.3f} B params, state {state_bytes / 2**30:.2f} GiB; "
          f"host: {host}", flush=True)
    write_json(out_path, res)

    # the engine's own D2H copy: a whole snapshot, GPU otherwise idle
    eng_t, issue_t = [], []
    for k in range(3):
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        eng.snapshot(k + 1, {"step": k + 1})
        issue_t.append(time.perf_counter() - t1)
        eng._last_copy.cuda_event.synchronize()
        eng_t.append(time.perf_counter() - t1)
    eng_gbps = nbytes / statistics.median(eng_t) / 1e9
    res["bandwidth"]["engine_snapshot"] = {
        "copy_s": eng_t, "issue_s": issue_t, "median_gbps": eng_gbps,
        "fraction_of_raw_pinned": eng_gbps / res["bandwidth"]["raw_pinned_d2h_gbps"]}
    res["bandwidth"]["copier_crc_s_per_snapshot"] = nbytes / (res["bandwidth"]["crc32_gbps"] * 1e9)
    print(f"engine snapshot copy: {res['bandwidth']['engine_snapshot']}", flush=True)
    write_json(out_path, res)

    corpus = SyntheticCorpus(mcfg["vocab_size"], 0)
    res["ab"] = []
    configs = [c.split(":") for c in args.configs.split(",")] if args.configs else \
        [(b, "1", "next") for b in args.batch_sizes.split(",") if b]
    for bs, accum, loss_read in configs:
        bs, accum = int(bs), int(accum)
        try:
            r = ab_run(model, opt, eng, corpus, mcfg["vocab_size"], bs, args.seq_len, args.rounds,
                       args.block, accum=accum, loss_read=loss_read)
        except torch.cuda.OutOfMemoryError as e:
            r = {"batch_size": bs, "accum": accum, "seq_len": args.seq_len,
                 "error": f"OOM: {str(e)[:200]}"}
        opt.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        res["ab"].append(r)
        brief = {k: v for k, v in r.items() if k != "steps"}
        print(f"A/B bs={bs} accum={accum} loss_read={loss_read}: {brief}", flush=True)
        write_json(out_path, res)
    res["last_copy_plus_crc_s"] = eng.last_copy_s  # the copier's latest copy + CRC (it lags)
    res["wall_s"] = time.perf_counter() - t0
    write_json(out_path, res)
    print(f"wrote {out_path.name}", flush=True)
    sys.stdout.flush()
    os._exit(0)  # the copier thread may still be checksumming a GB-scale slot


if __name__ == "__main__":
    main()
