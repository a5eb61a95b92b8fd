"""Stock ``torch.nn.parallel.DistributedDataParallel`` on DeadPool's model and data: what users run
today, the reference of ``bench_overhead.py``. Run it under torchrun::

    torchrun --standalone --nproc-per-node 4 experiments/ddp_reference.py --spec spec.json --out OUT

``spec.json`` holds the resolved DeadPool config (model, seed, batch_size, seq_len, num_steps, lr,
lr_schedule, weight_decay, grad_clip, precision, adamw, torch_num_threads). The loop is
nanoGPT's: the same model (``deadpool.model.build_model``, same init), the same batches
(``SyntheticCorpus``, the rank's data-parallel shard), AdamW with the same hyper-parameters,
kernel and weight-decay groups (matrices decayed, norms not), the same learning rate per step
(``lr_at``), ``clip_grad_norm_`` when ``grad_clip`` is set, DDP's default buckets (25 MB, first
1 MB) over gloo. ``precision=bf16`` is plain PyTorch's bf16 recipe: fp32 parameters, gradients
(reduced in fp32, like DeadPool's default ``grad_reduce_dtype``) and AdamW state, forward and
backward under ``torch.autocast(bfloat16)``. Each rank writes ``OUT/rank<r>.json`` with its step
times and losses. No fault tolerance of any kind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool.data import SyntheticCorpus  # noqa: E402
from deadpool.model import build_model  # noqa: E402
from deadpool.rank.lr_schedule import lr_at  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = json.loads(Path(args.spec).read_text())
    torch.set_num_threads(int(cfg.get("torch_num_threads", 1)))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build_model(cfg["model"], cfg["seed"])
    ddp = DDP(model)
    impl = {"fused": dict(fused=True), "foreach": dict(foreach=True),
            "for_loop": dict(foreach=False)}[cfg.get("adamw", "fused")]
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg["lr"], betas=(0.9, 0.95), **impl)
    bf16 = cfg.get("precision", "fp32") == "bf16"
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 \
        else contextlib.nullcontext
    clip = cfg.get("grad_clip")
    corpus = SyntheticCorpus(cfg["model"]["vocab_size"], cfg["seed"])
    times, losses = [], []
    for step in range(cfg["num_steps"]):
        t0 = time.perf_counter()
        x, y = corpus.batch(step, rank, cfg["batch_size"], cfg["seq_len"])
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = ddp(x, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, float(clip))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "step_time_s": times,
                                                      "loss": losses, "pid": os.getpid()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
