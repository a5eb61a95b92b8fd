"""The numeric precision of a run: ``precision``, ``grad_reduce_dtype`` and ``tf32``.

``precision=fp32`` trains in float32 throughout. ``precision=bf16`` is bf16-mixed training as
Megatron's distributed optimizer does it: bf16 parameters, gradients and activations, fp32
master weights and AdamW moments sharded by ZeRO-1 (``parallel/data/zero.py``). ``tf32`` lets
CUDA matmuls and convolutions of fp32 tensors use TF32 tensor cores (10-bit mantissa inputs):
off by default, so fp32 on a GPU means fp32.
"""

from __future__ import annotations

import torch

__all__ = ["PRECISIONS", "param_dtype", "grad_reduce_dtype", "check", "apply_tf32"]

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def param_dtype(cfg: dict) -> torch.dtype:
    """The dtype of parameters, gradients and activations."""
    return PRECISIONS[cfg.get("precision", "fp32")]


def grad_reduce_dtype(cfg: dict) -> torch.dtype:
    """The dtype gradients are accumulated and reduced over dp in (bf16 runs only)."""
    return PRECISIONS[cfg.get("grad_reduce_dtype", "fp32")]


def check(cfg: dict) -> None:
    """Raise ``ValueError`` naming the field on a bad precision setting."""
    for key in ("precision", "grad_reduce_dtype"):
        v = cfg.get(key, "fp32")
        if v not in PRECISIONS:
            raise ValueError(f"{key} must be one of {list(PRECISIONS)}, got {v!r}")
    if not isinstance(cfg.get("tf32", False), bool):
        raise ValueError(f"tf32 must be true or false, got {cfg['tf32']!r}")


def apply_tf32(cfg: dict) -> None:
    """Set torch's TF32 switches for this process from ``cfg['tf32']`` (CUDA devices only)."""
    if str(cfg.get("device", "cpu")).startswith("cuda"):
        on = bool(cfg.get("tf32", False))
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on
