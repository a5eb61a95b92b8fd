"""The flat ZeRO buffers' arithmetic: padding to the data-parallel width, and the bytes of a
rank's training state without building anything (``zero.py`` lays the buffers out this way).
"""

from __future__ import annotations

__all__ = ["state_nbytes"]

_STEP_BYTES = 4  # AdamW's step counter: a float32 scalar


def _padded(numel: int, dp_size: int) -> int:
    return -(-numel // dp_size) * dp_size


def state_nbytes(numel: int, dp_size: int, shard: bool, itemsize: int = 4,
                 precision: str = "fp32") -> dict[str, int]:
    """Bytes of a rank's training state for ``numel`` parameters, without building anything
    (memory estimator, benchmark). ``shared``: identical on every data-parallel peer (parameters,
    plus the optimizer state when not sharded); ``unique``: this rank's own (its optimizer
    shard), i.e. what no peer can supply and must be replicated elsewhere per snapshot. Padding
    included. ``precision``: ``fp32`` (parameters of ``itemsize`` bytes, no master copy) or
    ``bf16`` / ``bf16-mixed`` (bf16 parameters, shared; fp32 master weights and moments, unique
    under ZeRO). Matches ``ZeroOptimizer.state_nbytes()``."""
    padded = _padded(numel, dp_size)
    if precision in ("bf16", "bf16-mixed"):
        params, optim = padded * 2, 3 * 4  # bf16 parameters; fp32 master + 2 moments
    elif precision == "fp32":
        params, optim = padded * itemsize, 2 * itemsize
    else:
        raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")
    if shard:
        return {"shared": params, "unique": optim * (padded // dp_size) + _STEP_BYTES}
    return {"shared": params + optim * padded + _STEP_BYTES, "unique": 0}
