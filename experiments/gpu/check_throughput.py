"""GPU check 4: tokens/s and MFU of a ~1B LLaMA-shaped model in bf16 on one GPU, DeadPool with
snapshots off and on, next to the same model in plain PyTorch on the same GPU.

    python experiments/gpu/check_throughput.py OUT_DIR [--model gpt_1b] [--batch-size 8]
        [--seq-len 1024] [--steps 48] [--warmup 10] [--settled 8] [--peak-tflops 989.4]
        [--timeout-s 240] [--device cuda|cpu] [--dry-run]

plain     the model of ``deadpool.model`` (same init), fp32 parameters, fused AdamW, bf16
          autocast, the loss read every step (``loss.item()``): what a user writes without
          DeadPool
deadpool  ``python -m deadpool.train`` with one rank (``parallel.dp=1``), ``precision=bf16`` (bf16
          parameters, fp32 master weights and moments), ``ft.snapshot=false`` and ``true`` (the
          defaults otherwise: node agent, watchdog, adaptive snapshot schedule); step times from
          its metrics (``step_time_s``). Each job is stopped once its last step is logged (the
          exit writes every rank's full state); launch to first step is reported apart.

Tokens/s = batch x seq_len / median step time over the steps after ``--warmup``. MFU =
tokens/s x FLOPs per token / peak, FLOPs per token = 6 x parameters + 12 x layers x d_model x
seq_len (forward and backward, attention scores included; the embedding's lookups counted as
matmuls, a slight over-count). ``--peak-tflops``: dense bf16 of an H100 SXM (989.4). Writes
OUT_DIR/check_throughput.json. ``--dry-run`` (no GPU): the commands and the FLOP count only;
``--device cpu`` (with a small model): a smoke run of the whole check (``tests/test_experiments.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, env_info, write_json  # noqa: E402


def model_cfg(name: str) -> dict:
    import yaml

    return yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text())


def flops_per_token(cfg: dict, params: int, seq_len: int) -> float:
    return 6.0 * params + 12.0 * cfg["n_layers"] * cfg["d_model"] * seq_len


def deadpool_command(args, snapshot: bool, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "deadpool.train", f"model={args.model}", f"device={args.device}",
            "parallel.dp=1", "ft.num_spares=0", "precision=bf16", f"batch_size={args.batch_size}",
            f"seq_len={args.seq_len}", f"num_steps={args.steps}", "log_every_steps=8",
            f"ft.snapshot={str(snapshot).lower()}", f"hydra.run.dir={run_dir}", *args.overrides]


def plain(args, cfg: dict) -> dict:
    import torch

    from deadpool.model import build_model

    dev = args.device
    torch.manual_seed(0)
    model = build_model(cfg, seed=1234, device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=dev == "cuda")
    vocab = cfg["vocab_size"]
    times = []
    for step in range(args.steps):
        x = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), device=dev)
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(dev, dtype=torch.bfloat16):
            logits = model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab),
                                                     x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # read every step, as the trainer reads it
        times.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters())
    del model, opt
    if dev == "cuda":
        torch.cuda.empty_cache()
    return {"step_s": times, "params": params}


def _metrics(run_dir: Path) -> list[dict]:
    """Rank 0's step rows: metrics.jsonl is merged at the job's end, before that (or in a job
    killed early) the ranks' own files hold them."""
    files = [run_dir / "metrics.jsonl"] if (run_dir / "metrics.jsonl").exists() else \
        sorted((run_dir / "metrics").glob("slot*.jsonl"))
    rows = []
    for f in files:
        for line in f.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:  # a line being written
                continue
            if "step_time_s" in r and r.get("rank", 0) == 0:
                rows.append(r)
    return sorted(rows, key=lambda r: r["step"])


def deadpool_run(args, snapshot: bool, root: Path) -> dict:
    """One DeadPool arm. The job is stopped (its process group killed) once rank 0 logged the
    last step: what is measured is training, not the job's exit (writing every rank's final
    state, 20 GB for gpt_1b, outlasted a 170 s bound on the GPU). ``--timeout-s`` bounds the
    rest (``timed_out``: the steps logged by then are kept, with the output's tail)."""
    run_dir = root / f"deadpool_snapshot_{'on' if snapshot else 'off'}"
    cmd = deadpool_command(args, snapshot, run_dir)
    t0 = time.time()
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        timed_out = False
        while p.poll() is None:
            if any(r["step"] >= args.steps for r in _metrics(run_dir)[-1:]):
                break
            if time.time() - t0 > args.timeout_s:
                timed_out = True
                break
            time.sleep(0.5)
        ended_itself = p.poll() is not None
        if not ended_itself:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        out.seek(0)
        output = out.read()
    rows = _metrics(run_dir)
    # rank 0's own log (the console shows progress lines only as sampled, every 0.1 s)
    startup = [line for f in sorted((run_dir / "logs").glob("slot*.log"))
               for line in f.read_text(errors="replace").splitlines()
               if line.startswith("[rank 0] start-up")]
    return {"command": " ".join(cmd[1:]).replace(str(root), "TMP"),
            "returncode": p.returncode if ended_itself else None, "timed_out": timed_out,
            "wall_s": time.time() - t0,
            # launch to rank 0's first logged step (the row's wall-clock time, end of step 1)
            "launch_to_first_step_s": rows[0]["t"] - t0 if rows else None,
            "startup_line": startup[0] if startup else None,
            "step_s": [r["step_time_s"] for r in rows],
            "snapshots": sum(1 for r in rows if r.get("snapshot")),
            "snapshot_interval": [r.get("snapshot_interval") for r in rows],
            "blocked_s": [r.get("snapshot_blocked_s") for r in rows],
            "tail": output.replace(str(root), "TMP")[-3000:]}


