"""Memory estimator: GPU memory per rank, and host memory per node for snapshots and replicas.

``estimate()`` counts, for the worst rank of a dp x tp x pp layout (the pipeline stage with the
largest total: the first holds the embedding and the most micro-batches in flight, the last holds
the LM head and the logits), what training keeps resident, and per node what DeadPool's snapshot
engine adds in host memory. ``check_fits(cfg)`` refuses a job that cannot fit before any process
starts (``deadpool.launch.job.validate`` calls it). ``python -m deadpool.memory`` prints the table of
the LLaMA-shaped models on A100 nodes (docs/memory.md); ``--measured`` the tables that check
the counts against the runtime's own objects; ``--json <job overrides>`` one job's worst rank
(``memory_tables.py``).

What is counted, and why (all sizes in GiB = 2**30 bytes; ``gpu_gb`` means GiB too):

* Parameters of the rank: its stage's layers (``n_layers // pp``, the first ``n_layers % pp``
  stages one more), with the Megatron split over tp (q, k, v, out, gate, up, down and the
  vocabulary-parallel embedding and head divided by tp; k and v have ``n_kv_heads`` heads;
  RMSNorm weights replicated). The flat ZeRO buffer is padded to a multiple of dp, as in
  ``deadpool.parallel.data.zero`` (``state_bytes``).
* Gradients: one per parameter, unsharded (ZeRO-1 shards only the optimizer); under bf16 with
  ``grad_reduce_dtype=fp32`` (the default) also the fp32 accumulation buffer they are reduced in.
  ZeRO-2 (``parallel.zero=2``): the fp32 gradient shard and the buckets in flight (``state_bytes``).
* Optimizer: AdamW ``exp_avg`` + ``exp_avg_sq`` (+ the fp32 master copy under bf16), divided
  by dp when ``zero`` and dp > 1.
* Activations: what autograd keeps for backward, per micro-batch of ``T = micro_bs x seq``
  tokens, tensor by tensor as the runtime's eager ops save them (``layer_activations``,
  ``saved_activations``: unfused RMSNorm, memory-efficient attention with no seq x seq scores,
  norms replicated over tp: there is no sequence parallelism), under each
  ``activation_checkpointing`` mode. The count is exact: tests measure autograd's saved
  storages of built stages (every mode, tp 1 and 2, fp32 and bf16) and compare bytes. 1F1B
  keeps at most ``min(pp - pp_rank, microbatches)`` micro-batches in flight on stage
  ``pp_rank`` (plus each one's output on a non-last stage), so stage 0 holds ``n_layers``
  layers' worth whatever pp is: only tp, checkpointing, bf16 and fewer tokens per micro-batch
  shrink it. ``full`` adds one block's activations, alive while it is recomputed.
* Overhead: a fixed ``overhead_gb`` per rank (CUDA context, NCCL buffers, allocator slack,
  temporaries such as a recomputation's or the optimizer step's; for CPU processes: the
  interpreter and torch).

Host memory per rank (pinned on CUDA), from ``deadpool.snapshot``: a local ring of
``num_local_slots`` (3 by default; 2 is a double buffer) snapshots of the rank's full state (parameters + its
optimizer shard), for each of its ``replicas`` wards (``ft.replicas``, 1 by default)
``replica_buffers`` (2: the newest protected replica and the one arriving) receive buffers of
what is replicated (the optimizer shard only with
``replicate="unique"`` and a sharded optimizer, because the parameters come back from a
data-parallel peer; nothing with an unsharded optimizer and dp > 1; everything with ``"full"``
or dp == 1), and, when disk checkpoints are on, one persist buffer of the full state (they are
written from it while the ring moves on).

Precision (``precision``, conf/train.yaml): ``"fp32"``: fp32 parameters, gradients, AdamW state
and activations. ``"bf16"``: bf16 parameters, gradients and activations, fp32 master weights and
AdamW moments sharded by ZeRO-1 (Megatron's distributed optimizer, as ``ZeroOptimizer`` lays it
out); its snapshots hold the bf16 parameters and the fp32 optimizer shard (master + moments),
which is what is replicated.
"""

