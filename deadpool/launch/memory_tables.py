"""The memory estimator's tables and command line (``python -m deadpool.memory``).

``table()``: LLaMA-shaped models on A100 nodes (docs/memory.md). ``measured_table()``: the counts
against the runtime's own objects on the CPU (``measure``), ZeRO-1 and ZeRO-2. ``issue_rows()``:
Llama 3 8B and 70B on 64 nodes of 8 H100s, ZeRO-1 vs ZeRO-2 (docs/memory.md). ``job_terms``: the
worst rank's terms of a job given as its Hydra overrides (``--json``)::

  python -m deadpool.memory                      # the A100 table
  python -m deadpool.memory --measured           # estimate vs measured on this CPU
  python -m deadpool.memory --issue              # Llama 3 on H100 nodes, ZeRO-1 vs ZeRO-2
  python -m deadpool.memory --json model=llama3_8b parallel.dp=64 parallel.zero=2 ...
"""

from __future__ import annotations

import json
import sys

from deadpool.launch.memory import GiB, PRECISIONS, _gb, estimate, estimate_job, saved_activations, state_bytes
from deadpool.model import model_config, stage_params

# -- the docs/memory.md table (A100) -------------------------------------------------------------------

# usable memory of the GPUs as torch reports it (A100-SXM4 40 GB / 80 GB)
A100_GB = {"40g": 39.4, "80g": 79.1}
# model -> the layouts' name prefix (the grouped-query models share the LLaMA layout of their shape)
MODELS = {"llama_7b": "llama7b", "llama3_8b": "llama7b", "llama_13b": "llama13b",
          "llama_30b": "llama30b", "llama_65b": "llama65b", "llama2_70b": "llama65b",
          "llama3_70b": "llama65b"}
MODES = ("none", "selective", "full")


def _load(group: str, name: str) -> dict:
    import yaml
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "conf" / group / f"{name}.yaml"
    return yaml.safe_load(path.read_text())