def summarize(res: dict, args, fpt: float) -> dict:
    """Median step and tokens/s after ``--warmup`` and over the last ``--settled`` steps (the
    adaptive snapshot schedule's later decisions in force)."""
    out = dict(res)
    for name, steady in (("", res["step_s"][args.warmup:]),
                         ("settled_", res["step_s"][-args.settled:] if len(res["step_s"]) >= args.steps else [])):
        if not steady:
            out.update({f"{name}median_step_s": None, f"{name}tokens_per_s": None, f"{name}mfu": None})
            continue
        med = statistics.median(steady)
        tps = args.batch_size * args.seq_len / med
        out.update({f"{name}median_step_s": med, f"{name}tokens_per_s": tps,
                    f"{name}mfu": tps * fpt / (args.peak_tflops * 1e12)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--model", default="gpt_1b")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--settled", type=int, default=8,
                    help="also report the last N steps (the schedule's vote of step 32 rules from 40)")
    ap.add_argument("--peak-tflops", type=float, default=989.4)
    ap.add_argument("--timeout-s", type=float, default=240)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the check itself")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--skip-plain", action="store_true", help="DeadPool arms only")
    # building a 1.4 B model's stage on the host (each parameter drawn from its own generator)
    # outlasts the default 60 s progress timeout on the GPU machine: seen as a hang
    ap.add_argument("--overrides", nargs="*", default=["ft.progress_timeout_s=900"],
                    help="extra Hydra overrides of the DeadPool arms")
    args = ap.parse_args()
    cfg = model_cfg(args.model)
    # parameters: embedding + per layer 12 d^2 (4 attention + 8 SwiGLU-ish at ffn_mult 4) + head
    d, layers, vocab = cfg["d_model"], cfg["n_layers"], cfg["vocab_size"]
    approx = 12 * layers * d * d + 2 * vocab * d
    out = {"check": "throughput", "model": args.model, "batch_size": args.batch_size,
           "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup,
           "peak_tflops": args.peak_tflops,
           "commands": {k: " ".join(deadpool_command(args, k == "on", Path("RUN"))[1:])
                        for k in ("off", "on")}}
    path = Path(args.out) / "check_throughput.json"
    if args.dry_run:
        from deadpool.train import compose_config

        for k in ("off", "on"):  # the DeadPool arms' overrides compose (a typo fails here)
            overrides = deadpool_command(args, k == "on", Path("RUN"))[3:-(1 + len(args.overrides))]
            c = compose_config(overrides + list(args.overrides), Path(tempfile.mkdtemp()))
            out.setdefault("composed", {})[k] = {"snapshot": c["ft"]["snapshot"],
                                                 "precision": c["precision"],
                                                 "dp": c["parallel"]["dp"]}
        out["flops_per_token_approx"] = flops_per_token(cfg, approx, args.seq_len)
        write_json(path, out)
        print(json.dumps(out, indent=1))
        return
    out["env"] = env_info()
    res = {"step_s": [], "params": approx} if args.skip_plain else plain(args, cfg)
    fpt = flops_per_token(cfg, res["params"], args.seq_len)
    out.update(params=res["params"], flops_per_token=fpt)
    out["plain"] = summarize(res, args, fpt)
    write_json(path, out)
    with tempfile.TemporaryDirectory() as tmp:
        for snap in (False, True):
            key = f"deadpool_snapshot_{'on' if snap else 'off'}"
            out[key] = summarize(deadpool_run(args, snap, Path(tmp)), args, fpt)
            write_json(path, out)
    base = out["plain"]
    for k in ("plain", "deadpool_snapshot_off", "deadpool_snapshot_on"):
        r = out[k]
        for w in ("", "settled_"):
            if base.get(f"{w}tokens_per_s") and r.get(f"{w}tokens_per_s"):
                r[f"{w}vs_plain"] = r[f"{w}tokens_per_s"] / base[f"{w}tokens_per_s"]
        print(f"{k:24s} tokens/s {r.get('tokens_per_s') or 0:8.0f} MFU {r.get('mfu') or 0:.3f} "
              f"median step {r.get('median_step_s') or 0:.3f} s | last {args.settled}: tokens/s "
              f"{r.get('settled_tokens_per_s') or 0:8.0f} MFU {r.get('settled_mfu') or 0:.3f} "
              f"vs plain {r.get('settled_vs_plain') or 0:.3f}"
              + (" TIMED OUT" if r.get("timed_out") else ""))
    write_json(path, out)


if __name__ == "__main__":
    main()
