"""Memory estimator: GPU memory per rank, and host memory per node for snapshots and replicas.

``estimate()`` counts, for the worst rank of a dp x tp x pp layout (the pipeline stage with the
largest total: the first holds the embedding and the most micro-batches in flight, the last holds
the LM head and the logits), what training keeps resident, and per node what DeadPool's snapshot
engine adds in host memory. ``check_fits(cfg)`` refuses a job that cannot fit before any process
starts (``deadpool.job.validate`` calls it). ``python -m deadpool.memory`` prints the table of
the LLaMA sizes on A100 nodes that README.md shows.

What is counted, and why (all sizes in GiB = 2**30 bytes; ``gpu_gb`` means GiB too):

* Parameters of the rank: its stage's layers (``n_layers // pp``, the first ``n_layers % pp``
  stages one more), with the Megatron split over tp (qkv, out, gate, up, down and the
  vocabulary-parallel embedding and head divided by tp; RMSNorm weights replicated). The flat
  ZeRO buffer is padded to a multiple of dp, as in ``deadpool.parallel.data.zero``.
* Gradients: one per parameter, unsharded (ZeRO-1 shards only the optimizer).
* Optimizer: AdamW ``exp_avg`` + ``exp_avg_sq`` (+ an fp32 master copy under bf16-mixed), divided
  by dp when ``zero`` and dp > 1.
* Activations: what autograd keeps for backward, per layer and micro-batch of ``T = micro_bs x
  seq`` tokens, with a fused RMSNorm and memory-efficient attention (no seq x seq scores):
  attention block ``2 T d`` (norm input and output, replicated over tp: there is no sequence
  parallelism) + ``4 T d / tp`` (q, k, v, attention output); MLP block ``2 T d`` + ``4 T f / tp``
  (gate, silu(gate), up, their product). 1F1B keeps at most ``min(pp - pp_rank, microbatches)``
  micro-batches in flight on stage ``pp_rank``, so stage 0 holds ``n_layers`` layers' worth
  whatever pp is: only tp and fewer tokens per micro-batch shrink it. The last stage adds the
  final norm and the logits of one micro-batch (``T V / tp`` at activation precision plus an
  fp32 log-softmax). No activation checkpointing (the runtime has none).
* Overhead: a fixed ``overhead_gb`` per rank (CUDA context, NCCL buffers, allocator slack;
  for CPU processes: the interpreter and torch).

Host memory per rank (pinned on CUDA), from ``deadpool.snapshot``: a local ring of
``num_local_slots`` (3 by default; 2 is a double buffer) snapshots of the rank's full state (parameters + its
optimizer shard), the ward's ``replica_buffers`` (2: the newest protected replica and the one
arriving) receive buffers of what is replicated (the optimizer shard only with
``replicate="unique"`` and a sharded optimizer, because the parameters come back from a
data-parallel peer; nothing with an unsharded optimizer and dp > 1; everything with ``"full"``
or dp == 1), and, when disk checkpoints are on, one persist buffer of the full state (they are
written from it while the ring moves on).

Precision: ``"fp32"`` is what the runtime trains in today (fp32 parameters, gradients, AdamW state
and activations). ``"bf16-mixed"`` is a projection for a runtime that does not exist yet: bf16
parameters, gradients and activations, fp32 master weights and AdamW state (both sharded by
ZeRO-1, as in Megatron's distributed optimizer); its snapshots hold the bf16 parameters and the
fp32 optimizer shard.
"""

from __future__ import annotations

import os

from deadpool.settings import num_microbatches
from deadpool.topology import ParallelDims, layer_range

GiB = 2**30

# bytes per element: parameter, gradient, optimizer state per parameter (master + m + v), activation
PRECISIONS = {
    "fp32": {"param": 4, "grad": 4, "optim": 8, "act": 4},
    "bf16-mixed": {"param": 2, "grad": 2, "optim": 12, "act": 2},  # projection, not the runtime
}
_STEP_BYTES = 4  # AdamW's fp32 step counter


def stage_layers(n_layers: int, pp: int, pp_rank: int) -> int:
    """Layers on pipeline stage ``pp_rank`` (``topology.layer_range``)."""
    return len(layer_range(n_layers, pp, pp_rank))


def stage_params(model_cfg, tp: int, pp: int, pp_rank: int) -> int:
    """Parameters held by one rank of stage ``pp_rank`` (its tensor-parallel shard)."""
    from deadpool.model import model_config

    m = model_config(model_cfg)
    d, f, v = m.d_model, m.ffn_hidden, m.vocab_size
    per_layer = (4 * d * d + 3 * d * f) // tp + 2 * d  # qkv + out, gate + up + down; two norms
    n = stage_layers(m.n_layers, pp, pp_rank) * per_layer
    if pp_rank == 0:
        n += v * d // tp            # embedding, vocabulary-parallel
    if pp_rank == pp - 1:
        n += v * d // tp + d        # LM head (untied) and final norm
    return n


def model_params(model_cfg) -> int:
    """Parameters of the whole model (one rank, no parallelism)."""
    return stage_params(model_cfg, 1, 1, 0)