def table(precisions=("fp32", "bf16"), seq_len: int = 2048) -> str:
    """Markdown table: each LLaMA-shaped model on its 40 GB and 80 GB A100 layouts, micro-batches
    of one ``seq_len``-token sequence (``batch_size = microbatches = 2 x pp``, as ``microbatches:
    auto`` picks), without activation checkpointing and with each mode."""
    rows = ["| model | GPU | layout (dp x tp x pp) | GPUs | precision | GPU GB per rank, no "
            "checkpointing: params / grads / optimizer / activations / total (with 1 GB overhead) "
            "| fits? | activations / total GB with selective; with full checkpointing | host GB "
            "per node (snapshots + replicas) | replicated MB per rank per step |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for model, prefix in MODELS.items():
        m = _load("model", model)
        for gpu, cap in A100_GB.items():
            name = f"{prefix}_a100_{gpu}"
            p = _load("parallel", name)
            mb = 2 * p["pp"] if p["pp"] > 1 else 1
            for prec in precisions:
                e = {mode: estimate(m, p, batch_size=mb, seq_len=seq_len, microbatches=mb,
                                    precision=prec, activation_checkpointing=mode)
                     for mode in MODES}
                g = e["none"]["gpu"]
                parts = " / ".join(_gb(g[k]) for k in ("params", "grads", "optimizer",
                                                        "activations", "total"))
                ckpt = "; ".join(
                    f"{_gb(e[mode]['gpu']['activations'])} / {_gb(e[mode]['gpu']['total'])}"
                    + ("" if e[mode]["gpu"]["total"] <= cap * GiB else " (**no**)")
                    for mode in ("selective", "full"))
                fits = "yes" if g["total"] <= cap * GiB else "**no**"
                rows.append(
                    f"| {model} | A100 {gpu[:2]} GB | `{name}`: {p['dp']} x {p['tp']} x {p['pp']} "
                    f"| {p['dp'] * p['tp'] * p['pp']} | {prec} | {parts} | {fits} | {ckpt} | "
                    f"{_gb(e['none']['host_per_node'])} | "
                    f"{e['none']['replicated_per_step'] / 2**20:.0f} |")
    return "\n".join(rows)


# -- the measured path ----------------------------------------------------------------------------

def measure(model_cfg, *, pp: int, pp_rank: int, dp: int, micro_bs: int, seq_len: int,
            precision: str = "fp32", activation_checkpointing: str = "none") -> dict:
    """Bytes the runtime's own objects hold for one rank (tp 1) on the CPU: the stage
    (``build_stage``, cast to the precision's dtype as the trainer does) with its
    ``ZeroOptimizer`` (the flat parameter buffer; the gradient buffers, bf16's fp32 accumulation
    buffer included; the AdamW state, with bf16's fp32 master, of its shard), and the storages
    autograd saves in one micro-batch's forward (``saved_tensors_hooks``; the stage's parameters
    and buffers excluded). ``state_bytes`` and ``saved_activations`` must equal them."""
    import torch

    from deadpool.parallel.data.zero import ZeroOptimizer
    from deadpool.parallel.stage import build_stage

    m = model_config(model_cfg)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    stage = build_stage(m, 0, pp_rank=pp_rank, pp=pp, tp_rank=0, tp=1,
                        activation_checkpointing=activation_checkpointing).to(dtype)
    opt = ZeroOptimizer(list(stage.parameters()), dp_size=dp, dp_rank=0, lr=1e-3,
                        weight_decay=0.0, shard=dp > 1)

    def nbytes(t):
        return 0 if t is None else t.numel() * t.element_size()

    params = nbytes(opt.flat_params)
    region = opt.state_nbytes()  # the optimizer state is the unique region (sharded) or shared
    state = {"params": params, "grads": nbytes(opt.flat_grads) + nbytes(opt.main_grads),
             "optimizer": region["unique"] if dp > 1 else region["shared"] - params}
    skip = {t.untyped_storage().data_ptr() for t in [*stage.parameters(), *stage.buffers()]}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        # detached: a saved output returned as itself would hold its own graph node (a cycle
        # that keeps the whole graph, and what it references, alive)
        return t.detach()

    gen = torch.Generator().manual_seed(0)
    shape = (micro_bs, seq_len)
    inp = (torch.randint(0, m.vocab_size, shape, generator=gen) if pp_rank == 0 else
           torch.randn(*shape, m.d_model, generator=gen).to(dtype).requires_grad_())
    targets = torch.randint(0, m.vocab_size, shape, generator=gen) if pp_rank == pp - 1 else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage(inp, None, targets)
    return {"state": state, "activations": sum(saved.values())}


def measured_table(model: str = "tiny", layout=(2, 2), micro_bs: int = 2, seq_len: int = 64) -> str:
    """Markdown table: the estimate against ``measure`` for each stage of ``model`` at dp x pp =
    ``layout`` (tp 1), every checkpointing mode, fp32 and bf16 activations."""
    dp, pp = layout
    m = _load("model", model)
    rows = [f"| `{model}` stage (dp{dp} x pp{pp}) | precision | checkpointing | state bytes: params "
            "/ grads / optimizer, measured | activations bytes per micro-batch: estimated / "
            "measured |", "|---|---|---|---|---|"]
    for s in range(pp):
        for prec in ("fp32", "bf16"):
            for mode in MODES:
                got = measure(m, pp=pp, pp_rank=s, dp=dp, micro_bs=micro_bs, seq_len=seq_len,
                              precision=prec, activation_checkpointing=mode)
                want = saved_activations(m, 1, pp, s, tokens=micro_bs * seq_len,
                                         act_bytes=PRECISIONS[prec]["act"], mode=mode)
                est = tuple(state_bytes(stage_params(m, 1, pp, s), dp, dp > 1, prec).values())
                meas = tuple(got["state"][k] for k in ("params", "grads", "optimizer"))
                state = " / ".join(f"{b:,}" for b in meas) + (" (= estimate)" if meas == est
                                                              else f" (estimated {est})")
                rows.append(f"| {s} | {prec} | {mode} | {state} | {want:,} / "
                            f"{got['activations']:,} |")
    return "\n".join(rows)


# -- ZeRO-2: gradients measured ---------------------------------------------------------------

class _OneRankDp:
    """Stands in for a data-parallel group and its communicator when measuring one rank: every
    op completes at once and moves nothing (NCCL's ops: no gloo inbox), so what ``ShardedGrads``
    allocates is what one rank holds whatever its peers do."""
    backend = "nccl"

    def wait(self, work) -> None:
        pass

    def reduce(self, *args):
        return None


def measure_grads(model_cfg, *, dp: int, micro_bs: int, seq_len: int, precision: str = "bf16",
                  zero: int = 2, bucket_bytes: int = 1 << 16) -> int:
    """Gradient bytes the runtime's ``ZeroOptimizer`` holds for rank 0 of one stage (pp 1, tp 1)
    at dp ``dp``: ZeRO-1 its flat gradient buffers; ZeRO-2 its fp32 shard plus the peak of the
    staged buckets over one real backward (``ShardedGrads.peak_bytes``)."""
    import torch

    from deadpool.parallel.data.zero import ZeroOptimizer
    from deadpool.parallel.stage import build_stage

    m = model_config(model_cfg)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    stage = build_stage(m, 0, pp_rank=0, pp=1, tp_rank=0, tp=1).to(dtype)
    opt = ZeroOptimizer(list(stage.parameters()), dp_size=dp, dp_rank=0, lr=1e-3,
                        weight_decay=0.0, shard=dp > 1, shard_grads=zero >= 2,
                        bucket_bytes=bucket_bytes, first_bucket_bytes=bucket_bytes)
    if opt.grads is None:
        return sum(t.numel() * t.element_size() for t in (opt.flat_grads, opt.main_grads)
                   if t is not None)
    fake = _OneRankDp()
    opt.grads.arm(fake, fake)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, m.vocab_size, (micro_bs, seq_len), generator=gen)
    stage(x, None, torch.randint(0, m.vocab_size, (micro_bs, seq_len), generator=gen)).backward()
    opt.grads.finish(fake, fake)
    return opt.grads.shard.numel() * 4 + opt.grads.peak_bytes


