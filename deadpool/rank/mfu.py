"""Model FLOPs utilisation (MFU) and tokens/s/GPU: the per-step throughput fields of the metrics.

Model FLOPs per token (training: forward + backward), as in the PaLM paper's appendix B (Chowdhery
et al. 2022) and torchtitan's ``get_num_flop_per_token``::

    flops_per_token = 6 N + 12 L d T

``N``: the parameters without the input embedding table (a lookup, no matmul; the untied output
head is a matmul and counts), ``L`` layers, ``d = n_heads * head_dim`` (= d_model), ``T`` the
sequence length. ``6 N``: a multiply-add (2 FLOPs) per parameter and token forward, twice that
backward. ``12 L d T``: the attention scores and their product with V (``2 * 2 * T * d`` per
token and layer forward, x3 with backward), counted over the full ``T x T`` square as torchtitan
and PaLM do, not the causal half. Recomputation (activation checkpointing) is not counted: these
are model FLOPs, not hardware FLOPs.

MFU = flops_per_token * tokens / (step time * GPUs * peak), the peak being the device's dense
bf16 tensor-core FLOPs (the convention of torchtitan and Megatron whatever the run's precision):
``PEAK_TFLOPS`` by device name, or the setting ``metrics.peak_tflops``, which overrides it. A CPU
has no entry: MFU is omitted (None) unless the setting gives a peak.

The progress line shows the reporting rank's loss (the last stage's data-parallel rank 0: its
batch's mean), labelled ``loss[dp0]``; summary.json's ``final_loss`` is the mean over the
data-parallel ranks (deadpool/launch/report.py).
"""

from __future__ import annotations

from deadpool.model import model_config
from deadpool.parallel.compile import compiles, warm_compiles

# dense bf16 tensor-core peaks, TFLOPS (vendor data sheets); the first name contained wins
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("H800", 989.0),
               ("A100", 312.0), ("A800", 312.0))


def params_without_embedding(model_cfg) -> int:
    """Parameters of the whole model minus the input embedding table (see module docstring)."""
    cfg = model_config(model_cfg)
    d, f = cfg.d_model, cfg.ffn_hidden
    per_layer = d * sum(cfg.qkv_rows) + cfg.n_heads * cfg.head_dim * d + 3 * d * f + 2 * d
    return cfg.n_layers * per_layer + d + cfg.vocab_size * d  # final norm, head


def flops_per_token(model_cfg, seq_len: int) -> int:
    """``6 N + 12 L d T`` (module docstring)."""
    cfg = model_config(model_cfg)
    return (6 * params_without_embedding(cfg)
            + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * int(seq_len))


def peak_tflops(device_name: str | None) -> float | None:
    """The dense bf16 peak of a device by its name (``torch.cuda.get_device_name``), or None."""
    for key, tflops in PEAK_TFLOPS:
        if device_name and key.lower() in device_name.lower():
            return tflops
    return None


def device_peak_flops(cfg: dict) -> float | None:
    """FLOPs per second per GPU: ``metrics.peak_tflops`` if set, else the table's entry for the
    visible CUDA device, else None (a CPU run, or an unknown GPU)."""
    setting = (cfg.get("metrics") or {}).get("peak_tflops")
    if setting is not None:
        return float(setting) * 1e12
    if str(cfg.get("device", "cpu")).startswith("cuda"):
        import torch
        if torch.cuda.is_available():
            tflops = peak_tflops(torch.cuda.get_device_name())
            return None if tflops is None else tflops * 1e12
    return None


class Throughput:
    """The throughput fields of one step's metrics record: ``tokens_per_s_per_gpu`` (the global
    batch's tokens over the step time and the job's GPUs, i.e. ranks), ``mfu``, and under
    ``compile=true`` the graphs this process has compiled so far while training (``compiles``)
    and while warm (``warm_compiles``, a spare's; parallel/compile.py)."""

    def __init__(self, cfg: dict):
        p = cfg["parallel"]
        self.tokens_per_step = (int(p.get("global_dp") or p["dp"]) * int(cfg["batch_size"])
                                * int(cfg["seq_len"]))
        self.flops_per_token = flops_per_token(cfg["model"], cfg["seq_len"])
        self.peak = device_peak_flops(cfg)
        self.compiled = bool(cfg.get("compile", False))

    def fields(self, step_time_s: float, world_size: int) -> dict:
        out = {"tokens_per_s_per_gpu": None, "mfu": None}
        if self.compiled:
            out.update(compiles=compiles(), warm_compiles=warm_compiles())
        if not step_time_s or step_time_s <= 0:
            return out
        out["tokens_per_s_per_gpu"] = per_gpu = self.tokens_per_step / step_time_s / world_size
        if self.peak is not None:
            out["mfu"] = per_gpu * self.flops_per_token / self.peak
        return out


def progress_lines(rec: dict, num_steps: int, every: int) -> list[str]:
    """The reporting rank's lines for this metrics record: the validation loss when it has one,
    and every ``every`` steps (and the last) the progress line."""
    lines, step = [], rec["step"]
    if rec.get("val_loss") is not None:
        lines.append(f"[rank {rec['rank']}] step {step:4d}  val loss {rec['val_loss']:.4f}")
    if every and (step % every == 0 or step == num_steps):
        line = (f"[rank {rec['rank']}] step {step:4d}/{num_steps}  loss[dp0] {rec['loss']:.4f}  "
                f"step {rec['step_time_s'] * 1e3:6.1f} ms  "
                f"snapshot-blocked {rec['snapshot_blocked_s'] * 1e3:5.2f} ms")
        if rec.get("tokens_per_s_per_gpu") is not None:
            line += f"  {rec['tokens_per_s_per_gpu']:,.0f} tok/s/GPU"
        if rec.get("mfu") is not None:
            line += f"  MFU {rec['mfu']:.3f}"
        lines.append(line)
    return lines