def stage_activations(model_cfg, tp: int, pp: int, pp_rank: int, *, micro_bs: int, seq_len: int,
                      microbatches: int, act_bytes: int) -> int:
    """Bytes of activations kept for backward on stage ``pp_rank`` at the 1F1B peak."""
    from deadpool.model import model_config

    m = model_config(model_cfg)
    d, f, v, tokens = m.d_model, m.ffn_hidden, m.vocab_size, micro_bs * seq_len
    per_layer = tokens * (4 * d + 4 * (d + f) // tp) * act_bytes
    in_flight = min(pp - pp_rank, microbatches)
    total = in_flight * stage_layers(m.n_layers, pp, pp_rank) * per_layer
    if pp_rank == pp - 1:  # final norm + logits and fp32 log-softmax of one micro-batch
        total += tokens * (2 * d * act_bytes + v // tp * (act_bytes + 4))
    return total


def estimate(model_cfg, parallel_cfg, *, batch_size: int, seq_len: int, microbatches: int,
             precision: str = "fp32", num_local_slots: int = 3, replica_buffers: int = 2,
             replicate: str = "unique", persist: bool = True, overhead_gb: float = 1.0) -> dict:
    """Memory of the worst rank of a layout, in bytes.

    ``batch_size`` is sequences per data-parallel rank per step, split into ``microbatches``.
    Returns ``{"precision", "projection", "model_params", "params_per_rank", "stage", "gpu":
    {params, grads, optimizer, activations, overhead, total}, "host_per_rank": {local_ring,
    replicas, persist, total}, "host_per_node", "ranks_per_node", "replicated_per_step"}``;
    ``stage`` is the worst rank's pipeline stage, ``projection`` is True for bf16-mixed.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    if replicate not in ("unique", "full"):
        raise ValueError(f"replicate must be 'unique' or 'full', got {replicate!r}")
    b = PRECISIONS[precision]
    dims = ParallelDims.from_config(parallel_cfg)
    dp, tp, pp, sharded = dims.dp, dims.tp, dims.pp, dims.optimizer_sharded
    micro_bs = max(1, int(batch_size) // int(microbatches))
    best = None
    for s in range(pp):
        n = stage_params(model_cfg, tp, pp, s)
        padded = -(-n // dp) * dp
        optim = (padded // dp if sharded else padded) * b["optim"] + _STEP_BYTES
        gpu = {"params": padded * b["param"], "grads": padded * b["grad"], "optimizer": optim,
               "activations": stage_activations(model_cfg, tp, pp, s, micro_bs=micro_bs,
                                                seq_len=seq_len, microbatches=int(microbatches),
                                                act_bytes=b["act"]),
               "overhead": int(overhead_gb * GiB)}
        gpu["total"] = sum(gpu.values())
        if best is None or gpu["total"] > best[1]["total"]:
            best = (s, gpu, n)
    stage, gpu, n = best
    state = gpu["params"] + gpu["optimizer"]  # what a snapshot holds
    replicated = {"all": state, "unique": gpu["optimizer"], "none": 0}[dims.replica_region(replicate)]
    host = {"local_ring": num_local_slots * state, "replicas": replica_buffers * replicated,
            "persist": state if persist else 0}
    host["total"] = sum(host.values())
    per_node = min(int(parallel_cfg.get("ranks_per_node", 1)), dp * tp * pp)
    return {"precision": precision, "projection": precision != "fp32",
            "model_params": model_params(model_cfg), "params_per_rank": n, "stage": stage,
            "gpu": gpu, "host_per_rank": host, "ranks_per_node": per_node,
            "host_per_node": per_node * host["total"], "replicated_per_step": replicated}


def _gb(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f}"


def _hint(cfg: dict, micro_tokens: int) -> str:
    return (f"raise parallel.tp or parallel.pp, enable parallel.zero (sharded optimizer), or use "
            f"fewer tokens per micro-batch (now {micro_tokens}: batch_size / microbatches x "
            f"seq_len)")


def check_fits(cfg: dict) -> None:
    """Raise ValueError when the resolved job ``cfg`` cannot fit in memory.

    GPU memory per rank is checked against ``cfg["memory"]["gpu_gb"]`` or, on ``device=cuda``,
    the visible GPU's total. Host memory per node (snapshots + replicas) is checked against
    ``cfg["memory"]["host_gb_per_node"]`` when given. A CPU run without a ``memory`` section
    runs every rank and spare on this machine: its RAM (``os.sysconf``) must hold the world's
    ranks (training state + snapshot memory each) and the spares (a spare builds its rank's
    training state when it is swapped in); every rank is counted as the worst one, which errs
    on the safe side. Otherwise nothing is checked.
    """
    p, ft = cfg["parallel"], cfg.get("ft", {})
    mem = {k: v for k, v in (cfg.get("memory") or {}).items() if v is not None}  # null: not given
    mb = num_microbatches(cfg)
    cpu = not str(cfg.get("device", "cpu")).startswith("cuda")
    est = estimate(cfg["model"], p, batch_size=int(cfg["batch_size"]), seq_len=int(cfg["seq_len"]),
                   microbatches=mb, num_local_slots=int(ft.get("num_local_slots", 3)),
                   replicate=ft.get("replicate", "unique"),
                   persist=bool(ft.get("persist_interval_steps")),
                   overhead_gb=0.25 if cpu and not mem else 1.0)
    g, h = est["gpu"], est["host_per_rank"]
    micro_tokens = int(cfg["batch_size"]) // mb * int(cfg["seq_len"])
    layout = f"dp{p['dp']} x tp{p['tp']} x pp{p['pp']}"
    breakdown = (f"params {_gb(g['params'])} + grads {_gb(g['grads'])} + optimizer "
                 f"{_gb(g['optimizer'])} + activations {_gb(g['activations'])} + overhead "
                 f"{_gb(g['overhead'])}")

    gpu_gb = mem.get("gpu_gb")
    if gpu_gb is None and not cpu:
        import torch
        if torch.cuda.is_available():
            gpu_gb = torch.cuda.get_device_properties(0).total_memory / GiB
    if gpu_gb is not None and g["total"] > float(gpu_gb) * GiB:
        raise ValueError(
            f"does not fit: the worst rank of {layout} (pipeline stage {est['stage']}) needs "
            f"{_gb(g['total'])} GB per rank ({breakdown}), but the GPU has {float(gpu_gb):.1f} GB: "
            f"{_gb(g['total'] - float(gpu_gb) * GiB)} GB over. Hint: {_hint(cfg, micro_tokens)}")

    host_gb = mem.get("host_gb_per_node")
    if host_gb is not None and est["host_per_node"] > float(host_gb) * GiB:
        raise ValueError(
            f"does not fit: snapshots and replicas need {_gb(est['host_per_node'])} GB of host "
            f"memory per node ({est['ranks_per_node']} ranks x {_gb(h['total'])} GB: local ring "
            f"{_gb(h['local_ring'])} + replicas {_gb(h['replicas'])} + persist "
            f"{_gb(h['persist'])}), but a node has {float(host_gb):.1f} GB: "
            f"{_gb(est['host_per_node'] - float(host_gb) * GiB)} GB over. Hint: lower "
            f"ft.num_local_slots, use ft.replicate=unique with parallel.zero, or "
            f"{_hint(cfg, micro_tokens)}")

    if cpu and not mem:
        world = ParallelDims.from_config(p).world_size
        spares = int(ft.get("num_spares", 0))
        need = world * (g["total"] + h["total"]) + spares * g["total"]
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need > have:
            raise ValueError(
                f"does not fit: {world} ranks + {spares} spare(s) of {layout} on this machine need "
                f"{_gb(need)} GB of RAM (per rank {_gb(g['total'])} GB training: {breakdown}; "
                f"{_gb(h['total'])} GB snapshots and replicas), but it has {_gb(have)} GB: "
                f"{_gb(need - have)} GB over. Hint: a smaller model, or {_hint(cfg, micro_tokens)}")


# -- the README table ---------------------------------------------------------------------------

# usable memory of the GPUs as torch reports it (A100-SXM4 40 GB / 80 GB)
A100_GB = {"40g": 39.4, "80g": 79.1}
MODELS = ["llama_7b", "llama_13b", "llama_30b", "llama_65b"]


def _load(group: str, name: str) -> dict:
    import yaml
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "conf" / group / f"{name}.yaml"
    return yaml.safe_load(path.read_text())


def table(precisions=("fp32", "bf16-mixed")) -> str:
    """Markdown table: each LLaMA size on its 40 GB and 80 GB A100 layouts, micro-batches of one
    full-length sequence (``batch_size = microbatches = 2 x pp``, as ``microbatches: auto`` picks)."""
    rows = ["| model | GPU | layout (dp x tp x pp) | GPUs | precision | GPU GB per rank: params / "
            "grads / optimizer / activations / total (with 1 GB overhead) | fits? | host GB per node (snapshots + "
            "replicas) | replicated MB per rank per step |",
            "|---|---|---|---|---|---|---|---|---|"]
    for model in MODELS:
        m = _load("model", model)
        for gpu, cap in A100_GB.items():
            name = f"{model.replace('_', '')}_a100_{gpu}"
            p = _load("parallel", name)
            mb = 2 * p["pp"] if p["pp"] > 1 else 1
            for prec in precisions:
                e = estimate(m, p, batch_size=mb, seq_len=m["max_seq_len"], microbatches=mb,
                             precision=prec)
                g = e["gpu"]
                parts = " / ".join(_gb(g[k]) for k in ("params", "grads", "optimizer",
                                                        "activations", "total"))
                label = prec + (" (projection)" if e["projection"] else "")
                fits = "yes" if g["total"] <= cap * GiB else "**no**"
                rows.append(
                    f"| {model} | A100 {gpu[:2]} GB | `{name}`: {p['dp']} x {p['tp']} x {p['pp']} "
                    f"| {p['dp'] * p['tp'] * p['pp']} | {label} | {parts} | {fits} | "
                    f"{_gb(e['host_per_node'])} | {e['replicated_per_step'] / 2**20:.0f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