def zero2_table(model: str = "small", micro_bs: int = 2, seq_len: int = 64,
                bucket_bytes: int = 1 << 16) -> str:
    """Markdown: gradient bytes of one rank, ZeRO-1 against ZeRO-2, measured (``measure_grads``)
    and estimated (``state_bytes``, NCCL: no inbox), buckets of ``bucket_bytes``."""
    m = _load("model", model)
    n = stage_params(m, 1, 1, 0)
    rows = [f"| `{model}` (pp1, tp1), buckets {bucket_bytes >> 10} KiB | dp | precision | "
            "ZeRO-1 grads bytes: measured (estimate) | ZeRO-2 grads bytes: measured (estimate, "
            "a bound) | ZeRO-2 / ZeRO-1 |", "|---|---|---|---|---|---|"]
    for dp in (2, 4):
        for prec in ("fp32", "bf16"):
            got = {z: measure_grads(m, dp=dp, micro_bs=micro_bs, seq_len=seq_len, precision=prec,
                                    zero=z, bucket_bytes=bucket_bytes) for z in (1, 2)}
            est = {z: state_bytes(n, dp, True, prec, zero=z, bucket_bytes=bucket_bytes)["grads"]
                   for z in (1, 2)}
            rows.append(f"| | {dp} | {prec} | {got[1]:,} ({est[1]:,}) | {got[2]:,} ({est[2]:,}) "
                        f"| {got[2] / got[1]:.2f} |")
    return "\n".join(rows)


# -- Llama 3 on H100 nodes, ZeRO-1 against ZeRO-2 ------------------------------------------------

H100_GB = 79.1  # H100 SXM 80 GB as torch reports it
# (model, tp, pp) on 64 nodes of 8 GPUs; dp fills the 512 GPUs
ISSUE_LAYOUTS = (("llama3_8b", 1, 1), ("llama3_8b", 2, 1), ("llama3_70b", 8, 4))


def issue_rows(seq_len: int = 8192, gpus: int = 512) -> str:
    """Markdown: the worst rank of each ``ISSUE_LAYOUTS`` layout, bf16, one ``seq_len``-token
    sequence per micro-batch (``batch_size = microbatches = 2 x pp`` with pp > 1, else 1),
    ZeRO-1 and ZeRO-2, without checkpointing and with each mode, against an H100's 79.1 GB."""
    rows = ["| model | layout on 64 x 8 H100 (dp x tp x pp) | ZeRO | GB per rank, no checkpointing: "
            "params / grads / optimizer / activations / total (1 GB overhead) | fits? | total GB "
            "with selective; with full checkpointing |", "|---|---|---|---|---|---|"]
    for model, tp, pp in ISSUE_LAYOUTS:
        m = _load("model", model)
        dp = gpus // (tp * pp)
        mb = 2 * pp if pp > 1 else 1
        for zero in (1, 2):
            p = dict(dp=dp, tp=tp, pp=pp, ranks_per_node=8, zero=zero)
            e = {mode: estimate(m, p, batch_size=mb, seq_len=seq_len, microbatches=mb,
                                precision="bf16", activation_checkpointing=mode)["gpu"]
                 for mode in MODES}
            g = e["none"]
            parts = " / ".join(_gb(g[k]) for k in ("params", "grads", "optimizer", "activations",
                                                    "total"))
            fit = lambda t: "yes" if t <= H100_GB * GiB else "**no**"  # noqa: E731
            more = "; ".join(f"{_gb(e[mode]['total'])} ({fit(e[mode]['total'])})"
                             for mode in ("selective", "full"))
            rows.append(f"| {model} | {dp} x {tp} x {pp} | {zero} | {parts} | "
                        f"{fit(g['total'])} | {more} |")
    return "\n".join(rows)


# -- the command line ---------------------------------------------------------------------------

def job_terms(overrides: list[str]) -> dict:
    """The worst rank's GPU terms (GB) of the job that ``overrides`` compose, as ``check_fits``
    counts them: ``params_gb``, ``grads_gb``, ``optimizer_gb``, ``activations_gb``,
    ``overhead_gb``, ``total_gb``, with the stage, layout, ZeRO stage and host GB per node."""
    from deadpool.launch.config import compose_config
    from deadpool.topology import ParallelDims

    cfg = compose_config(list(overrides), "memory-estimate")  # nothing is written there
    est = estimate_job(cfg)
    dims = ParallelDims.from_config(cfg["parallel"])
    out = {f"{k}_gb": round(v / GiB, 3) for k, v in est["gpu"].items()}
    out.update(stage=est["stage"], layout=dims.layout, zero=dims.zero,
               precision=est["precision"], host_per_node_gb=round(est["host_per_node"] / GiB, 3))
    return out


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["--json"]:
        print(json.dumps(job_terms(args[1:])))
    elif "--measured" in args:
        print(measured_table() + "\n\n" + zero2_table())
    elif "--issue" in args:
        print(issue_rows())
    else:
        print(table())