from __future__ import annotations

import os

from deadpool.model import check_activation_checkpointing, model_config, stage_layers, stage_params
from deadpool.settings import num_microbatches
from deadpool.topology import ParallelDims

GiB = 2**30

# bytes per element: parameter, gradient, optimizer state per parameter (master + m + v), activation
PRECISIONS = {
    "fp32": {"param": 4, "grad": 4, "optim": 8, "act": 4},
    # bf16 parameters and gradients; fp32 master + moments. With grad_reduce_dtype=fp32 (the
    # default) gradients are also accumulated and reduced in an fp32 buffer: +4 bytes each.
    "bf16": {"param": 2, "grad": 2, "optim": 12, "act": 2},
}
_STEP_BYTES = 4  # AdamW's fp32 step counter


def model_params(model_cfg) -> int:
    """Parameters of the whole model (one rank, no parallelism)."""
    return stage_params(model_cfg, 1, 1, 0)


def layer_activations(model_cfg, tp: int, tokens: int, act_bytes: int, mode: str = "none") -> int:
    """Bytes autograd keeps for one transformer block's backward, one micro-batch of ``tokens``
    tokens, the block's own ops as ``deadpool/model.py`` and ``parallel/tensor/layers.py`` run
    them (each term a tensor it saves; ``tests/deadpool/test_memory.py`` measures them)::

      each RMSNorm (2)  input, x * rsqrt, output: 3 T d; rsqrt: T          replicated over tp
      attention         q/k/v projection output T (d + 2 kv), rotated q T d and k T kv,
                        attention output T d and its (b, t, d) copy T d            / tp
                        logsumexp T H x 4 bytes (fp32 in every precision)          / tp
      MLP               gate, silu(gate), up, silu(gate) * up: 4 T f               / tp

    ``kv = n_kv_heads * head_dim`` (grouped-query attention without copying KV heads; on CUDA in
    fp32 they are copied, ``model.native_gqa``, and attention keeps 2 T (d - kv) more).
    ``selective``: 3 T f in the MLP (silu(gate) is recomputed).
    ``full``: the block's input, T d (the rest is recomputed in backward: see
    ``stage_activations`` for the one block alive during its recomputation)."""
    m = model_config(model_cfg)
    d, f, t, kv, heads = m.d_model, m.ffn_hidden, tokens, m.n_kv_heads * m.head_dim, m.n_heads
    if mode == "full":
        return t * d * act_bytes
    mlp = (3 if mode == "selective" else 4) * t * f
    norms = 2 * (3 * t * d + t)
    attention = t * (d + 2 * kv) + t * (d + kv) + 2 * t * d
    return (norms + (attention + mlp) // tp) * act_bytes + t * heads // tp * 4


def saved_activations(model_cfg, tp: int, pp: int, pp_rank: int, *, tokens: int, act_bytes: int,
                      mode: str = "none") -> int:
    """Bytes autograd keeps for one micro-batch on stage ``pp_rank``: its blocks, plus on the
    first stage the token ids and the vocabulary mask (9 T bytes), on the last the final norm
    (3 T d + T), the fp32 softmax of its vocabulary slice (T V / tp x 4), the targets (int64) and
    the vocabulary-parallel loss's mask (T bytes; at tp 1 torch's loss keeps a 4-byte total)."""
    m = model_config(model_cfg)
    n = stage_layers(m.n_layers, pp, pp_rank) * layer_activations(m, tp, tokens, act_bytes, mode)
    if pp_rank == 0:
        n += 9 * tokens
    if pp_rank == pp - 1:
        n += (3 * tokens * m.d_model + tokens) * act_bytes + tokens * m.vocab_size // tp * 4
        n += 8 * tokens + (tokens if tp > 1 else 4)
    return n


def stage_activations(model_cfg, tp: int, pp: int, pp_rank: int, *, micro_bs: int, seq_len: int,
                      microbatches: int, act_bytes: int, mode: str = "none",
                      virtual_stages: int = 1) -> int:
    """Bytes of activations kept for backward on stage ``pp_rank`` at the 1F1B peak: the saved
    activations of each micro-batch in flight (``saved_activations``), plus, on a non-last stage,
    each one's output (held by the schedule until its backward); under ``full`` checkpointing
    one block's activations alive while it is recomputed. Interleaved (``virtual_stages`` > 1):
    per chunk, the micro-batches the schedule holds at its peak (``interleaved.in_flight``)."""
    m = model_config(model_cfg)
    tokens = micro_bs * seq_len
    if virtual_stages > 1:
        return _interleaved_activations(m, tp, pp, pp_rank, tokens, microbatches, act_bytes, mode,
                                        virtual_stages)
    in_flight = min(pp - pp_rank, microbatches)
    per_micro = saved_activations(m, tp, pp, pp_rank, tokens=tokens, act_bytes=act_bytes, mode=mode)
    if pp_rank < pp - 1:
        per_micro += tokens * m.d_model * act_bytes
    total = in_flight * per_micro
    if mode == "full":
        total += layer_activations(m, tp, tokens, act_bytes, "none")
    return total


def _interleaved_activations(m, tp, pp, pp_rank, tokens, microbatches, act_bytes, mode, v):
    from deadpool.parallel.pipeline.interleaved import in_flight

    live = in_flight(pp, v, int(microbatches), pp_rank)
    per_chunk = stage_layers(m.n_layers, pp, pp_rank) // v * layer_activations(m, tp, tokens,
                                                                                 act_bytes, mode)
    whole = saved_activations(m, tp, pp, pp_rank, tokens=tokens, act_bytes=act_bytes, mode=mode)
    ends = whole - stage_layers(m.n_layers, pp, pp_rank) * layer_activations(m, tp, tokens,
                                                                               act_bytes, mode)
    total = sum(live) * (per_chunk + tokens * m.d_model * act_bytes)  # blocks and each output
    if pp_rank == pp - 1:  # the model's last chunk sends no output but keeps the head's
        total += live[-1] * (ends - tokens * m.d_model * act_bytes)
    elif pp_rank == 0:
        total += live[0] * ends
    if mode == "full":
        total += layer_activations(m, tp, tokens, act_bytes, "none")
    return total


