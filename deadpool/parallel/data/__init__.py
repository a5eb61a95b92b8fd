"""Data parallelism: the ZeRO-1 optimizer (``zero.py``), which also owns the data-parallel group's
collectives (gradient reduce-scatter or all-reduce, parameter all-gather)."""

from deadpool.parallel.data.zero import ZeroOptimizer, state_nbytes

__all__ = ["ZeroOptimizer", "state_nbytes"]
