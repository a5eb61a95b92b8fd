"""Pipeline parallelism: the 1F1B schedule (``schedule.run_1f1b``) over the 2-rank stage groups.

The micro-batches per step default to the fewest keeping 1F1B's bubble ``(pp - 1) / (m + pp - 1)``
at most 10 % as far as the batch allows (``deadpool.settings.num_microbatches``).

Not built: Megatron's interleaved schedule (``v`` virtual stages per rank, each rank holding
``v`` non-contiguous chunks of layers, bubble ``(pp - 1) / (v m + pp - 1)``). Its parameter
names would stay the single-process model's (``stage.py``), so snapshots and checkpoints would
follow; what it needs is the chunked stage (``topology.layer_range`` over ``pp * v`` chunks,
chunk ``c`` of rank ``s`` being model chunk ``c * pp + s``), a wrap-around pair of groups from
the last stage to the first (``groups.py``: the ring's activation and gradient of chunk
``c`` -> ``c + 1``), the schedule itself (each rank's blocking receives ordered so that no
cycle forms with posted sends), its evaluation counterpart and a hot-swap test against its
failure-free run.
"""

from deadpool.parallel.pipeline.schedule import run_1f1b  # noqa: F401
