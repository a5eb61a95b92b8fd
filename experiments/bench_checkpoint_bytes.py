"""Disk checkpoint bytes per step: unique state (each replicated tensor written once) vs every
rank's full copy (how checkpoints were written before issue 37).

    python experiments/bench_checkpoint_bytes.py [--out experiments/results/checkpoint_bytes]

Runs the tiny model (4 layers) for 4 steps at dp4 and dp2 x tp2 x pp2, fp32 and bf16, ZeRO-1,
with a synchronous checkpoint at step 4, and reads the step directory back: the bytes on disk
(every file) and the tensor bytes each rank wrote. "Every rank's copy" is the same directory
with each rank that names a ``shared_from`` writer counted with that writer's shared tensors
again: exactly what it would have written. Expectation: the replicated share (the parameters:
fp32 4 B/param, bf16 2 B/param) is written once per (pp, tp) group instead of dp times, so at
dp4 ZeRO-1 fp32 (params 4 + moments 8/4 + master view 4/4 per rank) the total falls from
4 x (4 + 3) = 28 to 4 + 4 x 3 = 16 B per parameter (0.57x).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool import checkpoint  # noqa: E402
from deadpool.launch.config import compose_config  # noqa: E402
from deadpool.launch.job import run_job  # noqa: E402

LAYOUTS = {"dp4": (4, 1, 1), "dp2xtp2xpp2": (2, 2, 2)}


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(layout: str, precision: str, work: Path) -> dict:
    dp, tp, pp = LAYOUTS[layout]
    run = work / f"{layout}-{precision}"
    cfg = compose_config(["launcher.fork_workers=true", "model=tiny", "model.n_layers=4",
                          f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                          f"precision={precision}", "ft=none", "num_steps=4", "log_every_steps=0",
                          "ft.persist_interval_steps=4", "ft.persist_async=false"], run)
    s = run_job(cfg, log=lambda *a, **k: None)
    assert s["outcome"] == "completed", s["message"]
    step_dir = checkpoint.latest_step_dir(run / "checkpoints")
    world = dp * tp * pp
    written, shared_of = {}, {}
    for r in range(world):
        state, header = checkpoint.read_rank_state(step_dir, r)
        written[r] = sum(t.numel() * t.element_size() for t in state.values())
        shared_of[r] = header.get("shared_from")
    full = dict(written)
    for r, src in shared_of.items():
        if src:  # what it would have written: its own tensors plus its group's shared ones
            w = src[0]
            st, _ = checkpoint.read_rank_state(step_dir, w)
            mine, _ = checkpoint.read_rank_state(step_dir, r)
            full[r] += sum(t.numel() * t.element_size() for k, t in st.items() if k not in mine)
    return {"layout": layout, "precision": precision, "world_size": world,
            "model_params": s["model_params"],
            "tensor_bytes_unique": sum(written.values()),
            "tensor_bytes_every_rank_full": sum(full.values()),
            "ratio": round(sum(written.values()) / sum(full.values()), 4),
            "disk_bytes_unique": disk_bytes(step_dir),
            "per_rank_tensor_bytes": written}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="experiments/results/checkpoint_bytes")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in LAYOUTS:
            for precision in ("fp32", "bf16"):
                rows.append(measure(layout, precision, Path(tmp)))
                r = rows[-1]
                print(f"{layout:12s} {precision}: {r['tensor_bytes_unique']:>10,d} B unique vs "
                      f"{r['tensor_bytes_every_rank_full']:>10,d} B every rank's copy "
                      f"({r['ratio']:.2f}x); on disk {r['disk_bytes_unique']:,d} B", flush=True)
    (out / "checkpoint_bytes.json").write_text(json.dumps(rows, indent=1))
    lines = ["| layout | precision | params per rank | unique state, tensor B | every rank's copy, tensor B "
             "| ratio | on disk, B |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['layout']} | {r['precision']} | {r['model_params']:,d} | "
              f"{r['tensor_bytes_unique']:,d} | {r['tensor_bytes_every_rank_full']:,d} | "
              f"{r['ratio']:.2f} | {r['disk_bytes_unique']:,d} |" for r in rows]
    (out / "checkpoint_bytes.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
