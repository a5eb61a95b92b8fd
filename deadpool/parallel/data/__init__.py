"""Data parallelism: the ZeRO optimizer (``zero.py``), which also owns the data-parallel group's
collectives: gradient buckets reduced during backward (ZeRO-1: ``buckets.py``; ZeRO-2, gradients
kept sharded: ``grad_shard.py``), the parameter all-gather (overlapped: ``param_gather.py``), the
buffers' arithmetic (``layout.py``) and re-cutting state for another width (``reshard.py``)."""

from deadpool.parallel.data.zero import ZeroOptimizer, state_nbytes

__all__ = ["ZeroOptimizer", "state_nbytes"]