def state_bytes(numel: int, dp: int, sharded: bool, precision: str = "fp32",
                grad_reduce_dtype: str = "fp32", grad_inbox: bool = False, zero: int = 1,
                bucket_bytes: int = 25 << 20, buckets_in_flight: int = 2) -> dict:
    """``{"params", "grads", "optimizer"}`` bytes of a rank holding ``numel`` parameters, as
    ``ZeroOptimizer`` allocates them: flat buffers padded to a multiple of dp, the AdamW state
    (and the fp32 master copy under bf16) of its shard when ``sharded``, plus the step counter;
    with ``grad_inbox`` (gloo, sharded, dp > 1) the owned buckets' inboxes: one more reduction
    buffer. ZeRO-2 (``zero=2``, sharded, dp > 1: ``parallel/data/grad_shard.py``): no full
    gradient buffer; the fp32 gradient shard, plus at most ``buckets_in_flight`` + 1 buckets of
    ``bucket_bytes`` staged in the reduction dtype (and on gloo an inbox of dp copies of each
    bucket in flight)."""
    b = PRECISIONS[precision]
    padded = -(-numel // dp) * dp
    fp32_reduce = precision == "bf16" and grad_reduce_dtype == "fp32"
    optimizer = (padded // dp if sharded else padded) * b["optim"] + _STEP_BYTES
    if zero >= 2 and sharded and dp > 1:
        item = 4 if precision == "fp32" or fp32_reduce else 2
        bucket = min(bucket_bytes // item, padded // dp) * item  # buckets stop at shard edges
        grads = padded // dp * 4 + (buckets_in_flight + 1) * bucket
        if grad_inbox:
            grads += buckets_in_flight * dp * bucket
        return {"params": padded * b["param"], "grads": grads, "optimizer": optimizer}
    grad = b["grad"] + (4 if fp32_reduce else 0)
    if grad_inbox and sharded and dp > 1:
        grad += 4 if fp32_reduce else b["grad"]
    return {"params": padded * b["param"], "grads": padded * grad, "optimizer": optimizer}


def estimate(model_cfg, parallel_cfg, *, batch_size: int, seq_len: int, microbatches: int,
             precision: str = "fp32", activation_checkpointing: str = "none",
             grad_reduce_dtype: str = "fp32", num_local_slots: int = 3, replica_buffers: int = 2,
             replicate: str = "unique", persist: bool = True, overhead_gb: float = 1.0,
             replicas: int = 1, grad_inbox: bool = False, bucket_bytes: int = 25 << 20) -> dict:
    """Memory of the worst rank of a layout, in bytes.

    ``batch_size`` is sequences per data-parallel rank per step, split into ``microbatches``.
    Returns ``{"precision", "model_params", "params_per_rank", "stage", "gpu": {params, grads,
    optimizer, activations, overhead, total}, "host_per_rank": {local_ring, replicas, persist,
    total}, "host_per_node", "ranks_per_node", "replicated_per_step"}``; ``stage`` is the worst
    rank's pipeline stage. ``replicas`` (``ft.replicas``): each rank holds that many wards'
    replicas and sends its own that many times (``replicated_per_step``: bytes sent per
    snapshot, all buddies together). ``grad_inbox`` (gloo): a sharded optimizer's gradient
    buckets reach their owner by all-to-all, into one more reduction buffer's worth of inboxes
    (``parallel/data/zero.py``, Collectives), counted in ``grads``. ``parallel_cfg["zero"]``
    2: ZeRO-2's gradient terms (``state_bytes``), buckets of ``bucket_bytes``.
    """
    if int(replicas) < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    if replicate not in ("unique", "full"):
        raise ValueError(f"replicate must be 'unique' or 'full', got {replicate!r}")
    if grad_reduce_dtype not in ("fp32", "bf16"):
        raise ValueError(f"grad_reduce_dtype must be fp32 or bf16, got {grad_reduce_dtype!r}")
    check_activation_checkpointing(activation_checkpointing)
    act_bytes = PRECISIONS[precision]["act"]
    dims = ParallelDims.from_config(parallel_cfg)
    dp, tp, pp = dims.dp, dims.tp, dims.pp
    micro_bs = max(1, int(batch_size) // int(microbatches))
    best = None
    for s in range(pp):
        n = stage_params(model_cfg, tp, pp, s)
        gpu = {**state_bytes(n, dp, dims.optimizer_sharded, precision, grad_reduce_dtype,
                             grad_inbox, dims.zero, bucket_bytes),
               "activations": stage_activations(model_cfg, tp, pp, s, micro_bs=micro_bs,
                                                seq_len=seq_len, microbatches=int(microbatches),
                                                act_bytes=act_bytes, mode=activation_checkpointing,
                                                virtual_stages=dims.virtual_stages),
               "overhead": int(overhead_gb * GiB)}
        gpu["total"] = sum(gpu.values())
        if best is None or gpu["total"] > best[1]["total"]:
            best = (s, gpu, n)
    stage, gpu, n = best
    state = gpu["params"] + gpu["optimizer"]  # what a snapshot holds
    replicated = {"all": state, "unique": gpu["optimizer"], "none": 0}[dims.replica_region(replicate)]
    replicated *= int(replicas)  # once per buddy; each rank holds as many wards' replicas
    host = {"local_ring": num_local_slots * state, "replicas": replica_buffers * replicated,
            "persist": state if persist else 0}
    host["total"] = sum(host.values())
    per_node = min(int(parallel_cfg.get("ranks_per_node", 1)), dp * tp * pp)
    return {"precision": precision, "model_params": model_params(model_cfg), "params_per_rank": n, "stage": stage,
            "gpu": gpu, "host_per_rank": host, "ranks_per_node": per_node,
            "host_per_node": per_node * host["total"], "replicated_per_step": replicated}


def _gb(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f}"


def _hint(cfg: dict, micro_tokens: int) -> str:
    more = []
    if cfg.get("activation_checkpointing", "none") != "full":
        more.append("activation_checkpointing=full")
    if cfg.get("precision", "fp32") == "fp32":
        more.append("precision=bf16")
    return ("raise parallel.tp or parallel.pp, enable parallel.zero (sharded optimizer), "
            + "".join(f"{m}, " for m in more) + f"or use fewer tokens per micro-batch (now "
            f"{micro_tokens}: batch_size / microbatches x seq_len)")


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
    p = cfg["parallel"]
    mem = {k: v for k, v in (cfg.get("memory") or {}).items() if v is not None}  # null: not given
    mb = num_microbatches(cfg)
    cpu = not str(cfg.get("device", "cpu")).startswith("cuda")
    est = estimate_job(cfg)
    g, h = est["gpu"], est["host_per_rank"]
    micro_tokens = int(cfg["batch_size"]) // mb * int(cfg["seq_len"])
    layout = f"dp{p['dp']} x tp{p['tp']} x pp{p['pp']}"
    breakdown = (f"params {_gb(g['params'])} + grads {_gb(g['grads'])} + optimizer "
                 f"{_gb(g['optimizer'])} + activations {_gb(g['activations'])} + overhead "
                 f"{_gb(g['overhead'])}")
    _check(cfg, est, mem, cpu, layout, breakdown, micro_tokens)


def estimate_job(cfg: dict) -> dict:
    """``estimate`` of a resolved job config (what ``check_fits`` checks)."""
    p, ft = cfg["parallel"], cfg.get("ft", {})
    snapshots = bool(ft.get("snapshot", True))
    mem = {k: v for k, v in (cfg.get("memory") or {}).items() if v is not None}
    cpu = not str(cfg.get("device", "cpu")).startswith("cuda")
    return estimate(cfg["model"], p, batch_size=int(cfg["batch_size"]), seq_len=int(cfg["seq_len"]),
                   microbatches=num_microbatches(cfg), precision=cfg.get("precision", "fp32"),
                   activation_checkpointing=cfg.get("activation_checkpointing", "none"),
                   grad_reduce_dtype=cfg.get("grad_reduce_dtype", "fp32"),
                   # without snapshots no slot is allocated, and no ward's replica is received
                   num_local_slots=int(ft.get("num_local_slots", 3)) if snapshots else 0,
                   replica_buffers=2 if snapshots else 0,
                   replicate=ft.get("replicate", "unique"), replicas=int(ft.get("replicas", 1)),
                   bucket_bytes=int(float(p.get("bucket_mb", 25)) * 2**20),
                   persist=bool(ft.get("persist_interval_steps")),
                   overhead_gb=0.25 if cpu and not mem else 1.0,
                   # gloo: a CPU run sized for this machine (a memory section sizes GPUs: NCCL)
                   grad_inbox=cfg.get("backend", "auto") == "gloo" or (
                       cfg.get("backend", "auto") == "auto" and cpu and not mem))


def _check(cfg, est, mem, cpu, layout, breakdown, micro_tokens) -> None:
    p, ft = cfg["parallel"], cfg.get("ft", {})
    g, h = est["gpu"], est["host_per_rank"]

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
            f"ft.num_local_slots or ft.replicas, use ft.replicate=unique with parallel.zero, or "
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
