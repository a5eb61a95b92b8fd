"""GPU check 4: tokens/s and MFU of a ~1B LLaMA-shaped model in bf16 on one GPU, DeadPool with
snapshots off and on, next to the same model in plain PyTorch as a torchtitan user runs it.

    python experiments/gpu/check_throughput.py OUT_DIR [--model gpt_1b] [--batch-size 8]
        [--seq-len 1024] [--steps 56] [--warmup 10] [--settled 16] [--peak-tflops 989.4]
        [--arms deadpool_on_compile,deadpool_off_compile,plain,...] [--timeout-s 95]
        [--compile-timeout-s 130] [--plain-timeout-s 100] [--budget-s 270] [--name NAME]
        [--device cuda|cpu] [--dry-run]

Arms, in this order by default (the most important first: a bound that falls loses the last;
``run_session.sh`` part a runs the first three, part c the other three):

deadpool_on_compile   ``python -m deadpool.train`` with one rank (``parallel.dp=1
              ft.num_spares=0``), ``precision=bf16`` (bf16 parameters, fp32 master weights and
              moments), ``compile=true`` (each block's local compute compiled,
              deadpool/parallel/compile.py), ``ft.snapshot=true`` (the default: adaptive snapshot
              schedule); step times from its metrics (``step_time_s``). Bound:
              ``--compile-timeout-s`` (the compile is in its first step, not in the medians)
deadpool_off_compile  the same with ``ft.snapshot=false``
deadpool_off, deadpool_on  the same two without ``compile`` (eager blocks)
plain         the model of ``deadpool.model`` (its default init, built on the GPU), bf16
              parameters, fused AdamW, ``torch.compile`` of each block (as torchtitan does;
              ``--plain-compile``), SDPA attention (the model's), the loss read every step
plain_fp32_autocast  fp32 parameters under bf16 autocast, fused AdamW, no compile (the arm of
              the 2026-11-26 run: 0.213 s/step on an H200)

Each DeadPool job is stopped once its last step is logged (not waiting for its final state
write) and its steps are read from the ranks' own files; launch -> first step and rank 0's
start-up breakdown are reported apart. Each plain arm runs in a process of its own (GPU memory
freed between arms, a slow compile bounded). Every arm is bounded (``--timeout-s``,
``--plain-timeout-s``), and all together by ``--budget-s`` (an arm that would start with
under 30 s left is skipped, recorded as such).

Ratios: each arm's ``vs_plain`` (tokens/s over the plain compiled arm's; the issue's bar for
``deadpool_snapshot_on_compile``: >= 0.97), ``snapshot_on_vs_off_step_time`` (eager) and
``compile_snapshot_on_vs_off_step_time`` (compiled; bar <= 1.01).

Medians are over the same step numbers in every arm: steps after ``--warmup``, and the last
``--settled`` (the adaptive schedule's vote of step 32 rules from 40: steps 41-56 by default).
Tokens/s = batch x seq_len / median step. MFU = tokens/s x FLOPs per token / peak, FLOPs per
token = ``deadpool.rank.mfu.flops_per_token``: 6 x parameters without the input embedding + 12 x
layers x d_model x seq_len, as the runtime's metrics count it (runs before 2026-11-28 counted
the embedding too: 6 x 1.416e9 rather than 6 x 1.35e9 for gpt_1b, MFU 5 % higher).
``--peak-tflops``: dense bf16 of an H100 SXM (989.4). Writes OUT_DIR/NAME.json (default
check_throughput) after every arm. ``--dry-run`` (no GPU):
the commands and the FLOP count only; ``--device cpu`` with a small model: a smoke run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, env_info, write_json  # noqa: E402
from jobs import run_bounded  # noqa: E402

ARMS = ("deadpool_on_compile", "deadpool_off_compile", "plain", "deadpool_off", "deadpool_on",
        "plain_fp32_autocast")
KEYS = {"deadpool_off": "deadpool_snapshot_off", "deadpool_on": "deadpool_snapshot_on",
        "deadpool_on_compile": "deadpool_snapshot_on_compile",
        "deadpool_off_compile": "deadpool_snapshot_off_compile", "plain": "plain",
        "plain_fp32_autocast": "plain_fp32_autocast"}


def model_cfg(name: str) -> dict:
    import yaml

    return yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text())


def count_params(cfg: dict) -> int:
    import torch

    from deadpool.model import GPT, model_config

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(model_config(cfg)).parameters())


def flops_per_token(cfg: dict, seq_len: int) -> float:
    from deadpool.rank.mfu import flops_per_token as runtime_flops_per_token

    return float(runtime_flops_per_token(cfg, seq_len))


def deadpool_overrides(args, snapshot: bool, compile_: bool = False) -> list[str]:
    return [f"model={args.model}", f"device={args.device}", "parallel.dp=1", "ft.num_spares=0",
            "precision=bf16", f"batch_size={args.batch_size}", f"seq_len={args.seq_len}",
            f"num_steps={args.steps}", "log_every_steps=8", f"ft.snapshot={str(snapshot).lower()}",
            *(["compile=true"] if compile_ else [])]


def deadpool_command(args, snapshot: bool, run_dir: Path, compile_: bool = False) -> list[str]:
    return [sys.executable, "-m", "deadpool.train", *deadpool_overrides(args, snapshot, compile_),
            f"hydra.run.dir={run_dir}", *args.overrides]


# -- plain PyTorch (a process of its own: --arm) ------------------------------------------------
def plain_arm(args, cfg: dict, arm: str, result: Path) -> None:
    """Time ``args.steps`` steps, rewriting ``result`` after each (a bound that falls keeps
    the steps timed so far)."""
    import torch
    import torch.nn.functional as F

    from deadpool.model import GPT, model_config

    dev = args.device
    torch.manual_seed(0)
    t0 = time.perf_counter()
    bf16 = arm == "plain"
    with torch.device(dev):  # the default init, drawn on the device: values do not matter here
        model = GPT(model_config(cfg))
    model = model.to(dev)  # the rotary tables are built on the host whatever the default device
    if bf16:
        model = model.to(torch.bfloat16)
    compiled = bf16 and (args.plain_compile == "on" or (args.plain_compile == "auto" and dev == "cuda"))
    if compiled:  # per block, as torchtitan compiles (one graph for the 24 blocks)
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=dev == "cuda")
    vocab = cfg["vocab_size"]
    rec = {"arm": arm, "params_dtype": str(next(model.parameters()).dtype), "compiled": compiled,
           "autocast": not bf16, "fused_adamw": dev == "cuda", "attention": "F.scaled_dot_product_attention",
           "build_s": time.perf_counter() - t0, "step_s": []}
    for _ in range(args.steps):
        x = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), device=dev)
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=not bf16):
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # read every step, as the trainer reads it
        rec["step_s"].append(time.perf_counter() - t)
        write_json(result, rec)
    if dev == "cuda":
        rec["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    write_json(result, rec)


def run_plain(args, arm: str, bound: float, tmp: Path) -> dict:
    result = tmp / f"{arm}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), str(tmp), "--arm", arm,
           "--arm-result", str(result), "--model", args.model, "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--device", args.device,
           "--plain-compile", args.plain_compile]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=bound)
        rc, tail, timed_out = p.returncode, (p.stdout + p.stderr)[-2000:], False
    except subprocess.TimeoutExpired as e:
        rc, timed_out = None, True
        tail = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                       for x in (e.stdout, e.stderr))[-2000:]
    res = json.loads(result.read_text()) if result.exists() else {"step_s": []}
    res.update(returncode=rc, timed_out=timed_out, wall_s=time.time() - t0,
               rows=[{"step": i + 1, "step_time_s": s} for i, s in enumerate(res["step_s"])])
    if rc != 0:
        res["tail"] = tail.replace(str(tmp), "TMP")
    return res


def deadpool_arm(args, arm: str, bound: float, tmp: Path) -> dict:
    run_dir = tmp / arm
    cmd = deadpool_command(args, arm.startswith("deadpool_on"), run_dir, arm.endswith("compile"))
    res = run_bounded(cmd, run_dir, args.steps, bound, hide=str(tmp))
    rows = res["rows"]
    res.update(step_s=[r["step_time_s"] for r in rows],
               snapshots=sum(1 for r in rows if r.get("snapshot")),
               snapshot_interval=[r.get("snapshot_interval") for r in rows],
               blocked_s=[r.get("snapshot_blocked_s") for r in rows])
    return res


def summarize(res: dict, args, fpt: float) -> dict:
    """Medians over the same step numbers in every arm: after ``--warmup``, and the last
    ``--settled`` steps (only when the arm reached the last step)."""
    out = {k: v for k, v in res.items() if k not in ("rows", "t_launch")}
    rows = res.get("rows", [])
    reached = bool(rows) and rows[-1]["step"] >= args.steps
    windows = {"": [r["step_time_s"] for r in rows if r["step"] > args.warmup],
               "settled_": [r["step_time_s"] for r in rows if r["step"] > args.steps - args.settled]
               if reached else []}
    out["window"] = {"median": [args.warmup + 1, args.steps],
                     "settled": [args.steps - args.settled + 1, args.steps]}
    for name, steady in windows.items():
        med = statistics.median(steady) if steady else None
        tps = args.batch_size * args.seq_len / med if med else None
        out.update({f"{name}median_step_s": med, f"{name}tokens_per_s": tps,
                    f"{name}mfu": tps * fpt / (args.peak_tflops * 1e12) if tps else None,
                    f"{name}n_steps": len(steady)})
    return out


def ratios(out: dict) -> None:
    base = out.get("plain", {})
    for w in ("", "settled_"):
        for k in KEYS.values():
            r = out.get(k)
            if isinstance(r, dict) and base.get(f"{w}tokens_per_s") and r.get(f"{w}tokens_per_s"):
                r[f"{w}vs_plain"] = r[f"{w}tokens_per_s"] / base[f"{w}tokens_per_s"]
        for name, suffix in (("", ""), ("compile_", "_compile")):
            off = out.get(f"deadpool_snapshot_off{suffix}", {})
            on = out.get(f"deadpool_snapshot_on{suffix}", {})
            if off.get(f"{w}median_step_s") and on.get(f"{w}median_step_s"):
                out[f"{w}{name}snapshot_on_vs_off_step_time"] = (on[f"{w}median_step_s"]
                                                                 / off[f"{w}median_step_s"])


def compile_option(args) -> bool:
    from deadpool.launch.config import compose_config

    cfg = compose_config(deadpool_overrides(args, True), Path(tempfile.mkdtemp()))
    return "compile" in cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--model", default="gpt_1b")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=56)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--settled", type=int, default=16,
                    help="also report the last N steps (the schedule's vote of step 32 rules from 40)")
    ap.add_argument("--peak-tflops", type=float, default=989.4)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--timeout-s", type=float, default=95, help="bound of each eager DeadPool arm")
    ap.add_argument("--compile-timeout-s", type=float, default=130,
                    help="bound of each compile=true DeadPool arm (its compile included)")
    ap.add_argument("--name", default="check_throughput", help="OUT/NAME.json")
    ap.add_argument("--plain-timeout-s", type=float, default=100, help="bound of each plain arm")
    ap.add_argument("--budget-s", type=float, default=270, help="bound of all arms together")
    ap.add_argument("--plain-compile", choices=("auto", "on", "off"), default="auto",
                    help="torch.compile the plain bf16 arm (auto: on CUDA only)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the check itself")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--skip-plain", action="store_true", help="DeadPool arms only")
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--arm-result", help=argparse.SUPPRESS)
    # building a 1.4 B model's stage on the host outlasted the default 60 s progress timeout
    ap.add_argument("--overrides", nargs="*", default=["ft.progress_timeout_s=900"],
                    help="extra Hydra overrides of the DeadPool arms")
    args = ap.parse_args()
    cfg = model_cfg(args.model)
    if args.arm:
        return plain_arm(args, cfg, args.arm, Path(args.arm_result))
    t_start = time.monotonic()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if args.skip_plain:
        arms = [a for a in arms if not a.startswith("plain")]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        ap.error(f"--arms: unknown {bad}; known: {','.join(ARMS)}")
    params = count_params(cfg)
    fpt = flops_per_token(cfg, args.seq_len)
    out = {"check": "throughput", "model": args.model, "batch_size": args.batch_size,
           "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup,
           "settled": args.settled, "peak_tflops": args.peak_tflops, "params": params,
           "flops_per_token": fpt, "arms": arms,
           "commands": {a: " ".join(deadpool_command(args, a.startswith("deadpool_on"), Path("RUN"),
                                                     a.endswith("compile"))[1:])
                        for a in ARMS if a.startswith("deadpool")}}
    path = Path(args.out) / f"{args.name}.json"
    out["runtime_compile_option"] = compile_option(args)
    if args.dry_run:
        from deadpool.launch.config import compose_config

        for a in (a for a in ARMS if a.startswith("deadpool")):  # the overrides compose
            c = compose_config(deadpool_overrides(args, a.startswith("deadpool_on"),
                                                  a.endswith("compile")) + list(args.overrides),
                               Path(tempfile.mkdtemp()))
            out.setdefault("composed", {})[a] = {"snapshot": c["ft"]["snapshot"],
                                                 "compile": c["compile"],
                                                 "precision": c["precision"], "dp": c["parallel"]["dp"]}
        out["flops_per_token_approx"] = fpt
        write_json(path, out)
        print(json.dumps(out, indent=1))
        return
    out["env"] = env_info()
    write_json(path, out)
    with tempfile.TemporaryDirectory() as tmp:
        for arm in arms:
            left = args.budget_s - (time.monotonic() - t_start)
            limit = (args.plain_timeout_s if arm.startswith("plain") else
                     args.compile_timeout_s if arm.endswith("compile") else args.timeout_s)
            if left < 30:
                out[KEYS[arm]] = {"skipped": f"{left:.0f} s of the {args.budget_s:.0f} s budget left"}
                print(f"{arm}: skipped ({left:.0f} s left)", flush=True)
                continue
            bound = min(limit, left - 5)
            print(f"=== {arm} (bound {bound:.0f} s)", flush=True)
            run = run_plain if arm.startswith("plain") else deadpool_arm
            out[KEYS[arm]] = r = summarize(run(args, arm, bound, Path(tmp)), args, fpt)
            ratios(out)
            write_json(path, out)
            print(f"{KEYS[arm]:30s} median step {r.get('median_step_s') or 0:.4f} s "
                  f"tokens/s {r.get('tokens_per_s') or 0:8.0f} MFU {r.get('mfu') or 0:.3f} | last "
                  f"{args.settled}: {r.get('settled_median_step_s') or 0:.4f} s | steps "
                  f"{len(r.get('step_s', []))} | launch->first step "
                  f"{r.get('launch_to_first_step_s') or 0:.1f} s | wall {r.get('wall_s', 0):.0f} s"
                  + (" TIMED OUT" if r.get("timed_out") else ""), flush=True)
    print(json.dumps({k: out.get(k) for k in (
        "snapshot_on_vs_off_step_time", "settled_snapshot_on_vs_off_step_time",
        "compile_snapshot_on_vs_off_step_time", "settled_compile_snapshot_on_vs_off_step_time")}))
    write_json(path, out)


if __name__ == "__main__":
    main()
